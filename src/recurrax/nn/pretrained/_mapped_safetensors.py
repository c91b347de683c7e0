"""A safetensors file's tensors as numpy views of the file mapped into memory, copy-on-write.

`safetensors.numpy.load_file` copies every tensor out of the file, and loading copies each
again into a JAX array: the checkpoint passes through memory twice. Views of the mapped file
leave one copy (the JAX array's), read from the page cache. The mapping is private: a write
to a view stays in this process's memory and never reaches the file; and the views are
writeable, so `jnp.asarray` copies them (it may keep a read-only, aligned host array in
place, which would leave parameters backed by the file's pages).

The format: an 8-byte little-endian header length N, N bytes of JSON `{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {…}}`, then the data, the offsets
counted from its start, little-endian.

| dtype here | numpy                          |
|------------|--------------------------------|
| F64, F32, F16, BF16 | float64, float32, float16, bfloat16 (JAX's)         |
| I64 … I8, U8, BOOL  | the integer types, bool                         |

A file this reader does not fully check out (another dtype, a header or offsets that do not
add up, a big-endian host) is read by `fallback` instead (safetensors' own reader, which
names what is wrong).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable

import jax.numpy as jnp
import numpy as np

DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(jnp.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
          "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
HEADER_LENGTH_BYTES = 8


def mapped_tensors(path: str, fallback: Callable[[str], dict]) -> dict[str, np.ndarray]:
    """The tensors of the safetensors file `path` by name, as copy-on-write views of the
    mapped file; `fallback(path)` where the file is not one this reader checks out."""
    layout = _layout(path)
    if layout is None:
        return fallback(path)
    data_start, entries = layout
    if os.path.getsize(path) == data_start:  # no data bytes (only empty tensors): nothing to map
        return {name: np.empty(shape, dtype) for name, (dtype, shape, _, _) in entries.items()}
    data = np.memmap(path, np.uint8, mode="c", offset=data_start)
    return {name: np.asarray(data[begin:end]).view(dtype).reshape(shape)
            for name, (dtype, shape, begin, end) in entries.items()}


def _layout(path: str) -> tuple[int, dict] | None:
    """(where the data starts, {name: (dtype, shape, begin, end)}), or None where the header
    does not check out: each tensor's bytes its shape's, within the data, none overlapping."""
    if sys.byteorder != "little":
        return None
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(HEADER_LENGTH_BYTES)
        if len(prefix) < HEADER_LENGTH_BYTES:
            return None
        length = int.from_bytes(prefix, "little")
        if length > size - HEADER_LENGTH_BYTES:
            return None
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
    if not isinstance(header, dict):
        return None
    data_start = HEADER_LENGTH_BYTES + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry = _entry(info, size - data_start)
        if entry is None:
            return None
        entries[name] = entry
    spans = sorted((begin, end) for _, _, begin, end in entries.values())
    if any(end > next_begin for (_, end), (next_begin, _) in zip(spans, spans[1:])):
        return None
    return data_start, entries


def _entry(info, data_bytes: int):
    """(dtype, shape, begin, end) of one header entry, or None where it does not add up."""
    if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
        return None
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        return None
    dtype, (begin, end) = DTYPES[info["dtype"]], offsets
    if not 0 <= begin <= end <= data_bytes or end - begin != int(np.prod(shape)) * dtype.itemsize:
        return None
    return dtype, tuple(shape), begin, end
