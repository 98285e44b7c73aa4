"""Use a recipe's verl-style ``compute_score`` as a TRL reward function.

TRL's GRPOTrainer calls each reward function with ``prompts``, ``completions``
and every other dataset column as a per-sample list, and logs it under the
function's ``__name__``. Our rows carry ``data_source``, ``reward_model`` and
``extra_info`` columns, so one adapter serves every recipe.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ScoreResult = float | Mapping[str, float]


def score_value(result: ScoreResult) -> float:
    """The scalar reward of a ``compute_score`` result: the float itself, or its ``"score"`` entry."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"a compute_score result dict must have a 'score' key, got keys {sorted(result)}")
        return float(result["score"])
    return float(result)


def completion_text(completion: str | Sequence[Mapping[str, str]]) -> str:
    """The generated text: a plain string, or the last message's content of a conversational completion."""
    if isinstance(completion, str):
        return completion
    if not completion:
        return ""
    return completion[-1]["content"]


def trl_reward_func(
    compute_score: Callable[..., ScoreResult], name: str, **reward_kwargs: Any
) -> Callable[..., list[float]]:
    """A TRL reward function named ``name`` that scores each completion with ``compute_score(**reward_kwargs)``.

    The other numbers a ``compute_score`` dict returns (accuracy, format, ...)
    are logged as ``<name>/<key>`` batch means through TRL's ``log_metric``.
    """

    def reward(
        prompts: list,
        completions: list,
        data_source: list[str],
        reward_model: list[Mapping[str, Any]],
        extra_info: list[Mapping[str, Any]],
        log_metric: Callable[[str, float], None] | None = None,
        **_other_columns: Any,
    ) -> list[float]:
        scores = []
        extras: dict[str, list[float]] = defaultdict(list)
        for completion, source, truth, info in zip(completions, data_source, reward_model, extra_info, strict=True):
            result = compute_score(source, completion_text(completion), truth["ground_truth"], info, **reward_kwargs)
            scores.append(score_value(result))
            if isinstance(result, Mapping):
                for key, value in result.items():
                    if key != "score":
                        extras[key].append(float(value))
        if log_metric is not None:
            for key, values in extras.items():
                log_metric(f"{name}/{key}", sum(values) / len(values))
        return scores

    reward.__name__ = name
    reward.__qualname__ = name
    return reward
