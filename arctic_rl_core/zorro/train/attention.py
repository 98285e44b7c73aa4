"""Attention over a packed prefix forest, plugged into any HF decoder through its attention interface.

HF decoders look their attention function up by name (``config._attn_implementation``)
at every call and pass it the keyword arguments their ``forward`` received. We
register one dispatching function per base implementation (``zorro_sdpa`` for
``sdpa``): a call that carries a ``ForestAttention`` under ``FOREST_ATTENTION_KWARG``
attends over the forest; every other call goes to the base implementation
unchanged. The switch is made once and stays, because gradient checkpointing
re-runs the layers during backward, after the packed forward has returned.

Three kernels compute the same pattern (``q`` sees ``k`` iff ``k <= q < subtree_end[k]``,
within the layer's sliding window if it has one):
- ``varlen``: FlashAttention-2 varlen (CUDA, fp16/bf16). Each forest node is one
  sequence whose queries are its own tokens and whose keys are its ancestors'
  tokens followed by its own, gathered per layer (``VarlenLayout``; K/V are small
  under GQA); causal attention aligned to the bottom right is then exactly the
  forest's pattern. When the ancestor attention is large (GRPO groups with long
  prompts) and cuDNN's fused attention is there, the forest is split instead
  (``split_attention``): each node's own tokens causally with FlashAttention, and
  all descendants of a node over its tokens at once with cuDNN (1.5-1.8x FA2 on
  such shapes), merged by log-sum-exp. The split costs about 2 ms of host time
  per layer, which only pays where the GPU work hides it. On CPU the split runs
  in plain torch (exact and slow: for tests).
- ``flex``: FlexAttention with a block mask built from the forest's block structure,
  so key blocks no query of a block can see (another sample's response) are
  skipped and fully visible blocks (a shared prompt) run without a mask.
  Compiled on CUDA (any dtype); elsewhere torch runs its exact, unfused reference.
- ``dense``: SDPA with the [L, L] boolean mask; the CPU path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from arctic_rl_core.models.forward import decoder_body
from arctic_rl_core.zorro.train.forest import PrefixForest, to_device
from arctic_rl_core.zorro.train.split_attention import (
    CudnnOps,
    FlashVarlenOps,
    ReferenceOps,
    SplitLayout,
    split_forest_attention,
)

Kernel = Literal["varlen", "flex", "dense"]
KERNELS = ("varlen", "flex", "dense")

# The keyword under which the packed forward hands its ForestAttention to every attention layer.
FOREST_ATTENTION_KWARG = "zorro_forest_attention"
IMPLEMENTATION_PREFIX = "zorro_"
# Base implementations the dispatcher can stand in front of (HF checks "flash" names specially).
BASE_IMPLEMENTATIONS = ("sdpa", "flex_attention")
# Query-key pairs of the largest ancestor span from which the cuDNN split beats gathered FlashAttention:
# eager, where the split's per-span host work counts; and with the layers replayed as CUDA graphs,
# where it does not (H200, G=8 P=2K R=512, an 8M-pair span: 77.8 ms a step split, 81.0 gathered).
SPLIT_MIN_PAIRS = 32 << 20
SPLIT_MIN_PAIRS_GRAPHED = 4 << 20
# FlexAttention's sparse block: packed sequences are padded to a multiple of it.
FLEX_BLOCK = 128


def default_kernel(device: torch.device, dtype: torch.dtype) -> Kernel:
    """FlashAttention varlen where it runs (CUDA, half precision), FlexAttention on other CUDA dtypes, else SDPA."""
    if device.type != "cuda":
        return "dense"
    return "varlen" if dtype in (torch.float16, torch.bfloat16) else "flex"


@dataclass(frozen=True)
class VarlenLayout:
    """Each forest node as one varlen sequence: its tokens as queries; its ancestors' tokens, then its own, as keys."""

    key_index: torch.Tensor  # packed index of every key, node after node
    cu_seq_q: torch.Tensor  # int32 [nodes + 1]
    cu_seq_k: torch.Tensor  # int32 [nodes + 1]
    max_q: int
    max_k: int

    @classmethod
    def of(cls, forest: PrefixForest) -> VarlenLayout:
        chains: list[np.ndarray] = []
        for node in forest.nodes:  # in packed order, so every parent's chain is already there
            own = np.arange(node.offset, node.offset + node.length)
            chains.append(own if node.parent < 0 else np.concatenate([chains[node.parent], own]))
        q_lengths = np.array([node.length for node in forest.nodes])
        k_lengths = np.array([len(chain) for chain in chains])
        return cls(
            key_index=torch.from_numpy(np.concatenate(chains)),
            cu_seq_q=torch.from_numpy(np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)),
            cu_seq_k=torch.from_numpy(np.concatenate([[0], np.cumsum(k_lengths)]).astype(np.int32)),
            max_q=int(q_lengths.max()),
            max_k=int(k_lengths.max()),
        )

    def to(self, device: torch.device) -> VarlenLayout:
        return VarlenLayout(*to_device(device, self.key_index, self.cu_seq_q, self.cu_seq_k), self.max_q, self.max_k)


class ForestAttention:
    """One packed forest, ready for the decoder: its tokens, positions, and attention under the chosen kernel."""

    def __init__(self, forest: PrefixForest, kernel: Kernel, device: torch.device):
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        token_ids, positions, subtree_end = _pad_for_kernel(forest, kernel)
        self.kernel = kernel
        self.token_ids, self.positions, self.subtree_end, self.select_index = to_device(
            device, token_ids, positions, subtree_end, forest.select_index
        )
        self.max_position = int(forest.positions.max())
        self._forest = forest
        # Both varlen layouts are built on first use: a forward takes one of them, not both.
        self._varlen: VarlenLayout | None = None
        self._split_host: SplitLayout | None = None  # decides; its bounds live on the host
        self._split: SplitLayout | None = None  # on the device, once a call takes the split
        self._split_ops = FlashVarlenOps() if device.type == "cuda" else ReferenceOps()
        self._takes_split: dict[tuple, bool] = {}  # per (device, dtype, head dim): every layer asks
        self._graphed = False  # whether the layers run as CUDA graphs: the split then costs no host time
        self._masks: dict[int | None, torch.Tensor | BlockMask] = {}

    @property
    def mask(self) -> torch.Tensor | BlockMask:
        """What the decoder gets as ``attention_mask``: HF passes any 4D mask or BlockMask to the layers as is."""
        if self.kernel == "varlen":
            return self.token_ids.new_zeros((1, 1, 0, 0), dtype=torch.bool)  # the layout, not a mask, decides
        return self.mask_for(None)

    def mask_for(self, sliding_window: int | None) -> torch.Tensor | BlockMask:
        window = self._binding(sliding_window)
        if window not in self._masks:
            build = _forest_block_mask if self.kernel == "flex" else _forest_dense_mask
            self._masks[window] = build(self.positions, self.subtree_end, window)
        return self._masks[window]

    def _binding(self, sliding_window: int | None) -> int | None:
        # A window no wider than the longest row never cuts anything off.
        return sliding_window if sliding_window is not None and self.max_position >= sliding_window else None

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
        if self.kernel == "varlen":
            window = self._binding(sliding_window)
            if window is None and self._split_taken(query):
                q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
                ancestors = CudnnOps() if query.is_cuda else self._split_ops
                return split_forest_attention(q, k, v, self._split, scaling, self._split_ops, ancestors)[None]
            return self._varlen_attention(query, key, value, scaling, window)
        mask = self.mask_for(sliding_window)
        gqa = query.shape[1] != key.shape[1]
        if self.kernel == "flex":
            flex = _compiled_flex_attention() if query.is_cuda else flex_attention
            out = flex(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous()

    def _split_taken(self, query: torch.Tensor) -> bool:
        return self.takes_split(query.device, query.dtype, query.shape[-1])

    def takes_split(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether the varlen kernel splits (always on CPU); moves the split's layout to the device when it does."""
        key = (device, dtype, head_dim)
        if key not in self._takes_split:
            if self._split_host is None:
                self._split_host = SplitLayout.of(self._forest)
            min_pairs = SPLIT_MIN_PAIRS_GRAPHED if self._graphed else SPLIT_MIN_PAIRS
            taken = device.type != "cuda" or _split_pays(self._split_host.ancestors, device, dtype, head_dim, min_pairs)
            if taken and self._split is None:
                self._split = self._split_host.to(device)
            self._takes_split[key] = taken
        return self._takes_split[key]

    def graph_inputs(self, dtype: torch.dtype, head_dim: int) -> tuple[tuple, tuple[torch.Tensor, ...]] | None:
        """What CUDA graphs of the layers need (``LayerGraphs.run``'s key and tensors), or None if they cannot run.

        The key holds every host-side value the kernels are launched with: lengths, maxima,
        and the cuDNN split's per-sequence bounds; the tensors are the layout's indices.
        """
        device = self.token_ids.device
        if self.kernel != "varlen" or device.type != "cuda":
            return None
        if self._takes_split:
            raise RuntimeError("graph_inputs must come before the forward: it decides the layout")
        self._graphed = True
        if self.takes_split(device, dtype, head_dim):
            own = self._split.own
            # The spans' bounds are the slices cuDNN is called on.
            key = ("split", len(self.token_ids), len(own.cu_q), own.max_q, own.max_k, self._split.ancestors)
            return key, (own.cu_q, own.cu_k)
        layout = self.varlen_layout()
        key = ("varlen", len(self.token_ids), len(layout.key_index), len(layout.cu_seq_q), layout.max_q, layout.max_k)
        return key, (layout.key_index, layout.cu_seq_q, layout.cu_seq_k)

    def varlen_layout(self) -> VarlenLayout:
        if self._varlen is None:
            self._varlen = VarlenLayout.of(self._forest).to(self.token_ids.device)
        return self._varlen

    def _varlen_attention(self, query, key, value, scaling, window):
        if not query.is_cuda:
            raise ValueError("the varlen kernel with a binding sliding window needs CUDA (FlashAttention)")
        layout = self.varlen_layout()
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).index_select(0, layout.key_index)
        v = value[0].transpose(0, 1).index_select(0, layout.key_index)
        # FlashAttention counts the window's keys besides the query's own.
        window_args = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
        out, *_ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            layout.cu_seq_q,
            layout.cu_seq_k,
            layout.max_q,
            layout.max_k,
            0.0,  # dropout
            True,  # causal, aligned to the bottom right: a node's queries follow its ancestors' keys
            False,  # no debug mask
            scale=scaling,
            **window_args,
        )
        return out[None]


def _split_pays(ancestors, device: torch.device, dtype: torch.dtype, head_dim: int, min_pairs: int) -> bool:
    """Split onto cuDNN when its ancestor passes are few and large (H200: G=16, P=8K, R=1K gains 8%).

    Eager, small ones (G=8, P=2K) lose: the split's host time then exceeds the GPU time it
    saves. Replayed as CUDA graphs there is no host time, and they win (``min_pairs``).
    """
    if not ancestors or any(len(spans) > CudnnOps.MAX_SEQUENCES for spans in ancestors):
        return False
    largest = max((q1 - q0) * (k1 - k0) for spans in ancestors for q0, q1, k0, k1 in spans)
    return largest >= min_pairs and CudnnOps.available(device, dtype, head_dim)


def _pad_for_kernel(forest: PrefixForest, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad the packed sequence to FlexAttention's block; each pad token attends only to itself."""
    length = len(forest.token_ids)
    pad = (-length) % FLEX_BLOCK if kernel == "flex" else 0
    if not pad:
        return forest.token_ids, forest.positions, forest.subtree_end
    return (
        F.pad(forest.token_ids, (0, pad)),
        F.pad(forest.positions, (0, pad)),
        torch.cat([forest.subtree_end, torch.arange(length + 1, length + pad + 1)]),
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
    reach = subtree_end.view(blocks, FLEX_BLOCK).amin(-1)
    every = (end[None, :] - 1 <= first[:, None]) & (reach[None, :] >= end[:, None])

    if window is None:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    else:
        block_positions = positions.view(blocks, FLEX_BLOCK)
        lowest, highest = block_positions.amin(-1), block_positions.amax(-1)
        some &= lowest[:, None] - highest[None, :] < window
        every &= highest[:, None] - lowest[None, :] < window

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx]) & (positions[q_idx] - positions[kv_idx] < window)

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
        return _forest_attention(forest, query, key, value, **kwargs), None

    return attention


@torch.compiler.disable
def _forest_attention(forest: ForestAttention, query, key, value, **kwargs) -> torch.Tensor:
    """Never traced: a compiled decoder layer breaks its graph here, since the forest changes every batch."""
    return forest(query, key, value, **kwargs)


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
