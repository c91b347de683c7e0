"""Text in, text out: `generate` on a prompt string, streamed as text as the tokens come,
stopping at an end-of-sequence id, a stop string or `max_new_tokens`.

| name         | meaning                                                                    |
|--------------|----------------------------------------------------------------------------|
| ids          | a window of tokens: the last prompt tokens (context), then generated ones  |
| prefix, read | `ids[prefix:read]` was already turned into text; `ids[read:]` is new       |
| pending      | text decoded but not yet given out (it may be the start of a stop string)  |

    for each new token:
      end-of-sequence id → stop (the id is not decoded)
      piece   = decode(ids[prefix:]) − decode(ids[prefix:read])   (nothing while it ends in �)
      pending += piece
      a stop string in pending → give out what precedes it, stop
      give out pending but its longest end that begins a stop string

Decoding from `prefix` rather than from the token alone keeps what depends on the tokens
before (a SentencePiece space, a character whose UTF-8 bytes span tokens): a byte-level
tokenizer decodes an incomplete character as U+FFFD, so the text waits for its last byte.
A stop string is found even when it spans tokens, and none of it is ever given out.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from ._generate import GenerationSession, generate_tokens
from ._tokenizer import Tokenizer

CONTEXT_TOKENS = 4
"""Prompt tokens decoded with the first new ones (spacing and multi-byte characters that
depend on them come out right)."""


class IncrementalDecoder:
    """Text of a growing token sequence, piece by piece, never splitting a character.

    **Arguments:**
    - `tokenizer`: a `Tokenizer`.
    - `context`: tokens before the first one pushed (e.g. the prompt); only their end is used.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(context)[-CONTEXT_TOKENS:]
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        """The new text `token` completes ("" while a character is still incomplete)."""
        self.ids.append(int(token))
        return self._new_text(final=False)

    def flush(self) -> str:
        """What is left, incomplete characters included (as U+FFFD)."""
        return self._new_text(final=True)

    def _new_text(self, *, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


class TextPieces:
    """The text of one generated sequence, pushed a token at a time (see the module notes):
    `push` returns the new text it may give out, `finish` what is left when generation ends
    without a stop. `finish_reason` is `"stop"` once an end-of-sequence id or a stop string
    came (push then returns nothing more), `"length"` after `finish` without one, else None.

    **Arguments:** `tokenizer`, `prompt_ids` (the decoding context), `stop_tokens`, `stop`:
    as `TextStream`'s.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop_tokens: Sequence[int],
                 stop: Sequence[str]):
        self.finish_reason: str | None = None
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids)
        self._stop_tokens = set(stop_tokens)
        self._stop = tuple(stop)
        self._pending = ""

    def push(self, token: int) -> str:
        """The text `token` lets out ("" while it may be part of a stop string or a character)."""
        if self.finish_reason is not None:
            return ""
        if token in self._stop_tokens:
            self.finish_reason = "stop"
            return self._release(len(self._pending))  # what was held back is no stop string
        self._pending += self._decoder.push(token)
        end = first_stop(self._pending, self._stop)
        if end is not None:
            self.finish_reason = "stop"
            return self._release(end, drop=True)
        return self._release(len(self._pending) - held_back(self._pending, self._stop))

    def finish(self) -> str:
        """The rest, at the end of generation (incomplete characters included as U+FFFD)."""
        if self.finish_reason is not None:
            return ""
        self._pending += self._decoder.flush()
        end = first_stop(self._pending, self._stop)
        self.finish_reason = "length" if end is None else "stop"
        return self._release(len(self._pending) if end is None else end, drop=True)

    def _release(self, ready: int, *, drop: bool = False) -> str:
        """`pending[:ready]`, kept out of `pending` (with `drop`, the rest is dropped too)."""
        text, self._pending = self._pending[:ready], "" if drop else self._pending[ready:]
        return text


class TextStream:
    """An iterator of the new text of one prompt, a piece per step (see the module notes).

    **Arguments:**
    - `tokenizer`: the `Tokenizer` that decodes.
    - `events`: a generator of `(prompt index, token)`, as `generate_tokens` yields for one
      prompt (closed when the text stops).
    - `prompt_ids`: the prompt (its last tokens are the decoding context).
    - `stop_tokens`: ids that end the text (not decoded); `stop`: strings that end it (not
      given out).

    After (or during) iteration: `tokens` are the generated ids (the end-of-sequence id
    included), `token_times` when each came (`time.perf_counter()`), `text` the text given
    out so far, `finish_reason` `"stop"` (an end-of-sequence id or a stop string), `"length"`
    (`max_new_tokens`) or None while running. `close()` stops generating.
    """

    def __init__(self, tokenizer: Tokenizer, events: Iterator[tuple[int, int]], prompt_ids: Sequence[int],
                 stop_tokens: Sequence[int], stop: Sequence[str]):
        self.tokens: list[int] = []
        self.token_times: list[float] = []
        self.text = ""
        self._events = events
        self._text = TextPieces(tokenizer, prompt_ids, stop_tokens, stop)
        self._pieces = self._generate()

    @property
    def finish_reason(self) -> str | None:
        return self._text.finish_reason

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        piece = next(self._pieces)
        self.text += piece
        return piece

    def close(self) -> None:
        """Stop generating (nothing more is computed)."""
        self._pieces.close()
        self._events.close()

    def _generate(self) -> Iterator[str]:
        for _, token in self._events:
            self.tokens.append(token)
            self.token_times.append(time.perf_counter())
            piece = self._text.push(token)
            if piece:
                yield piece
            if self._text.finish_reason is not None:
                break
        self._events.close()
        piece = self._text.finish()  # max_new_tokens: what is left
        if piece:
            yield piece


def first_stop(text: str, stop: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins (None if none is in it)."""
    found = [at for at in (text.find(s) for s in stop) if at >= 0]
    return min(found) if found else None


def held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (it may
    become one with the next text, so it is not given out yet)."""
    return max((n for s in stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:n])), default=0)


def stream_text(model, tokenizer: Tokenizer, prompt: str | Sequence[int], max_new_tokens: int = 256, *,
                temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                repetition_penalty: float | None = None, seed: int = 0, stop: Sequence[str] = (),
                stop_tokens: Sequence[int] | None = None, max_cache_bytes: int | None = None,
                session: GenerationSession | None = None) -> TextStream:
    """Continue `prompt`, giving out its new text step by step (a `TextStream`).

    **Arguments:**
    - `model`: any `CachedLanguageModel` (e.g. `from_pretrained(directory)`).
    - `tokenizer`: its `Tokenizer` (e.g. `load_tokenizer(directory)`).
    - `prompt`: text (encoded with the tokenizer's special tokens, e.g. a leading BOS), or
      token ids used as they are (e.g. `tokenizer.apply_chat_template(messages, tokenize=True)`).
    - `max_new_tokens`, `temperature`, `top_k`, `top_p`, `repetition_penalty`, `seed`,
      `max_cache_bytes`: as in `generate` (greedy at temperature 0).
    - `stop`: strings that end the text; the text stops before the first one (it is not
      given out).
    - `stop_tokens`: ids that end the text (not decoded); default: the tokenizer's and the
      model's `eos_token_ids`.
    - `session`: a `GenerationSession` of `model` to generate in: a prompt that extends an
      earlier call's prompt and output (a chat's next turn) prefills only its new tokens.

    **Returns:** the `TextStream`; its pieces joined are `generate`'s tokens decoded up to
    the first stop. The arguments are checked here (as `generate` checks them; a stop string
    must be a non-empty `str`).
    """
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError("prompt must be text (a str) or a sequence of token ids, got bytes (their values would "
                        "be read as token ids): decode them first, e.g. prompt.decode('utf-8')")
    prompt_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"stop must be a sequence of non-empty strings, got {stop!r}")
    if stop_tokens is None:
        stop_tokens = end_of_sequence_ids(model, tokenizer)
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                   seed=seed, stop_tokens=stop_tokens, max_cache_bytes=max_cache_bytes)
    if session is None:
        events = generate_tokens(model, [prompt_ids], max_new_tokens, **options)
    elif session.model is not model:
        raise ValueError("session is a GenerationSession of another model: make one with GenerationSession(model)")
    else:
        events = session.generate_tokens(prompt_ids, max_new_tokens, **options)
    return TextStream(tokenizer, events, prompt_ids, stop_tokens, stop)


def end_of_sequence_ids(model, tokenizer: Tokenizer) -> list[int]:
    """The tokenizer's and the model's `eos_token_ids`, less those the model cannot produce."""
    return sorted(i for i in set(tokenizer.eos_token_ids) | set(getattr(model, "eos_token_ids", ()))
                  if i < model.vocab_size)


def generate_text(model, tokenizer: Tokenizer, prompt: str | Sequence[int], max_new_tokens: int = 256,
                  **options) -> str:
    """The new text of `prompt`, all at once: `stream_text`'s pieces joined (same arguments)."""
    return "".join(stream_text(model, tokenizer, prompt, max_new_tokens, **options))
