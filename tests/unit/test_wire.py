import gc
import json
import math
import struct

import numpy as np
import pytest
import torch

from arctic_rl_core import wire


def test_round_trip_keeps_structure_values_dtypes_and_shapes():
    message = {
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "lp": torch.randn(2, 5, dtype=torch.bfloat16),
        "mask": torch.tensor([[True, False]]),
        "empty": torch.zeros(0, 7),
        "scalar": torch.tensor(3.5),
        "nested": [{"a": 1, "b": None, "c": [1.5, "x", True]}, torch.ones(3, dtype=torch.float16)],
        "array": np.arange(6, dtype=np.int32).reshape(2, 3),
        "nan": math.nan,
    }
    decoded = wire.decode(wire.encode(message))
    assert torch.equal(decoded["ids"], message["ids"])
    assert decoded["lp"].dtype == torch.bfloat16 and torch.equal(decoded["lp"], message["lp"])
    assert torch.equal(decoded["mask"], message["mask"])
    assert decoded["empty"].shape == (0, 7)
    assert decoded["scalar"].shape == () and decoded["scalar"].item() == 3.5
    assert decoded["nested"][0] == {"a": 1, "b": None, "c": [1.5, "x", True]}
    assert torch.equal(decoded["nested"][1], torch.ones(3, dtype=torch.float16))
    assert torch.equal(decoded["array"], torch.arange(6, dtype=torch.int32).reshape(2, 3))
    assert math.isnan(decoded["nan"])


def test_decoded_tensors_are_writable_and_independent_of_the_message():
    data = wire.encode({"t": torch.zeros(4)})
    first = wire.decode(data)["t"]
    first += 1
    assert torch.equal(wire.decode(data)["t"], torch.zeros(4))


def test_non_contiguous_and_sliced_tensors_are_sent_by_value():
    base = torch.arange(20.0).reshape(4, 5)
    decoded = wire.decode(wire.encode({"t": base.t()[1:3]}))["t"]
    assert torch.equal(decoded, base.t()[1:3])


@pytest.mark.parametrize(
    "blob",
    [b"", b"JSON{}", wire.MAGIC + b"\xff" * 8, wire.encode({"t": torch.ones(8)})[:-8]],
    ids=["empty", "bad-magic", "huge-header", "truncated-tensor"],
)
def test_corrupt_messages_raise_wire_error_not_crash(blob):
    with pytest.raises(wire.WireError):
        wire.decode(blob)


def test_unencodable_values_name_their_type():
    with pytest.raises(TypeError, match="set"):
        wire.encode({"s": {1, 2}})


def test_pieces_cut_large_chunks_into_views_that_concatenate_to_the_message():
    chunks = wire.encode_chunks({"t": torch.arange(1000, dtype=torch.int32), "s": "x"})
    pieces = list(wire.pieces(chunks, size=256))
    assert max(memoryview(p).nbytes for p in pieces) <= 256
    assert b"".join(pieces) == wire.encode({"t": torch.arange(1000, dtype=torch.int32), "s": "x"})


def test_pool_reuses_a_buffer_only_once_no_tensor_views_it():
    pool = wire.BufferPool(min_bytes=1024, max_bytes=1 << 20)
    first = pool.take(4096)
    tensor = torch.frombuffer(first, dtype=torch.uint8)
    del first
    second = pool.take(4096)
    second[:] = b"\1" * 4096
    assert torch.equal(tensor, torch.zeros(4096, dtype=torch.uint8)), "a buffer in use was handed out again"
    del tensor, second
    assert len(pool._buffers) == 2
    pool.take(4096)
    assert len(pool._buffers) == 2, "a free buffer was not reused"


def test_received_body_decodes_in_place_and_frees_its_buffer_without_the_garbage_collector():
    message = wire.encode({"t": torch.arange(1 << 20, dtype=torch.float32)})
    pool = wire.BufferPool()
    gc.disable()
    try:
        for _ in range(3):
            body = wire.Body(str(len(message)), pool)
            for start in range(0, len(message), 300_000):
                body.add(message[start : start + 300_000])
            decoded = wire.decode(body.data)["t"]
            assert torch.equal(decoded, torch.arange(1 << 20, dtype=torch.float32))
            del body, decoded
        assert len(pool._buffers) == 1
    finally:
        gc.enable()


@pytest.mark.parametrize("declared", [None, "10", "100000"], ids=["none", "too-small", "too-large"])
def test_body_without_a_true_content_length_still_holds_exactly_what_arrived(declared):
    body = wire.Body(declared)
    for _ in range(5):
        body.add(b"abc" * 100)
    assert bytes(body.data) == b"abc" * 500


def _with_offsets(message: bytes, offsets) -> bytearray:
    """``message`` with its header's offset table replaced."""
    (header_len,) = struct.unpack_from("<Q", message, len(wire.MAGIC))
    header = json.loads(message[len(wire.MAGIC) + 8 : len(wire.MAGIC) + 8 + header_len])
    header["offsets"] = offsets
    raw = json.dumps(header).encode()
    prefix = wire.MAGIC + struct.pack("<Q", len(raw)) + raw
    return bytearray(prefix + b"\0" * (-len(prefix) % 64) + b"\0" * 64)


@pytest.mark.parametrize("offsets", ["abc", [1.5], [None]], ids=["string", "float", "null"])
def test_a_corrupt_offset_table_raises_wire_error(offsets):
    with pytest.raises(wire.WireError, match="offset"):
        wire.decode(_with_offsets(wire.encode({"t": torch.ones(4)}), offsets))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16], ids=str)
def test_a_tensor_of_an_unsupported_dtype_is_refused_when_encoded_naming_the_dtype(dtype):
    with pytest.raises(TypeError, match=str(dtype).removeprefix("torch.") + ".*supported dtypes: float64"):
        wire.encode({"t": torch.zeros(2, dtype=dtype)})
