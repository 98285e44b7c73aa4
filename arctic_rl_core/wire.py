"""Binary codec for nested dicts/lists of tensors, strings and numbers.

Tensors cross HTTP as raw bytes, never as JSON float lists: a 64 MB tensor
costs one copy to encode and none to decode. A message is

    MAGIC | u64 header length | JSON header | padding | tensor bytes ...

The header is the structure itself, with each tensor replaced by
``{"__t": index, "dtype": ..., "shape": [...]}`` and an offset table; tensor
data starts 64-byte aligned so decoding can view it in place.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import torch

CONTENT_TYPE = "application/x-arctic-wire"
MAGIC = b"ARW1"
_ALIGN = 64
_TENSOR_KEY = "__t"

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


class WireError(ValueError):
    """A message that is not valid arctic wire format."""


def encode(obj: Any) -> bytes:
    """Serialize ``obj``: dicts with str keys, lists/tuples, str/int/float/bool/None, tensors, numpy arrays."""
    return b"".join(encode_chunks(obj))


def encode_chunks(obj: Any) -> list[bytes | memoryview]:
    """``encode`` as a list of chunks whose concatenation is the message; tensor bytes are views, not copies.

    Transports write the chunks to the socket one after another, so a large
    tensor is never copied on the sending side.
    """
    buffers: list[memoryview] = []
    offsets: list[int] = []
    position = 0

    def visit(value: Any) -> Any:
        nonlocal position
        if isinstance(value, np.ndarray):
            value = torch.from_numpy(np.ascontiguousarray(value))
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
            position = -(-position // _ALIGN) * _ALIGN
            offsets.append(position)
            buffers.append(raw)
            position += raw.nbytes
            dtype = str(tensor.dtype).removeprefix("torch.")
            return {_TENSOR_KEY: len(offsets) - 1, "dtype": dtype, "shape": list(tensor.shape)}
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise TypeError(f"wire dict keys must be str, got {type(key).__name__} {key!r}")
                out[key] = visit(item)
            return out
        if isinstance(value, (list, tuple)):
            return [visit(item) for item in value]
        if value is None or isinstance(value, (str, bool, int, float)):
            return value
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return value.item()
        raise TypeError(f"cannot encode {type(value).__name__} on the wire")

    structure = visit(obj)
    header = json.dumps({"body": structure, "offsets": offsets}, separators=(",", ":")).encode()
    prefix_len = len(MAGIC) + 8 + len(header)
    data_start = -(-prefix_len // _ALIGN) * _ALIGN
    parts: list[bytes | memoryview] = [MAGIC, struct.pack("<Q", len(header)), header, b"\0" * (data_start - prefix_len)]
    cursor = 0
    for offset, raw in zip(offsets, buffers):
        if offset > cursor:
            parts.append(b"\0" * (offset - cursor))
        parts.append(raw)
        cursor = offset + raw.nbytes
    return parts


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of ``encode``.

    A ``bytearray`` is decoded in place: tensors are views into it, and the
    caller hands it over (transports receive into one, so the payload is
    copied once, from the socket). Immutable input is copied first.
    """
    view = memoryview(data)
    if view.nbytes < len(MAGIC) + 8 or bytes(view[: len(MAGIC)]) != MAGIC:
        raise WireError("not an arctic wire message (bad magic)")
    (header_len,) = struct.unpack_from("<Q", view, len(MAGIC))
    header_end = len(MAGIC) + 8 + header_len
    if header_end > view.nbytes:
        raise WireError(f"truncated wire header: needs {header_end} bytes, got {view.nbytes}")
    try:
        header = json.loads(bytes(view[len(MAGIC) + 8 : header_end]))
        structure, offsets = header["body"], header["offsets"]
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"corrupt wire header: {exc}") from None
    data_start = -(-header_end // _ALIGN) * _ALIGN
    if isinstance(data, bytearray):
        payload, base = data, data_start
    else:
        # torch.frombuffer needs a writable buffer: tensors must be safe to modify.
        payload, base = (bytearray(view[data_start:]) if offsets else bytearray()), 0

    def tensor(spec: dict) -> torch.Tensor:
        try:
            index, dtype, shape = spec[_TENSOR_KEY], _DTYPES[spec["dtype"]], [int(s) for s in spec["shape"]]
            offset = offsets[index]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise WireError(f"corrupt tensor entry {spec!r}: {exc}") from None
        numel = 1
        for size in shape:
            if size < 0:
                raise WireError(f"negative dimension in tensor shape {shape}")
            numel *= size
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if offset < 0 or base + offset + nbytes > len(payload):
            raise WireError(f"tensor {index} ({dtype}, {shape}) runs past the end of the message")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=base + offset)
        return flat.view(dtype).view(shape)

    def visit(value: Any) -> Any:
        if isinstance(value, dict):
            if _TENSOR_KEY in value:
                return tensor(value)
            return {key: visit(item) for key, item in value.items()}
        if isinstance(value, list):
            return [visit(item) for item in value]
        return value

    return visit(structure)


def to_jsonable(obj: Any) -> Any:
    """Tensors as nested lists, for JSON responses to clients that did not ask for the wire format."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {key: to_jsonable(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(value) for value in obj]
    return obj
