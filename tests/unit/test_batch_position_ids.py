"""The fwd_bwd batch accepts position_ids only when they are the positions the engines use."""

import pytest
import torch
from pydantic import ValidationError

from arctic_rl_core.ops import Batch

IDS = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def test_position_ids_that_match_the_attention_mask_are_accepted():
    positions = (MASK.cumsum(-1) - 1).clamp_min(0)
    batch = Batch(args=[IDS], kwargs={"attention_mask": MASK, "position_ids": positions})
    assert torch.equal(batch.attention_mask, MASK)


def test_position_ids_the_engines_would_ignore_are_refused_naming_the_field():
    packed = torch.tensor([[0, 0, 0, 1, 0], [0, 1, 2, 0, 1]])  # two packed sequences per row
    with pytest.raises(ValidationError, match=r"batch\.kwargs\.position_ids: .*row 0"):
        Batch(args=[IDS], kwargs={"attention_mask": MASK, "position_ids": packed})
