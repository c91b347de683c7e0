"""fla and `transformers` (Mamba-2 family, Qwen3-Next, Qwen3.5) checkpoints in recurrax: models, loading, saving.

    model = from_pretrained("path/to/fla-checkpoint")          # config.json + model.safetensors
    logits = model(tokens)                                      # [B, T, vocab]
    save_pretrained(model, "out/")                              # readable by fla's from_pretrained

Supported `model_type`s (`SUPPORTED`): fla's gla, retnet, hgrn2, linear_attn, lightnet, each
optionally hybrid with fla's softmax attention (config `attn`), and `transformers`' mamba2,
nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2, qwen3_next, qwen3_5_text,
qwen3_5_moe_text, olmo_hybrid. `CausalLM(config)` builds any of them
freshly initialised (to train from scratch); `from_pretrained` returns one. Needs `flax` and,
for checkpoints, `safetensors` (`pip install 'recurrax[pretrained]'`).

Generation (`generate`, `DecodePool`, `load_tokenizer`, `stream_text`, …) is
`recurrax.generation`, which depends on the models and not the reverse. Its names are still
found here, under their old path: `GENERATION` lists them, and the first use of one imports
`recurrax.generation` (this package never imports it at import time).
"""

from .._conv import CausalConv1d
from ._checkpoint import from_pretrained, load_weights, save_pretrained, state_dict
from ._config import SUPPORTED
from ._model import CausalLM, ModelCache
from ._sizes import SIZES, from_size, model_from_config, size_config
from .families._gated_deltanet import GatedDeltaNet
from .families._gla import GatedLinearAttention
from .families._hgrn2 import HGRN2Attention
from .families._lightnet import LightNetAttention
from .families._linear_attn import LinearAttention
from .families._retnet import MultiScaleRetention
from .layers._attention import Attention, KVCache
from .layers._mixer import RecurrentCache
from .layers._norm import RMSNorm

__all__ = [
    "SIZES",
    "SUPPORTED",
    "Attention",
    "CausalConv1d",
    "CausalLM",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "HGRN2Attention",
    "KVCache",
    "LightNetAttention",
    "LinearAttention",
    "ModelCache",
    "MultiScaleRetention",
    "RMSNorm",
    "RecurrentCache",
    "from_pretrained",
    "from_size",
    "load_weights",
    "model_from_config",
    "save_pretrained",
    "size_config",
    "state_dict",
]

GENERATION = ("CachedLanguageModel", "DecodePool", "GenerationSession", "IncrementalDecoder", "Sampling", "TextPieces",
              "TextStream", "Tokenizer", "cache_capacity", "end_of_sequence_ids", "generate", "generate_text",
              "generate_tokens", "greedy_tokens", "load_tokenizer", "render_chat", "sample_tokens", "stream_text")
"""`recurrax.generation`'s names, found here too under their old path."""


def __getattr__(name: str):
    """An old path of a generation name (`recurrax.nn.pretrained.generate`): the same object as
    `recurrax.generation`'s, imported when first asked for."""
    if name in GENERATION:
        from ... import generation

        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
