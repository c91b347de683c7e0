"""Flax NNX layers on top of `recurrax.recurrent` and `recurrax.delta_rule` (install with the `nn` extra).

Every mixer maps `[batch, seq_len, d_model]` (or packed `[total_tokens, d_model]` with
`cu_seqlens`) to the same shape, uses the best registered algorithm for the parallel
forward, and decodes with an explicit cache: `y, cache = layer(x, cache=cache)`, starting
from `layer.init_cache(batch_size)`.

Every parameter carries logical axis names; `logical_rules` maps them to mesh axes,
`shard_model` places a model on a mesh and `use_mesh` runs its forward there.
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
from ._gated_deltanet import GatedDeltaNet, GatedRMSNorm  # noqa: E402
from ._cross_entropy import chunked_cross_entropy  # noqa: E402
from ._model import MIXERS, MLP, Block, LanguageModel, make_mixer  # noqa: E402
from ._packing import PackedBatches, pack_documents  # noqa: E402
from ._moe import (  # noqa: E402
    Dispatch,
    ExpertWeights,
    MixtureOfExperts,
    Routing,
    all_experts,
    default_block_size,
    dispatch,
    grouped_matmul,
    padded_rows,
    route,
    routed_experts,
)
from ._layer_scan import call_blocks, scan_period  # noqa: E402
from ._remat import REMAT_POLICIES  # noqa: E402
from ._throughput import (  # noqa: E402
    PEAK_FLOPS,
    Throughput,
    parameter_count,
    peak_flops,
    training_dtype,
    training_throughput,
)
from ._sharding import (  # noqa: E402
    DATA_PARALLEL,
    EXPERT_PARALLEL,
    FSDP,
    LOGICAL_AXES,
    SEQUENCE_PARALLEL,
    TENSOR_PARALLEL,
    constrain,
    logical_rules,
    logical_specs,
    parameter_shardings,
    shard_model,
    use_mesh,
)

__all__ = [
    "DATA_PARALLEL",
    "Dispatch",
    "EXPERT_PARALLEL",
    "ExpertWeights",
    "FEATURE_MAPS",
    "FSDP",
    "LOGICAL_AXES",
    "MIXERS",
    "MLP",
    "MixtureOfExperts",
    "PEAK_FLOPS",
    "PackedBatches",
    "Block",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "GatedRMSNorm",
    "LanguageModel",
    "LightningAttention",
    "LinearAttention",
    "MixerCache",
    "MultiScaleRetention",
    "REMAT_POLICIES",
    "RecurrentMixer",
    "Routing",
    "SEQUENCE_PARALLEL",
    "ShortConvolution",
    "TENSOR_PARALLEL",
    "Throughput",
    "alibi_slopes",
    "call_blocks",
    "all_experts",
    "chunked_cross_entropy",
    "constrain",
    "default_block_size",
    "dispatch",
    "grouped_matmul",
    "lightning_log_decays",
    "logical_rules",
    "logical_specs",
    "make_mixer",
    "pack_documents",
    "padded_rows",
    "parameter_count",
    "parameter_shardings",
    "peak_flops",
    "retention_log_decays",
    "route",
    "routed_experts",
    "scan_period",
    "shard_model",
    "training_dtype",
    "training_throughput",
    "use_mesh",
]
