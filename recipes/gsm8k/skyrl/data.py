"""GSM8K in SkyRL's dataset format: the rows of ``recipes.gsm8k.data``, scored by the recipe's reward.

    python -m recipes.gsm8k.skyrl.data --out ~/data/gsm8k-skyrl                              # from the hub
    python -m recipes.gsm8k.skyrl.data --out /tmp/gsm8k-skyrl --source local --limit 64     # ../shared/data/gsm8k

Writes ``<split>.parquet`` (what ``data.train_data`` / ``data.val_data`` point at) and
``<split>.jsonl``. Each row carries ``env_class="gsm8k_recipe"`` and
``reward_spec.ground_truth``: the environment ``recipes.skyrl_main`` registers
(``recipes.skyrl_env``) scores the response with ``recipes.gsm8k.reward.compute_score``,
as verl and TRL do. skyrl-gym's own ``gsm8k`` environment compares strings and
scores ``#### 42.0``, ``#### $18`` or ``####42`` as wrong.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from recipes.common.records import to_skyrl_row, write_split
from recipes.gsm8k.data import SPLITS, Source, default_local_dir, load_split, to_row

ENV_CLASS = "gsm8k_recipe"


def prepare(
    out_dir: str | Path,
    source: Source = "hub",
    local_dir: str | Path | None = None,
    splits: Sequence[str] = SPLITS,
    limit: int | None = None,
) -> dict[str, dict[str, Path]]:
    """Write each split of GSM8K under ``out_dir`` in SkyRL's format; return the paths by split."""
    written = {}
    for split in splits:
        problems = load_split(split, source, local_dir, limit)
        rows = [to_skyrl_row(to_row(problem, split, i), ENV_CLASS) for i, problem in enumerate(problems)]
        written[split] = write_split(rows, out_dir, split)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write <split>.parquet and <split>.jsonl into")
    parser.add_argument("--source", choices=("hub", "local"), default="hub", help="hub: openai/gsm8k; local: JSONL")
    parser.add_argument("--local-dir", help=f"local copy with train.jsonl/test.jsonl (default {default_local_dir()})")
    parser.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    parser.add_argument("--limit", type=int, help="keep only the first N problems of each split")
    args = parser.parse_args(argv)
    for split, paths in prepare(args.out, args.source, args.local_dir, args.splits, args.limit).items():
        print(f"{split}: {paths['parquet']} {paths['jsonl']}")


if __name__ == "__main__":
    main()
