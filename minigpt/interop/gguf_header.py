"""A bounds check of a GGUF header, run before the ``gguf`` package's reader sees the file.

The reader trusts every count and length in the header: an array of ``2^64 - 1`` scalars past the end of the file
makes it loop (reads past the end return empty arrays, so its offset stops advancing), and arrays nested 100k deep
exhaust the stack. :func:`check_header` walks the same structure (the GGUF v2/v3 layout of llama.cpp's
``gguf.md``: magic, version, tensor and key-value counts, the key-value pairs, the tensor infos) iteratively, and
refuses any count or length that does not fit in the bytes that remain, with one line naming the file.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from minigpt.errors import MiniGPTError

# Bytes of each fixed-size GGUF value type (gguf.md: UINT8 .. FLOAT64, BOOL); 8 is STRING, 9 is ARRAY.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
# llama.cpp's GGML_MAX_DIMS; arrays of arrays are legal GGUF but no model file nests them deeply.
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 64


class _Cursor:
    """Reads little- or big-endian integers from ``data``, refusing reads past its end."""

    def __init__(self, data, where: str, order: str) -> None:
        self.data, self.where, self.order, self.pos = data, where, order, 0

    def need(self, n: int, what: str) -> None:
        if n > len(self.data) - self.pos:
            raise MiniGPTError(f"{self.where} is not a valid GGUF file or is truncated: {what} needs {n} bytes at "
                               f"offset {self.pos} but the file has {len(self.data)}")

    def uint(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(self.order + fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> None:
        length = self.uint("Q", what)
        self.need(length, what)
        self.pos += length


def _skip_value(cur: _Cursor, kind: int, key: str) -> None:
    """Step over one value of type ``kind``; arrays through an explicit stack of ``[item type, items left]``."""
    stack: list[list[int]] = []
    while True:
        if kind in SCALAR_BYTES:
            cur.need(SCALAR_BYTES[kind], f"the value of {key}")
            cur.pos += SCALAR_BYTES[kind]
        elif kind == STRING:
            cur.string(f"a string in {key}")
        elif kind == ARRAY:
            item, count = cur.uint("I", f"the array type of {key}"), cur.uint("Q", f"the array length of {key}")
            if item in SCALAR_BYTES:  # fixed-size items: skipped in one step
                cur.need(count * SCALAR_BYTES[item], f"the {count} items of {key}")
                cur.pos += count * SCALAR_BYTES[item]
            elif item in (STRING, ARRAY):
                # Each item takes at least its 8-byte length (a string) or its 12-byte type and count (an array).
                cur.need(count * (8 if item == STRING else 12), f"the {count} items of {key}")
                if len(stack) >= MAX_ARRAY_DEPTH:
                    raise MiniGPTError(f"{cur.where} is not a valid GGUF file: its metadata nests arrays too deeply "
                                       "to read")
                stack.append([item, count])
            else:
                raise MiniGPTError(f"{cur.where} is not a valid GGUF file: {key} has arrays of unknown type {item}")
        else:
            raise MiniGPTError(f"{cur.where} is not a valid GGUF file: {key} has unknown value type {kind}")
        while stack and stack[-1][1] == 0:
            stack.pop()
        if not stack:
            return
        stack[-1][1] -= 1
        kind = stack[-1][0]


def check_header(path: str | Path) -> None:
    """Raise :class:`MiniGPTError` (one line) if the header of the GGUF at ``path`` has a count, length, type or
    dimension count that cannot be right: anything that would run past the end of the file. Files that are not
    GGUF v2/v3 at all are left to the reader, which names what is wrong with them."""
    path = Path(path)
    with open(path, "rb") as f:
        if path.stat().st_size < 24:
            return  # too short for a header: the reader says so
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"GGUF":
                return
            # A version whose low half is zero is a file of the other byte order (the reader's rule).
            order = ">" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF == 0 else "<"
            if struct.unpack_from(order + "I", data, 4)[0] not in (2, 3):
                return
            cur = _Cursor(data, str(path), order)
            cur.pos = 8
            n_tensors, n_kv = cur.uint("Q", "the tensor count"), cur.uint("Q", "the key-value count")
            # A key-value pair takes at least 12 bytes (key length, type), a tensor info at least 24.
            cur.need(n_kv * 12 + n_tensors * 24, f"{n_kv} key-value pairs and {n_tensors} tensor infos")
            for i in range(n_kv):
                start = cur.pos
                cur.string(f"key {i}")
                # Quoted and cut short: the key is attacker-chosen text inside a one-line message.
                key = repr(bytes(data[start + 8:cur.pos][:64]).decode("utf-8", "replace"))
                _skip_value(cur, cur.uint("I", f"the type of {key}"), key)
            for i in range(n_tensors):
                cur.string(f"the name of tensor {i}")
                n_dims = cur.uint("I", f"the dimension count of tensor {i}")
                if n_dims > MAX_DIMS:
                    raise MiniGPTError(f"{path} is not a valid GGUF file: tensor {i} has {n_dims} dimensions "
                                       f"(at most {MAX_DIMS})")
                cur.need(8 * n_dims + 12, f"the shape, type and offset of tensor {i}")
                cur.pos += 8 * n_dims + 12
