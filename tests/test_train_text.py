"""Training from text (issue 30, item 5): `pack_documents` against a loop-by-loop numpy
reference, the named sizes, `save_pretrained` → `from_pretrained` of a `LanguageModel` of
every mixer, and examples/train_text.py's document splitting and byte-level tokenizer.
The script end to end (training, validation loss, `recurrax generate` on its output) is
tests/test_examples.py's `test_train_text` (slow tier)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recurrax.nn import MIXERS, LanguageModel, pack_documents
from recurrax.nn.pretrained import (SIZES, from_pretrained, from_size, generate, generate_text, load_tokenizer,
                                    save_pretrained, size_config)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_text.py"


def reference_packing(documents, batch_tokens):
    """One pair at a time: (input, target, document) of every document's consecutive tokens,
    cut into rows of `batch_tokens`, padded with (0, 0, none); boundaries where the document changes."""
    pairs = [(doc[i], doc[i + 1], d) for d, doc in enumerate(documents) for i in range(len(doc) - 1)]
    rows = []
    for start in range(0, len(pairs), batch_tokens):
        row = pairs[start:start + batch_tokens]
        row = row + [(0, 0, None)] * (batch_tokens - len(row))
        bounds = [0] + [i for i in range(1, batch_tokens) if row[i][2] != row[i - 1][2]]
        rows.append((row, bounds))
    return rows


def random_documents(seed: int, count: int, longest: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 50, rng.integers(0, longest + 1))) for _ in range(count)]


@pytest.mark.parametrize("seed, count, longest, batch_tokens", [(0, 1, 5, 8), (1, 7, 12, 8), (2, 30, 40, 16),
                                                                 (3, 12, 3, 5), (4, 5, 60, 7), (5, 9, 9, 1)])
def test_packing_equals_the_reference(seed, count, longest, batch_tokens):
    documents = random_documents(seed, count, longest) + [[7, 8]]    # at least one pair
    packed = pack_documents(documents, batch_tokens)
    rows = reference_packing(documents, batch_tokens)
    assert len(packed) == len(rows)
    most = max(len(bounds) for _, bounds in rows)
    assert packed.cu_seqlens.shape == (len(rows), most + 1) and packed.cu_seqlens.dtype == np.int32
    for b, (row, bounds) in enumerate(rows):
        np.testing.assert_array_equal(packed.inputs[b], [p[0] for p in row])
        np.testing.assert_array_equal(packed.targets[b], [p[1] for p in row])
        np.testing.assert_array_equal(packed.weights[b], [p[2] is not None for p in row])
        np.testing.assert_array_equal(packed.cu_seqlens[b], bounds + [batch_tokens] * (most + 1 - len(bounds)))
    real = packed.weights.reshape(-1) > 0      # no pair lost, none twice, in order
    np.testing.assert_array_equal(packed.inputs.reshape(-1)[real], [t for d in documents for t in d[:-1]])
    np.testing.assert_array_equal(packed.targets.reshape(-1)[real], [t for d in documents for t in d[1:]])


def test_a_batch_is_one_row_and_packing_needs_a_pair():
    packed = pack_documents([[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]], 4)
    batch = packed.batch(1)
    np.testing.assert_array_equal(batch.inputs, [7, 8, 10, 0])
    np.testing.assert_array_equal(batch.cu_seqlens, [0, 2, 3, 4])
    with pytest.raises(ValueError, match="no document has 2 or more tokens"):
        pack_documents([[1], []], 4)
    with pytest.raises(ValueError, match="batch_tokens must be a positive integer"):
        pack_documents([[1, 2]], 0)


@pytest.mark.slow  # 20 s of float64 compiling; the model's cu_seqlens are tested in test_nn
def test_packed_segments_do_not_see_each_other():
    """A packed batch's logits equal each document's own forward (float64: only rounding apart)."""
    model = LanguageModel(20, 8, 1, 2, mixer="gla", mlp_ratio=1, dtype=jnp.float64, param_dtype=jnp.float64,
                          rngs=nnx.Rngs(0))
    documents = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    batch = pack_documents(documents, 9).batch(0)
    packed = model(jnp.asarray(batch.inputs), cu_seqlens=jnp.asarray(batch.cu_seqlens))
    bounds = batch.cu_seqlens
    for start, end in zip(bounds[:-1], bounds[1:]):
        alone = model(jnp.asarray(batch.inputs[start:end])[None])[0]
        np.testing.assert_allclose(packed[start:end], alone, rtol=0, atol=1e-12)


def test_named_sizes_have_the_sizes_they_are_named_for():
    counts = {name: sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: from_size(name)),
                                                                   nnx.Param)))
              for name in ("gla-340m", "mamba2-130m")}
    assert 0.33e9 < counts["gla-340m"] < 0.35e9 and 0.125e9 < counts["mamba2-130m"] < 0.135e9, counts
    assert set(SIZES) >= {"tiny", "small", "gla-340m", "mamba2-130m"}
    config = size_config("tiny", vocab_size=300, mixer="retnet")
    assert (config["vocab_size"], config["mixer"], SIZES["tiny"]["vocab_size"]) == (300, "retnet", 512)
    model = nnx.eval_shape(lambda: from_size("tiny", vocab_size=300, mixer="retnet"))
    assert isinstance(model, LanguageModel) and model.config == config
    with pytest.raises(ValueError, match="unknown model size 'huge'; the sizes are tiny, small"):
        size_config("huge")
    with pytest.raises(ValueError, match="has no field hidden_size"):
        size_config("tiny", hidden_size=3)
    with pytest.raises(ValueError, match="mixer must be one of"):
        size_config("small", mixer="lstm")


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_a_language_model_of_every_mixer_round_trips(tmp_path, mixer):
    """config.json + model.safetensors read back into the same LanguageModel: same config,
    every parameter equal, equal logits."""
    fast = {"implementation": "scan"} if mixer == "gated_deltanet" else {}     # the chunk form compiles slowly
    model = from_size("tiny", vocab_size=24, d_model=16, num_layers=1, mixer=mixer, rngs=nnx.Rngs(3), **fast)
    save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "recurrax_language_model" and saved["mixer"] == mixer
    loaded = from_pretrained(tmp_path)
    assert type(loaded) is LanguageModel and loaded.config == model.config
    flat = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))  # noqa: E731
    assert flat(loaded).keys() == flat(model).keys()
    for path, variable in flat(model).items():
        np.testing.assert_array_equal(flat(loaded)[path].get_value(), variable.get_value(), err_msg=str(path))
    tokens = jnp.asarray([[1, 5, 9, 2, 14, 23]])
    np.testing.assert_array_equal(loaded(tokens), model(tokens))


def test_generate_and_generate_text_run_on_a_saved_language_model(tmp_path):
    from _tiny_checkpoint import write_tokenizer

    write_tokenizer(str(tmp_path))
    tokenizer = load_tokenizer(tmp_path)
    model = from_size("tiny", vocab_size=tokenizer.vocab_size, d_model=16, num_layers=1, rngs=nnx.Rngs(1))
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(tmp_path)
    prompt = tokenizer.encode("Once upon")
    tokens = generate(model, [prompt], 6, stop_tokens=())[0]
    assert len(tokens) == 6
    assert generate_text(loaded, tokenizer, "Once upon", 6, stop_tokens=()) == tokenizer.decode(tokens)


def _example():
    spec = importlib.util.spec_from_file_location("train_text", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_splits_documents_and_trains_a_byte_level_tokenizer(tmp_path):
    pytest.importorskip("optax")
    pytest.importorskip("tqdm")
    example = _example()
    text = "First line\nstill first.\n\n\n  Second 你好 🙂\n\nthird\r\n"
    assert example.split_documents(text, "paragraph") == ["First line\nstill first.", "Second 你好 🙂", "third"]
    assert example.split_documents(text, "line") == ["First line", "still first.", "Second 你好 🙂", "third"]
    documents = example.split_documents(text, "paragraph") * 3
    example.write_byte_level_tokenizer(documents, 280, str(tmp_path))
    tokenizer = load_tokenizer(tmp_path)
    assert 257 <= tokenizer.vocab_size <= 280
    assert tokenizer.eos_token_ids == (tokenizer.token_id(example.END_OF_TEXT),)
    encoded = example.encode_documents(tokenizer, ["Second 你好 🙂", "ünseen ∑ bytes"])
    for ids, document in zip(encoded, ["Second 你好 🙂", "ünseen ∑ bytes"]):
        assert ids[-1] == tokenizer.eos_token_ids[0]
        assert tokenizer.decode(ids) == document          # every byte round-trips, the eos is left out
