"""Mixtures of experts that compute only the routed (token, expert) pairs.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| n      | tokens (all rows flattened)                                              |
| D, F   | model width, an expert's hidden width                                    |
| E, k   | routed experts, experts per token                                        |
| m      | routed pairs, n·k                                                        |
| B      | rows per block of the CPU grouped matmul                                 |
| P      | padded rows, a static bound: B·⌊(m + min(E, m)·(B − 1)) / B⌋             |
| G      | expert groups of group-limited selection (`n_group`), `topk_group` kept  |

Routing (`route`), from router logits `l [n, E]`:

    s = softmax(l) or sigmoid(l)                          scores
    c = s + b   (or l + b)                                choice: scores or logits, plus the
                                                          score-correction bias b (selection only)
    groups: keep the topk_group best of G groups, each scored by the sum of its two best c
    S = top_k(c)                                          the k chosen experts (lower index first on ties)
    w = s_S,  renormalised: w / Σ w  (softmax: softmax(l_S)),  times routed_scaling

The experts (`routed_experts`): every pair (t, e) is one row. Rows are sorted by expert;
each expert's rows are padded to a multiple of B (never to a capacity: no token is dropped),
so every block of B rows belongs to one expert. On GPU and TPU each projection is then a
grouped matmul (`grouped_matmul`: `jax.lax.ragged_dot` over the sorted rows); on the CPU
one scan over the blocks runs each block's rows through its expert's whole FFN, gathering
the rows and the expert's matrices inside the step and adding the block's weighted outputs
into its tokens' outputs, with a hand-written VJP (`_expert_blocks.py`). The output is

    y_t = Σ_{e∈S_t} w_{t,e} · FFN_e(x_t)      FFN_e(x) = W_down,e (act(x W_gate,e) ⊙ x W_up,e)

(or `W_down,e act(x W_up,e)` without a gate; with a `limit` L, `act(x W_gate,e) ⊙ x W_up,e` is
`min(act(x W_gate,e), L) ⊙ clip(x W_up,e, −L, L)`: Ling's SwiGLU clipping), which is the
all-experts computation masked by the routing (`all_experts`) up to float rounding: the same
products, fewer of them. Shapes
are static (P bounds the padded rows), so it runs under `jit`, `grad` and `vmap`; the work
grows with m + E·B, not with n·E, and the CPU's forward holds no per-row buffer (its saved
activations for the backward, `[P, F]`, grow with m + E·B).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from .._core.registry import current_backend
from ._expert_blocks import block_ffn, combine, glu
from ._expert_parallel import expert_axis, expert_parallel
from ._sharding import param

SCORES = ("softmax", "sigmoid")
METHODS = ("blocks", "ragged")
ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu,
               "relu2": lambda x: jnp.square(jax.nn.relu(x))}


class Routing(NamedTuple):
    """Each token's chosen experts `[n, k]` (int32) and their combine weights `[n, k]` (float32)."""

    experts: Int[Array, "n k"]
    weights: Float[Array, "n k"]


def route(logits: Float[Array, "n E"], top_k: int, *, score: str = "softmax", renormalize: bool = False,
          select_on: str = "scores", bias: Float[Array, " E"] | None = None, n_group: int = 1,
          topk_group: int | None = None, routed_scaling: float = 1.0) -> Routing:
    """The top-`top_k` experts of each token and their weights.

    **Arguments:**
    - `logits`: router logits (computed in float32).
    - `top_k`: experts per token, 1 ≤ k ≤ E.
    - `score`: `"softmax"` (over all E) or `"sigmoid"`.
    - `renormalize`: divide the k weights by their sum (sigmoid: plus 1e-20, as DeepSeek).
    - `select_on`: choose by `"scores"` or by `"logits"` (Granite; the same order up to ties).
    - `bias`: score-correction bias, added for the choice only (DeepSeek-V3, Nemotron-H, Kimi).
    - `n_group`, `topk_group`: group-limited choice among the `topk_group` best of `n_group`
      equal groups of experts, each scored by the sum of its two best choice values.
    - `routed_scaling`: multiplies the final weights.

    Ties go to the lower expert index (`jax.lax.top_k`, as `torch.topk`).
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if select_on not in ("scores", "logits"):
        raise ValueError(f"select_on must be 'scores' or 'logits', got {select_on!r}")
    if getattr(logits, "ndim", None) != 2:
        shape = getattr(logits, "shape", type(logits).__name__)
        raise ValueError(f"logits must be [tokens, experts], got shape {shape}")
    n, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    if bias is not None and getattr(bias, "shape", None) != (E,):
        raise ValueError(f"bias must be [experts] = ({E},), one per column of logits, got shape "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if select_on == "scores" else logits
    if bias is not None:
        choice = choice + bias.astype(jnp.float32)
    if n_group > 1:
        choice = _limit_to_groups(choice, n_group, n_group if topk_group is None else topk_group)
    experts = jax.lax.top_k(choice, top_k)[1]
    if score == "softmax" and renormalize:  # softmax(l)_S / Σ_S softmax(l) = softmax(l_S)
        weights = jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1)
    else:
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if renormalize:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(experts.astype(jnp.int32), weights * routed_scaling)


def _limit_to_groups(choice: Float[Array, "n E"], n_group: int, topk_group: int) -> Float[Array, "n E"]:
    """`choice` with the experts outside each token's `topk_group` best groups set to −∞."""
    n, E = choice.shape
    if E % n_group:
        raise ValueError(f"n_group ({n_group}) must divide the number of experts ({E})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, {n_group}], got {topk_group}")
    grouped = choice.reshape(n, n_group, E // n_group)
    group_scores = jax.lax.top_k(grouped, min(2, E // n_group))[0].sum(-1)  # [n, G]
    best = jax.lax.top_k(group_scores, topk_group)[1]
    kept = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best].set(True)
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(n, E)


class Dispatch(NamedTuple):
    """Where the routed pairs go: `rows [P]` (the token of each padded row; n for a padding row),
    `positions [n, k]` (the padded row of each pair), `block_experts [P/B]` (each block's
    expert) and `group_sizes [E]` (each expert's padded row count; they sum to at most P)."""

    rows: Int[Array, " P"]
    positions: Int[Array, "n k"]
    block_experts: Int[Array, " blocks"]
    group_sizes: Int[Array, " E"]


def padded_rows(pairs: int, num_experts: int, block_size: int) -> int:
    """P: the most rows `pairs` pairs over `num_experts` experts fill when each expert's rows
    are padded to a multiple of `block_size` (Σ_e ⌈c_e/B⌉ ≤ (m + min(E, m)(B − 1)) / B)."""
    used = min(num_experts, pairs)
    return block_size * ((pairs + used * (block_size - 1)) // block_size)


def dispatch(experts: Int[Array, "n k"], num_experts: int, block_size: int) -> Dispatch:
    """Sort the pairs of `experts` by expert (stably: by token within an expert) and pad each
    expert's rows to a multiple of `block_size`."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    m = flat.shape[0]
    total = padded_rows(m, num_experts, block_size)
    order = jnp.argsort(flat, stable=True)  # pair index of each sorted row
    counts = jnp.bincount(flat, length=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts, padded_starts = jnp.cumsum(counts) - counts, jnp.cumsum(padded) - padded
    expert_of_sorted = flat[order]
    destination = padded_starts[expert_of_sorted] + jnp.arange(m) - starts[expert_of_sorted]
    rows = jnp.full((total,), n, jnp.int32).at[destination].set((order // k).astype(jnp.int32))
    positions = jnp.zeros((m,), jnp.int32).at[order].set(destination.astype(jnp.int32)).reshape(n, k)
    block_starts = jnp.arange(total // block_size) * block_size
    block_experts = jnp.searchsorted(jnp.cumsum(padded), block_starts, side="right")
    return Dispatch(rows, positions, jnp.minimum(block_experts, num_experts - 1).astype(jnp.int32),
                    padded.astype(jnp.int32))


def default_method() -> str:
    """`"ragged"` (`jax.lax.ragged_dot`) on GPU and TPU, `"blocks"` on the CPU, where XLA's
    `ragged_dot` runs at a few GFLOP/s (benchmarks/moe.py). The backend is the one dispatch
    judges for (`recurrax.registry.current_backend`): a `recurrax.target(...)` chip or a
    deviceless topology's abstract mesh when compiling for one, else this host's device."""
    return "blocks" if current_backend() == "cpu" else "ragged"


def default_block_size(method: str, pairs: int, num_experts: int) -> int:
    """Rows per block: 1 for `ragged_dot` (no padding); for the CPU's blocks, the power of two
    nearest below the mean rows per expert m/E, held to [8, 128]: so the padding (< E·B rows)
    stays under m once blocks pass 8 rows, and blocks are large enough for a fast matmul."""
    if method == "ragged":
        return 1
    mean = max(pairs // num_experts, 1)
    return int(min(128, max(8, 1 << (mean.bit_length() - 1))))


def default_chunk(block_size: int) -> int:
    """Blocks per step of the CPU's grouped matmul: about 128 rows (measured at 64 experts
    top-8, B = 128: one block per step takes ~8% less CPU time than two, forward and backward;
    larger steps gather more expert matrices at once)."""
    return max(1, 128 // block_size)


def grouped_matmul(x: Float[Array, "P Din"], weights: Float[Array, "E Din Dout"], routed: Dispatch, *,
                   method: str = "blocks", transposed: bool = False,
                   chunk: int | None = None) -> Float[Array, "P Dout"]:
    """Row p of `x` times the matrix of its expert. `transposed`: `weights` are `[E, Dout, Din]`
    (PyTorch's layout). `"blocks"`: each block of rows times its expert's matrix, `chunk` blocks
    per step (default `default_chunk`); `"ragged"`: `jax.lax.ragged_dot` by `routed.group_sizes`."""
    if method == "ragged":
        rhs = jnp.swapaxes(weights, 1, 2) if transposed else weights
        return jax.lax.ragged_dot(x, rhs.astype(x.dtype), routed.group_sizes)
    if method != "blocks":
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    blocks = routed.block_experts.shape[0]
    chunk = chunk or default_chunk(x.shape[0] // blocks)
    spec = "bi,oi->bo" if transposed else "bi,io->bo"

    def block_product(args):
        rows, expert = args
        return jnp.einsum(spec, rows, weights[expert].astype(rows.dtype))

    x_blocks = x.reshape(blocks, x.shape[0] // blocks, x.shape[1])
    y = jax.lax.map(block_product, (x_blocks, routed.block_experts), batch_size=min(chunk, blocks))
    return y.reshape(x.shape[0], -1)


class ExpertWeights(NamedTuple):
    """Stacked expert matrices: `up [E, D, F]`, `down [E, F, D]`, optional `gate [E, D, F]`
    (or each as PyTorch stores it, `[E, out, in]`: the `transposed` option of the functions)."""

    up: Float[Array, "E D F"]
    down: Float[Array, "E F D"]
    gate: Float[Array, "E D F"] | None = None


def routed_experts(x: Float[Array, "n D"], routing: Routing, weights: ExpertWeights, *,
                   act: Callable = jax.nn.silu, transposed: bool = False, method: str | None = None,
                   block_size: int | None = None, limit: float | None = None) -> Float[Array, "n D"]:
    """`Σ_{e∈S_t} w_{t,e} FFN_e(x_t)` over the routed pairs only (see the module docstring).
    `transposed`: `weights` in PyTorch's `[E, out, in]` layout; `method`: `"blocks"` or
    `"ragged"` (default: by backend); `block_size` (default by method); `limit`: the gated
    experts' clipping, `min(act(G), limit) ⊙ clip(U, −limit, limit)` (None: none).

    Under a mesh whose rules map the `experts` axis to a mesh axis (`logical_rules("expert")`,
    `use_mesh`), the experts run split over it, each pair sent to its expert's device
    (`recurrax.nn._expert_parallel`); the result is the same up to float rounding."""
    check_routed_inputs(x, routing, weights, transposed)
    if limit is not None and weights.gate is None:
        raise ValueError(f"limit={limit} clips a gated FFN (min(act(G), limit) ⊙ clip(U, ±limit)); these experts "
                         "have no gate: pass limit=None")
    options = dict(act=act, transposed=transposed, method=method, block_size=block_size, limit=limit)
    axis = expert_axis(weights.up.shape[0])
    if axis is not None:
        def local(rows, experts, weights):  # each received row through its one expert, weight 1
            ones = jnp.ones((rows.shape[0], 1), jnp.float32)
            return _routed_experts(rows, Routing(experts[:, None], ones), weights, **options)

        return expert_parallel(x, routing.experts, routing.weights, weights, axis, local, transposed=transposed)
    return _routed_experts(x, routing, weights, **options)


def _routed_experts(x, routing: Routing, weights: ExpertWeights, *, act, transposed, method, block_size, limit):
    """`routed_experts` on the devices at hand (each holding every expert it is given)."""
    method = method or default_method()
    num_experts = weights.up.shape[0]
    block_size = block_size or default_block_size(method, routing.experts.size, num_experts)
    routed = dispatch(routing.experts, num_experts, block_size)
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])  # row n: the padding rows' zeros
    if method == "blocks":  # one pass, each block through its expert's whole FFN, combined in it (_expert_blocks)
        row_weights = jnp.zeros(routed.rows.shape, routing.weights.dtype).at[routed.positions.reshape(-1)].set(
            routing.weights.reshape(-1))
        return block_ffn(padded, routed.rows, row_weights, routed.group_sizes, weights.gate, weights.up,
                         weights.down, act=act, transposed=transposed, block_size=block_size, limit=limit)
    rows = padded[routed.rows]  # [P, D]
    options = dict(method=method, transposed=transposed)
    hidden = grouped_matmul(rows, weights.gate if weights.gate is not None else weights.up, routed, **options)
    if weights.gate is None:
        hidden = act(hidden)
    else:
        hidden = glu(act, limit, hidden, grouped_matmul(rows, weights.up, routed, **options))
    out = grouped_matmul(hidden, weights.down, routed, **options)  # [P, D]
    return combine(out, routed.positions, routing.weights)


def all_experts(x: Float[Array, "n D"], routing: Routing, weights: ExpertWeights, *,
                act: Callable = jax.nn.silu, transposed: bool = False, limit: float | None = None
                ) -> Float[Array, "n D"]:
    """Every expert on every token, combined by the routing's weights (zero outside S_t): the
    oracle `routed_experts` equals, at E/k times its work."""
    check_routed_inputs(x, routing, weights, transposed)
    n, E = x.shape[0], weights.up.shape[0]
    dense = jnp.zeros((n, E), routing.weights.dtype).at[jnp.arange(n)[:, None], routing.experts].add(routing.weights)
    spec = "nd,efd->nef" if transposed else "nd,edf->nef"
    hidden = jnp.einsum(spec, x, weights.gate if weights.gate is not None else weights.up)
    if weights.gate is None:
        hidden = act(hidden)
    else:
        hidden = glu(act, limit, hidden, jnp.einsum(spec, x, weights.up))
    spec = "nef,edf->nd" if transposed else "nef,efd->nd"
    return jnp.einsum(spec, hidden * dense.astype(hidden.dtype)[:, :, None], weights.down)


def check_routed_inputs(x, routing: Routing, weights: ExpertWeights, transposed: bool) -> None:
    """`x [n, D]`, `routing` of `[n, k]` int experts and weights, `weights` of E experts whose
    `up` (and `gate`) read D and whose `down` gives D back (their hidden widths may differ: an
    `act` may halve it); concrete expert ids in `[0, E)`.
    A `ValueError` naming the argument otherwise."""
    shape = lambda a: getattr(a, "shape", type(a).__name__)  # noqa: E731
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be [tokens, d_model], got shape {shape(x)}")
    n, D = x.shape
    experts, combine_weights = routing
    if getattr(experts, "ndim", None) != 2 or experts.shape[0] != n or shape(combine_weights) != experts.shape:
        raise ValueError(f"routing must hold experts and weights of one shape [tokens, top_k] with x's {n} tokens, "
                         f"got experts {shape(experts)}, weights {shape(combine_weights)}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"routing.experts must be integer expert ids, got dtype {experts.dtype}")
    up, down = getattr(weights.up, "shape", ()), getattr(weights.down, "shape", ())
    gate = None if weights.gate is None else getattr(weights.gate, "shape", ())
    in_axis, out_axis = (2, 1) if transposed else (1, 2)
    fits = (len(up) == 3 and len(down) == 3 and up[0] == down[0] > 0 and up[in_axis] == D
            and down[out_axis] == D and gate in (None, up))
    if not fits:
        layout = "[E, out, in] (transposed)" if transposed else "[E, in, out]"
        raise ValueError(f"weights must be {layout} matrices of the same E experts, up and gate (like up, or None) "
                         f"reading x's d_model {D}, down giving it back; got up {shape(weights.up)}, down "
                         f"{shape(weights.down)}, gate {None if gate is None else shape(weights.gate)}")
    E = up[0]
    if not isinstance(experts, jax.core.Tracer) and experts.size:
        ids = np.asarray(experts)
        if ids.min() < 0 or ids.max() >= E:
            bad = int(ids[(ids < 0) | (ids >= E)][0])
            raise ValueError(f"routing.experts must be expert ids in [0, {E}) (weights' experts), got {bad}")


class MixtureOfExperts(nnx.Module):
    """A mixture of SwiGLU experts with an optional shared SwiGLU expert:
    `y = routed_experts(x) + shared(x)`, computing only the routed pairs.

    **Arguments:**
    - `d_model`, `num_experts`, `expert_width` (F), `top_k`.
    - router options, as `route`: `score`, `renormalize`, `n_group`, `topk_group`,
      `routed_scaling`; `selection_bias`: learn a score-correction bias `[E]` (choice only).
    - `shared_width`: the shared expert's hidden width (0: none).
    - `method`, `block_size`: the grouped matmul (`routed_experts`).
    - `dtype`, `rngs`.

    Parameters: `router [D, E]`, `gate`, `up [E, D, F]`, `down [E, F, D]` (logical axes
    `experts`, `embed`, `mlp`), optional `bias [E]`, `shared_gate`, `shared_up [D, S]`,
    `shared_down [S, D]`.
    """

    def __init__(self, d_model: int, num_experts: int, expert_width: int, top_k: int, *, score: str = "softmax",
                 renormalize: bool = True, n_group: int = 1, topk_group: int | None = None,
                 routed_scaling: float = 1.0, selection_bias: bool = False, shared_width: int = 0,
                 method: str | None = None, block_size: int | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        D, E, F = d_model, num_experts, expert_width
        self.router = param(init(rngs.params(), (D, E), jnp.float32), "embed", "experts")
        self.bias = param(jnp.zeros((E,), jnp.float32), "experts") if selection_bias else None
        self.gate = param(init(rngs.params(), (E, D, F), dtype), "experts", "embed", "mlp")
        self.up = param(init(rngs.params(), (E, D, F), dtype), "experts", "embed", "mlp")
        self.down = param(init(rngs.params(), (E, F, D), dtype), "experts", "mlp", "embed")
        if shared_width:
            self.shared_gate = param(init(rngs.params(), (D, shared_width), dtype), "embed", "mlp")
            self.shared_up = param(init(rngs.params(), (D, shared_width), dtype), "embed", "mlp")
            self.shared_down = param(init(rngs.params(), (shared_width, D), dtype), "mlp", "embed")
        self.shared_width = shared_width
        self.top_k, self.score, self.renormalize = top_k, score, renormalize
        self.n_group, self.topk_group, self.routed_scaling = n_group, topk_group, float(routed_scaling)
        self.method, self.block_size = method, block_size
        route(jnp.zeros((1, E)), top_k, score=score, n_group=n_group, topk_group=topk_group)  # check options

    def routing(self, x: Float[Array, "n D"]) -> Routing:
        """Each token's experts and weights."""
        logits = x.astype(jnp.float32) @ self.router[...]
        bias = None if self.bias is None else self.bias[...]
        return route(logits, self.top_k, score=self.score, renormalize=self.renormalize, bias=bias,
                     n_group=self.n_group, topk_group=self.topk_group, routed_scaling=self.routed_scaling)

    def expert_weights(self) -> ExpertWeights:
        """The stacked routed experts."""
        return ExpertWeights(self.up[...], self.down[...], self.gate[...])

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        flat = x.reshape(-1, x.shape[-1])
        y = routed_experts(flat, self.routing(flat), self.expert_weights(), method=self.method,
                           block_size=self.block_size)
        if self.shared_width:
            shared = jax.nn.silu(flat @ self.shared_gate[...]) * (flat @ self.shared_up[...])
            y = y + shared @ self.shared_down[...]
        return y.reshape(x.shape)
