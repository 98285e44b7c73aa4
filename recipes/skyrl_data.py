"""A recipe's prepared data in SkyRL's dataset format, each row bound to the recipe's skyrl-gym environment.

    python -m recipes.txt2sql.data --out /tmp/sql --source synthetic
    python -m recipes.skyrl_data --src /tmp/sql --out /tmp/sql-skyrl --env-class txt2sql --splits train dev

``--splits`` defaults to ``train test`` (the GSM8K and long-context QA splits); Txt2SQL's are ``train dev``.

Reads ``<split>.parquet`` of a recipe's data script (verl's format) and writes
``<split>.parquet`` and ``<split>.jsonl`` with SkyRL's columns
(``recipes.common.records.to_skyrl_row``): what ``data.train_data`` and
``data.val_data`` point at.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from recipes.common.records import to_skyrl_row, write_split

# The recipes' skyrl-gym environments (recipes.skyrl_env) and the module whose compute_score rewards
# each. Listed here, free of skyrl imports, so data converts in any environment. GSM8K's is not
# skyrl-gym's own `gsm8k` (a string match that scores "#### 42.0", "#### $18" or "####42" as 0) but
# the recipe's reward, as verl and TRL score it.
REWARD_MODULES = {
    "txt2sql": "recipes.txt2sql.reward",
    "long_context_qa": "recipes.long_context_qa.reward",
    "gsm8k_recipe": "recipes.gsm8k.reward",
}
ENV_CLASSES = tuple(REWARD_MODULES)


def convert(
    src_dir: str | Path, out_dir: str | Path, env_class: str, splits: Sequence[str]
) -> dict[str, dict[str, Path]]:
    """Write each split of ``src_dir`` under ``out_dir`` in SkyRL's format; return the paths by split."""
    import pyarrow.parquet as pq

    if env_class not in ENV_CLASSES:
        raise ValueError(f"env_class must be one of {ENV_CLASSES}, got {env_class!r}")
    written = {}
    for split in splits:
        source = Path(src_dir) / f"{split}.parquet"
        if not source.is_file():
            present = sorted(path.stem for path in Path(src_dir).glob("*.parquet"))
            hint = f"pass --splits from {present}" if present else "run the recipe's data script first"
            raise FileNotFoundError(f"split {split!r} not found at {str(source)!r}: {hint}")
        rows = pq.read_table(source).to_pylist()
        written[split] = write_split([to_skyrl_row(row, env_class) for row in rows], out_dir, split)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="directory with <split>.parquet from recipes.<task>.data")
    parser.add_argument("--out", required=True, help="directory to write SkyRL's <split>.parquet and .jsonl into")
    parser.add_argument("--env-class", required=True, choices=ENV_CLASSES)
    parser.add_argument("--splits", nargs="+", default=["train", "test"])
    args = parser.parse_args(argv)
    for split, paths in convert(args.src, args.out, args.env_class, args.splits).items():
        print(f"{split}: {paths['parquet']} {paths['jsonl']}")


if __name__ == "__main__":
    main()
