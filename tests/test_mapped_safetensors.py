"""`recurrax.nn.pretrained._mapped_safetensors`: a checkpoint's tensors as views of the mapped
file, against safetensors' own reader (`safetensors.numpy.load_file`, the reference), and
its fallback to that reader for files it does not check out."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

st = pytest.importorskip("safetensors.numpy", reason="checkpoints need safetensors (recurrax[pretrained])")

from recurrax.nn.pretrained._mapped_safetensors import mapped_tensors  # noqa: E402


def no_fallback(path):
    raise AssertionError(f"the mapped reader fell back to safetensors for {path}")


def every_dtype() -> dict[str, np.ndarray]:
    """One tensor of each dtype the mapped reader reads, odd sizes (unaligned offsets), an empty
    tensor and a scalar."""
    rng = np.random.default_rng(0)
    return {"f32": rng.standard_normal((3, 5)).astype(np.float32),
            "f64": rng.standard_normal(7),
            "f16": rng.standard_normal((2, 3)).astype(np.float16),
            "bf16": rng.standard_normal((5, 1)).astype(jnp.bfloat16),
            "i64": np.arange(-3, 4, dtype=np.int64), "i32": np.arange(3, dtype=np.int32),
            "i16": np.arange(5, dtype=np.int16), "i8": np.arange(-2, 1, dtype=np.int8),
            "u8": np.arange(9, dtype=np.uint8), "bool": np.array([True, False, True]),
            "empty": np.zeros((0, 4), np.float32), "scalar": np.array(2.5, np.float32)}


def test_mapped_tensors_equal_safetensors_own_reader(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file(every_dtype(), path)
    ours, theirs = mapped_tensors(str(path), no_fallback), st.load_file(path)
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert np.array_equal(ours[name], value), name


def test_a_write_to_a_view_never_reaches_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file({"w": np.arange(6, dtype=np.float32)}, path)
    view = mapped_tensors(str(path), no_fallback)["w"]
    view[0] = 100.0
    assert view[0] == 100.0 and st.load_file(path)["w"][0] == 0.0


def test_only_empty_tensors(tmp_path):
    path = tmp_path / "model.safetensors"
    st.save_file({"a": np.zeros((0,), np.float32), "b": np.zeros((2, 0), np.float16)}, path)
    ours = mapped_tensors(str(path), no_fallback)
    assert {name: (v.shape, v.dtype) for name, v in ours.items()} == {"a": ((0,), np.float32),
                                                                      "b": ((2, 0), np.float16)}


def header_edited(path, edit) -> None:
    """Rewrite the JSON header of the safetensors file at `path` with `edit(header)`, the data unchanged."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def overlapping(header):
    header["b"]["data_offsets"] = header["a"]["data_offsets"]


def wrong_size(header):
    header["a"]["shape"] = [3]


def past_the_end(header):
    begin, end = header["b"]["data_offsets"]
    header["b"]["data_offsets"] = [begin + 8, end + 8]


def other_dtype(header):
    header["a"]["dtype"] = "U32"  # not one this reader maps: left to safetensors


@pytest.mark.parametrize("edit", [overlapping, wrong_size, past_the_end, other_dtype])
def test_headers_that_do_not_check_out_go_to_the_fallback(tmp_path, edit):
    path = tmp_path / "model.safetensors"
    st.save_file({"a": np.arange(4, dtype=np.float32), "b": np.arange(4, dtype=np.float32)}, path)
    header_edited(path, edit)
    assert mapped_tensors(str(path), lambda p: {"fallback": p}) == {"fallback": str(path)}


BROKEN = {"empty": b"", "short": b"\x05", "long-header": (10**6).to_bytes(8, "little") + b"{}",
          "not-an-object": (2).to_bytes(8, "little") + b"[]", "not-utf8": (2).to_bytes(8, "little") + b"\xff\xfe"}


@pytest.mark.parametrize("content", BROKEN.values(), ids=BROKEN.keys())
def test_broken_files_go_to_the_fallback(tmp_path, content):
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    assert mapped_tensors(str(path), lambda p: {"fallback": p}) == {"fallback": str(path)}
