"""The row every recipe writes, and the files it is written to.

A row has verl's RL dataset columns, as verl's own ``examples/data_preprocess``
scripts write them:

    data_source   str                    which reward applies (and a metrics key)
    prompt        [{"role", "content"}]  chat messages; frameworks apply the chat template
    ability       str
    reward_model  {"style": "rule", "ground_truth": ...}
    extra_info    {str: ...}             passed to ``compute_score`` as ``extra_info``

TRL reads the same files (``prompt`` is its conversational column; the other
columns reach reward functions as keyword arguments). SkyRL names two columns
differently; ``to_skyrl_row`` renames them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REWARD_STYLE = "rule"
CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(user: str, system: str | None = None) -> list[dict[str, str]]:
    """Chat messages for a single-turn prompt, with an optional system message first."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return messages


def rl_row(
    *,
    data_source: str,
    prompt: Sequence[Mapping[str, str]],
    ability: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any],
) -> dict[str, Any]:
    """One dataset row in verl's format. Raises ValueError naming the field when a part is malformed."""
    if not data_source:
        raise ValueError("data_source must be a non-empty string, got ''")
    if not prompt:
        raise ValueError("prompt must hold at least one chat message, got []")
    for position, message in enumerate(prompt):
        if set(message) != {"role", "content"} or message["role"] not in CHAT_ROLES:
            raise ValueError(
                f"prompt[{position}] must be {{'role': one of {CHAT_ROLES}, 'content': str}}, got {dict(message)!r}"
            )
    if not extra_info:
        # Parquet cannot store a struct without fields.
        raise ValueError("extra_info must hold at least one field, got {}")
    return {
        "data_source": data_source,
        "prompt": [dict(message) for message in prompt],
        "ability": ability,
        "reward_model": {"style": REWARD_STYLE, "ground_truth": ground_truth},
        "extra_info": dict(extra_info),
    }


def to_skyrl_row(row: Mapping[str, Any], env_class: str) -> dict[str, Any]:
    """The row in SkyRL's format: ``env_class`` names the environment, ``reward_spec`` replaces ``reward_model``."""
    reward = row["reward_model"]
    return {
        "data_source": row["data_source"],
        "prompt": row["prompt"],
        "env_class": env_class,
        "reward_spec": {"method": reward["style"], "ground_truth": reward["ground_truth"]},
        "extra_info": row["extra_info"],
    }


def write_split(rows: Sequence[Mapping[str, Any]], out_dir: str | Path, split: str) -> dict[str, Path]:
    """Write ``rows`` to ``out_dir/<split>.parquet`` and ``out_dir/<split>.jsonl``; return both paths by format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise ValueError(f"split {split!r} has no rows to write")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parquet_path = out_dir / f"{split}.parquet"
    jsonl_path = out_dir / f"{split}.jsonl"
    pq.write_table(pa.Table.from_pylist(list(rows)), parquet_path)
    with jsonl_path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {"parquet": parquet_path, "jsonl": jsonl_path}


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All JSON objects of a JSON Lines file, skipping blank lines."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json_records(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``.jsonl`` file (one per line) or a ``.json`` file holding one list."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    records = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(records, list):
        raise ValueError(f"{str(path)!r} must hold a JSON list of records, got {type(records).__name__}")
    return records


def take(records: Iterable[Any], limit: int | None) -> list[Any]:
    """The first ``limit`` records (all when ``limit`` is None)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of rows, got {limit}")
    records = list(records)
    return records if limit is None else records[:limit]
