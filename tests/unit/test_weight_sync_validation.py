import pytest
import torch

from arctic_rl_core.weight_sync import WeightMismatchError, check_shapes, module_shapes
from arctic_rl_core.weight_sync.validation import mismatch_report


def test_identical_names_and_shapes_pass():
    shapes = {"a": (2, 3), "b": (4,)}
    check_shapes(shapes, {"a": torch.Size([2, 3]), "b": [4]})
    assert mismatch_report(shapes, shapes) is None


def test_mismatch_names_missing_unexpected_and_misshapen_parameters():
    expected = {"a": (2, 3), "b": (4,), "c": (1,)}
    incoming = {"a": (3, 2), "b": (4,), "z": (9,)}
    with pytest.raises(WeightMismatchError) as info:
        check_shapes(incoming, expected)
    message = str(info.value)
    assert info.value.step == "validate"
    assert "missing c" in message and "unexpected z" in message and "wrong shape a [3, 2] (expected [2, 3])" in message


def test_a_whole_wrong_model_is_summarised_with_a_count():
    report = mismatch_report({f"x{i}": (1,) for i in range(20)}, {})
    assert report.startswith("unexpected x0, x1") and "(20 in all)" in report


def test_module_shapes_is_the_receivers_expected_set():
    layer = torch.nn.Linear(3, 2)
    assert module_shapes(layer.named_parameters()) == {"weight": (2, 3), "bias": (2,)}
