"""GSM8K data preparation: ``openai/gsm8k`` (or a local copy) to verl-format parquet and JSONL.

    python -m recipes.gsm8k.data --out ~/data/gsm8k                  # from the Hugging Face hub
    python -m recipes.gsm8k.data --out /tmp/gsm8k --source local     # from ../shared/data/gsm8k
    python -m recipes.gsm8k.data --out /tmp/gsm8k --source local --local-dir DIR --limit 64

A local copy is a directory with ``train.jsonl`` and ``test.jsonl`` in the
hub's fields (``question``, ``answer`` ending in ``#### <number>``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from recipes.common.paths import DATA_DIR_ENV, shared_data_dir
from recipes.common.records import chat_prompt, read_jsonl, rl_row, take, write_split
from recipes.gsm8k.reward import extract_answer

DATA_SOURCE = "openai/gsm8k"
HUB_CONFIG = "main"
SPLITS = ("train", "test")
ABILITY = "math"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

Source = Literal["hub", "local"]


def default_local_dir() -> Path:
    """The local copy unless told otherwise: ``$ARCTIC_RL_DATA_DIR/gsm8k``, else ``<repo>/../shared/data/gsm8k``."""
    return shared_data_dir("gsm8k")


def load_split(
    split: str, source: Source = "hub", local_dir: str | Path | None = None, limit: int | None = None
) -> list[dict[str, str]]:
    """Raw GSM8K problems (``question``, ``answer``) of ``split``, from the hub or a local directory."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if source == "hub":
        import datasets

        dataset = datasets.load_dataset(DATA_SOURCE, HUB_CONFIG, split=split)
        if limit is not None:
            dataset = dataset.select(range(min(limit, len(dataset))))
        return [{"question": row["question"], "answer": row["answer"]} for row in dataset]
    if source == "local":
        directory = Path(local_dir) if local_dir is not None else default_local_dir()
        path = directory / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"GSM8K {split} split not found at {str(path)!r}: pass --local-dir DIR, set {DATA_DIR_ENV}, "
                f"or use --source hub to download {DATA_SOURCE}"
            )
        return take(read_jsonl(path), limit)
    raise ValueError(f"source must be 'hub' or 'local', got {source!r}")


def reference_answer(answer: str) -> str:
    """The canonical final number of a GSM8K reference solution (the text after ``####``)."""
    number = extract_answer(answer, "strict")
    if number is None:
        raise ValueError(f"a GSM8K answer must end with '#### <number>', got {answer[-80:]!r}")
    return number


def to_row(problem: dict[str, str], split: str, index: int) -> dict[str, Any]:
    """One verl row for a GSM8K problem, laid out as verl's own GSM8K preprocessing does."""
    return rl_row(
        data_source=DATA_SOURCE,
        prompt=chat_prompt(f"{problem['question']} {INSTRUCTION}"),
        ability=ABILITY,
        ground_truth=reference_answer(problem["answer"]),
        extra_info={"split": split, "index": index, "answer": problem["answer"], "question": problem["question"]},
    )


def prepare(
    out_dir: str | Path,
    source: Source = "hub",
    local_dir: str | Path | None = None,
    splits: Sequence[str] = SPLITS,
    limit: int | None = None,
) -> dict[str, dict[str, Path]]:
    """Write ``<split>.parquet`` and ``<split>.jsonl`` under ``out_dir`` for each split; return the paths by split."""
    written = {}
    for split in splits:
        problems = load_split(split, source, local_dir, limit)
        written[split] = write_split([to_row(p, split, i) for i, p in enumerate(problems)], out_dir, split)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write <split>.parquet and <split>.jsonl into")
    parser.add_argument(
        "--source", choices=("hub", "local"), default="hub", help=f"hub: {DATA_SOURCE}; local: JSONL files"
    )
    parser.add_argument("--local-dir", help=f"local copy with train.jsonl/test.jsonl (default {default_local_dir()})")
    parser.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    parser.add_argument("--limit", type=int, help="keep only the first N problems of each split")
    args = parser.parse_args(argv)
    for split, paths in prepare(args.out, args.source, args.local_dir, args.splits, args.limit).items():
        print(f"{split}: {paths['parquet']} {paths['jsonl']}")


if __name__ == "__main__":
    main()
