"""A checkpoint's tokenizer: Hugging Face `tokenizers` for text ↔ ids, its chat template, its
special tokens and end-of-sequence ids, all read from the checkpoint directory.

| file                    | what is read from it                                             |
|-------------------------|------------------------------------------------------------------|
| tokenizer.json          | the tokenizer itself (required)                                  |
| tokenizer_config.json   | `chat_template`, the special tokens (`bos_token`, `eos_token`, …) |
| chat_template.jinja     | the chat template (wins over tokenizer_config.json's)            |
| generation_config.json  | `eos_token_id` (an id or a list; wins over config.json's)        |
| config.json             | `eos_token_id`, when generation_config.json has none             |

Without any `eos_token_id`, the id of tokenizer_config.json's `eos_token` is the one
end-of-sequence id. Only tokenizer.json is required: a directory without it is a
`FileNotFoundError` naming it (token ids still work through `generate`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from .._extras import require
from ._chat_template import render_chat
from ..nn.pretrained._config_checks import eos_token_ids, read_json

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens of tokenizer_config.json a chat template sees by name (as `transformers`)."""


class Tokenizer:
    """Text ↔ token ids for one checkpoint, with its chat template and end-of-sequence ids.

    **Arguments:**
    - `backend`: a `tokenizers.Tokenizer`.
    - `chat_template`: the Jinja chat template, or None.
    - `special_tokens`: names of `SPECIAL_TOKENS` → their text (what templates see).
    - `eos_token_ids`: the ids that end a sequence.

    `load_tokenizer(directory)` builds one from a checkpoint.
    """

    def __init__(self, backend, *, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None, eos_token_ids: Sequence[int] = ()):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Ids are in `[0, vocab_size)` (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; `add_special_tokens` applies the tokenizer's post-processor
        (e.g. a leading BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids` (special tokens left out unless `skip_special_tokens=False`)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of the token `token`, None if the vocabulary lacks it."""
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, **variables: Any) -> str | list[int]:
        """The conversation `messages` through the chat template (see `render_chat`), as
        text, or with `tokenize=True` as ids (the template writes its own special tokens, so
        none are added). The special tokens are visible to the template by name;
        `variables` (`tools`, `documents`, `date_string`, …) add to them or override them.

        A tokenizer without a chat template is a `ValueError`.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json "
                             "and no chat_template.jinja); give the prompt as plain text instead")
        text = render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           **{**self.special_tokens, **variables})
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The `Tokenizer` of the checkpoint directory `path` (the files in the table above).

    Needs `tokenizers` (and `jinja2` for chat templates): `pip install 'recurrax[pretrained]'`.
    A directory without tokenizer.json is a `FileNotFoundError` naming it; a file that is
    not valid JSON is a `ValueError` naming it.
    """
    tokenizers = require("tokenizers", "pretrained", "load_tokenizer")
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(
            f"no tokenizer.json in {path!r}: text generation needs the checkpoint's tokenizer (Hugging Face "
            "tokenizers' tokenizer.json); without it, give token ids to recurrax.generation.generate")
    try:
        backend = tokenizers.Tokenizer.from_file(file)
    except Exception as error:  # tokenizers raises its own exception type for unreadable files
        raise ValueError(f"{file}: not a tokenizers tokenizer.json ({error})") from error
    settings = _json_object(path, "tokenizer_config.json")
    config_file = os.path.join(path, "tokenizer_config.json")
    special = {name: _token_text(config_file, name, settings[name]) for name in SPECIAL_TOKENS
               if settings.get(name) is not None}
    eos = _eos_ids(path) or ((backend.token_to_id(special["eos_token"]),) if "eos_token" in special else ())
    return Tokenizer(backend, chat_template=_chat_template(path, settings), special_tokens=special,
                     eos_token_ids=tuple(i for i in eos if i is not None))


def _token_text(file: str, name: str, token) -> str:
    """A special token as tokenizer_config.json writes it: its text, or `{"content": text, …}`;
    a `ValueError` naming the file and key otherwise."""
    text = token.get("content") if isinstance(token, Mapping) else token
    if not isinstance(text, str):
        raise ValueError(f"{file}: {name!r} must be the token's text or an object with a \"content\" text, "
                         f"got {token!r}")
    return text


def _chat_template(path: str, settings: Mapping[str, Any]) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": …, "template": …}]
        if not all(isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                   and isinstance(entry.get("template"), str) for entry in template):
            _refuse_template(path, template)
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    elif template is not None and not isinstance(template, str):
        _refuse_template(path, template)
    return template


def _refuse_template(path: str, template) -> None:
    raise ValueError(f"{os.path.join(path, 'tokenizer_config.json')}: 'chat_template' must be null, a Jinja "
                     f"template (a string) or a list of {{\"name\": ..., \"template\": ...}} objects, got {template!r}")


def _eos_ids(path: str) -> tuple[int, ...]:
    """`eos_token_id` of generation_config.json, else of config.json; () if neither has one."""
    for name in ("generation_config.json", "config.json"):
        value = _json_object(path, name).get("eos_token_id")
        if value is not None:
            try:
                return eos_token_ids(value, "eos_token_id")
            except ValueError as error:
                raise ValueError(f"{os.path.join(path, name)}: {error}") from error
    return ()


def _json_object(path: str, name: str) -> dict:
    """The JSON object in `path/name`, {} when the file is absent."""
    file = os.path.join(path, name)
    return read_json(file) if os.path.isfile(file) else {}
