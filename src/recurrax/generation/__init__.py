"""Text generation with any model that has a cache: the decode engine, sampling, tokenizers,
chat templates and text streams. It depends on the models (`recurrax.nn`,
`recurrax.nn.pretrained`); they never import it.

    outputs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=20)    # any CachedLanguageModel
    tokenizer = load_tokenizer("path/to/checkpoint")            # tokenizer.json (+ chat template, eos ids)
    for piece in stream_text(model, tokenizer, "Once upon a time", max_new_tokens=50): print(piece, end="")

| module           | what it is                                                                  |
|------------------|-----------------------------------------------------------------------------|
| `_generate`      | the decode engine: `DecodePool` (continuous batching), `generate`, sessions |
| `_sampling`      | the next token from logits: greedy, temperature, top-k, top-p, penalties    |
| `_tokenizer`     | a checkpoint's tokenizer, special tokens and end-of-sequence ids            |
| `_chat_template` | a checkpoint's Jinja chat template, sandboxed, rendered as `transformers`'  |
| `_text`          | text in, text out: `stream_text`, stop strings, incremental decoding        |
| `_chat`          | a chat at the terminal (`recurrax generate --chat`)                         |
| `serve/`         | the OpenAI-compatible server of `recurrax serve` (the `serve` extra)        |

The command lines `recurrax generate` and `recurrax serve` (`recurrax.tools`) only parse
their options and call these. These names were `recurrax.nn.pretrained`'s and are still
found there (forwarded here when first asked for). Needs `flax` and, for text, `tokenizers`
and `jinja2` (`pip install 'recurrax[pretrained]'`).
"""

from ._chat_template import render_chat
from ._generate import (TOKENS_PER_CALL, CachedLanguageModel, DecodePool, GenerationSession, Sampling, cache_capacity,
                        generate, generate_tokens)
from ._sampling import greedy_tokens, sample_tokens
from ._text import IncrementalDecoder, TextPieces, TextStream, end_of_sequence_ids, generate_text, stream_text
from ._tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "TOKENS_PER_CALL",
    "CachedLanguageModel",
    "DecodePool",
    "GenerationSession",
    "IncrementalDecoder",
    "Sampling",
    "TextPieces",
    "TextStream",
    "Tokenizer",
    "cache_capacity",
    "end_of_sequence_ids",
    "generate",
    "generate_text",
    "generate_tokens",
    "greedy_tokens",
    "load_tokenizer",
    "render_chat",
    "sample_tokens",
    "stream_text",
]
