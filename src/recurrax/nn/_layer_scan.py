"""A stack of residual blocks run under one `jax.lax.scan`: traced and compiled once, not once per layer.

    period p: the smallest p dividing L with graphdef(block_l) = graphdef(block_{l mod p}) for every l
    group g = blocks g·p … g·p + p − 1;   h ← group_g(h) for g = 0 … L/p − 1   (one scan step a group)

The blocks stay separate modules (their parameter names, and the checkpoints written from
them, are those of the unrolled stack): at trace time each block is split (`nnx.split`),
the parameters of the blocks at the same place in their group are stacked (`jnp.stack`,
a new leading axis of L/p), and the scan's body merges the graphdef with one group's slice
and calls each block through `call_block` (so `remat=` applies inside the scan). Gradients
reach each block's own parameters back through the stack. A hybrid of identical groups
(three linear-attention blocks and one softmax-attention block, say) scans with p = 4.

With decode caches, a call of more than one token a row (a prefill) scans too: the caches of
the blocks at the same place in their group are stacked like the parameters, go in as the
scan's inputs and come out as its outputs, one per block again. A decode step (one token a
row) runs the blocks one after another: stacking would copy every weight, more bytes than the
step itself reads.

Where no period below L divides the stack (blocks that differ in their static attributes,
such as Lightning Attention's per-layer decays), where a block holds something that is not
an array, where the per-layer keyword arguments or caches differ in their structure, shapes
or non-array values, or at a decode step, the blocks run one after another as before. The
values and gradients are the unrolled stack's up to float rounding (tests/test_layer_scan.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ._remat import call_block
from ._sharding import RESIDUAL, constrain


def call_blocks(blocks, remat: str | None, h, caches=None, contexts=None, *, scan: bool = True, **shared):
    """Run `blocks` in order on the residual stream `h`: `h, cache_l = call_block(block_l, remat,
    h, cache_l, **shared, **contexts[l])`, the stream constrained to the residual sharding after each.

    **Arguments:**
    - `blocks`: the residual blocks (each called as `block(h, cache, **keywords)`).
    - `remat`: `call_block`'s policy name (None, `"block"` or `"dots"`).
    - `h`: the residual stream; `caches`: one decode cache per block, or None to train.
    - `contexts`: one dict of keyword arguments per block (None: none).
    - `scan`: run groups of identical blocks under one `jax.lax.scan` where `scan_period` finds
      a period (with `caches`, only for calls of more than one token a row: `h` `[..., T, D]`,
      T > 1); False: always one after another.
    - `shared`: keyword arguments every block gets (`cu_seqlens`, `positions`, …).

    **Returns:** `(h, new_caches)`, `new_caches` a list with one entry per block (None without caches).
    """
    contexts = [{} for _ in blocks] if contexts is None else list(contexts)
    prefill = caches is None or h.shape[-2] > 1
    period = scan_period(blocks, contexts, caches) if scan and prefill else None
    caches = (None,) * len(blocks) if caches is None else tuple(caches)
    if period is not None:
        return _scanned(blocks, remat, h, caches, contexts, period, shared)
    new_caches = []
    for block, cache, context in zip(blocks, caches, contexts):
        h, new_cache = call_block(block, remat, h, cache, **shared, **context)
        h = constrain(h, *RESIDUAL)
        new_caches.append(new_cache)
    return h, new_caches


def scan_period(blocks, contexts=None, caches=None) -> int | None:
    """The smallest period p < L (dividing L) of the stack's graphdefs, of its per-layer keyword
    arguments' structure and non-array values and of its caches' structure, shapes and dtypes,
    or None where there is none (the blocks then run unrolled) or where some block or cache
    holds something other than arrays."""
    blocks = list(blocks)
    contexts = [{} for _ in blocks] if contexts is None else list(contexts)
    caches = [None] * len(blocks) if caches is None else list(caches)
    L = len(blocks)
    splits = [nnx.split(block) for block in blocks]
    held = [leaf for _, state in splits for leaf in jax.tree.leaves(state)] + jax.tree.leaves(caches)
    if not all(isinstance(leaf, jax.Array) for leaf in held):
        return None
    keys = [(graphdef, _static_part(context), _shape_of(cache))
            for (graphdef, _), context, cache in zip(splits, contexts, caches)]
    for p in range(1, L // 2 + 1):
        if L % p == 0 and all(_equal(keys[l], keys[l % p]) for l in range(p, L)):
            return p
    return None


def _equal(a, b) -> bool:
    """`a == b` as one bool; False where the comparison is not one (numpy arrays among the values)."""
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _shape_of(cache) -> tuple:
    """A cache's tree structure with each leaf's shape and dtype: what must be equal across the
    layers for their caches to stack."""
    leaves, treedef = jax.tree.flatten(cache)
    return treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)


def _static_part(context: dict) -> tuple:
    """A block's keyword arguments with their arrays replaced by shape and dtype: what must be
    equal across the layers for the arrays to stack and the rest to be shared."""
    arrays, rest = _split_context(context)
    return (tuple(sorted((name, value.shape, value.dtype) for name, value in arrays.items())),
            tuple(sorted(rest.items(), key=lambda item: item[0])))


def _scanned(blocks, remat, h, caches, contexts, period: int, shared: dict):
    """The stack as `L / period` scan steps, each running one group of `period` blocks, and the
    blocks' new caches (None without caches). A keyword argument that is the same array for
    every block of a place in the group (Zamba2's embedded tokens) is passed as it is, not
    stacked. Where a group changes the stream's dtype (a float32 residual stream after bfloat16
    embeddings), the first group runs before the scan."""
    splits = [nnx.split(block) for block in blocks]
    graphdefs = [graphdef for graphdef, _ in splits[:period]]
    stack = lambda trees: jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)  # noqa: E731
    states = [stack([state for _, state in splits[j::period]]) for j in range(period)]
    stacked_caches = [stack(caches[j::period]) for j in range(period)]
    fixed, stacked = [], []
    for j in range(period):
        places = contexts[j::period]
        arrays, rest = _split_context(places[0])
        same = {name for name in arrays if all(place[name] is arrays[name] for place in places)}
        fixed.append({**rest, **{name: arrays[name] for name in same}})
        stacked.append(stack([{name: value for name, value in _split_context(place)[0].items() if name not in same}
                              for place in places]))

    def group(h, slices):
        new_caches = []
        for graphdef, state, cache, context, static in zip(graphdefs, *slices, fixed):
            h, new_cache = call_block(nnx.merge(graphdef, state), remat, h, cache, **shared, **context, **static)
            h = constrain(h, *RESIDUAL)
            new_caches.append(None if cache is None else new_cache)
        return h, tuple(new_caches)

    inputs, first = (states, stacked_caches, stacked), []
    carried = jax.eval_shape(lambda h, slices: group(h, slices)[0], h, _first(inputs))
    if (carried.shape, carried.dtype) != (h.shape, h.dtype):
        h, first = group(h, _first(inputs))
        first, inputs = [first], jax.tree.map(lambda leaf: leaf[1:], inputs)
    h, new_caches = jax.lax.scan(group, h, inputs)
    scanned = len(blocks) // period - len(first)
    groups = first + [jax.tree.map(lambda leaf, g=g: leaf[g], new_caches) for g in range(scanned)]
    return h, [cache for group_caches in groups for cache in group_caches]


def _first(tree):
    """Every leaf's first slice along the stacking axis."""
    return jax.tree.map(lambda leaf: leaf[0], tree)


def _split_context(context: dict) -> tuple[dict, dict]:
    """A block's keyword arguments as (the arrays, the rest)."""
    arrays = {name: value for name, value in context.items() if isinstance(value, jax.Array)}
    return arrays, {name: value for name, value in context.items() if name not in arrays}
