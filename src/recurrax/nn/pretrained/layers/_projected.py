"""fla layers whose inputs are three projections of x, each with an optional short
convolution without activation: HGRN2 (q, f, i) and LightNet (q, k, v).

| symbol | meaning                                              |
|--------|------------------------------------------------------|
| D      | `hidden_size`                                        |
| H, K   | heads and key head dim (`expand_ratio`); V = D / H   |

The projections are `<name>_proj` (D → H·K, H·K, D) and the convolutions `<name>_conv1d`,
fla's parameter names; the convolutions' last inputs and the recurrent state travel in the
cache (`RecurrentCache`), continued by `_projected` and `_recur_cached`.
"""

from __future__ import annotations

from flax import nnx
from jaxtyping import Array

from ._mixer import FlaMixer, RecurrentCache, linear, make_conv


class ProjectedMixer(FlaMixer):
    """A `FlaMixer` whose `_mix` starts from named projections of x (`_projected`); subclasses
    call `_make_projections` in their `__init__`."""

    projections: tuple[str, ...] = ()

    def _make_projections(self, names: tuple[str, str, str], hidden_size: int, num_heads: int, expand_ratio: int, *,
                          use_short_conv: bool, conv_size: int, conv_bias: bool, dtype, rngs: nnx.Rngs):
        """Set the heads and head dims, the three projections and, with `use_short_conv`, their
        short convolutions.

        **Arguments:** `names` of the projections (key-width, key-width, value-width);
        `hidden_size` D, `num_heads` H, `expand_ratio` K; fla's `use_short_conv`,
        `conv_size`, `conv_bias`; `dtype`, `rngs`.
        """
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by num_heads {num_heads}")
        self.hidden_size, self.num_heads, self.dtype = hidden_size, num_heads, dtype
        self.head_k_dim, self.head_v_dim = expand_ratio, hidden_size // num_heads
        widths = dict(zip(names, (num_heads * expand_ratio, num_heads * expand_ratio, hidden_size)))
        self.projections = tuple(names)
        for name, width in widths.items():
            setattr(self, f"{name}_proj", linear(hidden_size, width, axes=("embed", "heads"), dtype=dtype, rngs=rngs))
        if use_short_conv:
            self.conv_names = tuple(f"{name}_conv1d" for name in names)
            for name, width in widths.items():
                setattr(self, f"{name}_conv1d", make_conv(width, conv_size, conv_bias, None, dtype, rngs, "heads"))

    def _projected(self, x, cache: RecurrentCache | None, cu_seqlens) -> tuple[dict[str, Array], tuple | None]:
        """The projections of `x` by name, convolved (continuing the cache's buffers) where the
        layer has short convolutions, and the convolutions' new buffers (None without)."""
        inputs = {f"{name}_conv1d": getattr(self, f"{name}_proj")(x) for name in self.projections}
        outputs, buffers = self._convolve(inputs, cache, cu_seqlens) if self.conv_names else (inputs, None)
        return {name: outputs[f"{name}_conv1d"] for name in self.projections}, buffers

    def _recur_cached(self, q, k, v, g, cache: RecurrentCache | None, buffers, cu_seqlens, **carried):
        """The recurrence with log decay `g` from the cache's state (zeros without a cache), and
        the cache after it: the new state, the convolutions' `buffers` and any other `carried`
        field (LightNet's `normalizer`); None without a cache."""
        o, state = self._recur(q, k, v, g=g, state=None if cache is None else cache.state, cu_seqlens=cu_seqlens)
        return o, None if cache is None else cache._replace(state=state, conv=buffers, **carried)
