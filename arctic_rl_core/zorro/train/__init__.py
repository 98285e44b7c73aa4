"""ZoRRo Train: shared prefixes (GRPO groups, system prompts, earlier turns) computed once in forward and backward.

    from arctic_rl_core.zorro import train as zorro_train

    forest = zorro_train.build_prefix_forest(input_ids, attention_mask, select)   # optional, for metrics
    rows = zorro_train.selected_hidden_states(model, input_ids, attention_mask, select, forest=forest)
    metrics.update(forest.stats.metrics())

``selected_hidden_states`` returns the rows ``arctic_rl_core.models.forward.selected_hidden_states``
returns, with equal values and gradients, for any HF decoder whose attention
implementation is ``sdpa`` or ``flex_attention``. Attention runs as FlashAttention
varlen on CUDA in fp16/bf16, FlexAttention on CUDA in fp32, masked SDPA on CPU.
"""

from arctic_rl_core.zorro.train.attention import ForestAttention, VarlenLayout, default_kernel, enable_forest_attention
from arctic_rl_core.zorro.train.forest import ForestNode, ForestStats, PrefixForest, build_prefix_forest
from arctic_rl_core.zorro.train.forward import packed_selected_hidden_states, selected_hidden_states

__all__ = [
    "ForestAttention",
    "ForestNode",
    "ForestStats",
    "PrefixForest",
    "VarlenLayout",
    "build_prefix_forest",
    "default_kernel",
    "enable_forest_attention",
    "packed_selected_hidden_states",
    "selected_hidden_states",
]
