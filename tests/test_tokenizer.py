"""`load_tokenizer`: tokenizer.json through `tokenizers`, the chat template and special tokens
from tokenizer_config.json (or chat_template.jinja), the end-of-sequence ids by precedence,
and a clear error without tokenizer.json."""

import json
import os

import pytest

from _tiny_checkpoint import CHATML, CORPUS, write_tokenizer
from recurrax.nn.pretrained import load_tokenizer


@pytest.fixture
def directory(tmp_path):
    write_tokenizer(str(tmp_path))
    return tmp_path


def write_json(path, name, data):
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
        json.dump(data, f)


@pytest.mark.parametrize("text", CORPUS + ["<|im_start|>user\nmixed 🙂<|im_end|>"])
def test_text_round_trips(directory, text):
    tokenizer = load_tokenizer(directory)
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_encode_as_one_id_and_decode_skips_them(directory):
    tokenizer = load_tokenizer(directory)
    im_end = tokenizer.token_id("<|im_end|>")
    assert tokenizer.encode("a<|im_end|>") == tokenizer.encode("a") + [im_end]
    assert tokenizer.decode(tokenizer.encode("a<|im_end|>")) == "a"


def test_eos_ids_precedence(directory):
    tokenizer = load_tokenizer(directory)
    assert tokenizer.eos_token_ids == (tokenizer.token_id("<|im_end|>"),)  # tokenizer_config.json's eos_token
    write_json(directory, "config.json", {"eos_token_id": [5, 6]})
    assert load_tokenizer(directory).eos_token_ids == (5, 6)
    write_json(directory, "generation_config.json", {"eos_token_id": 7})
    assert load_tokenizer(directory).eos_token_ids == (7,)
    write_json(directory, "generation_config.json", {"eos_token_id": "x"})
    with pytest.raises(ValueError, match="generation_config.json.*eos_token_id"):
        load_tokenizer(directory)


def test_chat_template_sources(directory):
    messages = [{"role": "user", "content": "hi"}]
    tokenizer = load_tokenizer(directory)
    text = tokenizer.apply_chat_template(messages)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.apply_chat_template(messages, tokenize=True) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    write_json(directory, "tokenizer_config.json", {"chat_template": [{"name": "tool_use", "template": "T"},
                                                                       {"name": "default", "template": CHATML}]})
    assert load_tokenizer(directory).apply_chat_template(messages) == text
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
        f.write("{{ eos_token }}{{ messages[0].content }}")
    write_json(directory, "tokenizer_config.json", {"eos_token": {"content": "<|im_end|>", "special": True}})
    assert load_tokenizer(directory).apply_chat_template(messages) == "<|im_end|>hi"
    os.remove(os.path.join(directory, "chat_template.jinja"))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(directory).apply_chat_template(messages)


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    write_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("[1")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("key, value", [
    ("eos_token", {"special": True}), ("bos_token", {"content": 5}), ("pad_token", 5), ("eos_token", ["<|im_end|>"]),
    ("chat_template", 5), ("chat_template", [1]), ("chat_template", [{"name": "default"}]),
])
def test_a_malformed_tokenizer_config_names_the_file_and_key(directory, key, value):
    """A special token that is neither text nor `{"content": text}`, or a chat template that is
    neither text nor named templates, is a ValueError naming tokenizer_config.json and the key
    (issue 49: bare KeyError / TypeError, or a number taken as the token's text)."""
    write_json(directory, "tokenizer_config.json", {key: value})
    with pytest.raises(ValueError, match=rf"tokenizer_config.json: '{key}' must be .*, got"):
        load_tokenizer(directory)
