"""Text generation: incremental decoding that never splits a character, stop strings found
across tokens and never given out, and `stream_text` / `generate_text` equal to `generate`'s
tokens decoded (greedy and sampled) on a tiny random checkpoint."""

import functools

import pytest
from hypothesis import given, settings, strategies as st

from _tiny_checkpoint import CORPUS, write_checkpoint
from recurrax.nn.pretrained import (IncrementalDecoder, TextStream, from_pretrained, generate, generate_text,
                                    load_tokenizer, stream_text)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny"))
    write_checkpoint(directory)
    return from_pretrained(directory), load_tokenizer(directory)


@functools.lru_cache(maxsize=None)
def tokenizer():
    import tempfile

    from _tiny_checkpoint import write_tokenizer

    with tempfile.TemporaryDirectory() as directory:
        write_tokenizer(directory)
        return load_tokenizer(directory)


def events(ids):
    """What `generate_tokens` yields for one prompt, as a closable generator."""
    return ((0, token) for token in ids)


@pytest.mark.parametrize("text", CORPUS[2:] + ["🙂🚀🌍 ß", "日本語のテキスト"])
def test_incremental_decoding_never_splits_a_character(text):
    ids = tokenizer().encode(text)
    decoder = IncrementalDecoder(tokenizer())
    pieces = [decoder.push(token) for token in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces[:-1]  # some character's bytes did span tokens (the case under test happened)


def test_decoding_after_a_prompt_keeps_its_context():
    text = "Once upon a time there was"
    ids = tokenizer().encode(text)
    decoder = IncrementalDecoder(tokenizer(), ids[:3])
    assert "".join(decoder.push(t) for t in ids[3:]) + decoder.flush() == tokenizer().decode(ids[3:])


@pytest.mark.parametrize("stop, expected", [
    ((" there",), "Once upon a time"),                 # spans tokens
    (("zzz", "a t"), "Once upon "),                     # the first of several, inside a token boundary
    (("Once",), ""),
    (("was.",), "Once upon a time there was"),          # its start is held back, then it never completes
    ((), "Once upon a time there was"),
])
def test_stop_strings(stop, expected):
    text = "Once upon a time there was"
    stream = TextStream(tokenizer(), events(tokenizer().encode(text)), [], (), stop)
    pieces = list(stream)
    assert "".join(pieces) == stream.text == expected
    assert stream.finish_reason == ("stop" if any(s in text for s in stop) else "length")
    for position in range(len(pieces)):  # nothing given out was ever part of a stop string
        assert not any(s in "".join(pieces[: position + 1]) for s in stop)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(text=st.text(alphabet="ab 🙂é", min_size=1, max_size=12), stop=st.text(alphabet="ab 🙂é", min_size=1,
                                                                               max_size=3))
def test_stream_is_the_text_up_to_the_first_stop(text, stop):
    stream = TextStream(tokenizer(), events(tokenizer().encode(text)), [], (), [stop])
    expected = text[: text.find(stop)] if stop in text else text
    assert "".join(stream) == expected


def test_an_end_of_sequence_id_stops_and_is_not_decoded():
    ids = tokenizer().encode("Once upon<|im_end|> a time")
    end = tokenizer().token_id("<|im_end|>")
    stream = TextStream(tokenizer(), events(ids), [], (end,), ())
    assert "".join(stream) == "Once upon"
    assert stream.tokens[-1] == end and stream.finish_reason == "stop"


def test_stream_equals_generate_decoded(checkpoint):
    model, tokenizer = checkpoint
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    end = tokenizer.eos_token_ids
    for sampling in (dict(), dict(temperature=0.9, top_k=40, top_p=0.95, seed=3)):
        expected = generate(model, [ids], 24, stop_tokens=end, **sampling)[0]
        stream = stream_text(model, tokenizer, prompt, 24, **sampling)
        text = "".join(stream)
        assert stream.tokens == expected
        assert text == tokenizer.decode([t for t in expected if t not in end])
        assert stream.finish_reason == ("stop" if expected[-1] in end else "length")
    stop = text[3:6]
    assert generate_text(model, tokenizer, prompt, 24, stop=[stop], **sampling) == text[: text.find(stop)]


def test_stream_text_checks_its_arguments(checkpoint):
    model, tokenizer = checkpoint
    with pytest.raises(TypeError, match="stop"):
        stream_text(model, tokenizer, "x", 4, stop="x")
    with pytest.raises(ValueError, match="temperature"):
        stream_text(model, tokenizer, "x", 4, temperature=-1.0)
    for bad in (0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            stream_text(model, tokenizer, "x", 4, repetition_penalty=bad)
    for raw in (b"Once", bytearray(b"Once")):  # issue 49: its byte values were taken as token ids
        with pytest.raises(TypeError, match=r"^prompt must be text .* got bytes"):
            generate_text(model, tokenizer, raw, 4)
        with pytest.raises(TypeError, match=r"^prompts\[0\] must be a sequence of integer token ids, got"):
            generate(model, [raw], 4)
