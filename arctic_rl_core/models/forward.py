"""The plain forward every engine shares: hidden states only where they are needed.

Log-probs follow the ``torch.roll(input_ids, -1)`` convention: the hidden state
at position t predicts token t+1. A loss needs logits only at its response
positions, so engines run the decoder body, keep the selected rows and apply
the LM head to those alone (the [B, T, V] logits tensor of a long batch would
otherwise dominate memory). ZoRRo Train replaces ``selected_hidden_states``
with a packed computation that returns the same rows.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from arctic_rl_core.models.layer_graphs import layer_graphs


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left- and right-padded rows see the RoPE of their unpadded text."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def decoder_body(model: nn.Module) -> nn.Module:
    """The transformer body of an HF causal LM (``model.model`` for Llama/Qwen/Mistral)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    if body is None:
        raise TypeError(f"{type(model).__name__} exposes no decoder body (get_decoder())")
    return body


def head_dim(config) -> int:
    """The attention head size of an HF config: ``head_dim`` where it is set (Qwen3), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class OutputHead(nn.Module):
    """The LM head followed by the model's own final-logit transforms: a scale, then a soft cap.

    HF applies them in the causal LM's forward, after its ``lm_head`` (Cohere's
    ``logit_scale``, Granite's 1 / ``logits_scaling``, Falcon-H1's
    ``lm_head_multiplier``, Gemma 2/3's ``final_logit_softcapping``); an
    engine that calls the head on selected rows must apply them too.
    """

    def __init__(self, head: nn.Module, scale: float = 1.0, softcap: float | None = None):
        super().__init__()
        self.head, self.scale, self.softcap = head, scale, softcap

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def final_logit_transform(config) -> tuple[float, float | None]:
    """(scale, soft cap) the model's forward applies to its logits; (1.0, None) for most models."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = 1.0 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), getattr(text, "final_logit_softcapping", None)


def lm_head(model: nn.Module) -> OutputHead:
    head = model.get_output_embeddings()
    if head is None:
        raise TypeError(f"{type(model).__name__} has no output embeddings (lm_head)")
    return OutputHead(head, *final_logit_transform(model.config))


def selected_hidden_states(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    select: torch.Tensor,
    *,
    cuda_graphs: bool = False,
) -> torch.Tensor:
    """Final hidden states at ``select`` (a [B, T] bool mask), as [N, H] rows in row-major order.

    ``cuda_graphs`` replays the decoder layers as CUDA graphs when the batch's shape
    repeats (``arctic_rl_core.models.layer_graphs``), where they can run.
    """
    # Found before the forward: a boolean index makes the host wait for the GPU, and after
    # the forward that wait would empty the queue the backward is about to need.
    rows = select.flatten().nonzero().squeeze(1)
    body = decoder_body(model)
    graphs = layer_graphs(body) if cuda_graphs and torch.is_grad_enabled() else None
    if graphs is not None:
        # HF drops an all-ones mask for causal attention, a choice made on the host: part of the key.
        key = ("padded", tuple(input_ids.shape), bool(attention_mask.all()))
        context = graphs.run(key)
    else:
        context = contextlib.nullcontext()
    with context:
        out = body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
    return out.last_hidden_state.flatten(0, 1).index_select(0, rows)
