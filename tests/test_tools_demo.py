"""`recurrax demo`: the MQAR generator, the training loop, decoding check and plot."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from recurrax.tools import demo as _demo
from recurrax.tools.mqar import HELD_OUT, TRAIN, MQARConfig, mqar_batch, split_key

TASK = MQARConfig(vocab_size=32, seq_len=24, num_pairs=5)
JIT_BATCH = jax.jit(mqar_batch, static_argnums=(1, 2))


def batch_of(split: int, index: int, task: MQARConfig = TASK, size: int = 16):
    batch = JIT_BATCH(jax.random.fold_in(split_key(0, split), index), size, task)
    return tuple(np.asarray(x) for x in batch)


@pytest.mark.parametrize("task", [TASK, MQARConfig(vocab_size=20, seq_len=41, num_pairs=4)], ids=str)
def test_answers_are_right_by_construction(task):
    tokens, targets, mask = batch_of(TRAIN, 0, task)
    P, Q = task.num_pairs, task.num_queries
    assert tokens.shape == targets.shape == mask.shape == (16, task.seq_len)
    assert (mask.sum(axis=1) == Q).all()
    for row, row_targets, row_mask in zip(tokens, targets, mask):
        keys, values = row[0 : 2 * P : 2], row[1 : 2 * P : 2]
        assert len(set(keys.tolist())) == P
        assert ((1 <= keys) & (keys <= task.num_keys)).all()
        assert ((task.num_keys < values) & (values < task.vocab_size)).all()
        pairs = dict(zip(keys.tolist(), values.tolist()))
        for position in np.flatnonzero(row_mask):
            assert row_targets[position] == pairs[row[position]] == row[position + 1]
        assert (row[2 * (P + Q) :] == 0).all()
        assert (row_targets[:-1] == row[1:]).all()


def test_splits_are_deterministic_and_held_out_differs():
    assert all((a == b).all() for a, b in zip(batch_of(HELD_OUT, 3), batch_of(HELD_OUT, 3)))
    training = {row.tobytes() for step in range(20) for row in batch_of(TRAIN, step)[0]}
    held_out = {row.tobytes() for row in batch_of(HELD_OUT, 0)[0]}
    assert len(training) == 20 * 16 and not training & held_out


@pytest.mark.parametrize(
    "options, match",
    [(dict(vocab_size=10, num_pairs=5), "vocab_size"), (dict(seq_len=10, num_pairs=5), "seq_len")],
)
def test_task_errors(options, match):
    with pytest.raises(ValueError, match=match):
        MQARConfig(**options)


def test_options_and_quick_preset():
    args = _demo.parse_args(["--mixer", "all", "--quick", "--steps", "7", "--seed", "3"])
    configs = _demo.configs_from(args)
    assert [c.mixer for c in configs] == list(_demo.mixer_names())
    assert all(c.steps == 7 and c.seed == 3 for c in configs)
    assert configs[0].task.seq_len == _demo.QUICK["seq_len"]
    default = _demo.configs_from(_demo.parse_args(["--seq-len", "40", "--num-pairs", "6"]))
    assert [c.mixer for c in default] == ["gla"] and default[0].steps == _demo.DEFAULTS["steps"]
    assert (default[0].task.seq_len, default[0].task.num_pairs) == (40, 6)
    assert _demo.main(["--seq-len", "8", "--num-pairs", "6"]) == 2
    assert default[0].dtype == "float32"
    assert _demo.configs_from(_demo.parse_args(["--dtype", "bfloat16"]))[0].dtype == "bfloat16"


def test_plot_writes_a_png(tmp_path):
    history = _demo.History("gla", [10, 20], [3.0, 1.0], [0.1, 0.5], [20], [0.4])
    path = tmp_path / "sub" / "demo.png"
    _demo.plot([history, dataclasses.replace(history, mixer="retnet")], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TINY = _demo.TrainConfig(
    task=MQARConfig(vocab_size=16, seq_len=12, num_pairs=3), d_model=16, num_layers=1, num_heads=2,
    mlp_ratio=1, steps=40, batch_size=16, learning_rate=1e-2, warmup=5,
)


@pytest.mark.slow
def test_tiny_training_run_lowers_the_loss_and_decodes_exactly(capsys):
    graphdef, params, history, _ = _demo.train(TINY, evals=2, progress=True)
    err = capsys.readouterr().err
    # compiling is announced and timed before the progress bar starts, evaluation included
    assert re.search(r"compiling the training step and the evaluation\.\.\. \d+ s\n", err), err[:500]
    assert err.index("compiling") < err.index("train ")
    assert len(history.loss) == 4 and len(history.eval_accuracy) == 2
    assert history.loss[-1] < 0.85 * history.loss[0]
    report = _demo.decode_check(graphdef, params, TINY, batch_size=4)
    assert report.matches and report.tokens_per_second > 0


@pytest.mark.slow
def test_bfloat16_training_keeps_float32_parameters_and_decodes(capsys):
    """`--dtype bfloat16`: bfloat16 compute on float32 parameters (and optimiser state) lowers
    the loss, and decoding matches the parallel forward within bfloat16's tolerance."""
    config = dataclasses.replace(TINY, dtype="bfloat16")
    graphdef, params, history, _ = _demo.train(config, evals=2, progress=False)
    assert {x.dtype for x in jax.tree.leaves(params) if np.issubdtype(x.dtype, np.floating)} == {np.dtype("float32")}
    assert history.loss[-1] < 0.85 * history.loss[0]
    report = _demo.decode_check(graphdef, params, config, batch_size=4)
    assert report.matches


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    out = tmp_path / "demo.png"
    assert _demo.main(["--quick", "--steps", "20", "--no-progress", "--out", str(out)]) == 0
    assert out.exists()


# ----------------------------------------------------------------------------- issue 31: command line


def test_no_progress_keeps_the_compiling_line(monkeypatch, capsys):
    """`--no-progress` (progress=False) hides the bar only; the compiling line stays."""
    import jax.numpy as jnp

    def tiny_functions(model, config):
        outputs = (jnp.float32(1.0), jnp.float32(0.5))
        step = jax.jit(lambda params, opt_state, key: (params, opt_state, *outputs))
        evaluate = jax.jit(lambda params, key: outputs)
        return None, jnp.zeros(2), jnp.zeros(2), step, evaluate

    monkeypatch.setattr(_demo, "build_model", lambda config: None)
    monkeypatch.setattr(_demo, "make_functions", tiny_functions)
    _demo.train(dataclasses.replace(TINY, steps=2), evals=1, progress=False)
    err = capsys.readouterr().err
    assert re.search(r"compiling the training step and the evaluation\.\.\. \d+ s\n", err), err
    assert "train " not in err, "the progress bar is hidden"
