"""``log_prob_engine="vllm"``: log-probs of given tokens from vLLM's prompt log-probs.

A sequence is scored in one prefill: vLLM returns, at every position, the
log-prob of the token that is there and the ``top_k`` most likely ones (raw
logits, no temperature). Two layouts come out:

- ``log_probs(prompts, completions, top_k)``: the client API's per-token
  result dicts, the same as the DeepSpeed log-prob job's;
- ``token_log_probs(input_ids, attention_mask, top_k)``: ``_shifted`` [B, T]
  tensors (entry t = log p(token t+1 | tokens <= t), 0 where token t+1 is
  padding), so it can serve ``fwd_no_grad(reference_model=True)``.

It computes no entropy: that needs the full distribution at every position.
"""

from __future__ import annotations

from typing import Iterable

import torch

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions
from arctic_rl_core.engines.sampling.vllm.backend import PromptLogProbs, VLLMBackend


class VLLMLogProbEngine:
    """A vLLM engine used only to score tokens; weights load and sleep as the sampling backend's do."""

    def __init__(self, model_path: str, options: SamplingEngineOptions) -> None:
        # Scores are of the raw logits whatever the sampler reports (vLLM's prompt log-probs are raw in its
        # processed mode too; this says so rather than rely on it).
        self.backend = VLLMBackend(model_path, options.model_copy(update={"logprobs_mode": "raw_logprobs"}))

    def log_probs(self, prompts: list[str], completions: list[str] | None = None, top_k: int = 1) -> list[dict]:
        """Log-probs of each completion's tokens given its prompt (of the prompt's own when ``completions`` is None)."""
        if completions is not None and len(completions) != len(prompts):
            raise ValueError(
                f"completions has {len(completions)} entries for {len(prompts)} prompts; pass one per prompt"
            )
        tokenizer = self.backend.tokenizer
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        completion_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions or []]
        sequences = [p + (completion_ids[i] if completions is not None else []) for i, p in enumerate(prompt_ids)]
        for i, sequence in enumerate(sequences):
            if len(sequence) < 2 or (completions is not None and not prompt_ids[i]):
                raise ValueError(
                    f"prompts[{i}] (+ its completion) must give a non-empty prompt and at least 2 tokens to score, "
                    f"got {len(prompt_ids[i])} prompt and {len(sequence) - len(prompt_ids[i])} completion tokens"
                )
        scored = self.backend.prompt_logprobs(sequences, top_k)
        results = []
        for i, scores in enumerate(scored):
            # Scores start at token 1; a completion's tokens start at len(prompt).
            first = len(prompt_ids[i]) - 1 if completions is not None else 0
            entry = {
                "prompt": prompts[i],
                "completion": completions[i] if completions is not None else None,
                "prompt_token_ids": prompt_ids[i],
                "completion_token_ids": completion_ids[i] if completions is not None else [],
                "token_ids": scores.token_ids[first:],
                "token_log_probs": scores.logprobs[first:],
            }
            if top_k:
                entry["top_log_probs"] = [[[t, lp] for t, lp in position] for position in scores.top_logprobs[first:]]
            results.append(entry)
        return results

    def token_log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, top_k: int = 0) -> dict:
        """``log_probs_shifted`` [B, T] float32, plus ``top_ids`` / ``top_log_probs`` [B, T, top_k] when top_k > 0.

        Rows may be left- or right-padded; each row's tokens are the
        contiguous run where ``attention_mask`` is 1.
        """
        spans = _token_spans(input_ids, attention_mask)
        rows, length = input_ids.shape
        log_probs = torch.zeros(rows, length, dtype=torch.float32)
        top_ids = torch.zeros(rows, length, top_k, dtype=torch.long)
        top_log_probs = torch.zeros(rows, length, top_k, dtype=torch.float32)
        scoring = [(row, start, stop) for row, (start, stop) in enumerate(spans) if stop - start >= 2]
        sequences = [input_ids[row, start:stop].tolist() for row, start, stop in scoring]
        for (row, start, stop), scores in zip(scoring, self.backend.prompt_logprobs(sequences, top_k)):
            log_probs[row, start : stop - 1] = torch.tensor(scores.logprobs)
            if top_k:
                top_ids[row, start : stop - 1], top_log_probs[row, start : stop - 1] = _top_tensors(scores, top_k)
        result = {"log_probs_shifted": log_probs}
        if top_k:
            result["top_ids"], result["top_log_probs"] = top_ids, top_log_probs
        return result

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.backend.load_weights(weights)

    def weight_norm(self) -> float:
        return self.backend.weight_norm()

    def sleep(self, level: int = 1) -> dict:
        return self.backend.sleep(level)

    def wake(self, tags: list[str] | None = None) -> dict:
        return self.backend.wake(tags)

    def shutdown(self) -> None:
        self.backend.shutdown()


def _token_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, stop) of each row's tokens; the mask must be one contiguous run of ones per row."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids must be [B, T] and attention_mask the same shape, got {tuple(input_ids.shape)} "
            f"and {tuple(attention_mask.shape)}"
        )
    spans = []
    for row, mask in enumerate(attention_mask.tolist()):
        ones = [t for t, m in enumerate(mask) if m]
        if any(m not in (0, 1) for m in mask) or (ones and ones[-1] - ones[0] + 1 != len(ones)):
            raise ValueError(
                f"attention_mask row {row} must be 0/1 with its ones in one contiguous run (left or right padding)"
            )
        spans.append((ones[0], ones[-1] + 1) if ones else (0, 0))
    return spans


def _top_tensors(scores: PromptLogProbs, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[token for token, _ in position] for position in scores.top_logprobs], dtype=torch.long)
    lps = torch.tensor([[lp for _, lp in position] for position in scores.top_logprobs], dtype=torch.float32)
    return ids.reshape(-1, top_k), lps.reshape(-1, top_k)
