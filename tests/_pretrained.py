"""What the tests of a `transformers` family module (test_pretrained_<family>.py) share.

Each family's main fixture (tests/fixtures/transformers, made by `transformers` 5.25) runs
through test_pretrained_transformers.py's compiled forward and decode step plus one compiled
packed prefill, and is checked the same way: a packed prefill then one token at a time equals
the parallel forward (within `floor_tolerance` of its float32-vs-float64 error) and
`transformers`' logits; greedy tokens through the cache equal `transformers`' own;
`save_pretrained` writes `transformers`' names and values and reads back; and every parameter
of every fixture's model has logical axis names.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from _cases import floor_tolerance, max_rel_error
from flax import nnx
from safetensors.numpy import load_file
from test_pretrained_transformers import FIXTURES, TOLERANCE, loaded

import recurrax.nn as rnn
from recurrax.nn.pretrained import CausalLM, from_pretrained, save_pretrained

CAPACITY = 16
"""Cache positions: the longest fixture prompt (9) plus the new tokens (6), rounded up."""
PROMPT = 5
"""Tokens of each row packed into the first call."""


def config_of(name: str) -> dict:
    """The fixture's config.json."""
    return json.loads((FIXTURES / name / "config.json").read_text())


@functools.lru_cache(maxsize=None)
def logits_floor(name: str) -> float:
    """The rounding floor of the fixture's parallel logits (float32 against float64)."""
    fixture = loaded(name)
    return fixture.logits_floor(jnp.asarray(fixture.expected["input_ids"]))


@functools.lru_cache(maxsize=None)
def packed_prefill(name: str):
    """The fixture's model called on packed tokens with a cache, compiled."""
    graphdef = nnx.split(loaded(name).model)[0]
    return jax.jit(lambda params, tokens, cu, cache: nnx.merge(graphdef, params)(tokens, cache, cu_seqlens=cu))


def check_packed_prefill_then_decoding(name: str) -> None:
    """Both rows' first `PROMPT` tokens packed into one cache, then one token at a time: the
    parallel logits within `floor_tolerance` of their rounding floor, and `transformers`' logits
    (as the parallel logits are: `PACKED_PREFILL_FIXTURES` need no other default-run check)."""
    fixture = loaded(name)
    tokens = jnp.asarray(fixture.expected["input_ids"])
    B, T = tokens.shape
    logits, cache = packed_prefill(name)(fixture.params, tokens[:, :PROMPT].reshape(-1),
                                         jnp.arange(B + 1, dtype=jnp.int32) * PROMPT,
                                         fixture.model.init_cache(B, CAPACITY))
    pieces = [logits.reshape(B, PROMPT, -1)]
    for t in range(PROMPT, T):
        logits, cache = fixture.step(fixture.params, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    decoded, parallel = jnp.concatenate(pieces, axis=1), fixture.forward(fixture.params, tokens)
    error = max_rel_error(decoded, parallel)
    assert error <= floor_tolerance(logits_floor(name)), (error, logits_floor(name))
    assert max_rel_error(decoded, fixture.expected["logits"]) < TOLERANCE
    assert max_rel_error(parallel, fixture.expected["logits"]) < TOLERANCE  # test_logits_match_transformers'


def check_greedy_tokens_through_the_cache(name: str) -> None:
    """Both prompts in one cache (rows of 5 and 9 tokens, one token per step), each row's next
    token its argmax once its prompt is in: `transformers`' greedy continuations."""
    fixture = loaded(name)
    prompts = [fixture.expected["prompt_0"].tolist(), fixture.expected["prompt_1"].tolist()]
    wanted = [fixture.expected["greedy_0"].tolist(), fixture.expected["greedy_1"].tolist()]
    cache = fixture.model.init_cache(len(prompts), CAPACITY)
    new = [[] for _ in prompts]
    fed = [prompt[0] for prompt in prompts]
    for t in range(max(map(len, prompts)) + len(wanted[0]) - 1):
        logits, cache = fixture.step(fixture.params, jnp.asarray(fed)[:, None], cache)
        choices = np.argmax(np.asarray(logits[:, 0]), axis=-1)
        for row, prompt in enumerate(prompts):
            if t + 1 < len(prompt):
                fed[row] = prompt[t + 1]
            elif len(new[row]) < len(wanted[row]):
                new[row].append(int(choices[row]))
                fed[row] = new[row][-1]
    assert new == wanted


def check_saved_as_transformers_writes(name: str, folder, names: set[str]) -> None:
    """`save_pretrained` into `folder` writes the fixture's tensors (among them `names`) with
    their values and its config.json, and what it wrote reads back to the same logits."""
    fixture = loaded(name)
    save_pretrained(fixture.model, folder)
    original, saved = load_file(FIXTURES / name / "model.safetensors"), load_file(folder / "model.safetensors")
    assert names <= set(saved)
    assert sorted(saved) == sorted(original)
    assert all(np.array_equal(saved[k], original[k]) for k in original)
    assert json.loads((folder / "config.json").read_text()) == config_of(name)
    again = nnx.split(from_pretrained(folder))[1]
    tokens = jnp.asarray(fixture.expected["input_ids"])
    assert max_rel_error(fixture.forward(again, tokens), fixture.forward(fixture.params, tokens)) == 0


def check_logical_axis_names(name: str) -> None:
    """Every parameter of the fixture's model (built abstractly) has one logical axis name per
    dimension, each one of `recurrax.nn.LOGICAL_AXES` (or None)."""
    model = nnx.eval_shape(lambda: CausalLM(config_of(name), rngs=nnx.Rngs(0)))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == len(variable.get_value().shape), path
        assert set(names) <= set(rnn.LOGICAL_AXES) | {None}, path
