"""`recurrax check`: progress with an ETA, and a summary that counts matches apart from refusals."""

import re

from _cases import Case

from recurrax.tools import check


def test_progress_and_summary(monkeypatch, capsys):
    tiny = dict(B=1, T=3, H=1, Hkv=1, K=2, V=2)
    monkeypatch.setattr(check, "CASES", {"tiny": Case(**tiny), "tiny gv": Case(**tiny, gates=("gv",))})
    assert check.main(["--implementations", "reference", "pallas_interpret", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"\[\d/4, ETA \d+:\d\d\]", out)) == 4
    assert "2 matched, 0 mismatched, 2 declared unsupported (not run)" in out
    assert "all match" not in out


def test_eta_is_the_mean_time_per_row():
    assert check._eta(1, 4, 30.0) == "[1/4, ETA 1:30]"
    assert check._eta(4, 4, 10.0) == "[4/4, ETA 0:00]"
