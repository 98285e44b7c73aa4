"""Long-context QA data preparation: HotpotQA, MuSiQue or synthetic contexts to verl-format parquet and JSONL.

    python -m recipes.long_context_qa.data --out ~/data/hotpotqa --dataset hotpotqa            # hub: hotpotqa/hotpot_qa
    python -m recipes.long_context_qa.data --out ~/data/hotpotqa --dataset hotpotqa \\
        --train-file hotpot_train_v1.1.json --test-file hotpot_dev_distractor_v1.json
    python -m recipes.long_context_qa.data --out ~/data/musique --dataset musique \\
        --train-file musique_ans_v1.0_train.jsonl --test-file musique_ans_v1.0_dev.jsonl
    python -m recipes.long_context_qa.data --out /tmp/lcqa --dataset synthetic --tokenizer MODEL_DIR \\
        --context-tokens 32768 --contexts 64 --questions-per-context 8

Fields read, as the releases name them:

- HotpotQA: ``question``, ``answer``, ``context`` as ``[title, [sentence, ...]]``
  pairs and ``supporting_facts`` as ``[title, sentence_index]`` pairs; the hub
  copy's column-wise ``{"title": [...], "sentences": [...]}`` form as well.
- MuSiQue: ``question``, ``answer``, ``answer_aliases``, ``paragraphs`` with
  ``title``, ``paragraph_text`` and ``is_supporting``; unanswerable questions
  (``answerable: false``) are skipped.

Rows that share a context are written next to each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from recipes.common.records import read_json_records, take, write_split
from recipes.long_context_qa.examples import Document, QAExample, to_row
from recipes.long_context_qa.synthetic import DATA_SOURCE as SYNTHETIC_DATA_SOURCE
from recipes.long_context_qa.synthetic import generate

Dataset = Literal["hotpotqa", "musique", "synthetic"]
SPLITS = ("train", "test")
HUB = {"hotpotqa": ("hotpotqa/hotpot_qa", "distractor")}
# The split each of ours reads on the hub: HotpotQA publishes no test answers.
HUB_SPLITS = {"train": "train", "test": "validation"}
# Added to --seed per split; fixed by name, not by position in --splits.
SYNTHETIC_SEED_OFFSETS = {"train": 0, "test": 1}


def _field(record: dict[str, Any], name: str, dataset: str) -> Any:
    if name not in record:
        raise ValueError(f"a {dataset} record lacks field {name!r} (has {sorted(record)})")
    return record[name]


def _pairs(value: Any, keys: tuple[str, str]) -> list[tuple[Any, Any]]:
    """HotpotQA's row-wise ``[[a, b], ...]`` or the hub's column-wise ``{keys[0]: [...], keys[1]: [...]}``."""
    if isinstance(value, dict):
        return list(zip(value[keys[0]], value[keys[1]], strict=True))
    return [(first, second) for first, second in value]


def from_hotpotqa(record: dict[str, Any]) -> QAExample:
    """A HotpotQA record (distractor setting) as a QAExample; supporting documents are those with supporting facts."""
    example_id = str(record["_id"] if "_id" in record else _field(record, "id", "HotpotQA"))
    context = _pairs(_field(record, "context", "HotpotQA"), ("title", "sentences"))
    supporting = {title for title, _ in _pairs(record.get("supporting_facts") or [], ("title", "sent_id"))}
    documents = tuple(
        # HotpotQA sentences carry their own leading spaces.
        Document(title, "".join(sentences).strip(), title in supporting)
        for title, sentences in context
    )
    return QAExample(
        id=example_id,
        question=_field(record, "question", "HotpotQA"),
        answers=(_field(record, "answer", "HotpotQA"),),
        documents=documents,
        context_id=example_id,
    )


def from_musique(record: dict[str, Any]) -> QAExample | None:
    """A MuSiQue record as a QAExample, the answer and its aliases accepted; None if it is unanswerable."""
    if record.get("answerable") is False:
        return None
    example_id = str(_field(record, "id", "MuSiQue"))
    documents = tuple(
        Document(paragraph["title"], paragraph["paragraph_text"], bool(paragraph.get("is_supporting")))
        for paragraph in _field(record, "paragraphs", "MuSiQue")
    )
    answers = dict.fromkeys([_field(record, "answer", "MuSiQue"), *record.get("answer_aliases", [])])
    return QAExample(
        id=example_id,
        question=_field(record, "question", "MuSiQue"),
        answers=tuple(answers),
        documents=documents,
        context_id=example_id,
    )


def convert(dataset: Dataset, records: Iterable[dict[str, Any]]) -> list[QAExample]:
    """QAExamples from raw ``hotpotqa`` or ``musique`` records, skipping unanswerable ones."""
    if dataset == "hotpotqa":
        return [from_hotpotqa(record) for record in records]
    if dataset == "musique":
        return [example for record in records if (example := from_musique(record)) is not None]
    raise ValueError(f"dataset must be 'hotpotqa' or 'musique' to convert records, got {dataset!r}")


def load_records(
    dataset: Dataset,
    split: str,
    file: str | Path | None = None,
    hub_id: str | None = None,
    hub_config: str | None = None,
) -> list[dict[str, Any]]:
    """Raw records of ``split``: from ``file`` (JSON or JSONL) if given, else from the hub."""
    if file is not None:
        return read_json_records(file)
    default_id, default_config = HUB.get(dataset, (None, None))
    hub_id = hub_id or default_id
    if hub_id is None:
        raise ValueError(f"{dataset} {split} split needs a local file (--{split}-file) or --hub-id")
    import datasets

    config = hub_config if hub_config is not None else default_config
    return [dict(row) for row in datasets.load_dataset(hub_id, config, split=HUB_SPLITS[split])]


def prepare(
    out_dir: str | Path,
    dataset: Dataset,
    files: dict[str, str | Path] | None = None,
    splits: Sequence[str] = SPLITS,
    limit: int | None = None,
    hub_id: str | None = None,
    hub_config: str | None = None,
) -> dict[str, dict[str, Path]]:
    """Write HotpotQA or MuSiQue splits under ``out_dir``; ``files`` maps a split to its local file."""
    files = files or {}
    written = {}
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        examples = take(convert(dataset, load_records(dataset, split, files.get(split), hub_id, hub_config)), limit)
        rows = [to_row(example, dataset, split, i) for i, example in enumerate(examples)]
        written[split] = write_split(rows, out_dir, split)
    return written


def prepare_synthetic(
    out_dir: str | Path,
    tokenizer: Any,
    context_tokens: int,
    contexts: dict[str, int],
    questions_per_context: int,
    seed: int = 0,
) -> dict[str, dict[str, Path]]:
    """Write synthetic splits under ``out_dir``; ``contexts`` maps a split to its number of contexts.

    Each split has its own seed, ``seed`` plus a fixed offset per split name
    (``SYNTHETIC_SEED_OFFSETS``: train 0, test 1), so no context appears in two
    splits and a split is the same whichever other splits are written with it
    (``--splits test`` alone writes the test split of a full run).
    """
    written = {}
    for split, count in contexts.items():
        if split not in SYNTHETIC_SEED_OFFSETS:
            raise ValueError(f"split must be one of {tuple(SYNTHETIC_SEED_OFFSETS)}, got {split!r}")
        rows: list[dict[str, Any]] = []
        split_seed = seed + SYNTHETIC_SEED_OFFSETS[split]
        for context in generate(count, questions_per_context, context_tokens, tokenizer, split_seed):
            for example in context.examples:
                rows.append(to_row(example, SYNTHETIC_DATA_SOURCE, split, len(rows), context_tokens=context.tokens))
        written[split] = write_split(rows, out_dir, split)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write <split>.parquet and <split>.jsonl into")
    parser.add_argument("--dataset", choices=("hotpotqa", "musique", "synthetic"), required=True)
    parser.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS))
    real = parser.add_argument_group("hotpotqa / musique")
    real.add_argument("--limit", type=int, help="keep only the first N examples of each split")
    real.add_argument("--train-file", help="local JSON/JSONL of the train split (default: the hub)")
    real.add_argument("--test-file", help="local JSON/JSONL of the test split (default: the hub's validation split)")
    real.add_argument("--hub-id", help=f"hub dataset id (default for hotpotqa: {HUB['hotpotqa'][0]})")
    real.add_argument("--hub-config", help=f"hub dataset config (default for hotpotqa: {HUB['hotpotqa'][1]})")
    synthetic = parser.add_argument_group("synthetic")
    synthetic.add_argument("--tokenizer", help="tokenizer (model directory or hub id) that measures context length")
    synthetic.add_argument("--context-tokens", type=int, default=8192, help="token budget of each shared context")
    synthetic.add_argument("--contexts", type=int, default=32, help="contexts in the train split")
    synthetic.add_argument("--test-contexts", type=int, default=4, help="contexts in the test split")
    synthetic.add_argument("--questions-per-context", type=int, default=8)
    synthetic.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.dataset == "synthetic":
        if args.tokenizer is None:
            parser.error("--dataset synthetic needs --tokenizer to measure context length")
        counts = {"train": args.contexts, "test": args.test_contexts}
        written = prepare_synthetic(
            args.out,
            args.tokenizer,
            args.context_tokens,
            {split: counts[split] for split in args.splits},
            args.questions_per_context,
            args.seed,
        )
    else:
        files = {split: path for split, path in (("train", args.train_file), ("test", args.test_file)) if path}
        written = prepare(args.out, args.dataset, files, args.splits, args.limit, args.hub_id, args.hub_config)
    for split, paths in written.items():
        print(f"{split}: {paths['parquet']} {paths['jsonl']}")


if __name__ == "__main__":
    main()
