"""fla and `transformers` (Mamba-2 family, Qwen3-Next, Qwen3.5) checkpoints in recurrax: models, loading, generation.

    model = from_pretrained("path/to/fla-checkpoint")          # config.json + model.safetensors
    logits = model(tokens)                                      # [B, T, vocab]
    outputs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=20)    # any CachedLanguageModel
    save_pretrained(model, "out/")                              # readable by fla's from_pretrained
    tokenizer = load_tokenizer("path/to/checkpoint")            # tokenizer.json (+ chat template, eos ids)
    for piece in stream_text(model, tokenizer, "Once upon a time", max_new_tokens=50): print(piece, end="")

Supported `model_type`s (`SUPPORTED`): fla's gla, retnet, hgrn2, linear_attn, lightnet, each
optionally hybrid with fla's softmax attention (config `attn`), and `transformers`' mamba2,
nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2, qwen3_next, qwen3_5_text,
qwen3_5_moe_text, olmo_hybrid. `CausalLM(config)` builds any of them
freshly initialised (to train from scratch); `from_pretrained` returns one. Needs `flax` and,
for checkpoints, `safetensors`, for text `tokenizers` and `jinja2` (`pip install 'recurrax[pretrained]'`).
"""

from .._conv import CausalConv1d
from ._chat_template import render_chat
from ._checkpoint import from_pretrained, load_weights, save_pretrained, state_dict
from ._config import SUPPORTED
from ._generate import (CachedLanguageModel, DecodePool, GenerationSession, Sampling, cache_capacity, generate,
                        generate_tokens)
from ._model import CausalLM, ModelCache
from ._sampling import greedy_tokens, sample_tokens
from ._sizes import SIZES, from_size, model_from_config, size_config
from ._text import IncrementalDecoder, TextPieces, TextStream, end_of_sequence_ids, generate_text, stream_text
from ._tokenizer import Tokenizer, load_tokenizer
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
    "CachedLanguageModel",
    "CausalConv1d",
    "CausalLM",
    "DecodePool",
    "GenerationSession",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "HGRN2Attention",
    "IncrementalDecoder",
    "KVCache",
    "LightNetAttention",
    "LinearAttention",
    "ModelCache",
    "MultiScaleRetention",
    "RMSNorm",
    "RecurrentCache",
    "Sampling",
    "TextPieces",
    "TextStream",
    "Tokenizer",
    "cache_capacity",
    "end_of_sequence_ids",
    "from_pretrained",
    "from_size",
    "generate",
    "generate_text",
    "generate_tokens",
    "greedy_tokens",
    "load_tokenizer",
    "load_weights",
    "model_from_config",
    "render_chat",
    "sample_tokens",
    "save_pretrained",
    "size_config",
    "state_dict",
    "stream_text",
]
