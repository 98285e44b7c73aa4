import math

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
