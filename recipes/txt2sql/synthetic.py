"""Small synthetic Txt2SQL corpora: SQLite databases with question/SQL pairs, the same for the same seed.

The corpus is written in Spider's layout, so ``load_spider`` reads it like the
real thing and tests and the CPU smoke run go through the real code path:

    <out>/train_spider.json, <out>/dev.json       [{"db_id", "question", "query"}, ...]
    <out>/database/<db_id>/<db_id>.sqlite

Each database holds one of a few two-table domains (a group table and an item
table with a foreign key). Every question's gold query has a non-empty result
that answers it without ties, and train and dev use disjoint databases, as in
Spider.

    python -m recipes.txt2sql.synthetic /tmp/synthetic_sql --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SPLIT_FILES = {"train": "train_spider.json", "dev": "dev.json"}


@dataclass(frozen=True)
class _Domain:
    """A two-table world: groups (``group_table``) each holding items (``item_table``), and how to talk about it."""

    group_table: str
    group_noun: str
    group_names: tuple[str, ...]
    item_table: str
    item_noun: str
    item_plural: str
    amount: str
    amount_phrase: str
    above: str
    descending: str
    amount_range: tuple[int, int]
    year_column: str
    year_verb: str
    item_names: Callable[[random.Random], str]


_FIRST = (
    "Ada",
    "Bram",
    "Cora",
    "Dev",
    "Elin",
    "Faro",
    "Gita",
    "Hugo",
    "Iris",
    "Jon",
    "Kira",
    "Leo",
    "Mina",
    "Nils",
    "Omar",
    "Pia",
    "Quin",
    "Rosa",
    "Sami",
    "Tove",
    "Uma",
    "Vik",
    "Wren",
    "Yara",
    "Zeno",
)
_LAST = (
    "Abbot",
    "Berg",
    "Castell",
    "Dahl",
    "Eklund",
    "Ferro",
    "Grant",
    "Holm",
    "Ivers",
    "Jansen",
    "Kovac",
    "Lund",
    "Moreau",
    "Novak",
    "Olsen",
    "Price",
    "Quist",
    "Rossi",
    "Stone",
    "Toth",
    "Varga",
    "Weber",
    "Young",
    "Zell",
)
_ADJECTIVES = (
    "Silent",
    "Hidden",
    "Golden",
    "Last",
    "Broken",
    "Northern",
    "Crimson",
    "Quiet",
    "Endless",
    "Bright",
    "Lost",
    "Winter",
    "Paper",
    "Iron",
    "Glass",
    "Hollow",
)
_NOUNS = (
    "River",
    "Garden",
    "Harbor",
    "Orchard",
    "Tower",
    "Letter",
    "Island",
    "Forest",
    "Bridge",
    "Compass",
    "Lantern",
    "Mountain",
    "Station",
    "Archive",
    "Meadow",
    "Engine",
)
_CITIES = ("Oslo", "Lyon", "Porto", "Turin", "Ghent", "Malmo", "Krakow", "Bergen", "Graz", "Leeds")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _title(rng: random.Random) -> str:
    return f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"


_DOMAINS = (
    _Domain(
        group_table="departments",
        group_noun="department",
        group_names=("Sales", "Research", "Finance", "Legal", "Support", "Design"),
        item_table="employees",
        item_noun="employee",
        item_plural="employees",
        amount="salary",
        amount_phrase="salary",
        above="with a salary above {}",
        descending="from the highest salary to the lowest",
        amount_range=(30_000, 150_000),
        year_column="hire_year",
        year_verb="were hired",
        item_names=_person,
    ),
    _Domain(
        group_table="publishers",
        group_noun="publisher",
        group_names=("Northwind", "Bluebird", "Harbor", "Quill", "Meridian", "Atlas"),
        item_table="books",
        item_noun="book",
        item_plural="books",
        amount="pages",
        amount_phrase="number of pages",
        above="with more than {} pages",
        descending="from the longest to the shortest",
        amount_range=(80, 1_200),
        year_column="published_year",
        year_verb="were published",
        item_names=_title,
    ),
    _Domain(
        group_table="teams",
        group_noun="team",
        group_names=("Falcons", "Otters", "Comets", "Wolves", "Herons", "Tigers"),
        item_table="players",
        item_noun="player",
        item_plural="players",
        amount="goals",
        amount_phrase="number of goals",
        above="who scored more than {} goals",
        descending="from the most goals to the fewest",
        amount_range=(0, 400),
        year_column="joined_year",
        year_verb="joined their team",
        item_names=_person,
    ),
)


@dataclass(frozen=True)
class _Item:
    name: str
    group_id: int
    amount: int
    year: int


def _build_world(rng: random.Random, domain: _Domain) -> tuple[list[tuple[str, str]], list[_Item]]:
    """Groups (name, city) and items with unique names and unique amounts, so ordered answers have no ties."""
    groups = [(name, rng.choice(_CITIES)) for name in rng.sample(domain.group_names, rng.randint(3, 5))]
    size = rng.randint(10, 18)
    names: set[str] = set()
    while len(names) < size:
        names.add(domain.item_names(rng))
    amounts = rng.sample(range(*domain.amount_range), len(names))
    items = [
        _Item(name, rng.randrange(len(groups)) + 1, amount, rng.randint(1995, 2024))
        for name, amount in zip(sorted(names), amounts)
    ]
    return groups, items


def _write_database(path: Path, domain: _Domain, groups: list[tuple[str, str]], items: list[_Item]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    connection = sqlite3.connect(path)
    try:
        connection.executescript(
            f"CREATE TABLE {domain.group_table} (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);\n"
            f"CREATE TABLE {domain.item_table} (id INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            f"{domain.group_noun}_id INTEGER NOT NULL REFERENCES {domain.group_table}(id), "
            f"{domain.amount} INTEGER NOT NULL, {domain.year_column} INTEGER NOT NULL);"
        )
        connection.executemany(f"INSERT INTO {domain.group_table} (name, city) VALUES (?, ?)", groups)
        connection.executemany(
            f"INSERT INTO {domain.item_table} (name, {domain.group_noun}_id, {domain.amount}, {domain.year_column}) "
            "VALUES (?, ?, ?, ?)",
            [(item.name, item.group_id, item.amount, item.year) for item in items],
        )
        connection.commit()
    finally:
        connection.close()


def _candidate_questions(
    rng: random.Random, domain: _Domain, groups: list[tuple[str, str]], items: list[_Item]
) -> list[tuple[str, str]]:
    """Question/SQL pairs about this world whose answers exist and are unambiguous."""
    d = domain
    g, i = d.group_table, d.item_table
    join = f"{i} JOIN {g} ON {i}.{d.group_noun}_id = {g}.id"
    sizes = {group_id: sum(item.group_id == group_id for item in items) for group_id in range(1, len(groups) + 1)}
    populated = [groups[group_id - 1] for group_id, size in sizes.items() if size]
    group_name, _ = rng.choice(populated)
    city = rng.choice(sorted({c for (_, c) in populated}))
    # Below the largest amount and at most the latest year, so both filters keep at least one item.
    threshold = rng.choice(sorted(item.amount for item in items)[:-1])
    year = rng.choice([item.year for item in items])
    pairs = [
        (
            f"How many {d.item_plural} belong to the {group_name} {d.group_noun}?",
            f"SELECT COUNT(*) FROM {join} WHERE {g}.name = '{group_name}'",
        ),
        (f"What is the highest {d.amount_phrase} of any {d.item_noun}?", f"SELECT MAX({d.amount}) FROM {i}"),
        (
            f"List the names of {d.item_plural} {d.above.format(threshold)}, {d.descending}.",
            f"SELECT name FROM {i} WHERE {d.amount} > {threshold} ORDER BY {d.amount} DESC",
        ),
        (
            f"In which city is the {group_name} {d.group_noun} located?",
            f"SELECT city FROM {g} WHERE name = '{group_name}'",
        ),
        (
            f"For each {d.group_noun}, what is the average {d.amount_phrase} of its {d.item_plural}?",
            f"SELECT {g}.name, AVG({i}.{d.amount}) FROM {join} GROUP BY {g}.name",
        ),
        (
            f"Which {d.item_plural} {d.year_verb} in {year} or later?",
            f"SELECT name FROM {i} WHERE {d.year_column} >= {year}",
        ),
        (
            f"What is the total {d.amount_phrase} of {d.item_plural} whose {d.group_noun} is in {city}?",
            f"SELECT SUM({i}.{d.amount}) FROM {join} WHERE {g}.city = '{city}'",
        ),
        (
            f"Which {d.item_noun} has the lowest {d.amount_phrase}?",
            f"SELECT name FROM {i} ORDER BY {d.amount} ASC LIMIT 1",
        ),
    ]
    largest = sorted(sizes.values(), reverse=True)
    if largest[0] > largest[1]:
        pairs.append(
            (
                f"Which {d.group_noun} has the most {d.item_plural}?",
                f"SELECT {g}.name FROM {join} GROUP BY {g}.id ORDER BY COUNT(*) DESC LIMIT 1",
            )
        )
    return pairs


def _database_questions(rng: random.Random, db_id: str, database: Path, count: int) -> list[dict[str, str]]:
    domain = rng.choice(_DOMAINS)
    groups, items = _build_world(rng, domain)
    _write_database(database, domain, groups, items)
    questions: dict[str, str] = {}
    # Each draw re-rolls the group, city and thresholds; a bounded number of
    # draws keeps a tiny world from looping forever.
    for _ in range(count * 8):
        for question, sql in _candidate_questions(rng, domain, groups, items):
            questions.setdefault(sql, question)
        if len(questions) >= count:
            break
    chosen = rng.sample(sorted(questions.items()), min(count, len(questions)))
    return [{"db_id": db_id, "question": question, "query": sql} for sql, question in chosen]


def generate_corpus(
    out_dir: str | Path,
    seed: int = 0,
    train_databases: int = 6,
    dev_databases: int = 2,
    questions_per_database: int = 12,
) -> Path:
    """Write a Spider-layout corpus under ``out_dir`` and return it; the same arguments give the same corpus.

    Each database gets ``questions_per_database`` distinct questions, or all its
    world offers when that is fewer (a few dozen).
    """
    for field, value in (
        ("train_databases", train_databases),
        ("dev_databases", dev_databases),
        ("questions_per_database", questions_per_database),
    ):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    out_dir = Path(out_dir)
    rng = random.Random(seed)
    counts = {"train": train_databases, "dev": dev_databases}
    db_index = 0
    for split, file_name in SPLIT_FILES.items():
        examples = []
        for _ in range(counts[split]):
            db_id = f"synthetic_{db_index:03d}"
            database = out_dir / "database" / db_id / f"{db_id}.sqlite"
            examples.extend(_database_questions(rng, db_id, database, questions_per_database))
            db_index += 1
        (out_dir / file_name).write_text(json.dumps(examples, indent=1) + "\n", encoding="utf-8")
    return out_dir


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-databases", type=int, default=6)
    parser.add_argument("--dev-databases", type=int, default=2)
    parser.add_argument("--questions-per-database", type=int, default=12)
    args = parser.parse_args(argv)
    print(generate_corpus(args.out, args.seed, args.train_databases, args.dev_databases, args.questions_per_database))


if __name__ == "__main__":
    main()
