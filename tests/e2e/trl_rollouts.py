"""A fixed rollout and reward shared by the TRL tests, so that comparisons are about training, not sampling luck."""

from __future__ import annotations

import torch

PROMPTS = ["What is 2 + 3?", "Name a color", "Count to five please", "hi"]


def fixed_rollout(prompts, trainer):
    """Deterministic completions of 3 to 8 tokens; every other one ends with EOS."""
    tokenizer = trainer.processing_class
    seen: dict[str, int] = {}
    prompt_ids, completion_ids = [], []
    for prompt in prompts:
        index = seen[prompt] = seen.get(prompt, -1) + 1
        ids = tokenizer(prompt)["input_ids"]
        generator = torch.Generator().manual_seed(sum(ids) * 31 + index)
        tokens = torch.randint(3, 1000, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator)
        prompt_ids.append(ids)
        completion_ids.append(tokens.tolist() + ([tokenizer.eos_token_id] if index % 2 == 0 else []))
    logprobs = [[-7.0] * len(ids) for ids in completion_ids]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


def multiple_of_three_share(completion_ids, **_):
    """A reward with spread: the share of completion tokens divisible by 3."""
    return [sum(t % 3 == 0 for t in ids) / len(ids) for ids in completion_ids]
