"""Txt2SQL data preparation: Spider, BIRD or a synthetic corpus to verl-format parquet and JSONL.

    python -m recipes.txt2sql.data --out ~/data/spider --source spider --root ~/spider_data
    python -m recipes.txt2sql.data --out ~/data/bird --source bird --root ~/bird --splits train dev
    python -m recipes.txt2sql.data --out /tmp/sql --source synthetic --seed 0

Layouts read, as their releases ship them:

- Spider: ``<root>/train_spider.json``, ``dev.json`` (``db_id``, ``question``,
  ``query``) and ``<root>/database/<db_id>/<db_id>.sqlite``;
- BIRD: ``<split>.json`` (``db_id``, ``question``, ``evidence``, ``SQL``) and
  ``<split>_databases/<db_id>/<db_id>.sqlite``, in ``<root>`` (an unzipped
  split directory) or in ``<root>/<split>``.

Each row's ``extra_info["db_path"]`` is the absolute path of its database: the
reward opens it read-only there, so prepare the data where training runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from recipes.common.records import chat_prompt, read_json_records, rl_row, take, write_split
from recipes.txt2sql.reward import SQL_TAG
from recipes.txt2sql.sandbox import table_definitions
from recipes.txt2sql.synthetic import generate_corpus

ABILITY = "sql"
SPIDER_SPLITS = {
    "train": ("train_spider.json", "database"),
    "dev": ("dev.json", "database"),
    "test": ("test.json", "test_database"),
}
BIRD_SPLITS = ("train", "dev")
SYNTHETIC_SPLITS = ("train", "dev")
DATA_SOURCES = {"spider": "spider", "bird": "bird", "synthetic": "synthetic_sql"}

Source = Literal["spider", "bird", "synthetic"]

INSTRUCTION = (
    f"Think step by step, then write one SQLite query that answers the question, inside <{SQL_TAG}></{SQL_TAG}> tags."
)


@dataclass(frozen=True)
class Txt2SQLExample:
    """A question about one SQLite database and the gold query that answers it."""

    question: str
    db_id: str
    db_path: Path
    gold_sql: str
    evidence: str = ""


def _database_path(databases_dir: Path, db_id: str) -> Path:
    path = databases_dir / db_id / f"{db_id}.sqlite"
    if not path.is_file():
        raise FileNotFoundError(f"database of db_id {db_id!r} not found at {str(path)!r}")
    return path.resolve()


def _require_fields(record: dict[str, Any], fields: Sequence[str], source: Path) -> None:
    missing = [field for field in fields if field not in record]
    if missing:
        raise ValueError(f"{str(source)!r}: a record lacks fields {missing} (has {sorted(record)})")


def load_spider(root: str | Path, split: str = "train") -> list[Txt2SQLExample]:
    """Spider-format examples of ``split`` (train, dev or test) under ``root``."""
    if split not in SPIDER_SPLITS:
        raise ValueError(f"Spider split must be one of {sorted(SPIDER_SPLITS)}, got {split!r}")
    file_name, databases = SPIDER_SPLITS[split]
    path = Path(root) / file_name
    examples = []
    for record in read_json_records(path):
        _require_fields(record, ("db_id", "question", "query"), path)
        examples.append(
            Txt2SQLExample(
                question=record["question"],
                db_id=record["db_id"],
                db_path=_database_path(Path(root) / databases, record["db_id"]),
                gold_sql=record["query"],
            )
        )
    return examples


def load_bird(root: str | Path, split: str = "train") -> list[Txt2SQLExample]:
    """BIRD-format examples of ``split`` (train or dev), with their external-knowledge evidence.

    ``root`` is the unzipped split directory (holding ``<split>.json``) or its parent.
    """
    if split not in BIRD_SPLITS:
        raise ValueError(f"BIRD split must be one of {BIRD_SPLITS}, got {split!r}")
    split_dir = Path(root) if (Path(root) / f"{split}.json").is_file() else Path(root) / split
    path = split_dir / f"{split}.json"
    examples = []
    for record in read_json_records(path):
        _require_fields(record, ("db_id", "question", "SQL"), path)
        examples.append(
            Txt2SQLExample(
                question=record["question"],
                db_id=record["db_id"],
                db_path=_database_path(split_dir / f"{split}_databases", record["db_id"]),
                gold_sql=record["SQL"],
                evidence=record.get("evidence") or "",
            )
        )
    return examples


@cache
def database_schema(db_path: Path) -> str:
    """The database's ``CREATE TABLE`` statements, as the model sees them."""
    return ";\n\n".join(table_definitions(db_path)) + ";"


def build_prompt(example: Txt2SQLExample) -> list[dict[str, str]]:
    """The chat prompt: schema first, so questions on one database share a prefix, then evidence and question."""
    parts = [f"Database schema (SQLite):\n\n{database_schema(example.db_path)}"]
    if example.evidence:
        parts.append(f"External knowledge: {example.evidence}")
    parts.append(f"Question: {example.question}")
    parts.append(INSTRUCTION)
    return chat_prompt("\n\n".join(parts))


def to_row(example: Txt2SQLExample, data_source: str, split: str, index: int) -> dict[str, Any]:
    """One verl row; the reward finds the database through ``extra_info["db_path"]``."""
    return rl_row(
        data_source=data_source,
        prompt=build_prompt(example),
        ability=ABILITY,
        ground_truth=example.gold_sql,
        extra_info={
            "split": split,
            "index": index,
            "db_id": example.db_id,
            "db_path": str(example.db_path),
            "question": example.question,
            "evidence": example.evidence,
        },
    )


def load_examples(source: Source, root: str | Path, split: str) -> list[Txt2SQLExample]:
    """Examples of ``split`` from a Spider-layout (``spider``, ``synthetic``) or BIRD-layout root."""
    if source in ("spider", "synthetic"):
        return load_spider(root, split)
    if source == "bird":
        return load_bird(root, split)
    raise ValueError(f"source must be one of {sorted(DATA_SOURCES)}, got {source!r}")


def prepare(
    out_dir: str | Path,
    source: Source,
    root: str | Path | None = None,
    splits: Sequence[str] = ("train", "dev"),
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Path]]:
    """Write ``<split>.parquet`` and ``<split>.jsonl`` under ``out_dir``; return the paths by split.

    ``synthetic`` first generates its corpus (databases included) under
    ``root``, by default ``<out_dir>/synthetic_corpus``.
    """
    if source == "synthetic":
        root = generate_corpus(root or Path(out_dir) / "synthetic_corpus", seed=seed)
    elif root is None:
        raise ValueError(f"source {source!r} needs root, the directory of the dataset release")
    written = {}
    for split in splits:
        examples = take(load_examples(source, root, split), limit)
        rows = [to_row(example, DATA_SOURCES[source], split, i) for i, example in enumerate(examples)]
        written[split] = write_split(rows, out_dir, split)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write <split>.parquet and <split>.jsonl into")
    parser.add_argument("--source", choices=sorted(DATA_SOURCES), required=True)
    parser.add_argument("--root", help="dataset release directory (synthetic: where to generate the corpus)")
    parser.add_argument("--splits", nargs="+", default=["train", "dev"])
    parser.add_argument("--limit", type=int, help="keep only the first N examples of each split")
    parser.add_argument("--seed", type=int, default=0, help="synthetic corpus seed")
    args = parser.parse_args(argv)
    for split, paths in prepare(args.out, args.source, args.root, args.splits, args.limit, args.seed).items():
        print(f"{split}: {paths['parquet']} {paths['jsonl']}")


if __name__ == "__main__":
    main()
