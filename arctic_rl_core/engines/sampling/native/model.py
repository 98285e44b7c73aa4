"""Our decoder for the Llama / Qwen2 / Qwen3 / Mistral families, laid out for fast decode.

The q, k and v projections are one matrix (one GEMM), as are gate and up;
norms, rotary embedding with the KV-cache write, and the gated activation are
fused kernels on CUDA (``ops``). Decode batches of a half-precision model
run their projections as ``decode_linear`` kernels (the gated activation
inside the gate/up one), each launched while the kernel before it finishes;
there the norms between projections run inside them (``o_proj`` and
``down_proj`` add into the residual stream and start the next norm, the
projection after it finishes it), so a layer has no norm launch.
``weights`` maps Hugging Face parameter names onto this layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from arctic_rl_core.engines.sampling.native import ops
from arctic_rl_core.engines.sampling.native.attention import AttentionMetadata, attend
from arctic_rl_core.models.forward import head_dim as config_head_dim

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants whose frequencies do not depend on the sequence length, so one table serves every step.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a supported HF decoder, read and checked once from its config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not supported by the native engine; "
                             f"expected one of {SUPPORTED_MODEL_TYPES}")  # fmt: skip
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; expected 'silu'")
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported by the native engine")
        num_heads = config.num_attention_heads
        head_size = config_head_dim(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=window,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def rotary_tables(config, head_dim: int, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[max_positions, head_dim // 2]`` (float32), with the config's RoPE scaling.

    The inverse frequencies come from transformers' own RoPE initialisers, so
    every static scaling type it knows is computed exactly as HF computes it.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type={rope_type!r} is not supported by the native engine; expected one of "
            f"{SUPPORTED_ROPE_TYPES} (length-dependent scaling needs a per-step table)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor={params['partial_rotary_factor']} is not supported; expected 1.0")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    # HF rounds cos/sin after scaling in float32; so do we.
    return (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, dtype, device):
        super().__init__()
        self.spec = spec
        self.qkv_proj = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias,
                                  dtype=dtype, device=device)  # fmt: skip
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias, dtype=dtype, device=device)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device) if spec.qk_norm else None
        self.scale = spec.head_dim**-0.5

    def forward(self, x: ops.Normed, positions, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        """The heads' outputs ``[tokens, q_size]``, before ``o_proj``: the layer applies it, adding into the
        residual stream in the same kernel."""
        spec = self.spec
        store = ops.RotaryStore(
            positions, cos, sin,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            spec.rms_norm_eps, k_cache, v_cache, meta.slot_mapping, spec.num_heads, spec.num_kv_heads,
        )  # fmt: skip
        q = ops.qkv_rotary_and_store(x, self.qkv_proj.weight, self.qkv_proj.bias, store)
        return attend(q, k_cache, v_cache, meta, self.scale).flatten(1)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype, device):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False,
                                      dtype=dtype, device=device)  # fmt: skip
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False, dtype=dtype, device=device)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.self_attn = Attention(spec, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.mlp = MLP(spec, dtype, device)

    def forward(self, h: ops.Normed, residual, positions, cos, sin, k_cache, v_cache, meta, next_norm: RMSNorm):
        """``h`` is this layer's input, already through ``input_layernorm``; returns the residual stream and
        ``next_norm`` of it, the next layer's input (or the model's final norm).

        Each block's last projection adds into the residual stream and hands the norm after it to the next
        projection (``ops.linear_into_residual``), so on the fused decode path no norm needs a launch.
        """
        attn = self.self_attn
        out = attn(h, positions, cos, sin, k_cache, v_cache, meta)
        norm = self.post_attention_layernorm
        h, residual = ops.linear_into_residual(out, attn.o_proj.weight, attn.o_proj.bias, residual, norm.weight,
                                               norm.eps)  # fmt: skip
        mlp = self.mlp
        out = ops.gated_linear(h, mlp.gate_up_proj.weight)
        return ops.linear_into_residual(out, mlp.down_proj.weight, None, residual, next_norm.weight, next_norm.eps)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; tied embeddings share one parameter.

    Parameters are allocated uninitialised (built on the meta device, then
    materialised): the weight loader fills every one and checks that it did.
    """

    def __init__(self, spec: ModelSpec, hf_config, max_positions: int, dtype, device):
        super().__init__()
        self.spec = spec
        meta = torch.device("meta")
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=meta)
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype, meta) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, meta)
        if spec.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, dtype=dtype, device=meta)
        self.to_empty(device=device)
        self.requires_grad_(False)
        # Plain attributes, not buffers: they are derived from the config, never loaded, and stay put in sleep().
        self.rope_cos, self.rope_sin = rotary_tables(hf_config, spec.head_dim, max_positions, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]``.

        ``kv_cache`` is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``.
        """
        first = self.layers[0].input_layernorm
        h, residual = ops.rms_norm(F.embedding(input_ids, self.embed_tokens.weight), first.weight, first.eps)
        norms_after = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms_after)):
            h, residual = layer(h, residual, positions, self.rope_cos, self.rope_sin, kv_cache[i, 0], kv_cache[i, 1],
                                meta, next_norm)  # fmt: skip
        return ops.apply_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight)
