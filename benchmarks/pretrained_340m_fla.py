"""fla's own GLA on the checkpoint of `pretrained_340m.py`, on this CPU: load, decode, prefill, logits.

    python benchmarks/pretrained_340m.py --keep /tmp/gla340m        # writes the checkpoint (JAX venv)
    TRITON_INTERPRET=1 FLA_CACHE_RESULTS=0 FLA_PYTHON \\
        benchmarks/pretrained_340m_fla.py /tmp/gla340m               # writes benchmarks/results/pretrained_340m_fla.md

FLA_PYTHON is an interpreter of another environment with torch and flash-linear-attention 0.6.0
(the one tests/fixtures/fla/make_fixtures.py describes), e.g. `venv-fla/bin/python`.

The side-by-side fla measurement for `pretrained_340m.py`. It loads the same 341.7M-parameter
checkpoint (Hugging Face layout, fla's parameter names) with flash-linear-attention and
PyTorch (CPU) and measures:
- `from_pretrained` time: transformers' `AutoModelForCausalLM.from_pretrained` after
  `import fla`, float32 -- directly comparable with recurrax's `from_pretrained`, since
  loading runs no Triton kernel;
- one decode step (one token per sequence with fla's cache) at batch 8, timed on the step
  after a warm-up step; batch 64 only if a batch-8 step took under `BATCH_64_IF_UNDER_S`;
- a prefill of one 64-token prompt, abandoned if it runs past `PREFILL_LIMIT_S`;
- its figures, for `pretrained_340m.py` to set beside its own, as
  `<checkpoint>/fla_measurements.json`;
- fla's logits for one fixed sequence of 16 token ids (numpy `default_rng(0)`, ids < vocab),
  saved as `<checkpoint>/fla_logits_16.npy` (float32 [1, 16, vocab], ids beside them in
  `fla_input_ids_16.npy`) so recurrax can be compared with fla on the real checkpoint.

There is no GPU: fla's Triton kernels run only under Triton's interpreter, which executes
every kernel program instance in Python, so the decode and prefill figures measure the
interpreter, not fla's kernels. That is also why the 8 x 512 prefill of `pretrained_340m.py`
is not attempted here. The patches that make fla run on a CPU are those of
`tests/fixtures/fla/make_fixtures.py`: importing that module applies them
(`_patch_triton_for_cpu` before fla is imported, then `_patch_flash_attn`, `_patch_libdevice`).
The whole run stops at `--budget-minutes` (a SIGALRM interrupts the measurement running then);
whatever did not run is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "fla"))

import make_fixtures  # noqa: E402  (patches triton for the interpreter, imports fla, patches fla)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "pretrained_340m_fla.md"
CHECK_LEN = 16
PREFILL_LEN = 64
BATCH_64_IF_UNDER_S = 60.0
PREFILL_LIMIT_S = 120.0


class OutOfTime(BaseException):
    """Raised by SIGALRM. A BaseException, so the Triton interpreter's `except Exception`
    (which would wrap it in an InterpreterError) lets it through."""


def _raise_out_of_time(signum, frame):
    raise OutOfTime


def run_within(seconds: float, fn: Callable[[], object]) -> tuple[object | None, float]:
    """`fn()` and its wall time, or (None, elapsed) if it ran past `seconds`."""
    if seconds < 1:
        return None, 0.0
    signal.signal(signal.SIGALRM, _raise_out_of_time)
    signal.alarm(int(seconds))
    start = time.perf_counter()
    try:
        result = fn()
    except OutOfTime:
        result = None
    finally:
        signal.alarm(0)
    return result, time.perf_counter() - start


class Clock:
    """Time since the start of the run, the budget left, and progress lines."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, message: str) -> None:
        print(f"[{self.elapsed():7.1f} s] {message}", flush=True)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def load(directory: Path):
    """fla's model from `directory` and what transformers reported missing or unexpected."""
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@torch.no_grad()
def decode_step(model, tokens, cache):
    """One token per sequence through fla's cache; the next cache."""
    return model(input_ids=tokens, past_key_values=cache, use_cache=True).past_key_values


def decode_seconds(model, batch: int, rng: np.random.Generator, seconds: float, clock: Clock) -> float | None:
    """The wall time of the decode step after a warm-up step at `batch` (the warm-up starts from
    no cache), or None if the two steps ran past `seconds`."""
    vocab = model.config.vocab_size
    first, second = (torch.as_tensor(rng.integers(0, vocab, (batch, 1))) for _ in range(2))

    def warm_then_timed() -> float:
        start = time.perf_counter()
        cache = decode_step(model, first, None)
        clock.say(f"decode batch {batch}: warm-up step {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        decode_step(model, second, cache)
        return time.perf_counter() - start

    step_s, _ = run_within(seconds, warm_then_timed)
    return step_s


@torch.no_grad()
def prefill_seconds(model, rng: np.random.Generator, seconds: float) -> float | None:
    """The wall time of one prompt of PREFILL_LEN tokens (cache on), or None past `seconds`."""
    prompt = torch.as_tensor(rng.integers(0, model.config.vocab_size, (1, PREFILL_LEN)))
    done, elapsed = run_within(seconds, lambda: model(input_ids=prompt, use_cache=True))
    return elapsed if done is not None else None


@torch.no_grad()
def cross_check_logits(model, directory: Path) -> Path:
    """fla's float32 logits [1, CHECK_LEN, vocab] for ids `default_rng(0).integers(0, vocab,
    (1, CHECK_LEN))`, saved beside the checkpoint (ids too); the logits' path."""
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, CHECK_LEN))
    logits = model(input_ids=torch.as_tensor(ids), use_cache=False).logits.float().numpy()
    np.save(directory / "fla_input_ids_16.npy", ids.astype(np.int32))
    np.save(directory / "fla_logits_16.npy", logits.astype(np.float32))
    return directory / "fla_logits_16.npy"


def step_row(batch: int, seconds: float | None, why_not: str) -> str:
    label = f"| decode, batch {batch}, one token per sequence, step after a warm-up step |"
    if seconds is None:
        return f"{label} not measured: {why_not} |"
    return f"{label} {batch / seconds:,.3f} tokens/s ({seconds:,.1f} s per step) |"


def report(directory: Path, parameters: int, load_s: float, info: dict, rows: list[str], notes: list[str],
           wall_s: float) -> str:
    versions = make_fixtures._versions()
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    lines = [
        "# fla's GLA 340M on this CPU, under Triton's interpreter",
        "",
        "**These fla figures are measured under Triton's interpreter (`TRITON_INTERPRET=1`) on a CPU: "
        "every Triton program instance of fla's kernels runs as Python, so the decode and prefill times "
        "measure the interpreter, not fla's kernels, and say nothing about fla on a GPU.** "
        "Only `from_pretrained` (no kernel runs while loading) is directly comparable with recurrax's "
        "figure in `pretrained_340m.md`.",
        "",
        "Command: `TRITON_INTERPRET=1 FLA_CACHE_RESULTS=0 FLA_PYTHON "
        f"benchmarks/pretrained_340m_fla.py {directory}` (FLA_PYTHON: an interpreter with torch and fla; "
        f"process niceness {os.nice(0)}).",
        "",
        f"Checkpoint: `{directory}` written by `python benchmarks/pretrained_340m.py --keep {directory}` "
        f"({parameters / 1e6:.1f}M parameters, float32). Loading reported missing keys {missing} and "
        f"unexpected keys {unexpected}.",
        "",
        f"Machine: {cpu_name()}, {len(os.sched_getaffinity(0))} CPUs (shared), torch threads "
        f"{torch.get_num_threads()}. Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "| measurement (fla, PyTorch CPU, Triton interpreter) | value |",
        "|---|---:|",
        f"| `from_pretrained` (safetensors, float32) | {load_s:.2f} s |",
        *rows,
        "",
        *notes,
        f"Whole run: {wall_s:.0f} s of wall time.",
        "",
        "recurrax on the same checkpoint and CPU, with these figures beside its own: `pretrained_340m.md` "
        "(it reads `fla_measurements.json`, which this run leaves in the checkpoint directory).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the directory of `pretrained_340m.py --keep`")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--budget-minutes", type=float, default=20.0, help="stop everything after this long")
    args = parser.parse_args(argv)
    assert os.environ.get("TRITON_INTERPRET") == "1", "needs TRITON_INTERPRET=1 (no GPU here)"
    torch.set_default_dtype(torch.float32)
    clock = Clock(args.budget_minutes * 60)
    rng = np.random.default_rng(1)

    clock.say(f"from_pretrained({args.checkpoint}) ...")
    start = time.perf_counter()
    model, info = load(args.checkpoint)
    load_s = time.perf_counter() - start
    parameters = sum(p.numel() for p in model.parameters())
    clock.say(f"loaded {parameters / 1e6:.1f}M parameters in {load_s:.2f} s; missing {info['missing_keys']}, "
              f"unexpected {info['unexpected_keys']}")

    rows, notes = [], []
    clock.say(f"cross-check: logits of {CHECK_LEN} tokens ...")
    saved, check_s = run_within(clock.left(), lambda: cross_check_logits(model, args.checkpoint))
    clock.say(f"cross-check: {'saved ' + str(saved) if saved else 'out of time'} ({check_s:.1f} s)")
    rows.append(f"| cross-check forward, 1 × {CHECK_LEN} tokens (logits saved) | "
                + (f"{check_s:.1f} s |" if saved else "not finished: run's time budget spent |"))

    clock.say("decode, batch 8 ...")
    step_8 = decode_seconds(model, 8, rng, clock.left(), clock)
    clock.say(f"decode batch 8: {step_8 and round(step_8, 1)} s per step")
    rows.append(step_row(8, step_8, "run's time budget spent"))
    step_64 = None
    if step_8 is not None and step_8 < BATCH_64_IF_UNDER_S:
        clock.say("decode, batch 64 ...")
        step_64 = decode_seconds(model, 64, rng, clock.left(), clock)
        clock.say(f"decode batch 64: {step_64 and round(step_64, 1)} s per step")
        rows.append(step_row(64, step_64, "run's time budget spent"))
    else:
        rows.append(step_row(64, None, f"skipped, a batch-8 step did not finish under {BATCH_64_IF_UNDER_S:.0f} s"))

    clock.say(f"prefill, 1 × {PREFILL_LEN} tokens ...")
    limit = min(PREFILL_LIMIT_S, clock.left())
    prefill_s = prefill_seconds(model, rng, limit)
    clock.say(f"prefill: {prefill_s and round(prefill_s, 1)} s")
    label = f"| prefill, 1 prompt × {PREFILL_LEN} tokens (cache on; fla's fused_recurrent path for ≤ 64 tokens) |"
    rows.append(f"{label} {PREFILL_LEN / prefill_s:,.2f} tokens/s ({prefill_s:,.1f} s) |" if prefill_s is not None
                else f"{label} not measured: did not finish within {limit:.0f} s |")
    rows.append("| prefill, 8 prompts × 512 tokens packed (as in `pretrained_340m.py`) | not attempted |")
    notes += [
        "The 8 × 512 prefill was not attempted: above 64 tokens fla switches to its chunk kernels, and the "
        "interpreter runs each of their program instances in Python; no figure is extrapolated from the "
        "runs above.",
        "",
    ]

    measured = {"from_pretrained_s": load_s, "decode_step_s": {"8": step_8, "64": step_64}, "prefill_64_s": prefill_s,
                "note": "fla's kernels under Triton's interpreter (TRITON_INTERPRET=1) on a CPU"}
    (args.checkpoint / "fla_measurements.json").write_text(json.dumps(measured, indent=2) + "\n")
    text = report(args.checkpoint, parameters, load_s, info, rows, notes, clock.elapsed())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
