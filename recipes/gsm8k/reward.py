"""GSM8K reward: the final number of a completion against the reference answer.

Two extraction methods, as in the ReFT paper and verl's GSM8K scorer:
``strict`` reads only the number after ``####`` (so it also rewards the
format), ``flexible`` reads the last number anywhere. Numbers are compared
after dropping ``$`` and thousands separators and as values, so ``$1,200.00``
equals ``1200``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

Method = Literal["strict", "flexible"]
METHODS = ("strict", "flexible")

# A number as people write it: optional sign and currency, thousands separators, decimals.
_NUMBER = r"-?(?:\$\s?)?-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(rf"####\s*({_NUMBER})")
_ANY_NUMBER = re.compile(_NUMBER)


def canonical_number(text: str) -> str | None:
    """``text`` as a canonical decimal string ("$1,200.50" -> "1200.5", "72.0" -> "72"); None if it is no number."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(solution_str: str, method: Method = "strict") -> str | None:
    """The canonical final number of ``solution_str`` by ``method``; None when it has none."""
    if method == "strict":
        candidates = _STRICT.findall(solution_str)
    elif method == "flexible":
        candidates = _ANY_NUMBER.findall(solution_str)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    for candidate in reversed(candidates):
        number = canonical_number(candidate)
        if number is not None:
            return number
    return None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """Score one completion; verl's ``custom_reward_function`` signature.

    ``score`` for the right answer, ``format_score`` for a wrong one that
    still has an extractable answer, 0 otherwise. Also reports ``acc`` (1 if
    right) and ``format`` (1 if the completion ends its answer with ``####``).
    """
    expected = canonical_number(str(ground_truth))
    if expected is None:
        raise ValueError(f"ground_truth must be a number, got {ground_truth!r}")
    answer = extract_answer(solution_str, method)
    correct = answer == expected
    reward = score if correct else (format_score if answer is not None else 0.0)
    return {
        "score": float(reward),
        "acc": float(correct),
        "format": float(extract_answer(solution_str, "strict") is not None),
    }
