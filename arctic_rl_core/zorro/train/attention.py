"""Attention over a packed prefix forest, plugged into any HF decoder through its attention interface.

HF decoders look their attention function up by name (``config._attn_implementation``)
at every call and pass it the keyword arguments their ``forward`` received. We
register one dispatching function per base implementation (``zorro_sdpa`` for
``sdpa``): a call that carries a ``ForestAttention`` under ``FOREST_ATTENTION_KWARG``
attends over the forest; every other call goes to the base implementation
unchanged. The switch is made once and stays, because gradient checkpointing
re-runs the layers during backward, after the packed forward has returned.

Two kernels compute the same pattern (``q`` sees ``k`` iff ``k <= q < subtree_end[k]``,
within the layer's sliding window if it has one):
- ``flex``: FlexAttention with a block mask built from the forest's block structure,
  so key blocks no query of a block can see (another sample's response) are
  skipped and fully visible blocks (a shared prompt) run without a mask.
  Compiled on CUDA; elsewhere torch runs its exact, unfused reference.
- ``dense``: SDPA with the [L, L] boolean mask; the CPU path.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from arctic_rl_core.models.forward import decoder_body

Kernel = Literal["flex", "dense"]
KERNELS = ("flex", "dense")

# The keyword under which the packed forward hands its ForestAttention to every attention layer.
FOREST_ATTENTION_KWARG = "zorro_forest_attention"
IMPLEMENTATION_PREFIX = "zorro_"
# Base implementations the dispatcher can stand in front of (HF checks "flash" names specially).
BASE_IMPLEMENTATIONS = ("sdpa", "flex_attention")
# FlexAttention's sparse block: packed sequences are padded to a multiple of it.
FLEX_BLOCK = 128


class ForestAttention:
    """The attention pattern of one packed forest, as the masks each kernel needs (built once per window)."""

    def __init__(self, positions: torch.Tensor, subtree_end: torch.Tensor, kernel: Kernel, max_position: int):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel == "flex" and len(positions) % FLEX_BLOCK:
            raise ValueError(f"the flex kernel needs a length that is a multiple of {FLEX_BLOCK}, got {len(positions)}")
        self.positions = positions
        self.subtree_end = subtree_end
        self.kernel = kernel
        self.max_position = max_position
        self._masks: dict[int | None, torch.Tensor | BlockMask] = {}

    @property
    def mask(self) -> torch.Tensor | BlockMask:
        """The full-attention mask; HF passes a 4D mask or BlockMask through to the layers as is."""
        return self.mask_for(None)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor | BlockMask:
        # A window no wider than the longest row never cuts anything off.
        window = sliding_window if sliding_window is not None and self.max_position >= sliding_window else None
        if window not in self._masks:
            build = _forest_block_mask if self.kernel == "flex" else _forest_dense_mask
            self._masks[window] = build(self.positions, self.subtree_end, window)
        return self._masks[window]

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scaling: float | None = None,
        dropout: float = 0.0,
        sliding_window: int | None = None,
        softcap: float | None = None,
        s_aux: torch.Tensor | None = None,
        **_layer_kwargs,
    ) -> torch.Tensor:
        """[1, heads, L, D] query (key/value may have fewer heads) -> [1, L, heads, D], as HF attention returns it."""
        if dropout:
            raise ValueError(f"ZoRRo Train needs attention dropout 0 (exact prefix sharing), got {dropout}")
        if softcap is not None or s_aux is not None:
            raise ValueError("ZoRRo Train supports neither attention logit soft-capping nor attention sinks")
        mask = self.mask_for(sliding_window)
        gqa = query.shape[1] != key.shape[1]
        if self.kernel == "flex":
            flex = _compiled_flex_attention() if query.is_cuda else flex_attention
            out = flex(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()


def pad_for_kernel(
    token_ids: torch.Tensor, positions: torch.Tensor, subtree_end: torch.Tensor, kernel: Kernel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad the packed sequence to the kernel's block; each pad token attends only to itself."""
    length = len(token_ids)
    pad = (-length) % FLEX_BLOCK if kernel == "flex" else 0
    if not pad:
        return token_ids, positions, subtree_end
    return (
        F.pad(token_ids, (0, pad)),
        F.pad(positions, (0, pad)),
        torch.cat([subtree_end, torch.arange(length + 1, length + pad + 1, dtype=subtree_end.dtype)]),
    )


def _forest_dense_mask(positions: torch.Tensor, subtree_end: torch.Tensor, window: int | None) -> torch.Tensor:
    q = torch.arange(len(positions), device=positions.device)[:, None]
    k = q.view(1, -1)
    visible = (k <= q) & (q < subtree_end[None, :])
    if window is not None:
        visible &= positions[:, None] - positions[None, :] < window
    return visible[None, None]


def _forest_block_mask(positions: torch.Tensor, subtree_end: torch.Tensor, window: int | None) -> BlockMask:
    length = len(positions)
    blocks = length // FLEX_BLOCK
    device = positions.device
    index = torch.arange(length, device=device)
    first = torch.arange(blocks, device=device) * FLEX_BLOCK
    end = first + FLEX_BLOCK
    # A query block sees key k when [k, subtree_end[k]) meets the block's [first, end).
    meets = torch.maximum(index, first[:, None]) < torch.minimum(subtree_end, end[:, None])
    some = meets.view(blocks, blocks, FLEX_BLOCK).any(-1)
    # Every query of the block sees every key of the key block: keys all precede it, and all reach past it.
    every = (end[None, :] - 1 <= first[:, None]) & (subtree_end.view(blocks, FLEX_BLOCK).amin(-1)[None, :] >= end[:, None])

    if window is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    else:
        block_positions = positions.view(blocks, FLEX_BLOCK)
        lowest, highest = block_positions.amin(-1), block_positions.amax(-1)
        some &= lowest[:, None] - highest[None, :] < window
        every &= highest[:, None] - lowest[None, :] < window

        def mask_mod(b, h, q_idx, kv_idx):
            return (
                (kv_idx <= q_idx)
                & (q_idx < subtree_end[kv_idx])
                & (positions[q_idx] - positions[kv_idx] < window)
            )

    partial = some & ~every
    return BlockMask.from_kv_blocks(
        kv_num_blocks=_count(partial),
        kv_indices=_indices(partial),
        full_kv_num_blocks=_count(every),
        full_kv_indices=_indices(every),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(length, length),
    )


def _count(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.sum(-1, dtype=torch.int32)[None, None]


def _indices(blocks: torch.Tensor) -> torch.Tensor:
    """Per query block, the key blocks marked True first (in order); the rest are never read."""
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return order.to(torch.int32)[None, None]


@functools.cache
def _compiled_flex_attention() -> Callable:
    return torch.compile(flex_attention)


def _dispatching_to(base: Callable) -> Callable:
    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
        forest = kwargs.pop(FOREST_ATTENTION_KWARG, None)
        if forest is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        return forest(query, key, value, **kwargs), None

    return attention


def enable_forest_attention(model: nn.Module) -> str:
    """Put ZoRRo's dispatcher in front of the model's attention implementation; idempotent.

    Calls without a forest behave exactly as before. Returns the new
    implementation name (``zorro_sdpa`` for an ``sdpa`` model).
    """
    body = decoder_body(model)
    current = body.config._attn_implementation
    if current.startswith(IMPLEMENTATION_PREFIX):
        return current
    if current not in BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"ZoRRo Train needs the model's attn_implementation to be one of {BASE_IMPLEMENTATIONS}, "
            f"got {current!r}; load the model with attn_implementation='sdpa'"
        )
    name = IMPLEMENTATION_PREFIX + current
    if name not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(name, _dispatching_to(ALL_ATTENTION_FUNCTIONS[current]))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    body.set_attn_implementation(name)
    return name
