"""The scripts in examples/ run, and what they print holds: errors under their bounds, a loss
that falls. Each runs in its own process (they configure JAX devices and precision
themselves) at tiny sizes through the scripts' own flags."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NEEDS_FLAX = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax (pip install '.[nn]')")
NEEDS_OPTAX = pytest.mark.skipif(importlib.util.find_spec("optax") is None, reason="needs optax (pip install '.[examples]')")
NEEDS_SCRIPTS = pytest.mark.skipif(not EXAMPLES.is_dir(), reason="examples/ is not in this checkout")


def run_example(name: str, *flags: str, timeout: float = 240.0) -> str:
    """Run examples/<name> with `flags`; its stdout and stderr, after asserting exit status 0."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    # A session of its own, so that a timeout kills the script and any processes it started.
    process = subprocess.Popen([sys.executable, str(EXAMPLES / name), *flags], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=EXAMPLES.parent,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{name} ran past {timeout:.0f} s:\n{output[-4000:]}")
    assert process.returncode == 0, f"{name} exited {process.returncode}:\n{output[-4000:]}"
    return output


def max_errors(output: str) -> list[tuple[str, float]]:
    """(what, value) of every `max error, WHAT: VALUE` line the examples print."""
    return [(name, float(value)) for name, value in re.findall(r"max error,? ([^:\n]+): ([-+.\deE]+)", output)]


def assert_errors(output: str, expected: set[str], bound: float) -> None:
    errors = max_errors(output)
    missing = {name for name in expected if not any(name in found for found, _ in errors)}
    assert not missing, f"no error line for {missing} in:\n{output[-3000:]}"
    assert all(value <= bound for _, value in errors), errors


@pytest.mark.slow  # .ci/run runs every slow example test after the suite
@NEEDS_SCRIPTS
def test_packed_batches():
    output = run_example("packed_batches.py", "--lengths", "5,0,11", "--heads", "2", "--head-dim", "8",
                         *(() if importlib.util.find_spec("flax") else ("--no-layer",)))
    assert_errors(output, {"recurrent output", "recurrent final state", "recurrent gradients"}, 1e-5)
    if importlib.util.find_spec("flax"):
        assert_errors(output, {"GatedLinearAttention output"}, 1e-5)
    assert "packed == per sequence" in output


@pytest.mark.slow  # .ci/run runs every slow example test after the suite
@NEEDS_SCRIPTS
def test_sequence_parallel():
    output = run_example("sequence_parallel.py", "--devices", "4", "--seq-len", "32", "--heads", "2",
                         "--head-dim", "8")
    assert "4 cpu devices" in output
    assert_errors(output, {"forward output", "reverse final state", "gradients", "packed final states",
                           "2-D mesh output"}, 1e-5)


@pytest.mark.slow  # .ci/run runs every slow example test after the suite
@NEEDS_SCRIPTS
def test_multiprocess():
    """Two processes joined by jax.distributed on 127.0.0.1, one device each."""
    output = run_example("multiprocess.py", "--seq-len", "16", "--heads", "2", "--head-dim", "8",
                         "--local-devices", "1", "--timeout", "200", timeout=240.0)
    for process in (0, 1):
        assert f"[process {process}/2]" in output
    errors = max_errors(output)
    assert len(errors) == 6, output[-3000:]                  # output, final state, gradients × 2 processes
    assert all(value <= 1e-5 for _, value in errors), errors
    assert "all processes agree with one process" in output


@pytest.mark.slow  # .ci/run runs every slow example test after the suite
@NEEDS_SCRIPTS
@NEEDS_FLAX
@pytest.mark.parametrize("mixer", ["gla", "gated_deltanet"])
def test_generate(mixer):
    output = run_example("generate.py", "--new-tokens", "4", "--prompt-len", "8", "--batch-size", "2",
                         "--num-layers", "1", "--d-model", "32", "--num-heads", "2", "--mixer", mixer)
    shortfall = float(re.search(r"max logit shortfall \(generate vs parallel\) ([-+.\deE]+)", output).group(1))
    assert shortfall <= 1e-4
    assert output.count("-> generated") == 2


@NEEDS_SCRIPTS
@NEEDS_FLAX
@NEEDS_OPTAX
@pytest.mark.slow
@pytest.mark.parametrize("mixer", ["gla", "gated_deltanet"])
def test_train_lm(mixer):
    output = run_example("train_lm.py", "--steps", "8", "--batch-size", "4", "--seq-len", "16", "--num-layers", "1",
                         "--d-model", "32", "--learning-rate", "1e-2", "--log-every", "1", "--mixer", mixer)
    losses = [float(x) for x in re.findall(r"^step +\d+ loss ([-+.\deE]+)$", output, re.M)]
    assert len(losses) == 8
    assert losses[0] > 2.5                       # about log(32) = 3.47 before training
    assert min(losses[-3:]) < losses[0] - 0.2    # and it learns
    assert re.search(r"^training rate [\d,]+ tokens/s \(MFU: no peak FLOP/s known for cpu\)$", output, re.M), output


@NEEDS_SCRIPTS
@NEEDS_FLAX
@pytest.mark.slow
def test_linen_wrapper():
    output = run_example("linen_wrapper.py", "--seq-len", "8", "--d-model", "16")
    assert_errors(output, {"linen-wrapped vs NNX layer"}, 1e-6)
    norm = float(re.search(r"gradient norm of the wrapped layer's parameters ([-+.\deE]+)", output).group(1))
    assert norm > 0


@NEEDS_SCRIPTS
@NEEDS_FLAX
def test_pretrained():
    pytest.importorskip("safetensors")
    output = run_example("pretrained.py", "--prompts", "3", "--prompt-len", "9", "--new-tokens", "4")
    assert re.search(r"prefill: 27 tokens in [\d.]+ ms = [\d,]+ tokens/s", output), output
    assert re.search(r"generate \(prefill \+ decode, batch 3\): 12 new tokens", output), output


@NEEDS_SCRIPTS
def test_pretrained_help_names_every_family_it_loads():
    """`--help` shows the docstring's first paragraph: it loads transformers' checkpoints as well
    as fla's (issue 31: it said "fla checkpoint")."""
    import ast

    description = ast.get_docstring(ast.parse((EXAMPLES / "pretrained.py").read_text())).split("\n\n")[0]
    assert "fla" in description and "transformers" in description, description


@NEEDS_SCRIPTS
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_help_documents_every_option(script):
    """`--help` shows what each option does and its default: every `add_argument` has a
    `help=` and the parser uses `ArgumentDefaultsHelpFormatter` (read from the source, so
    nothing is imported)."""
    import ast

    tree = ast.parse((EXAMPLES / script).read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    parsers = [call for call in calls if call.func.attr == "ArgumentParser"]
    options = [call for call in calls if call.func.attr == "add_argument"]
    assert parsers and options, f"{script} parses no arguments"
    for parser in parsers:
        formatter = {kw.arg: ast.unparse(kw.value) for kw in parser.keywords}.get("formatter_class", "")
        assert formatter.endswith("ArgumentDefaultsHelpFormatter"), f"{script}: --help does not show defaults"
    undocumented = [ast.unparse(call.args[0]) for call in options if "help" not in {kw.arg for kw in call.keywords}]
    assert not undocumented, f"{script}: options without help text: {undocumented}"


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"step +\d+ loss ([-+.\deE]+)$", output, re.M)]


@NEEDS_SCRIPTS
@NEEDS_FLAX
@NEEDS_OPTAX
@pytest.mark.slow
def test_train_sharded():
    """The default 2 data × 2 tensor × 2 sequence mesh: the first step as one device's, a falling loss."""
    pytest.importorskip("safetensors")
    output = run_example("train_sharded.py", "--steps", "4", "--seq-len", "16", timeout=120.0)
    assert "8 local of 8 cpu devices; mesh {'data': 2, 'tensor': 2, 'sequence': 2}" in output
    assert_errors(output, {"first step loss", "first step optimizer state"}, 1e-4)
    losses = _losses(output)
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses     # log(128) = 4.85 at the start


@NEEDS_SCRIPTS
@NEEDS_FLAX
@NEEDS_OPTAX
@pytest.mark.slow
def test_train_sharded_two_processes(tmp_path):
    """2 processes × 4 devices, FSDP 2 × tensor 2 × sequence 2: each process's first step as one
    device's, the same losses in both, an orbax checkpoint written by both, and save_pretrained
    gathering the shards into one checkpoint that loads back, trained away from the fixture."""
    pytest.importorskip("safetensors")
    pytest.importorskip("orbax.checkpoint")
    output = run_example("train_sharded.py", "--num-processes", "2", "--mesh", "data=2,tensor=2,sequence=2", "--fsdp",
                         "--steps", "2", "--seq-len", "8", "--checkpoint-dir", str(tmp_path / "checkpoints"),
                         "--save-pretrained", str(tmp_path / "trained"), "--timeout", "150", timeout=180.0)
    for process in (0, 1):
        assert f"[process {process}/2] 4 local of 8 cpu devices" in output
    assert len(max_errors(output)) == 4, output[-3000:]
    assert_errors(output, {"first step loss", "first step optimizer state"}, 1e-4)
    per_process = [[float(x) for x in re.findall(rf"\[process {p}/2\] step +\d+ loss ([-+.\deE]+)$", output, re.M)]
                   for p in (0, 1)]
    assert len(per_process[0]) == 2 and per_process[0] == per_process[1]
    assert "all processes agree with one process" in output
    assert (tmp_path / "checkpoints" / "2").is_dir()

    import numpy as np
    from flax import nnx

    from recurrax.nn.pretrained import from_pretrained

    trained, fixture = (nnx.state(from_pretrained(path)) for path in (tmp_path / "trained", EXAMPLES.parent /
                                                                      "tests/fixtures/fla/gla_basic"))
    assert _all_leaves(lambda a, b: a.shape == b.shape and np.isfinite(a).all(), trained, fixture)
    assert not _all_leaves(lambda a, b: np.array_equal(a, b), trained, fixture)


def _all_leaves(check, *trees) -> bool:
    import jax
    import numpy as np

    return all(check(*(np.asarray(leaf) for leaf in leaves)) for leaves in zip(*(jax.tree.leaves(t) for t in trees)))


@NEEDS_SCRIPTS
@NEEDS_FLAX
@NEEDS_OPTAX
@pytest.mark.slow
def test_train_text(tmp_path):
    """A few KB of text made here: the validation loss falls, and `recurrax generate` reads the
    saved directory (model and tokenizer)."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("tqdm")
    import random

    chooser = random.Random(0)
    words = "the cat dog sat on a mat ran to big red ball and then slept in sun".split()
    paragraphs = [" ".join(chooser.choice(words) for _ in range(chooser.randint(5, 30))) + "." for _ in range(200)]
    (tmp_path / "text.txt").write_text("\n\n".join(paragraphs))
    output = run_example("train_text.py", str(tmp_path / "text.txt"), "--output", str(tmp_path / "model"),
                         "--steps", "30", "--eval-every", "10", "--batch-tokens", "256", "--vocab-size", "300",
                         "--prompt", "the cat", "--sample-tokens", "8", "--no-progress")
    assert "180 training documents" in output and "20 validation documents" in output
    validation = [float(x) for x in re.findall(r"^validation loss ([-+.\deE]+) at step \d+$", output, re.M)]
    assert len(validation) == 4, output[-3000:]
    assert validation[0] > 5.0                    # about log(300) = 5.7 before training
    assert validation[-1] < validation[0] - 1.0   # and it learns
    assert re.search(r"^sample: the cat", output, re.M)
    assert re.search(r"^training rate [\d,]+ tokens/s \(MFU: no peak FLOP/s known for cpu\)$", output, re.M), output
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(EXAMPLES.parent / "src"),
                                                                 env.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "recurrax.tools.cli", "generate", str(tmp_path / "model"), "--prompt",
                          "the dog", "--max-new-tokens", "8"], capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "loaded" in run.stderr and "tokens/s" in run.stderr
