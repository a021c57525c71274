"""Read an ONNX file's graph without copying its weights: initializers as arrays over a
memory map of the file, everything else through the ``onnx`` package's protobuf classes.

``onnx.load`` parses the whole ~1 GB speech tokenizer into protobuf messages, and reading
an initializer's ``raw_data`` copies it again (on 2 CPU cores: 8 s to load, 4 s more to turn
the initializers into arrays). The weights need neither copy: they are bytes in the file.
Here the graph message is walked at the wire-format level; each initializer's header (name,
shape, type) is decoded and its ``raw_data`` becomes ``np.frombuffer`` over a private
(copy-on-write) memory map, so the only copy of a weight is the one into its model, on
whatever device that lives. The other graph fields (nodes, inputs, outputs: a few hundred KB)
are cut out of the file and parsed by ``onnx`` as one ``GraphProto``, so nodes and attributes
keep onnx's own types. An initializer stored any other way (typed fields, external data, a
type without a NumPy twin) is parsed by ``onnx`` alone, as ``onnx.load`` would.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ONNX TensorProto.DataType -> NumPy (little-endian in raw_data, as the format specifies)
_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 7: np.int64,
          9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5  # field numbers in ModelProto / GraphProto
_T_DIMS, _T_TYPE, _T_NAME, _T_RAW = 1, 2, 8, 9  # TensorProto fields decoded here


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 64 bits")


def fields(buf, start: int, end: int):
    """(field number, wire type, value, field start, field end) of each field of the message
    in ``buf[start:end]``; the value of a length-delimited field is its payload's
    (start, end), of any other its integer."""
    pos = start
    while pos < end:
        at = pos
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value = (pos, pos + n)
            pos += n
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos: pos + 8], "little"), pos + 8
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos: pos + 4], "little"), pos + 4
        else:
            raise WireError(f"unsupported wire type {wire} at byte {at}")
        if pos > end:
            raise WireError(f"field {number} at byte {at} runs past its message")
        yield number, wire, value, at, pos


@dataclass
class OnnxFile:
    """A graph's parts: ``graph`` an ``onnx.GraphProto`` without its initializers, which are
    in ``initializers`` (name -> array; those stored as raw data views of the file, unaligned)."""

    graph: object
    initializers: dict


def _initializer(buf, start: int, end: int):
    """(name, array) of a TensorProto whose data is ``raw_data`` of a known type, else None."""
    dims, dtype, name, raw = [], None, None, None
    for number, wire, value, _, _ in fields(buf, start, end):
        if number == _T_DIMS:
            if wire == 0:
                dims.append(value)
            else:  # packed
                pos, stop = value
                while pos < stop:
                    d, pos = _varint(buf, pos)
                    dims.append(d)
        elif number == _T_TYPE:
            dtype = _NUMPY.get(value)
        elif number == _T_NAME:
            name = bytes(buf[value[0]: value[1]]).decode("utf-8")
        elif number == _T_RAW:
            raw = value
        elif number not in (12,):  # doc_string is harmless; any data field but raw_data is not
            return None
    if dtype is None or name is None or raw is None:
        return None
    dtype = np.dtype(dtype).newbyteorder("<")
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if count * dtype.itemsize != raw[1] - raw[0]:
        return None
    # Protobuf does not align raw_data: most of these arrays are unaligned (NumPy and torch
    # read them; whoever computes with a weight copies it first, see onnx_weights._build).
    return name, np.frombuffer(buf, dtype=dtype, count=count, offset=raw[0]).reshape(dims)


def read_onnx(path: str | Path) -> OnnxFile:
    """The graph of the ONNX model at ``path`` (raises OSError, WireError or onnx's
    DecodeError for a file that is not one)."""
    import onnx
    from onnx import numpy_helper

    with open(path, "rb") as f:
        # ACCESS_COPY: the arrays are writable (torch.from_numpy takes them without a warning)
        # and a write would stay private; the map lives as long as any array over it.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    graph = None
    for number, wire, value, _, _ in fields(buf, 0, len(buf)):
        if number == _MODEL_GRAPH and wire == 2:
            graph = value
    if graph is None:
        raise WireError(f"{path}: no graph")
    rest, inits = [], {}
    for number, wire, value, at, end in fields(buf, *graph):
        if number == _GRAPH_INITIALIZER and wire == 2:
            got = _initializer(buf, *value)
            if got is None:
                t = onnx.TensorProto.FromString(bytes(buf[value[0]: value[1]]))
                got = t.name, numpy_helper.to_array(t, base_dir=str(Path(path).parent))
            inits[got[0]] = got[1]
        else:
            rest.append(bytes(buf[at:end]))
    return OnnxFile(onnx.GraphProto.FromString(b"".join(rest)), inits)


__all__ = ["OnnxFile", "WireError", "fields", "read_onnx"]
