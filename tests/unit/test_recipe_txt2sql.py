"""Txt2SQL recipe: the execution sandbox under attack, result comparison, scoring, loaders and the generator."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from recipes.txt2sql import data
from recipes.txt2sql.reward import compute_score, orders_rows, results_match
from recipes.txt2sql.sandbox import (
    ExecutionLimits,
    SQLExecutionError,
    SQLRefused,
    SQLResultTooLarge,
    SQLTimeout,
    execute_readonly,
)
from recipes.txt2sql.synthetic import generate_corpus

REPO_ROOT = Path(__file__).resolve().parents[2]
ENDLESS_CTE = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT COUNT(*) FROM r"


@pytest.fixture
def db(tmp_path) -> Path:
    return _database(
        tmp_path / "shop.sqlite",
        "CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, price REAL);"
        "INSERT INTO t (name, price) VALUES ('apple', 1.5), ('pear', 2.0), ('fig', 3.25), ('kiwi', 0.5);",
    )


def _database(path: Path, script: str) -> Path:
    connection = sqlite3.connect(path)
    connection.executescript(script)
    connection.commit()
    connection.close()
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def score(db: Path, completion: str, gold: str, **kwargs) -> dict[str, float]:
    return compute_score("synthetic_sql", completion, gold, {"db_path": str(db)}, **kwargs)


def test_drop_table_is_refused_and_the_database_is_unchanged(db):
    before = digest(db)
    with pytest.raises(SQLRefused):
        execute_readonly(db, "DROP TABLE t")
    assert digest(db) == before
    assert execute_readonly(db, "SELECT COUNT(*) FROM t") == [(4,)]


def test_writes_and_schema_changes_are_refused(db):
    before = digest(db)
    for statement in (
        "DELETE FROM t",
        "INSERT INTO t (name) VALUES ('x')",
        "UPDATE t SET price = 0",
        "CREATE TABLE u (a)",
        "CREATE TEMP TABLE u (a)",
        "ALTER TABLE t ADD COLUMN c",
        "VACUUM",
        "PRAGMA query_only = OFF",
        "BEGIN",
    ):
        with pytest.raises(SQLRefused):
            execute_readonly(db, statement)
    assert digest(db) == before


def test_multi_statement_injection_is_refused_before_anything_runs(db):
    before = digest(db)
    with pytest.raises(SQLRefused, match="single statement"):
        execute_readonly(db, "SELECT 1; DROP TABLE t")
    assert digest(db) == before
    assert execute_readonly(db, "SELECT COUNT(*) FROM t") == [(4,)]


def test_attach_database_is_refused_and_creates_no_file(db, tmp_path):
    target = tmp_path / "stolen.sqlite"
    with pytest.raises(SQLRefused):
        execute_readonly(db, f"ATTACH DATABASE '{target}' AS stolen")
    assert not target.exists()


def test_endless_recursive_cte_times_out_quickly(db):
    start = time.monotonic()
    with pytest.raises(SQLTimeout):
        execute_readonly(db, ENDLESS_CTE, ExecutionLimits(timeout_s=0.2))
    assert time.monotonic() - start < 1.5


def test_results_past_the_row_limit_are_refused(db):
    with pytest.raises(SQLResultTooLarge):
        execute_readonly(db, "SELECT * FROM t", ExecutionLimits(max_rows=3))
    assert len(execute_readonly(db, "SELECT * FROM t", ExecutionLimits(max_rows=4))) == 4


def test_oversized_values_are_refused(db):
    with pytest.raises(SQLExecutionError, match="too big"):
        execute_readonly(db, "SELECT zeroblob(100000000)", ExecutionLimits(max_value_bytes=1_000_000))


def _blob_query(rows: int, columns: int) -> str:
    values = ", ".join(["zeroblob(999999)"] * columns)
    return f"WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT {rows}) SELECT {values} FROM r"


# Peak memory from VmHWM, this process image's high-water mark: ru_maxrss survives exec, so a child of a
# large pytest process would report the parent's peak (1.1 GB in CI) rather than its own.
_HUGE_RESULTS_SCRIPT = """
import json, re, sys, time
from pathlib import Path
from recipes.txt2sql.sandbox import ExecutionLimits, SQLExecutionError, execute_readonly
outcomes = []
for sql in json.loads(sys.argv[2]):
    start = time.monotonic()
    try:
        outcome = f"{len(execute_readonly(sys.argv[1], sql, ExecutionLimits(timeout_s=1.0)))} rows"
    except SQLExecutionError as error:
        outcome = type(error).__name__
    outcomes.append([outcome, time.monotonic() - start])
peak_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({"outcomes": outcomes, "max_rss_mb": peak_kb / 1024}))
"""


def test_huge_results_are_refused_quickly_with_bounded_memory(db):
    # 1 row x 1000 columns of ~1 MB took 3 s past a 2 s limit and 1.9 GB;
    # 200 rows x 1 MB came back whole. Run apart so peak memory is this run's.
    attacks = [_blob_query(1, 1000), _blob_query(1000, 60), _blob_query(200, 1)]
    completed = subprocess.run(
        [sys.executable, "-c", _HUGE_RESULTS_SCRIPT, str(db), json.dumps(attacks)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        # pytest puts the repository on sys.path (pythonpath = ["."]); the child needs it too.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    report = json.loads(completed.stdout)
    for (outcome, elapsed), attack in zip(report["outcomes"], attacks):
        assert outcome == "SQLResultTooLarge", (attack[-60:], outcome)
        assert elapsed < 2.0, (attack[-60:], elapsed)
    assert report["max_rss_mb"] < 600, report


def test_a_huge_prediction_scores_as_a_failed_query(db):
    result = score(db, f"<sql>{_blob_query(1, 1000)}</sql>", "SELECT name FROM t")
    assert result["score"] == 0.1 and result["executable"] == 0.0


def test_results_past_the_byte_limit_are_refused(db):
    with pytest.raises(SQLResultTooLarge):
        execute_readonly(db, "SELECT name FROM t", ExecutionLimits(max_result_bytes=10))
    assert execute_readonly(db, "SELECT name FROM t", ExecutionLimits(max_result_bytes=100))


def test_the_column_limit_admits_the_databases_own_wide_tables(tmp_path):
    columns = ", ".join(f"c{i} INTEGER" for i in range(100))
    path = _database(
        tmp_path / "wide.sqlite", f"CREATE TABLE wide ({columns}); INSERT INTO wide VALUES ({', '.join(['1'] * 100)});"
    )
    assert len(execute_readonly(path, "SELECT * FROM wide")[0]) == 100
    assert len(execute_readonly(path, "SELECT * FROM wide AS a, wide AS b")[0]) == 200
    with pytest.raises(SQLResultTooLarge):
        execute_readonly(path, "SELECT * FROM wide AS a, wide AS b, wide AS c")


@pytest.fixture
def bad_utf8_db(tmp_path) -> Path:
    return _database(
        tmp_path / "bad_utf8.sqlite",
        "CREATE TABLE people (id INTEGER PRIMARY KEY, name TEXT);"
        "INSERT INTO people (name) VALUES (CAST(x'4d61726961ff' AS TEXT)), ('Ana');",
    )


def test_invalid_utf8_text_is_read_with_replacement_characters(bad_utf8_db):
    rows = execute_readonly(bad_utf8_db, "SELECT name FROM people ORDER BY id")
    assert rows == [("Maria\ufffd",), ("Ana",)]
    assert execute_readonly(bad_utf8_db, "SELECT CAST(x'ff' AS TEXT)") == [("\ufffd",)]


def test_invalid_utf8_in_prediction_or_gold_is_scored_not_raised(bad_utf8_db):
    gold = "SELECT name FROM people"
    # Python's sqlite3 failed these with an OperationalError lacking sqlite_errorname.
    wrong = score(bad_utf8_db, "<sql>SELECT CAST(x'ff' AS TEXT)</sql>", gold)
    assert wrong["score"] == 0.1 and wrong["executable"] == 1.0 and wrong["gold_failed"] == 0.0
    right = score(bad_utf8_db, "<sql>SELECT name FROM people</sql>", gold)
    assert right["score"] == 1.0 and right["acc"] == 1.0


def test_a_missing_database_is_not_created(tmp_path):
    missing = tmp_path / "missing.sqlite"
    with pytest.raises(FileNotFoundError):
        execute_readonly(missing, "SELECT 1")
    assert not missing.exists()


def test_adversarial_completions_earn_at_most_the_format_score_and_change_nothing(db):
    before = digest(db)
    gold = "SELECT name FROM t"
    for attack in ("DROP TABLE t", "SELECT name FROM t; DROP TABLE t", f"ATTACH DATABASE '{db}.x' AS x", ENDLESS_CTE):
        result = score(db, f"<sql>{attack}</sql>", gold, timeout_s=0.2)
        assert result["score"] == 0.1 and result["executable"] == 0.0
    assert digest(db) == before


def test_unordered_results_match_as_multisets():
    assert results_match([("a",), ("b",)], [("b",), ("a",)], ordered=False)
    assert not results_match([("a",), ("a",)], [("a",)], ordered=False)
    assert not results_match([("a", "b")], [("b", "a")], ordered=False)


def test_ordered_results_must_match_in_order():
    assert results_match([("a",), ("b",)], [("a",), ("b",)], ordered=True)
    assert not results_match([("a",), ("b",)], [("b",), ("a",)], ordered=True)


def test_float_results_match_up_to_six_decimals():
    assert results_match([(1 / 3,)], [(0.3333333333,)], ordered=False)
    assert not results_match([(0.3334,)], [(0.3333,)], ordered=False)


def test_only_a_top_level_order_by_orders_the_result():
    assert orders_rows("SELECT name FROM t ORDER BY price DESC")
    assert orders_rows("select a from t union select b from u order by 1")
    assert not orders_rows("SELECT name FROM (SELECT name FROM t ORDER BY price LIMIT 2)")
    assert not orders_rows("SELECT name, RANK() OVER (ORDER BY price) FROM t")
    assert not orders_rows("SELECT name FROM t WHERE name = 'order by'")
    assert not orders_rows("SELECT name FROM t -- order by price")
    assert not orders_rows('SELECT "order by" FROM t')


def test_correct_query_in_tags_earns_full_score_regardless_of_row_order(db):
    result = score(
        db,
        "Let me think. <sql>SELECT name FROM t WHERE price > 1 ORDER BY name</sql>",
        "SELECT name FROM t WHERE price > 1.0",
    )
    assert result == {"score": 1.0, "acc": 1.0, "format": 1.0, "executable": 1.0, "gold_failed": 0.0}


def test_order_matters_when_the_gold_query_orders(db):
    gold = "SELECT name FROM t ORDER BY price DESC"
    assert score(db, "<sql>SELECT name FROM t ORDER BY price DESC</sql>", gold)["acc"] == 1.0
    assert score(db, "<sql>SELECT name FROM t ORDER BY price ASC</sql>", gold)["acc"] == 0.0


def test_format_reward_needs_the_sql_tags(db):
    gold = "SELECT COUNT(*) FROM t"
    assert score(db, "SELECT COUNT(*) FROM t", gold)["score"] == 0.0
    assert score(db, "<sql>SELECT 5</sql>", gold)["score"] == 0.1
    assert score(db, "<sql>SELEC nonsense</sql>", gold) == {
        "score": 0.1,
        "acc": 0.0,
        "format": 1.0,
        "executable": 0.0,
        "gold_failed": 0.0,
    }
    assert score(db, "<sql>SELECT 5</sql>", gold, format_score=0.0)["score"] == 0.0


def test_the_last_sql_block_is_the_answer(db):
    gold = "SELECT COUNT(*) FROM t"
    assert score(db, "draft <sql>SELECT 5</sql> final <sql>SELECT COUNT(*) FROM t</sql>", gold)["acc"] == 1.0


def test_a_failing_gold_query_scores_zero_and_is_reported(db):
    result = score(db, "<sql>SELECT 1</sql>", "SELECT missing_column FROM t")
    assert result["gold_failed"] == 1.0 and result["score"] == 0.0


def test_score_requires_the_database_path():
    with pytest.raises(ValueError, match="db_path"):
        compute_score("spider", "<sql>SELECT 1</sql>", "SELECT 1", {})


def test_generator_is_deterministic_in_its_seed(tmp_path):
    first = generate_corpus(tmp_path / "a", seed=3, train_databases=2, dev_databases=1, questions_per_database=6)
    second = generate_corpus(tmp_path / "b", seed=3, train_databases=2, dev_databases=1, questions_per_database=6)
    other = generate_corpus(tmp_path / "c", seed=4, train_databases=2, dev_databases=1, questions_per_database=6)

    def dump(root: Path) -> tuple[str, list[list[str]]]:
        questions = (root / "train_spider.json").read_text() + (root / "dev.json").read_text()
        databases = []
        for path in sorted((root / "database").glob("*/*.sqlite")):
            connection = sqlite3.connect(path)
            databases.append(list(connection.iterdump()))
            connection.close()
        return questions, databases

    assert dump(first) == dump(second)
    assert dump(first) != dump(other)


def test_generated_gold_queries_answer_with_rows_and_dev_databases_are_unseen(tmp_path):
    root = generate_corpus(tmp_path, seed=0, train_databases=3, dev_databases=2, questions_per_database=10)
    train = data.load_spider(root, "train")
    dev = data.load_spider(root, "dev")
    assert len(train) == 30 and len(dev) == 20
    assert not {e.db_id for e in train} & {e.db_id for e in dev}
    for example in train + dev:
        assert execute_readonly(example.db_path, example.gold_sql), example.gold_sql


def test_bird_loader_reads_the_release_layout_and_puts_evidence_in_the_prompt(tmp_path, db):
    split_dir = tmp_path / "train"
    (split_dir / "train_databases" / "shop").mkdir(parents=True)
    (split_dir / "train_databases" / "shop" / "shop.sqlite").write_bytes(db.read_bytes())
    record = {
        "db_id": "shop",
        "question": "Which fruit is cheapest?",
        "evidence": "cheapest refers to MIN(price)",
        "SQL": "SELECT name FROM t ORDER BY price LIMIT 1",
    }
    (split_dir / "train.json").write_text(json.dumps([record]))

    for root in (tmp_path, split_dir):
        [example] = data.load_bird(root, "train")
        assert example.gold_sql == record["SQL"] and example.evidence == record["evidence"]
        assert example.db_path == (split_dir / "train_databases" / "shop" / "shop.sqlite").resolve()
    prompt = data.build_prompt(example)[0]["content"]
    assert "CREATE TABLE t" in prompt
    assert prompt.index("CREATE TABLE t") < prompt.index("External knowledge: cheapest") < prompt.index("Question:")


def test_loader_names_a_missing_database(tmp_path):
    (tmp_path / "train_spider.json").write_text(json.dumps([{"db_id": "gone", "question": "q", "query": "SELECT 1"}]))
    with pytest.raises(FileNotFoundError, match="'gone'"):
        data.load_spider(tmp_path, "train")


def test_synthetic_prepare_writes_rows_whose_gold_scores_full_marks(tmp_path):
    written = data.prepare(tmp_path / "out", "synthetic", root=tmp_path / "corpus", limit=8)
    rows = pq.read_table(written["train"]["parquet"]).to_pylist()
    assert len(rows) == 8
    for row in rows:
        assert row["data_source"] == "synthetic_sql" and row["ability"] == "sql"
        assert Path(row["extra_info"]["db_path"]).is_absolute()
        assert row["prompt"][0]["content"].endswith(data.INSTRUCTION)
        gold = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], f"<sql>{gold}</sql>", gold, row["extra_info"])["score"] == 1.0
