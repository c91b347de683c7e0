"""The scripts in `benchmarks/`: the chunk work item's targets and the committed run."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

targets = pytest.importorskip("targets")  # benchmarks/targets.py (needs tqdm, the `bench` extra)
run = pytest.importorskip("run")
MiB = targets.MiB
Target = targets.Target


def test_target_verdicts():
    assert Target("mfu", "chunk", 0.12, 0.10, True, "%").verdict == "pass"
    assert Target("mfu", "chunk", 0.08, 0.10, True, "%").verdict == "FAIL"
    assert Target("memory", "chunk", 300 * MiB, 256 * MiB, False, "MiB").verdict == "FAIL"
    assert Target("speed-up", "chunk", None, 10.0, True, "×").verdict == "n/a"
    assert Target("mfu", "chunk", 0.123, 0.10, True, "%").formatted(0.123) == "12.3%"


def test_quick_run_with_targets(tmp_path):
    pytest.importorskip("matplotlib")
    argv = ["--quick", "--impls", "reference", "--gates", "gk", "--seq-lens", "32",
            "--heads", "2", "--qk-dim", "16", "--v-dim", "16",
            "--repeats", "1", "--matmul-size", "128", "--matmul-repeats", "1",
            "--target-impl", "reference", "--out", str(tmp_path)]
    assert run.main(argv) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert len(report["targets"]) == 5
    assert {t["impl"] for t in report["targets"]} == {"reference"}
    markdown = (tmp_path / "results.md").read_text()
    assert "## Targets" in markdown and "matmul peak" in markdown


@pytest.mark.slow  # two child processes that compile both sides: ~30 s of CI's budget
def test_ab_runs_both_sides_and_reports_ratios(tmp_path):
    """`benchmarks/ab.py` (the A/B issue 31 asks for before any change to chunk/): a quick run
    against HEAD measures both sides in child processes and writes the ratio table."""
    import subprocess

    ab = pytest.importorskip("ab")
    repository = BENCHMARKS.parent
    if subprocess.run(["git", "-C", str(repository), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "ab.md"
    gates = "g,shared_qk_parallel,decode"  # the second on a mesh of 2 host devices (the child's XLA_FLAGS)
    assert ab.main(["--against", "HEAD", "--quick", "--rounds", "1", "--repeats", "1", "--gates", gates, "--out", str(out)]) == 0
    report = out.read_text()
    assert "| g | fwd+bwd (ms) |" in report and "| g | temp (MiB) |" in report
    assert "| shared_qk_parallel | fwd+bwd (ms) |" in report
    assert "| decode | decode step, batch 8 (ms) |" in report and "| decode | generate 8 × 16, top-p 0.9 (ms) |" in report
    with pytest.raises(SystemExit):
        ab.main(["--against", "HEAD", "--gates", "bogus"])


@pytest.mark.slow  # compiles chunk's fwd+bwd at T = 256, H = 4
def test_delta_rule_tpu_smoke_run_says_why_a_side_does_not_run(tmp_path):
    """`benchmarks/delta_rule_tpu.py --smoke` (issue 28, item 5; `tpu.sh` runs it) off a TPU:
    XLA chunk timed, `pallas_tpu` and ejKernel's kernel rows with the reason they did not run."""
    delta_rule_tpu = pytest.importorskip("delta_rule_tpu")
    assert delta_rule_tpu.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    (rows,) = json.loads((tmp_path / "delta_rule_tpu.json").read_text())["results"].values()
    rows = {row["name"]: row for row in rows}
    assert len(rows["recurrax chunk (XLA)"]["fwd+bwd"]) == 1
    if jax.default_backend() != "tpu":
        assert "dispatch picks chunk" in rows["recurrax pallas_tpu"]["skipped"]
        assert rows["ejKernel Pallas GDN"]["skipped"].startswith("not ")
    assert "| recurrax chunk (XLA) |" in (tmp_path / "delta_rule_tpu.md").read_text()


def test_delta_rule_quick_run_without_peers(tmp_path):
    """`benchmarks/delta_rule.py --quick` (issue 32's side-by-side): recurrax's implementations
    timed and checked against the float64 reference; a peer without an interpreter is reported
    as not run, not silently dropped."""
    delta_rule = pytest.importorskip("delta_rule")
    argv = ["--quick", "--variants", "gdn", "--rounds", "1", "--repeats", "1", "--matmul-size", "128", "--no-reference",
            "--ejkernel-python", str(tmp_path / "missing-python"), "--out", str(tmp_path)]
    assert delta_rule.main(argv) == 0
    report = json.loads((tmp_path / "delta_rule.json").read_text())
    rows = {row["name"]: row for row in report["variants"]["gdn"]["rows"]}
    assert rows["recurrax chunk"]["output_vs_f64"] < 1e-4
    assert rows["recurrax chunk"]["stats"]["fwd_bwd"]["n"] == 1
    assert "no interpreter given" in rows["transformers"]["not_run"]
    assert "not found" in rows["ejKernel"]["not_run"]
    markdown = (tmp_path / "delta_rule.md").read_text()
    assert "| recurrax chunk |" in markdown and "fwd+bwd ≥ 5× transformers | — | n/a" in markdown
    assert delta_rule.forward_flops(**delta_rule.SHAPE) == 2 * 2048 * 4 * (64 * 8 * 128 + 6 * 128 * 128)


def test_qwen3_5_workload_counts_the_models_own_matmuls():
    """`benchmarks/qwen3_5.py`'s floor arithmetic against the model it benchmarks: the prefill's
    matmul FLOPs are 2·tokens·in·out over every projection kernel the model holds (plus the
    last-position head), and a decode step's state bytes are its cache's, read and written."""
    qwen3_5 = pytest.importorskip("qwen3_5")
    from flax import nnx

    config = {**qwen3_5.TINY, "layer_types": qwen3_5.layer_types(4), "num_hidden_layers": 4}
    model = qwen3_5.CausalLM(config, rngs=nnx.Rngs(0))
    batch, length = 3, 16
    kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
               if "proj" in jax.tree_util.keystr(path) and x.ndim == 2]
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    work = qwen3_5.workload(config, batch, length, parameters)
    head = 2 * batch * config["hidden_size"] * config["vocab_size"]
    assert sum(work["prefill_flops"].values()) == sum(2 * batch * length * x.size for x in kernels) + head
    assert len(work["matmul_names"]) == len(work["prefill_flops"])
    caches = [c for c in model.init_cache(1, 1).layers if hasattr(c, "state")]
    assert work["state_bytes"] == 2 * sum(c.state.nbytes + c.conv.nbytes for c in caches)
    assert work["param_bytes"] == 4 * parameters


@pytest.mark.slow  # compiles a tiny model's prefill, three decode steps and every part: ~30 s on 2 cores
def test_qwen3_5_tiny_run_without_transformers(tmp_path):
    """`benchmarks/qwen3_5.py --tiny` without a torch interpreter: our side measured and checked
    against its float64 run, the transformers side reported as not run."""
    import re

    qwen3_5 = pytest.importorskip("qwen3_5")
    argv = ["--tiny", "--repeats", "1", "--decode-steps", "2", "--torch-python", str(tmp_path / "missing-python"),
            "--out", str(tmp_path)]
    assert qwen3_5.main(argv) == 0
    report = (tmp_path / "qwen3_5.md").read_text()
    assert "transformers not run: interpreter missing-python not found" in report
    assert "| decode batch 64, tokens/s" in report and "| delta rule |" in report
    assert float(re.search(r"recurrax float32 vs recurrax float64 (\S+)\.", report)[1]) < 1e-4
    assert "recurrax over its floor: prefill" in report



@pytest.mark.slow  # compiles a tiny Kimi Linear's prefill and decode steps: ~20 s on 2 cores
def test_kimi_linear_tiny_run_without_transformers(tmp_path):
    """`benchmarks/kimi_linear.py --tiny` without a torch interpreter: the layer lists and expert
    count it builds, our side measured and checked against its float64 run."""
    import re

    kimi_linear = pytest.importorskip("kimi_linear")
    config = kimi_linear.config(kimi_linear.KIMI_LINEAR_48B_A3B, 9, 16)
    assert config["linear_attn_config"]["full_attn_layers"] == [4, 8] and config["num_experts"] == 16
    assert config["linear_attn_config"]["kda_layers"] == [1, 2, 3, 5, 6, 7, 9]
    argv = ["--tiny", "--repeats", "1", "--decode-steps", "2", "--torch-python", str(tmp_path / "missing-python"),
            "--out", str(tmp_path)]
    assert kimi_linear.main(argv) == 0
    report = (tmp_path / "kimi_linear.md").read_text()
    assert "transformers not run: interpreter missing-python not found" in report
    assert "| decode batch 64, tokens/s" in report
    assert float(re.search(r"recurrax float32 vs recurrax float64 (\S+)\.", report)[1]) < 1e-4

def _memory_row(layers: int, peak_gib: float, tokens: int = 131072) -> dict:
    GiB = 2**30
    return dict(model="Mamba-2 1.3B", slice="v5e-8", layout="data=1,sequence=8", remat="block", tokens=tokens,
                layers=layers, full_depth=48, chips=8, hbm=16 * GiB, count=layers * 10**7, params=0, opt=0,
                arguments=GiB, outputs=GiB, aliased=GiB, temp=round((peak_gib - 1) * GiB), peak=round(peak_gib * GiB),
                seconds=1.0)


def test_long_context_reports_a_full_depth_compile_over_its_estimate():
    """`benchmarks/long_context.py`: where the whole model compiled, the tables report that
    compile and not the line through the two cut depths (shown beside it as a check); where it
    did not, the estimate stands in."""
    long_context = pytest.importorskip("long_context")  # needs flax and optax
    rows = [_memory_row(2, 8.0), _memory_row(4, 8.5), _memory_row(48, 14.0),
            _memory_row(2, 6.0, 32768), _memory_row(4, 6.5, 32768)]
    assert [r["tokens"] for r in long_context.estimates(rows)] == [32768]
    chosen = {r["tokens"]: r for r in long_context.best([*rows, *long_context.estimates(rows)])}
    assert chosen[131072]["peak"] == 14 * 2**30 and "basis" not in chosen[131072]
    assert chosen[32768]["basis"] == "2 and 4 layers" and chosen[32768]["peak"] == round(17.5 * 2**30)
    text = "\n".join(long_context.extrapolation(rows))
    assert "131,072 tokens: estimated 19.50 GiB from 2 and 4 layers, compiled 14.00 GiB" in text


@pytest.mark.slow  # compiles chunk's fwd+bwd for both operations
def test_tpu_paths_smoke_run_times_chunk_and_says_why_the_kernel_does_not_run(tmp_path):
    """`benchmarks/tpu_paths.py --smoke` (`tpu.sh` runs it) off a TPU: `chunk` timed in both
    directions with its roofline fraction, `pallas_tpu` a row with its refusal, and what
    dispatch picks; the markdown, JSON and PNG are written."""
    tpu_paths = pytest.importorskip("tpu_paths")
    assert tpu_paths.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tpu.json").read_text())
    assert [row["op"] for row in rows] == ["recurrent", "delta_rule"]
    for row in rows:
        assert row["paths"]["chunk"]["forward"] > 0 and row["paths"]["chunk"]["fwd+bwd"] > 0
        assert min(row["floors"].values()) > 0
        if jax.default_backend() != "tpu":
            assert "runs on tpu" in row["paths"]["pallas_tpu"]["refused"] and row["dispatch"] == "chunk"
    text = (tmp_path / "tpu.md").read_text()
    assert "| `chunk` |" in text and "% roof" in text and (tmp_path / "tpu.png").stat().st_size > 0


@pytest.mark.slow  # compiles chunk's fwd+bwd for both operations
def test_tpu_chunk_sweep_smoke_run_times_each_tiling_and_compares_it(tmp_path):
    """`benchmarks/tpu_chunk_sweep.py --smoke`: every tiling of a row timed both ways and its
    output compared with the row's first (the same math: a rounding-level difference)."""
    sweep = pytest.importorskip("tpu_chunk_sweep")
    assert sweep.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tpu_chunk_sweep.json").read_text())["rows"]
    assert [(row["row"], row["tiling"]) for row in rows] == [("recurrent gk", "16x1x2"), ("recurrent gk", "16x4x1"),
                                                              ("delta KDA", "32x1")]
    for row in rows:
        assert "error" not in row and min(row["forward"]) > 0 and min(row["fwd+bwd"]) > 0
    # bf16 outputs of the same math: a few of bf16's roundings apart, relative to the largest entry
    assert rows[0]["difference"] == 0 and rows[1]["difference"] < 4 * float(jnp.finfo(jnp.bfloat16).eps)
    assert "| recurrent gk | 16x4x1 |" in (tmp_path / "tpu_chunk_sweep.md").read_text()


def test_tpu_path_profile_smoke_run_times_both_programs_of_each_row(tmp_path):
    """`benchmarks/tpu_path_profile.py --smoke` off a TPU: `chunk` of each smoke row timed back to
    back, forward and forward+backward; the trace holds no device ops off a TPU, so its tables are
    empty and its device time 0; the markdown and JSON are written."""
    profile = pytest.importorskip("tpu_path_profile")
    assert profile.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "tpu_path_profile.json").read_text())
    assert [r["path"] for r in results] == ["chunk", "chunk"]
    for r in results:
        for program in ("forward", "fwd+bwd"):
            assert r[program]["ms"] > 0 and r[program]["device_s"] == 0 and r[program]["kind_share"] == {}
    assert "`chunk` fwd+bwd" in (tmp_path / "tpu_path_profile.md").read_text()


@pytest.mark.slow  # interprets the TPU kernels, forward and backward, for both operations
def test_tpu_kernel_sweep_smoke_run_times_chunk_and_the_kernel_at_many_heads(tmp_path):
    """`benchmarks/tpu_kernel_sweep.py --smoke` (interpret mode off a TPU): per row `chunk` and
    the kernel at 4 heads a grid step timed both ways, its output within float32 rounding of
    `chunk`'s; the markdown and JSON are written."""
    sweep = pytest.importorskip("tpu_kernel_sweep")
    assert sweep.main(["--smoke", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tpu_kernel_sweep.json").read_text())
    assert [row["row"]["op"] for row in rows] == ["recurrent", "delta_rule"]
    assert [len(row["tiles"]) for row in rows] == [1, 1]
    for row in rows:
        assert row["chunk"]["forward"] > 0 and row["chunk"]["fwd+bwd"] > 0 and min(row["floors"].values()) > 0
        for tile in row["tiles"]:
            assert tile["heads"] == 4 and tile["forward"] > 0 and tile["fwd+bwd"] > 0
            assert tile["error vs chunk"] < 1e-5  # float32 inputs: the two paths agree to rounding
    text = (tmp_path / "tpu_kernel_sweep.md").read_text()
    assert "| `chunk` |" in text and "| `pallas_tpu` | 4 | 16 | 4 |" in text and "Fastest tile per row" in text


def test_tpu_kernel_sweep_tries_todays_tile_first_and_keeps_heads_that_divide():
    sweep = pytest.importorskip("tpu_kernel_sweep")
    row = sweep.rows(smoke=False)[2]  # GDN, 32 value heads
    tiles = sweep.tiles_of(row, [1, 2, 3, 8, 16], [128, 256], smoke=False)
    assert (tiles[0].heads, tiles[0].chunk) == (1, 128) and (tiles[1].heads, tiles[1].chunk) == (8, 128)
    assert {t.heads for t in tiles} == {1, 2, 8, 16} and len(tiles) == 8
    gk = sweep.tiles_of(sweep.rows(smoke=False)[1], [8], [128], smoke=False, groups=(2, 4, 16))
    assert [(t.heads, t.group) for t in gk] == [(8, 2), (8, 4), (8, 16)]
    g = sweep.tiles_of(sweep.rows(smoke=False)[0], [1, 2, 8], [128], smoke=False)  # K = 64: lane-dense at Hb ≥ 2
    assert [t.heads for t in g] == [8, 2]


def test_remat_memory_reports_every_remat():
    """`benchmarks/remat_memory.py` at a tiny size: one row per `remat`, `"block"` below none."""
    remat_memory = pytest.importorskip("remat_memory")
    rows = remat_memory.main(["--seq-len", "256", "--vocab", "64", "--d-model", "32", "--num-layers", "2",
                              "--num-heads", "2"])
    assert [row["remat"] for row in rows] == ["none", "block", "dots"]
    assert rows[1]["temp_mib"] < rows[0]["temp_mib"], rows


@pytest.mark.slow  # compiles four tiny models' training steps and their parts (minutes on a loaded CPU)
def test_tpu_train_smoke_run_measures_every_model_and_part(tmp_path):
    """`benchmarks/tpu_train.py --smoke` (the lead runs it on the TPU without `--smoke`): every model's
    step timed with its compile and memory, its parts timed for the profile, the unrolled stack's
    compile, and the markdown, JSON and PNG written."""
    pytest.importorskip("optax")
    tpu_train = pytest.importorskip("tpu_train")
    assert tpu_train.main(["--smoke", "--steps", "1", "--budget", "1e6", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "tpu_train.json").read_text())
    assert [row["name"] for row in rows] == [row["name"] for row in tpu_train.rows(True)]
    for row in rows[:4]:
        assert "failed" not in row, row
        assert row["step_s"] > 0 and row["compile_s"] > 0 and row["step_memory_gib"] > 0, row
        seconds = row["profile"]["seconds"]
        assert min(seconds[kind] for kind in ("mixers", "norms", "loss head", "optimizer")) > 0, row
        assert (seconds["MLPs"] > 0) == (row["model"] != "mamba2-370m"), row  # Mamba-2's layers have no MLP
    assert not rows[4]["scan"] and rows[4]["compile_s"] > 0 and "step_s" not in rows[4]
    text = (tmp_path / "tpu_train.md").read_text()
    assert "| gla-340m T64 |" in text and "unrolled." in text and (tmp_path / "tpu_train.png").stat().st_size > 0


def test_tpu_train_trace_counts_each_op_once_and_names_its_kind():
    """`tpu_train.py`'s trace table: an op's self time is its span less the ops nested in it (a scanned
    layer's `while` less its body), so the self times add up to the outermost spans; the kind of an
    op comes from its HLO text (a Pallas kernel by name, a convolution fusion as a matmul, an opcode)."""
    tpu_train = pytest.importorskip("tpu_train")

    def event(text, start, duration):
        return types.SimpleNamespace(name=text, start_ns=start, duration_ns=duration, end_ns=start + duration)

    events = [event("%while.1 = (s32[], f32[4]) while((s32[], f32[4]) %t), body=%b", 0, 100),
              event("%fusion.2 = f32[4]{0} fusion(f32[4]{0} %a), kind=kLoop", 10, 30),
              event("%convolution_fusion.3 = f32[4]{0} fusion(f32[4]{0} %a), kind=kOutput", 50, 40),
              event("%copy.4 = bf16[4,6]{1,0:T(4,128)(2,1)S(1)} copy(bf16[4,6]{1,0} %r)", 120, 5),
              event('%recurrax_tpu_chunk_fwd.7 = (f32[4]) custom-call(f32[4] %c), custom_call_target="tpu_custom_call"',
                    130, 7)]
    own = {text.split(" = ")[0]: round(seconds * 1e9) for text, seconds in tpu_train.self_times(events)}
    assert own == {"%while.1": 30, "%fusion.2": 30, "%convolution_fusion.3": 40, "%copy.4": 5,
                   "%recurrax_tpu_chunk_fwd.7": 7}
    assert [tpu_train.kind_of_op(e.name) for e in events] == [
        "while", "fusion kLoop", "matmul", "copy", "kernel recurrax_tpu_chunk_fwd"]


def test_tpu_train_mixer_flops_match_tpu_paths():
    """The mixers' FLOPs per token of GLA-340M and GDN-340M (one layer, forward + backward) are
    `tpu_paths.py`'s MXU floor of the same recurrence per token and head, times the heads."""
    tpu_train = pytest.importorskip("tpu_train")
    tpu_paths = pytest.importorskip("tpu_paths")
    chip = {"peak_tflops": 1.0, "hbm_gbs": 1.0}
    for model, op, gate, H, K, V in (("gla-340m", "recurrent", "gk", 4, 128, 256),
                                     ("gdn-340m", "delta_rule", "g", 6, 256, 512)):
        config = tpu_train.config_of(model, smoke=False)
        row = dict(op=op, gate=gate, B=1, T=64, H=H, Hqk=H, K=K, V=V, dtype="bfloat16")
        inputs, _ = tpu_paths.make_arrays(row)
        floors = tpu_paths.floors(row, inputs, chip)
        per_token = floors["mxu fwd+bwd"] * 1e12 / 64  # B·T = 64 tokens, all H heads
        layers = config["num_hidden_layers"]
        assert tpu_train.mixer_flops_per_token(config, 4096) == pytest.approx(layers * per_token, rel=1e-12), model


@pytest.mark.slow  # compiles three tiny models' decode steps, prefills and generate (minutes on a loaded CPU)
def test_tpu_generate_smoke_run_measures_every_row(tmp_path):
    """`benchmarks/tpu_generate.py --smoke`: the chip run's code on tiny models: every row
    measured (decode beside a positive floor, prefill in several pieces with its MFU, generate's
    time to first token), nothing failed or skipped; the markdown, JSON and PNG written."""
    tpu_generate = pytest.importorskip("tpu_generate")
    assert tpu_generate.main(["--smoke", "--out", str(tmp_path), "--budget", "100000"]) == 0
    rows = json.loads((tmp_path / "tpu_generate.json").read_text())["rows"]
    assert [(r["model"], r["kind"]) for r in rows] == [(r["model"], r["kind"]) for r in tpu_generate.rows(True)]
    assert not [r for r in rows if "failed" in r or "skipped" in r]
    for r in rows:
        if r["kind"] == "decode":
            assert r["step_s"] > 0 and r["floor_s"] > 0 and r["weight_bytes"] > 0 and r["cache_bytes"] > 0
        elif r["kind"] == "prefill":
            assert r["pieces"] > 1 and r["mfu"] > 0 and r["tokens_per_s"] > 0
        else:
            assert 0 < r["ttft_median_s"] <= r["ttft_p90_s"] and r["tokens_per_s"] > 0
    text = (tmp_path / "tpu_generate.md").read_text()
    assert "## Decode step" in text and "MFU" in text and (tmp_path / "tpu_generate.png").stat().st_size > 0


def test_tpu_generate_spent_budget_still_writes_its_report(tmp_path):
    """A run whose budget is spent before its first row says which rows it did not run."""
    tpu_generate = pytest.importorskip("tpu_generate")
    assert tpu_generate.main(["--smoke", "--out", str(tmp_path), "--budget", "0"]) == 0
    text = (tmp_path / "tpu_generate.md").read_text()
    assert "Not run (the budget was spent): qwen3.5-0.8b decode batch 1;" in text
