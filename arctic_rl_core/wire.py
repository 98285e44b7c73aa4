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
import threading
from collections.abc import Callable, Iterable, Iterator
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
    tensors: list[torch.Tensor] = []
    structure = _take_tensors(obj, tensors)
    buffers = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"") for t in tensors]
    offsets: list[int] = []
    position = 0
    for raw in buffers:
        position = -(-position // _ALIGN) * _ALIGN
        offsets.append(position)
        position += raw.nbytes
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


# The walks below are module functions, not closures: a recursive closure is a reference cycle, and the cycle
# would keep every tensor and receive buffer it saw alive until the garbage collector happens to run.
def _take_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its header entry; the tensors (contiguous, on CPU) go to ``tensors``."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            # Refused here, by name: the receiver could only call the message corrupt.
            raise TypeError(f"cannot send a {dtype} tensor on the wire; supported dtypes: {', '.join(_DTYPES)}")
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        tensors.append(tensor.contiguous())
        return {_TENSOR_KEY: len(tensors) - 1, "dtype": dtype, "shape": list(tensor.shape)}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"wire dict keys must be str, got {type(key).__name__} {key!r}")
            out[key] = _take_tensors(item, tensors)
        return out
    if isinstance(value, (list, tuple)):
        return [_take_tensors(item, tensors) for item in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    raise TypeError(f"cannot encode {type(value).__name__} on the wire")


def _put_tensors(value: Any, tensor: Callable[[dict], torch.Tensor]) -> Any:
    """Inverse of ``_take_tensors``: each header entry becomes ``tensor(entry)``."""
    if isinstance(value, dict):
        if _TENSOR_KEY in value:
            return tensor(value)
        return {key: _put_tensors(item, tensor) for key, item in value.items()}
    if isinstance(value, list):
        return [_put_tensors(item, tensor) for item in value]
    return value


def pieces(chunks: Iterable[bytes | memoryview], size: int = 1 << 20) -> Iterator[bytes | memoryview]:
    """The chunks, with large ones cut into ``size``-byte views.

    A socket takes a few hundred KB per send; asyncio copies whatever it did
    not take, and h11 copies each chunk it frames. Cut small, those copies
    stay small and land in warm memory instead of a fresh 64 MB block.
    """
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        if view.nbytes <= size:
            yield chunk
        else:
            for start in range(0, view.nbytes, size):
                yield view[start : start + size]


class BufferPool:
    """Receive buffers, handed out again once no view of them is alive.

    First touch of fresh memory page-faults: a new 64 MB buffer costs several
    times a copy into a warm one. A buffer goes out only as a memoryview, and
    decoded tensors are views of that, so while any of them lives the buffer
    is in use and is not handed out again.
    """

    def __init__(self, min_bytes: int = 1 << 20, max_bytes: int = 256 << 20, max_buffers: int = 4):
        self.min_bytes, self.max_bytes, self.max_buffers = min_bytes, max_bytes, max_buffers
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray | memoryview:
        """A writable buffer of exactly ``nbytes``: a view of a pooled bytearray, or a fresh one outside the bounds."""
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return bytearray(nbytes)
        with self._lock:
            for buffer in self._buffers:
                if nbytes <= len(buffer) <= 2 * nbytes and _unviewed(buffer):
                    return memoryview(buffer)[:nbytes]
            # Rounded up to 1 MB, so a slightly larger next message still fits.
            buffer = bytearray(-(-nbytes // self.min_bytes) * self.min_bytes)
            self._buffers.append(buffer)
            while len(self._buffers) > self.max_buffers or sum(map(len, self._buffers)) > self.max_bytes:
                self._buffers.pop(0)  # forgotten, not freed: a buffer in use lives on with its views
            return memoryview(buffer)[:nbytes]


def _unviewed(buffer: bytearray) -> bool:
    """Whether no memoryview or tensor views ``buffer``: only then may a bytearray change size."""
    try:
        last = buffer.pop()
    except BufferError:
        return False
    buffer.append(last)
    return True


receive_buffers = BufferPool()


class Body:
    """A message body received chunk by chunk into one buffer, which ``decode`` then uses in place."""

    def __init__(self, content_length: str | None, pool: BufferPool = receive_buffers):
        declared = content_length is not None and content_length.isdigit()
        self._data = pool.take(int(content_length)) if declared else bytearray()
        self.size = 0

    def add(self, chunk: bytes) -> None:
        end = self.size + len(chunk)
        if end <= len(self._data):
            self._data[self.size : end] = chunk
        else:  # no Content-Length, or a wrong one: grow
            if not isinstance(self._data, bytearray):
                self._data = bytearray(self._data[: self.size])
            del self._data[self.size :]
            self._data += chunk
        self.size = end

    @property
    def data(self) -> bytearray | memoryview:
        return self._data if self.size == len(self._data) else memoryview(self._data)[: self.size]


def decode(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of ``encode``.

    A writable buffer (a ``bytearray`` or a view of one) is decoded in place:
    tensors are views into it, and the caller hands it over (transports
    receive into one, so the payload is copied once, from the socket).
    Immutable input is copied first.
    """
    view = memoryview(data).cast("B")
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
    if not view.readonly:
        payload, base = view, data_start
    else:
        # torch.frombuffer needs a writable buffer: tensors must be safe to modify.
        payload, base = (memoryview(bytearray(view[data_start:])) if offsets else memoryview(b"")), 0

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
        if type(offset) is not int:
            raise WireError(f"corrupt offset {offset!r} of tensor {index}: expected an integer")
        if offset < 0 or base + offset + nbytes > payload.nbytes:
            raise WireError(f"tensor {index} ({dtype}, {shape}) runs past the end of the message")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=base + offset)
        return flat.view(dtype).view(shape)

    return _put_tensors(structure, tensor)


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
