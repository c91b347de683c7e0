"""A tiny text checkpoint built in the tests: a byte-level BPE tokenizer trained with
`tokenizers` on a few sentences (English, CJK, emoji), a ChatML chat template, and a small
random GLA model saved with `save_pretrained`."""

from __future__ import annotations

import functools
import json
import os

import numpy as np

CORPUS = [
    "Once upon a time there was a tiny recurrent model that read text one token at a time.",
    "The state stays the same size however long the text grows.",
    "你好，世界。循环注意力的状态大小不变。",
    "Emoji travel as several bytes: 🙂 🚀 🌍 and é, ß, ñ too.",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")


@functools.lru_cache(maxsize=None)
def tokenizer_json() -> str:
    """tokenizer.json of a byte-level BPE (vocabulary 300) trained on `CORPUS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer.to_str()


def write_tokenizer(directory: str, *, chat_template: str | None = CHATML) -> None:
    """tokenizer.json and tokenizer_config.json (eos `<|im_end|>`, the chat template)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json())
    config = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": {"content": "<|endoftext|>"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def write_checkpoint(directory: str) -> None:
    """A random GLA model (vocabulary 300, no eos id in config.json) and the tokenizer."""
    from flax import nnx

    from recurrax.nn.pretrained import CausalLM, load_weights, save_pretrained
    from recurrax.nn.pretrained._checkpoint import tensors

    config = dict(model_type="gla", vocab_size=300, hidden_size=32, num_hidden_layers=1, num_heads=2,
                  hidden_ratio=2, use_short_conv=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(7)
    weights = {name: rng.normal(0, 0.5, t.to_fla(np.zeros(t.variable.get_value().shape)).shape).astype(np.float32)
               for name, t in tensors(model).items()}
    save_pretrained(load_weights(model, weights), directory)
    write_tokenizer(directory)
