"""Flax NNX layers on top of `recurrax.recurrent` (install with the `nn` extra).

Every mixer maps `[batch, seq_len, d_model]` (or packed `[total_tokens, d_model]` with
`cu_seqlens`) to the same shape, uses the best registered algorithm for the parallel
forward, and decodes with an explicit cache: `y, cache = layer(x, cache=cache)`, starting
from `layer.init_cache(batch_size)`.
"""

from .._extras import require

require("flax.nnx", "nn", "recurrax.nn")

from ._mixers import (  # noqa: E402
    FEATURE_MAPS,
    GatedLinearAttention,
    LightningAttention,
    LinearAttention,
    MixerCache,
    MultiScaleRetention,
    RecurrentMixer,
    alibi_slopes,
    lightning_log_decays,
    retention_log_decays,
)
from ._conv import ShortConvolution  # noqa: E402
from ._model import MIXERS, MLP, Block, LanguageModel, make_mixer  # noqa: E402

__all__ = [
    "FEATURE_MAPS",
    "MIXERS",
    "MLP",
    "Block",
    "GatedLinearAttention",
    "LanguageModel",
    "LightningAttention",
    "LinearAttention",
    "MixerCache",
    "MultiScaleRetention",
    "RecurrentMixer",
    "ShortConvolution",
    "alibi_slopes",
    "lightning_log_decays",
    "make_mixer",
    "retention_log_decays",
]
