"""Long-context QA reward: exact match and token F1 of the tagged answer, after SQuAD normalization.

Normalization lowercases, drops punctuation and the articles a/an/the, and
collapses whitespace. Against several accepted answers, the best one counts.
As in HotpotQA's official scorer, a yes/no answer earns F1 only by being exact:
"yes it is" shares a token with "yes" but is not a partial answer to it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable
from typing import Any, Literal

from recipes.common.tags import last_tagged
from recipes.long_context_qa.examples import ANSWER_TAG

Metric = Literal["f1", "em"]
METRICS = ("f1", "em")

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_CLOSED_ANSWERS = frozenset({"yes", "no", "noanswer"})


def normalize_answer(text: str) -> str:
    """SQuAD normalization: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when both normalize to the same string."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall between the normalized strings."""
    predicted_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if (" ".join(predicted_tokens) in _CLOSED_ANSWERS or " ".join(gold_tokens) in _CLOSED_ANSWERS) and (
        predicted_tokens != gold_tokens
    ):
        return 0.0
    common = sum((Counter(predicted_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(predicted_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _answers(ground_truth: str | Iterable[str]) -> list[str]:
    answers = [ground_truth] if isinstance(ground_truth, str) else [str(answer) for answer in ground_truth]
    if not answers:
        raise ValueError("ground_truth must hold at least one accepted answer, got none")
    return answers


def extract_answer(solution_str: str) -> str | None:
    """The answer in the last ``<answer>...</answer>`` block of a completion; None when there is none."""
    return last_tagged(solution_str, ANSWER_TAG)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str | Iterable[str],
    extra_info: dict[str, Any] | None = None,
    metric: Metric = "f1",
    format_score: float = 0.0,
) -> dict[str, float]:
    """Score one completion; verl's ``custom_reward_function`` signature.

    ``ground_truth`` is the accepted answer or a list of them. The score is
    ``metric`` (F1 or EM, best over answers), at least ``format_score`` when an
    ``<answer>`` block is present; 0 without one. Also reports ``em``, ``f1``
    and ``format``.
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    answers = _answers(ground_truth)
    prediction = extract_answer(solution_str)
    if prediction is None:
        return {"score": 0.0, "em": 0.0, "f1": 0.0, "format": 0.0}
    em = max(exact_match(prediction, gold) for gold in answers)
    f1 = max(token_f1(prediction, gold) for gold in answers)
    chosen = f1 if metric == "f1" else em
    return {"score": max(chosen, float(format_score)), "em": em, "f1": f1, "format": 1.0}
