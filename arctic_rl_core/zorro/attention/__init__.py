"""Forest Cascade Attention (ZoRRo Inference): decode attention that reads each shared prefix once per group.

- ``forest``: groups of requests that share KV-cache blocks, built from block tables.
- ``reference``: plain and cascade paged attention in torch (exact; the CPU path).
- ``plan``: the work items the GPU kernel runs, for prefill, plain decode and cascade decode.
- ``triton_attention``: the fused Triton kernel (imported on demand: it compiles for the GPU).
"""

from arctic_rl_core.zorro.attention.forest import PrefixForest, SharedPrefix, build_forest
from arctic_rl_core.zorro.attention.plan import AttentionPlan, TileShape, plan_decode, plan_prefill
from arctic_rl_core.zorro.attention.reference import (
    cascade_attention,
    merge_attention_states,
    paged_decode_attention,
    paged_prefill_attention,
)

__all__ = [
    "AttentionPlan",
    "PrefixForest",
    "SharedPrefix",
    "TileShape",
    "build_forest",
    "cascade_attention",
    "merge_attention_states",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_decode",
    "plan_prefill",
]
