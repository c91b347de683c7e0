"""Chat templates: a checkpoint's Jinja template turned into the prompt text of a conversation,
rendered as `transformers`' `apply_chat_template` renders it.

| name                    | meaning                                                            |
|-------------------------|--------------------------------------------------------------------|
| messages                | the conversation: dicts with `role` and `content` (and any others) |
| add_generation_prompt   | end with the header that opens the assistant's reply               |
| tools, documents        | optional lists the template may show (tool schemas, RAG documents) |
| special tokens          | `bos_token`, `eos_token`, … as strings, visible to the template    |

A template from a downloaded checkpoint is untrusted code: it runs in Jinja's immutable
sandbox (no attribute access to Python internals, no mutation of the caller's lists), with
what chat templates on the Hub expect besides Jinja's own filters:

    trim_blocks, lstrip_blocks      a block tag's own line break and indentation vanish
    loop controls                   {% break %}, {% continue %}
    {% generation %}…{% endgeneration %}   marks the assistant's tokens; rendered as its body
    raise_exception(message)        a `jinja2.TemplateError` with the template's message
    tojson(x, indent=None, …)       `json.dumps`, non-ASCII kept and nothing HTML-escaped
    strftime_now(format)            the local time now, formatted

A message's reasoning under any of `reasoning_content`, `thinking` or `reasoning` is also
given under `reasoning_content` and `thinking` (the names templates read).
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from .._extras import require

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str:
    """The text of the conversation `messages` through the Jinja chat `template`.

    **Arguments:**
    - `template`: the template source (a checkpoint's `chat_template`).
    - `messages`: dicts with at least `role` and `content`; they are copied, never changed.
    - `add_generation_prompt`: end with the opening of the assistant's reply.
    - `tools`, `documents`: JSON-schema tool descriptions / documents, for templates that
      show them.
    - `variables`: anything else the template reads (`bos_token`, `eos_token`, `date_string`…).

    **Returns:** the rendered text. A message that is not a dict is a `TypeError`; a
    template's `raise_exception` and syntax errors are `jinja2.TemplateError`s.
    """
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{position}] must be a dict with 'role' and 'content', got {message!r}")
    conversation = [_with_reasoning_aliases(dict(copy.deepcopy(message))) for message in messages]
    return compiled_template(template).render(
        messages=conversation, tools=copy.deepcopy(tools), documents=copy.deepcopy(documents),
        add_generation_prompt=add_generation_prompt, **variables)


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[name] for name in REASONING_FIELDS if message.get(name) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=16)
def compiled_template(template: str):
    """`template` compiled once in the sandboxed environment described above."""
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment():
    jinja2 = require("jinja2", "pretrained", "chat templates")
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}…{% endgeneration %}`: its body, unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(line)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return environment
