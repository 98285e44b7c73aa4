"""ZoRRo Train's forward: the selected hidden states of a batch, each shared prefix computed once.

A drop-in for ``arctic_rl_core.models.forward.selected_hidden_states``: the same
rows, in the same order, with the same gradients. The batch's prefix forest is
packed into one sequence and run through the model's own decoder body (its
normal ``forward``, so DeepSpeed ZeRO-3 gathering and gradient checkpointing
work as usual) with positions equal to the unpacked ones and attention
restricted to each token's own ancestors.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Literal

import torch
from torch import nn
from torch.profiler import record_function

from arctic_rl_core.models.forward import decoder_body, head_dim
from arctic_rl_core.models.forward import selected_hidden_states as plain_selected_hidden_states
from arctic_rl_core.models.layer_graphs import layer_graphs
from arctic_rl_core.zorro.train.attention import (
    FOREST_ATTENTION_KWARG,
    ForestAttention,
    Kernel,
    default_kernel,
    enable_forest_attention,
)
from arctic_rl_core.zorro.train.forest import PrefixForest, build_prefix_forest

logger = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "varlen", "flex", "dense")


def selected_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: torch.Tensor,
    *,
    min_shared_tokens: int = 16,
    forest: PrefixForest | None = None,
    kernel: Literal["auto", "varlen", "flex", "dense"] = "auto",
    cuda_graphs: bool = False,
) -> torch.Tensor:
    """Final hidden states at ``select`` (a [B, T] bool mask), as [N, H] rows in row-major order.

    Batches that share fewer than ``min_shared_tokens`` tokens run the plain
    padded forward. Pass ``forest`` (from ``build_prefix_forest`` on the same
    tensors) to reuse one built for metrics. ``kernel="auto"`` uses FlashAttention
    varlen on CUDA in fp16/bf16, FlexAttention on CUDA in fp32, masked SDPA elsewhere.
    ``cuda_graphs`` replays the decoder layers as CUDA graphs when the packed layout's
    shape repeats (``arctic_rl_core.models.layer_graphs``), where they can run.
    """
    if min_shared_tokens < 0:
        raise ValueError(f"min_shared_tokens must be >= 0, got {min_shared_tokens}")
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"kernel must be one of {KERNEL_CHOICES}, got {kernel!r}")
    if forest is None:
        with record_function("zorro.build_prefix_forest"):
            forest = build_prefix_forest(input_ids, attention_mask, select)
    stats = forest.stats
    if stats.selected == 0 or stats.shared_tokens < min_shared_tokens:
        logger.info(
            "ZoRRo Train: %d of %d needed tokens are shared (min_shared_tokens=%d); running the plain forward",
            stats.shared_tokens,
            stats.tokens_needed,
            min_shared_tokens,
        )
        return plain_selected_hidden_states(model, input_ids, attention_mask, select, cuda_graphs=cuda_graphs)
    device = input_ids.device
    if kernel == "auto":
        kernel = default_kernel(device, decoder_body(model).dtype)
    return packed_selected_hidden_states(model, forest, device, kernel, cuda_graphs=cuda_graphs)


def packed_selected_hidden_states(
    model: nn.Module, forest: PrefixForest, device: torch.device, kernel: Kernel, *, cuda_graphs: bool = False
) -> torch.Tensor:
    """Run the packed forest through the decoder body and return its selected rows."""
    enable_forest_attention(model)
    body = decoder_body(model)
    with record_function("zorro.forest_attention"):
        attention = ForestAttention(forest, kernel, device)
        graphed = _graphed_layers(body, attention) if cuda_graphs and torch.is_grad_enabled() else None
    with graphed or contextlib.nullcontext():
        out = body(
            input_ids=attention.token_ids[None],
            attention_mask=attention.mask,
            position_ids=attention.positions[None],
            use_cache=False,
            **{FOREST_ATTENTION_KWARG: attention},
        )
    return out.last_hidden_state[0, attention.select_index]


def _graphed_layers(body: nn.Module, attention: ForestAttention) -> contextlib.AbstractContextManager:
    """The layers' graphs for this forest's layout, or a no-op where they cannot run."""
    graphs = layer_graphs(body)
    inputs = attention.graph_inputs(body.dtype, head_dim(body.config)) if graphs is not None else None
    if inputs is None:
        return contextlib.nullcontext()
    key, tensors = inputs
    return graphs.run(key, tensors)
