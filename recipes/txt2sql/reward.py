"""Txt2SQL reward: execute the predicted and the gold query on the real database and compare results.

The completion must put its query in ``<sql>...</sql>``. Both queries run in
the read-only sandbox (``sandbox.py``). Results match when they hold the same
rows, in the same order if the gold query has a top-level ORDER BY, else as
multisets (duplicates count; columns keep their order).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from recipes.common.tags import last_tagged
from recipes.txt2sql.sandbox import ExecutionLimits, Row, SQLExecutionError, execute_readonly

SQL_TAG = "sql"

# Floats from aggregates differ in the last bits between equivalent queries
# (AVG over a different join order); six decimals absorb that.
_FLOAT_DIGITS = 6

_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


def extract_sql(solution_str: str) -> str | None:
    """The query in the last ``<sql>...</sql>`` block of a completion; None when there is none."""
    return last_tagged(solution_str, SQL_TAG)


def _top_level_text(sql: str) -> str:
    """``sql`` without string literals, quoted identifiers, comments and anything inside parentheses."""
    kept = []
    depth = 0
    i = 0
    closing = {"'": "'", '"': '"', "`": "`", "[": "]"}
    while i < len(sql):
        char = sql[i]
        if char in closing:
            end = sql.find(closing[char], i + 1)
            i = len(sql) if end < 0 else end + 1
            kept.append(" ")
            continue
        if sql.startswith("--", i):
            end = sql.find("\n", i)
            i = len(sql) if end < 0 else end
            continue
        if sql.startswith("/*", i):
            end = sql.find("*/", i + 2)
            i = len(sql) if end < 0 else end + 2
            kept.append(" ")
            continue
        if char == "(":
            depth += 1
            kept.append(" ")
        elif char == ")":
            depth = max(depth - 1, 0)
            kept.append(" ")
        elif depth == 0:
            kept.append(char)
        i += 1
    return "".join(kept)


def orders_rows(sql: str) -> bool:
    """Whether ``sql`` orders its result: an ORDER BY outside any subquery, CTE body or window."""
    return _ORDER_BY.search(_top_level_text(sql)) is not None


def _normalized(row: Row) -> Row:
    return tuple(round(value, _FLOAT_DIGITS) if isinstance(value, float) else value for value in row)


def results_match(predicted: Sequence[Row], gold: Sequence[Row], ordered: bool) -> bool:
    """Whether two results hold the same rows: as sequences if ``ordered``, else as multisets."""
    predicted = [_normalized(row) for row in predicted]
    gold = [_normalized(row) for row in gold]
    if ordered:
        return predicted == gold
    return Counter(predicted) == Counter(gold)


@lru_cache(maxsize=1024)
def _gold_rows(db_path: str, gold_sql: str, limits: ExecutionLimits) -> tuple[Row, ...]:
    # A GRPO group scores many completions against one gold query: run it once.
    return tuple(execute_readonly(db_path, gold_sql, limits))


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    timeout_s: float = 2.0,
    max_rows: int = 10_000,
    format_score: float = 0.1,
    score: float = 1.0,
) -> dict[str, float]:
    """Score one completion; verl's ``custom_reward_function`` signature.

    ``ground_truth`` is the gold SQL; ``extra_info["db_path"]`` the SQLite file
    both queries run on. ``score`` when the results match, ``format_score``
    when the completion has a ``<sql>`` block but the results differ or the
    query fails, 0 without a block. Also reports ``acc`` (results match),
    ``format`` (block present), ``executable`` (the predicted query ran) and
    ``gold_failed`` (the gold query itself failed: a data problem, scored 0).
    """
    if not extra_info or "db_path" not in extra_info:
        raise ValueError(f"extra_info must name the SQLite file as 'db_path', got {extra_info!r}")
    db_path = str(Path(extra_info["db_path"]).resolve())
    if not Path(db_path).is_file():
        raise FileNotFoundError(f"extra_info['db_path'] {db_path!r} does not exist")
    limits = ExecutionLimits(timeout_s=timeout_s, max_rows=max_rows)

    result = {"score": 0.0, "acc": 0.0, "format": 0.0, "executable": 0.0, "gold_failed": 0.0}
    predicted_sql = extract_sql(solution_str)
    if predicted_sql is None:
        return result
    result["format"] = 1.0
    result["score"] = float(format_score)
    try:
        predicted = execute_readonly(db_path, predicted_sql, limits)
    except SQLExecutionError:
        return result
    result["executable"] = 1.0
    try:
        gold = _gold_rows(db_path, ground_truth, limits)
    except SQLExecutionError:
        result["gold_failed"] = 1.0
        result["score"] = 0.0
        return result
    if results_match(predicted, gold, ordered=orders_rows(ground_truth)):
        result["acc"] = 1.0
        result["score"] = float(score)
    return result
