"""OpenAI request bodies → what the engine runs: the prompt's ids, the token budget, the
sampling settings, the stop strings; anything invalid is a `RequestError` (an HTTP status and
OpenAI's error JSON) naming the parameter.

| parameter                        | accepted                                                       |
|----------------------------------|----------------------------------------------------------------|
| `model`                          | the served model's name (or absent); another name is a 404     |
| `prompt` (completions)           | a string, a list of one string, token ids, a list of one list   |
| `messages` (chat)                | `{"role", "content"}` with text content (a string or text parts)|
| `max_tokens`, `max_completion_tokens` | an integer ≥ 1; prompt + it ≤ `--max-model-len`            |
| `temperature`                    | a finite number ≥ 0 (0: greedy)                                |
| `top_p`                          | a number in (0, 1]                                             |
| `top_k` (extra body)             | an integer ≥ 1; -1 or 0: no cut                                |
| `seed`                           | an integer in [0, 2³¹) (default: a random one)                 |
| `stop`                           | a string or a list of them, within `Limits`                    |
| `n`, `best_of`                   | 1 only                                                         |
| `stream`, `stream_options.include_usage` | booleans                                               |

The body is JSON of at most `--max-body-bytes` (checked by the HTTP side); JSON that Python
cannot read (nesting deeper than its recursion limit, an integer of more than 4300 digits),
text with a lone surrogate, a prompt of more than `--max-prompt-tokens` tokens (a text prompt
longer than that many of the vocabulary's longest tokens is refused before it is tokenized)
and a chat template's refusal are 400s like any invalid value.

Parameters that change what a model computes and that the server does not implement
(`logprobs`, `presence_penalty`, `logit_bias`, `tools`, …) are refused by name when set to
anything but their neutral value; other unknown fields are ignored, as OpenAI's own clients
send them.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from .. import Sampling

SEED_LIMIT = 2**31
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for `/v1/completions`; a chat's default is what the context leaves."""

NEUTRAL = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (None, 0),
           "frequency_penalty": (None, 0), "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""),
           "tools": (None, []), "functions": (None, []), "repetition_penalty": (None, 1)}
"""Parameters the server does not implement, with the values that mean "not used"."""


class RequestError(Exception):
    """An invalid request: the HTTP `status` and OpenAI's error fields."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code

    def body(self) -> dict:
        """OpenAI's error JSON."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Job:
    """One request as the engine runs it."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: `max_prompt_tokens` tokens of prompt, `max_stop_strings`
    stop strings of at most `max_stop_length` characters each (every generated token is
    checked against each of them)."""

    max_prompt_tokens: int
    max_stop_strings: int = 16
    max_stop_length: int = 64


class RequestParser:
    """`parser(body, chat=...)`: the `Job` of a `/v1/completions` (or with `chat`,
    `/v1/chat/completions`) body of bytes, for `model_name` of `vocab_size` token ids and a
    context of `max_model_len` tokens. `render(messages)` gives a chat's prompt text (a
    `TemplateRenderer`'s, bounded) or raises RequestError; None: the model has no chat
    template. Blocking work (JSON, the template, tokenizing): call it off the event loop."""

    def __init__(self, *, tokenizer, render: Callable[[list], str] | None, model_name: str, vocab_size: int,
                 max_model_len: int, limits: Limits):
        self.tokenizer, self.render, self.model_name = tokenizer, render, model_name
        self.vocab_size, self.max_model_len, self.limits = vocab_size, max_model_len, limits
        self.longest_token = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)
        """Characters of the vocabulary's longest token: a text of n characters has at least
        n / longest_token tokens (a token covers at most its own characters)."""

    def __call__(self, body: bytes, *, chat: bool) -> Job:
        try:
            fields = json.loads(body)
        except (ValueError, RecursionError) as failure:  # JSONDecodeError, bad UTF-8, huge integers; deep nesting
            raise RequestError(f"the request body is not JSON this server can read: {failure}") from None
        return self.parse(fields, chat=chat)

    def parse(self, body: Any, *, chat: bool) -> Job:
        """The `Job` of a decoded JSON body."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                               param="model", status=404, code="model_not_found")
        for name, neutral in NEUTRAL.items():
            if body.get(name) not in neutral:
                raise RequestError(f"{name} is not supported by this server", param=name)
        for name in ("n", "best_of"):
            if body.get(name) not in (None, 1) or isinstance(body.get(name), bool):
                raise RequestError(f"{name} must be 1 (this server returns one choice), got {body.get(name)!r}",
                                   param=name)
        stop = _stop(body, self.limits)  # before the prompt: cheap checks first
        param = "messages" if chat else "prompt"
        prompt_ids = (self._tokens(self._chat_text(body), param, special_tokens=False) if chat else
                      self._prompt_ids(body))
        if not all(0 <= t < self.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.vocab_size}) (the model's vocabulary)",
                               param=param)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens; this server's context is "
                               f"{self.max_model_len} tokens (--max-model-len), which must leave room for at least "
                               "one new token", param=param, code="context_length_exceeded")
        max_tokens = _max_tokens(body, chat, default=room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room))
        if max_tokens > room:
            raise RequestError(f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({max_tokens}) exceed this "
                               f"server's context of {self.max_model_len} tokens (--max-model-len)",
                               param="max_tokens", code="context_length_exceeded")
        stream = _boolean(body, "stream")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not stream):
            raise RequestError("stream_options must be an object, and only with stream: true",
                               param="stream_options")
        include_usage = _boolean(options or {}, "include_usage", "stream_options.include_usage")
        return Job(prompt_ids, max_tokens, _sampling(body), stop, stream, include_usage)

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a batch of one
        if isinstance(prompt, str):
            ids = self._tokens(prompt, "prompt", special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = list(prompt)
            self._check_length(len(ids), "prompt")
        else:
            raise RequestError("prompt must be a string or a list of token ids (one prompt per request)",
                               param="prompt")
        if not ids:
            raise RequestError("the prompt has no tokens", param="prompt")
        return ids

    def _chat_text(self, body: dict) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects",
                               param="messages")
        if self.render is None:
            raise RequestError("this model has no chat template (no 'chat_template' in tokenizer_config.json "
                               "and no chat_template.jinja); use /v1/completions with a plain prompt",
                               param="messages")
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a string role", param=f"messages[{i}]")
            conversation.append({**message, "content": _text_content(message.get("content"), i)})
        return self.render(conversation)

    def _tokens(self, text: str, param: str, *, special_tokens: bool) -> list[int]:
        """`text`'s ids, with the tokenizer's special tokens or not (a chat template writes its
        own)."""
        _check_text(text, param)
        if len(text) > self.limits.max_prompt_tokens * self.longest_token:
            raise RequestError(f"the prompt has {len(text)} characters: more than the {self.limits.max_prompt_tokens} "
                               "tokens this server takes (--max-prompt-tokens) can hold", param=param,
                               code="context_length_exceeded")
        ids = self.tokenizer.encode(text, add_special_tokens=special_tokens)
        self._check_length(len(ids), param)
        return ids

    def _check_length(self, tokens: int, param: str) -> None:
        if tokens > self.limits.max_prompt_tokens:
            raise RequestError(f"the prompt has {tokens} tokens; this server takes at most "
                               f"{self.limits.max_prompt_tokens} (--max-prompt-tokens)", param=param,
                               code="context_length_exceeded")


def _text_content(content: Any, i: int) -> str:
    """A message's text: a string, None (empty), or a list of `{"type": "text", "text"}` parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts (this model reads text "
                       "only)", param=f"messages[{i}].content")


def _max_tokens(body: dict, chat: bool, default: int) -> int:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < 1:
        raise RequestError(f"{name} must be an integer ≥ 1, got {value!r}", param=name)
    return value


def _sampling(body: dict) -> Sampling:
    temperature = _number(body, "temperature", 1.0)
    if not temperature >= 0:
        raise RequestError(f"temperature must be ≥ 0, got {temperature}", param="temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise RequestError(f"top_k must be an integer ≥ 1 (-1 or 0: no cut), got {top_k!r}", param="top_k")
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    elif not _is_int(seed) or not 0 <= seed < SEED_LIMIT:
        raise RequestError(f"seed must be an integer in [0, 2**31), got {seed!r}", param="seed")
    return Sampling(temperature=float(temperature), top_k=Sampling().top_k if top_k in (None, -1, 0) else top_k,
                    top_p=float(top_p), seed=seed)


def _stop(body: dict, limits: Limits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of them", param="stop")
    if len(stop) > limits.max_stop_strings:
        raise RequestError(f"stop has {len(stop)} strings; this server takes at most {limits.max_stop_strings} "
                           "(--max-stop-strings)", param="stop")
    if max(map(len, stop), default=0) > limits.max_stop_length:
        raise RequestError(f"a stop string has {max(map(len, stop))} characters; this server takes at most "
                           f"{limits.max_stop_length} (--max-stop-length)", param="stop")
    for text in stop:
        _check_text(text, "stop")
    return tuple(stop)


def _check_text(text: str, param: str) -> None:
    """`text` is Unicode text: no lone surrogate (JSON's "\\ud800" decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as failure:
        raise RequestError(f"{param} holds a lone surrogate ({failure.reason}, at character {failure.start}): "
                           "not Unicode text", param=param) from None


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}", param=name)
    return value


def _boolean(body: dict, name: str, label: str | None = None) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{label or name} must be true or false, got {value!r}", param=label or name)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
