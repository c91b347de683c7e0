"""`recurrax bench`: its arithmetic, its budget rules, and a tiny end-to-end run."""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest

import recurrax
from recurrax.tools.bench import command, machine, measure, report
from recurrax.tools.bench.measure import Settings, Shape


def test_model_flops_follow_the_issue_formulas():
    shape = Shape(batch=2, seq_len=2048, heads=8, qk_dim=64, v_dim=32)
    elements = 2 * 2048 * 8 * 64 * 32
    assert measure.model_flops(shape, "fwd") == 4 * elements
    assert measure.model_flops(shape, "fwd+bwd") == 12 * elements


def test_matmul_flops_and_utilisation():
    assert machine.matmul_flops(2048) == 2 * 2048**3
    peak = machine.matmul_flops(1000) / 0.01  # 200 GFLOP/s
    assert measure.utilisation(1e9, 0.05, peak) == pytest.approx(0.1)  # 20 GFLOP/s of 200
    assert measure.utilisation(2e9, 0.01, 2e11) == pytest.approx(1.0)


def test_budget_skip_extrapolates_linearly_in_seq_len():
    settings = Settings(repeats=3, max_seconds=10.0, reference_max_len=1024)
    assert measure.predicted_seconds(2.0, 1024, 4096) == pytest.approx(8.0)
    assert measure.budget_skip(None, 4096, settings) == ""
    assert measure.budget_skip((1024, 2.0), 4096, settings) == ""
    assert "predicted 12.0 s" in measure.budget_skip((1024, 3.0), 4096, settings)


def test_time_runs_keeps_one_sample_when_a_run_exceeds_the_budget():
    calls = []

    def slow_run():
        calls.append(None)
        time.sleep(0.02)

    timing = measure.time_runs(slow_run, repeats=5, max_seconds=0.001)
    assert timing["over_budget"] and timing["runs"] == 1 and len(calls) == 1
    calls.clear()
    timing = measure.time_runs(lambda: calls.append(None), repeats=4, max_seconds=10.0)
    assert not timing["over_budget"] and timing["runs"] == 4 and len(calls) == 5  # warm-up + 4
    assert timing["median_s"] > 0


def test_unknown_implementation_is_refused(capsys):
    assert command.main(["--quick", "--impls", "no-such-impl"]) == 2
    assert "no-such-impl" in capsys.readouterr().err


def _number(cell: str) -> float:
    return float(cell.strip().rstrip("%*"))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("tqdm")  # the `bench` extra
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    argv = ["--quick", "--impls", "reference", "--gates", "gk", "--seq-lens", "32,64",
            "--heads", "2", "--qk-dim", "16", "--v-dim", "16",
            "--repeats", "2", "--matmul-size", "256", "--matmul-repeats", "2",
            "--out", str(out)]
    return command.main(argv), out


def test_quick_run_writes_the_three_files(quick_run):
    code, out = quick_run
    assert code == 0
    for name in ("results.md", "results.json", "results.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quick_run_table_numbers_parse_and_are_positive(quick_run):
    _, out = quick_run
    rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| reference |")]
    assert len(rows) == 2  # 1 gate kind × 2 sequence lengths
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        times_and_mfu = [_number(cells[i]) for i in (3, 4, 5, 6)]
        memory = [_number(cells[i]) for i in (7, 8, 9)]
        assert all(x > 0 for x in times_and_mfu), row
        assert all(x >= 0 for x in memory), row  # tiny temporaries may round to 0.00


def test_quick_run_json_has_the_peak_and_records(quick_run):
    _, out = quick_run
    report = json.loads((out / "results.json").read_text())
    assert report["peak_flops_per_s"] > 0 and len(report["matmul_peaks"]) == 2
    assert report["machine"]["backend"] and report["machine"]["jax"]
    assert {r["status"] for r in report["records"]} == {"ok"}
    for record in report["records"]:
        assert record["median_s"] > 0 and record["mfu"] > 0 and record["peak_bytes"] > 0
    markdown = (out / "results.md").read_text()
    assert "matmul peak" in markdown


def test_default_output_is_a_fresh_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = command.with_defaults(command.parser().parse_args(["--quick"])).out
    assert first.name.startswith("recurrax-bench-") and "benchmarks" not in str(first)
    first.mkdir()
    second = command.with_defaults(command.parser().parse_args(["--quick"])).out
    assert second != first and not second.exists()


def test_quick_run_reports_no_verdicts(quick_run):
    _, out = quick_run
    markdown = (out / "results.md").read_text()
    assert "pass" not in markdown.split("|") and "FAIL" not in markdown and "Targets" not in markdown


# ----------------------------------------------------------------------------- issue 31: command line


def _fake_record(impl, kind, shape, mode, settings, *, run=True, skip_reason=""):
    """What `measure.measure` returns, without compiling or timing anything."""
    return {"impl": impl, "gates": kind, "mode": mode, **shape.__dict__, "dtype": settings.dtype,
            "model_flops": measure.model_flops(shape, mode), "compile_s": 0.0, "temp_bytes": 0, "peak_bytes": 0,
            "argument_bytes": 0, "output_bytes": 0, "median_s": 1e-3, "min_s": 1e-3, "runs": 1, "first_s": 1e-3,
            "over_budget": False, "status": "ok", "reason": ""}


@pytest.fixture
def measured(monkeypatch):
    """`recurrax bench` with measuring replaced: the settings of every measurement, in order."""
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    calls = []

    def fake_measure(impl, kind, shape, mode, settings, **options):
        calls.append(settings)
        return _fake_record(impl, kind, shape, mode, settings, **options)

    monkeypatch.setattr(measure, "measure", fake_measure)
    monkeypatch.setattr(command, "matmul_peak", lambda size, repeats: {"size": size, "repeats": repeats,
                                                                       "median_s": 1e-3, "flops_per_s": 1e11})
    monkeypatch.setattr(report, "plot_results", lambda records, path: path.write_bytes(b"png"))
    return calls


TINY_GRID = ["--impls", "scan", "--gates", "g", "--seq-lens", "8,16", "--batch", "1", "--heads", "1",
             "--qk-dim", "4", "--v-dim", "4"]


def test_dtype_reaches_the_measured_inputs(measured, tmp_path):
    primals, cotangents = measure.make_arguments(Shape(1, 8, 2, 4, 4), "gk", 0, "bfloat16")
    query, key, value, gates = primals
    assert {x.dtype.name for x in (query, key, value, gates["gk"], cotangents[0])} == {"bfloat16"}
    assert command.main([*TINY_GRID, "--dtype", "bfloat16", "--out", str(tmp_path / "b")]) == 0
    assert [settings.dtype for settings in measured] == ["bfloat16"] * 4
    assert "g_gamma, bfloat16)" not in (tmp_path / "b" / "results.md").read_text()
    assert "H=1 K=4 V=4, bfloat16)" in (tmp_path / "b" / "results.md").read_text()
    with pytest.raises(SystemExit) as exit_:
        command.parser().parse_args(["--dtype", "float16"])
    assert exit_.value.code == 2


def test_quick_grid_is_one_where_chunk_beats_scan():
    """K = V = 64 and T up to 1024: chunk's matmuls win there on a 2-core CPU (the old quick
    grid, K = V = 16 and T ≤ 256, had scan ahead)."""
    quick = command.QUICK
    assert quick["qk_dim"] >= 64 and quick["v_dim"] >= 64 and max(quick["seq_lens"]) >= 1024


def test_duration_of_the_full_grid_is_stated(measured, tmp_path, capsys):
    assert "the full grid about" in " ".join(command.parser().format_help().split())
    assert command.main([*TINY_GRID, "--out", str(tmp_path / "b")]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert "4 measurements" in first_line and f"the full grid takes {command.FULL_GRID_DURATION}" in first_line


@pytest.mark.parametrize("option, value", [("--seq-lens", "abc"), ("--seq-lens", "256,-1"), ("--heads", "-1"),
                                           ("--batch", "x"), ("--repeats", "0"), ("--max-seconds", "0"),
                                           ("--seed", "-1"), ("--reference-max-len", "-1")])
def test_bad_numbers_exit_2_naming_the_option(option, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        command.parser().parse_args([option, value])
    assert exit_.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err


def test_unusable_out_is_refused_before_measuring(measured, tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("")
    for out in (file, file / "below"):
        assert command.main([*TINY_GRID, "--out", str(out)]) == 2
        assert f"--out {out}" in capsys.readouterr().err
    assert measured == []


def test_results_in_out_are_kept_unless_overwrite(measured, tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    assert command.main([*TINY_GRID, "--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err and measured == []
    assert (tmp_path / "results.json").read_text() == "{}"
    assert command.main([*TINY_GRID, "--out", str(tmp_path), "--overwrite"]) == 0
    assert len(json.loads((tmp_path / "results.json").read_text())["records"]) == 4


def test_ctrl_c_keeps_the_finished_measurements(measured, monkeypatch, tmp_path, capsys):
    out = tmp_path / "b"
    seen_on_disk = []

    def interrupted_third(impl, kind, shape, mode, settings, **options):
        if len(seen_on_disk) == 2:
            raise KeyboardInterrupt
        results = out / "results.json"
        seen_on_disk.append(len(json.loads(results.read_text())["records"]) if results.exists() else 0)
        return _fake_record(impl, kind, shape, mode, settings, **options)

    monkeypatch.setattr(measure, "measure", interrupted_third)
    assert command.main([*TINY_GRID, "--out", str(out)]) == 130
    assert seen_on_disk == [0, 1], "each measurement is written before the next starts"
    saved = json.loads((out / "results.json").read_text())
    assert saved["status"] == "interrupted" and len(saved["records"]) == 2
    assert "Partial results (interrupted): 2 of 4 measurements" in (out / "results.md").read_text()
    assert "interrupted: 2 of 4 measurements saved in" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the delta rule


def test_delta_kinds_measure_the_delta_rule():
    """A delta kind compiles and runs `delta_rule` (gradients include beta), with the delta
    rule's model FLOPs; a name only `recurrent` registers is recorded as unsupported."""
    settings = measure.Settings(repeats=1, max_seconds=5.0, reference_max_len=64)
    shape = Shape(1, 8, 2, 4, 4)
    primals, _ = measure.make_arguments(shape, "delta_gk", 0)
    assert set(primals[3]) == {"beta", "gk"}
    record = measure.measure("scan", "delta_gk", shape, "fwd+bwd", settings)
    assert record["status"] == "ok" and record["model_flops"] == 18 * 1 * 8 * 2 * 4 * 4
    query, key, value, gates = measure.make_arguments(shape, "delta_g", 0)[0]
    output, _ = jax.jit(measure.forward_program("chunk", "delta_g"))(query, key, value, gates)
    direct = jax.jit(lambda *x: recurrax.delta_rule(*x, gates["beta"], g=gates["g"], qk_l2norm=True)[0])
    np.testing.assert_array_equal(output, direct(query, key, value))
    refused = measure.measure("pallas_interpret", "delta", shape, "fwd", settings)
    assert refused["status"] == "unsupported" and "implementation must be one of" in refused["reason"]
