"""GSM8K recipe: answer extraction and scoring, and data preparation on the real GSM8K files."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from recipes.common.paths import DATA_DIR_ENV, REPO_ROOT
from recipes.gsm8k import data
from recipes.gsm8k.reward import canonical_number, compute_score, extract_answer

GSM8K_DIR = data.default_local_dir()
needs_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(), reason=f"no GSM8K copy at {GSM8K_DIR}")


def score(solution: str, truth: str = "72", **kwargs) -> float:
    return compute_score("openai/gsm8k", solution, truth, **kwargs)["score"]


def test_strict_reads_the_number_after_the_last_hash_marker():
    assert extract_answer("first #### 10 then corrected #### 72", "strict") == "72"
    assert score("48 + 24 = 72\n#### 72") == 1.0


def test_strict_ignores_numbers_without_the_hash_marker():
    assert extract_answer("The answer is 72.", "strict") is None
    assert score("The answer is 72.") == 0.0


def test_flexible_reads_the_last_number_anywhere():
    assert extract_answer("She had 48, sold 24, so 72.", "flexible") == "72"
    assert score("She had 48, sold 24, so 72.", method="flexible") == 1.0


def test_commas_and_dollar_signs_are_normalized():
    assert score("#### $1,234", truth="1234") == 1.0
    assert score("She earns $1,234.00 in total.", truth="1234", method="flexible") == 1.0
    assert canonical_number("-$5") == "-5"


def test_numbers_compare_by_value():
    assert score("#### 72.00") == 1.0
    assert score("#### 0.50", truth="0.5") == 1.0
    assert score("#### 7.2") == 0.0


def test_wrong_answer_with_a_marker_earns_only_the_format_score():
    result = compute_score("openai/gsm8k", "#### 71", "72", format_score=0.1)
    assert result == {"score": 0.1, "acc": 0.0, "format": 1.0}
    assert score("no number here", format_score=0.1) == 0.0


def test_flexible_reports_format_only_for_the_hash_marker():
    result = compute_score("openai/gsm8k", "so 72", "72", method="flexible")
    assert result == {"score": 1.0, "acc": 1.0, "format": 0.0}


def test_unknown_method_is_rejected_by_name():
    with pytest.raises(ValueError, match="method must be one of"):
        score("#### 72", method="lenient")


def test_non_numeric_ground_truth_is_rejected():
    with pytest.raises(ValueError, match="ground_truth must be a number"):
        score("#### 72", truth="seventy-two")


def test_default_local_dir_is_next_to_the_repository_unless_the_env_var_says_otherwise(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert data.default_local_dir() == REPO_ROOT.parent / "shared" / "data" / "gsm8k"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert data.default_local_dir() == tmp_path / "gsm8k"


def test_missing_local_copy_names_the_path_and_the_alternatives(tmp_path):
    with pytest.raises(FileNotFoundError, match="--source hub"):
        data.load_split("train", source="local", local_dir=tmp_path)


@needs_gsm8k
def test_prepare_writes_verl_rows_from_the_real_files(tmp_path):
    written = data.prepare(tmp_path, source="local", limit=3)

    rows = pq.read_table(written["train"]["parquet"]).to_pylist()
    assert len(rows) == 3
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k"
    assert first["ability"] == "math"
    assert first["prompt"] == [{"role": "user", "content": first["extra_info"]["question"] + " " + data.INSTRUCTION}]
    assert first["extra_info"]["question"].startswith("Natalia sold clips")
    assert first["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert first["extra_info"]["split"] == "train" and first["extra_info"]["index"] == 0
    jsonl_rows = [json.loads(line) for line in written["train"]["jsonl"].read_text().splitlines()]
    assert jsonl_rows == rows
    assert len(pq.read_table(written["test"]["parquet"])) == 3


@needs_gsm8k
def test_reference_solutions_score_full_marks_under_strict_extraction():
    problems = data.load_split("test", source="local", limit=50)
    for problem in problems:
        truth = data.reference_answer(problem["answer"])
        assert compute_score("openai/gsm8k", problem["answer"], truth)["score"] == 1.0
