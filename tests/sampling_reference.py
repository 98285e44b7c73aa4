"""What a sampled token's processed log-prob is, written out from its definition, for checking both backends."""

import torch


def processed_logprobs(logits: torch.Tensor, tokens: list[int], temperature: float, top_k: int, top_p: float):
    """vLLM's ``processed_logprobs`` of ``tokens[i]`` under ``logits[i]``: top-k, then top-p over
    ``softmax(logits / T)`` of what top-k kept, then log-softmax of ``logits / T`` over the kept tokens."""
    out = []
    for row, token in zip(logits.float(), tokens, strict=True):
        values, order = (row / temperature).sort(descending=True)
        probs = torch.softmax(values[:top_k], -1)
        kept = order[:top_k][(probs.cumsum(-1) - probs) < top_p]
        out.append(float(torch.log_softmax(row[kept] / temperature, -1)[(kept == token).nonzero()[0, 0]]))
    return out
