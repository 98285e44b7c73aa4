"""The loss mask: which shifted positions contribute, so padding and prompt tokens never do.

Convention. Position t of every shifted tensor holds the prediction of token
t + 1 (``torch.roll(input_ids, -1)``). The client gives exactly one of

- ``response_mask`` [B, T], *unshifted*: 1 on the response tokens themselves.
  Token t + 1 is trained on at position t, so ``mask[:, t] = response_mask[:, t + 1]``
  and the last column is 0 (it would predict past the end of the row).
- ``loss_mask_shifted`` [B, T], already in the shifted layout, used as given.

Either way the result is ANDed with the shifted attention mask, which is 1 at
t only when tokens t and t + 1 are both real: a position that predicts a pad,
or a pad position that predicts the first real token of a left-padded row,
never counts. Masks must hold only 0 and 1 (bool, integer or float).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from arctic_rl_core.processors.base import BatchValidationError
from arctic_rl_core.processors.context import check_context_tensor

MASK_KEYS = ("response_mask", "loss_mask_shifted")


def _binary(name: str, mask: Tensor) -> Tensor:
    if mask.dtype.is_complex:
        raise BatchValidationError(f"{name} must be bool, integer or float, got dtype {mask.dtype}")
    values = mask.float()
    if not bool(((values == 0) | (values == 1)).all()):
        bad = values[(values != 0) & (values != 1)].unique()[:5].tolist()
        raise BatchValidationError(f"{name} must hold only 0 and 1, found {bad}")
    return values


def shift_left(mask: Tensor) -> Tensor:
    """``out[:, t] = mask[:, t + 1]``, last column 0: an unshifted per-token mask in the shifted layout."""
    out = torch.zeros_like(mask)
    out[:, :-1] = mask[:, 1:]
    return out


def shifted_attention_mask(attention_mask: Tensor) -> Tensor:
    """1 at t when tokens t and t + 1 are both real, as float32 [B, T]."""
    attention = _binary("attention_mask", attention_mask)
    return attention * shift_left(attention)


def loss_mask_from_context(context: Mapping[str, object], attention_mask: Tensor) -> Tensor:
    """The shifted float32 loss mask [B, T] from ``response_mask`` or ``loss_mask_shifted`` (exactly one)."""
    if attention_mask.dim() != 2:
        raise BatchValidationError(f"attention_mask must have shape [B, T], got {list(attention_mask.shape)}")
    given = [key for key in MASK_KEYS if key in context]
    if len(given) != 1:
        raise BatchValidationError(
            "batch context must carry exactly one loss mask: 'response_mask' ([B, T], unshifted, 1 on response "
            f"tokens) or 'loss_mask_shifted' ([B, T], already shifted); got {given or 'neither'}"
        )
    key = given[0]
    batch_shape = tuple(attention_mask.shape)
    check_context_tensor(key, context[key], batch_shape, floating=False)
    mask = _binary(key, context[key]).to(attention_mask.device)
    if key == "response_mask":
        mask = shift_left(mask)
    return mask * shifted_attention_mask(attention_mask)
