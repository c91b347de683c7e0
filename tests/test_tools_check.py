"""`recurrax check`: progress with an ETA, and a summary that counts matches apart from refusals."""

import re

import pytest
from _cases import Case

from recurrax import kernel_registry
from recurrax.tools import check
from recurrax.tools.cases import DeltaCase


def test_progress_and_summary(monkeypatch, capsys):
    tiny = dict(B=1, T=3, H=1, Hkv=1, K=2, V=2)
    monkeypatch.setattr(check, "CASES", {"tiny": Case(**tiny), "tiny gv": Case(**tiny, gates=("gv",))})
    assert check.main(["--operation", "recurrent", "--implementations", "reference", "pallas_interpret",
                       "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"\[\d/4, ETA \d+:\d\d\]", out)) == 4
    assert "2 matched, 0 mismatched, 2 declared unsupported (not run)" in out
    assert "all match" not in out


def test_eta_is_the_mean_time_per_row():
    assert check._eta(1, 4, 30.0) == "[1/4, ETA 1:30]"
    assert check._eta(4, 4, 10.0) == "[4/4, ETA 0:00]"


def test_quick_runs_only_the_quick_cases(monkeypatch, capsys):
    tiny = dict(B=1, T=3, H=1, Hkv=1, K=2, V=2)
    monkeypatch.setattr(check, "CASES", {"tiny": Case(**tiny), "tiny gv": Case(**tiny, gates=("gv",))})
    monkeypatch.setattr(check, "QUICK", ("tiny gv",))
    assert check.main(["--operation", "recurrent", "--implementations", "reference", "--dtype", "float64", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "1 implementations x 1 cases: 1 matched" in out and "tiny gv" in out


def test_quick_cases_exist_and_columns_align():
    assert set(check.QUICK) <= set(check.CASES) and set(check.DELTA_QUICK) <= set(check.DELTA_CASES)
    header = f"{'case':<{check.CASE_WIDTH}} "
    rows = [check._row("chunk", name, 1e-7, "dquery", 0.01, True) for name in (*check.CASES, *check.DELTA_CASES)]
    assert len({row.index("e-07") for row in rows}) == 1, "the error column moves with the case name"
    assert len(header) > max(len(name) for name in check.CASES)


# ----------------------------------------------------------------------------- issue 31: command line


def _exit_code(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        check.main(argv)
    return exit_.value.code, capsys.readouterr().err


def test_unknown_implementations_are_named_with_the_valid_ones(capsys):
    code, err = _exit_code(["--implementations", "bogus", "reference", "also-bogus"], capsys)
    assert code == 2 and "bogus, also-bogus not registered" in err
    assert all(name in err for name in check._machine_implementations())


def test_an_empty_selection_is_an_error(capsys):
    code, err = _exit_code(["--implementations"], capsys)
    assert code == 2 and "--implementations needs at least one name" in err
    elsewhere = [name for name in kernel_registry.names() if name not in check._machine_implementations()]
    if elsewhere:  # registered for another backend: nothing of this machine's is left
        code, err = _exit_code(["--implementations", elsewhere[0]], capsys)
        assert code == 2 and "do not run on this machine" in err


@pytest.mark.parametrize("tolerance", ["0", "-1e-3", "nan", "x"])
def test_tolerance_must_be_positive(tolerance, capsys):
    code, err = _exit_code(["--implementations", "reference", "--tolerance", tolerance], capsys)
    assert code == 2 and "argument --tolerance:" in err


# ----------------------------------------------------------------------------- the delta rule


def test_the_delta_rule_is_checked_too(monkeypatch, capsys):
    """`--operation delta_rule` runs the delta rule's registry against its float64 reference;
    the default checks both operations, and a name only one registers selects only that one."""
    tiny = dict(B=1, T=5, Hqk=1, H=2, K=3, V=2)
    monkeypatch.setattr(check, "DELTA_CASES", {"tiny": DeltaCase(**tiny, gates=("g",)),
                                               "tiny packed": DeltaCase(**tiny, gates=("gk",), cu_seqlens=(0, 2, 2, 5))})
    assert check.main(["--operation", "delta_rule", "--implementations", "scan", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "delta_rule: 1 implementations x 2 cases: 2 matched, 0 mismatched" in out
    monkeypatch.setattr(check, "CASES", {"tiny": Case(B=1, T=3, H=1, Hkv=1, K=2, V=2)})
    monkeypatch.setattr(check, "QUICK", ("tiny",))
    monkeypatch.setattr(check, "DELTA_QUICK", ("tiny",))
    assert check.main(["--implementations", "reference", "chunk", "--dtype", "float64", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "recurrent: 2 implementations x 1 cases: 2 matched" in out
    assert "delta_rule: 2 implementations x 1 cases: 2 matched" in out
    assert check.main(["--implementations", "pallas_interpret", "--dtype", "float64", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "recurrent: 1 implementations" in out and "delta_rule" not in out
