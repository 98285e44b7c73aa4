"""Functions that run inside vLLM's workers, sent there with ``LLM.collective_rpc``.

vLLM calls each with its worker as the first argument: directly when the
worker shares our process, after a cloudpickle round trip when it does not
(tensor parallelism), so they stay module-level and return plain values.
"""

from __future__ import annotations

import torch
from torch import nn

# Rows of the identity fed through a packed CPU linear kernel at once.
_READBACK_ROWS = 1024


def hf_names_by_module(worker) -> dict[str, list[str]]:
    """For each vLLM module with parameters, the Hugging Face tensor names it is loaded from.

    vLLM fuses q/k/v and gate/up projections into one module; the model's
    ``packed_modules_mapping`` (which LoRA and quantization read too) names
    the parts, e.g. ``qkv_proj.weight`` <- ``q_proj.weight, k_proj.weight,
    v_proj.weight``.
    """
    model = worker.model_runner.get_model()
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        for part in packed.get(leaf, [leaf]):
            out.setdefault(module, []).append(f"{parent}.{part}.{kind}" if parent else f"{part}.{kind}")
    return out


def sum_of_squares(worker) -> float:
    """This worker's share of the model's squared L2 norm, in float64.

    Tensor-parallel ranks hold shards of the parallel layers and full copies
    of everything else (norms, row-parallel biases, key/value heads that are
    replicated because there are fewer of them than ranks); copies are
    counted once across ranks, so the sum over all workers is the norm of
    the full model.
    """
    model = worker.model_runner.get_model()
    tp = worker.vllm_config.parallel_config.tensor_parallel_size
    total = 0.0
    seen: set[int] = set()  # a tied lm_head shares the embedding's parameter
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            per_row = _sum_of_squares_per_output_row(module, param)
            total += float((per_row / _copies_per_output_row(module, name, per_row.numel(), tp)).sum())
    return total


def _sum_of_squares_per_output_row(module: nn.Module, param: torch.Tensor) -> torch.Tensor:
    if param.numel() > 0 or not hasattr(module, "cpu_linear"):
        values = param.detach().double()
        return values.pow(2).reshape(values.shape[0], -1).sum(1) if values.dim() else values.pow(2).reshape(1)
    # vLLM's CPU backend packs linear weights for its GEMM kernels and leaves
    # an empty parameter behind; read the weights back through the kernel
    # itself (identity @ W^T = W^T), so the norm is that of what decoding uses.
    in_features = module.input_size_per_partition
    per_row = torch.zeros(module.output_size_per_partition, dtype=torch.float64)
    for start in range(0, in_features, _READBACK_ROWS):
        rows = min(_READBACK_ROWS, in_features - start)
        identity = torch.zeros(rows, in_features, dtype=param.dtype)
        identity[torch.arange(rows), start + torch.arange(rows)] = 1
        per_row += module.cpu_linear(identity, param, None).double().pow(2).sum(0)
    return per_row


def _copies_per_output_row(module: nn.Module, name: str, rows: int, tp: int) -> torch.Tensor | int:
    """How many tensor-parallel ranks hold each output row of ``module.<name>``."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if tp == 1 or getattr(module, "tp_size", tp) == 1:
        return tp
    if isinstance(module, QKVParallelLinear) and module.num_kv_head_replicas > 1:
        copies = torch.ones(rows, dtype=torch.float64)
        copies[module.num_heads * module.head_size :] = module.num_kv_head_replicas
        return copies
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 1
    if isinstance(module, RowParallelLinear) and name == "weight":
        return 1
    return tp
