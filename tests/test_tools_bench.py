"""`recurrax bench`: its arithmetic, its budget rules, and a tiny end-to-end run."""

from __future__ import annotations

import json
import time

import pytest

from recurrax.tools.bench import command, machine, measure
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
