"""What the recipes share: the verl row, its files, tag extraction, the TRL reward adapter, and verl reading it all."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from recipes.common.records import chat_prompt, rl_row, to_skyrl_row, write_split
from recipes.common.tags import last_tagged
from recipes.common.trl_reward import score_value, trl_reward_func
from recipes.gsm8k.reward import compute_score as gsm8k_score


def gsm8k_row(question: str, truth: str, index: int = 0) -> dict:
    return rl_row(
        data_source="openai/gsm8k",
        prompt=chat_prompt(question),
        ability="math",
        ground_truth=truth,
        extra_info={"split": "train", "index": index},
    )


def test_row_has_verls_columns_and_rule_reward():
    row = rl_row(
        data_source="src",
        prompt=chat_prompt("q?", system="be brief"),
        ability="math",
        ground_truth="4",
        extra_info={"index": 0},
    )
    assert row == {
        "data_source": "src",
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0},
    }


def test_row_rejects_malformed_messages_and_empty_extra_info():
    with pytest.raises(ValueError, match=r"prompt\[0\]"):
        rl_row(
            data_source="s",
            prompt=[{"role": "robot", "content": "x"}],
            ability="a",
            ground_truth="",
            extra_info={"i": 0},
        )
    with pytest.raises(ValueError, match="extra_info"):
        rl_row(data_source="s", prompt=chat_prompt("x"), ability="a", ground_truth="", extra_info={})


def test_split_is_written_as_parquet_and_jsonl_with_the_same_rows(tmp_path):
    rows = [gsm8k_row("1+1?", "2"), gsm8k_row("2+2?", "4", index=1)]
    paths = write_split(rows, tmp_path, "train")
    assert pq.read_table(paths["parquet"]).to_pylist() == rows
    assert [json.loads(line) for line in paths["jsonl"].read_text().splitlines()] == rows


def test_writing_no_rows_names_the_split(tmp_path):
    with pytest.raises(ValueError, match="'dev'"):
        write_split([], tmp_path, "dev")


def test_skyrl_row_renames_the_reward_columns_and_names_the_environment():
    row = gsm8k_row("1+1?", "2")
    skyrl = to_skyrl_row(row, env_class="gsm8k")
    assert skyrl["env_class"] == "gsm8k"
    assert skyrl["reward_spec"] == {"method": "rule", "ground_truth": "2"}
    assert "reward_model" not in skyrl and skyrl["prompt"] == row["prompt"]


def test_skyrl_data_names_the_splits_it_found_when_one_asked_for_is_missing(tmp_path):
    from recipes.skyrl_data import convert

    # Txt2SQL writes train and dev; skyrl_data's default splits are train and test.
    for split in ("train", "dev"):
        write_split([gsm8k_row("1+1?", "2")], tmp_path / "verl", split)
    with pytest.raises(
        FileNotFoundError, match=r"'test' not found at .*test\.parquet.*--splits from \['dev', 'train'\]"
    ):
        convert(tmp_path / "verl", tmp_path / "skyrl", "txt2sql", ["train", "test"])
    with pytest.raises(FileNotFoundError, match="run the recipe's data script first"):
        convert(tmp_path / "empty", tmp_path / "skyrl", "txt2sql", ["train"])


def test_last_tagged_takes_the_last_non_blank_block():
    assert last_tagged("<sql>a</sql> then <SQL>\n b \n</SQL>", "sql") == "b"
    assert last_tagged("<answer>  </answer>", "answer") is None
    assert last_tagged("<answer>unclosed", "answer") is None


def test_score_value_reads_floats_and_score_dicts():
    assert score_value(0.5) == 0.5
    assert score_value({"score": 1, "acc": 1.0}) == 1.0
    with pytest.raises(ValueError, match="'score'"):
        score_value({"acc": 1.0})


def test_trl_reward_func_scores_each_completion_from_the_dataset_columns_and_logs_extras():
    rows = [gsm8k_row("1+1?", "2"), gsm8k_row("2+2?", "4", index=1)]
    logged = {}
    reward = trl_reward_func(gsm8k_score, "gsm8k", format_score=0.25)
    # Called as GRPOTrainer calls it: every non-prompt column as a per-sample list.
    scores = reward(
        prompts=[row["prompt"] for row in rows],
        completions=[[{"role": "assistant", "content": "#### 2"}], [{"role": "assistant", "content": "#### 5"}]],
        completion_ids=[[1], [2]],
        data_source=[row["data_source"] for row in rows],
        ability=[row["ability"] for row in rows],
        reward_model=[row["reward_model"] for row in rows],
        extra_info=[row["extra_info"] for row in rows],
        trainer_state=None,
        log_extra=lambda column, values: None,
        log_metric=lambda name, value: logged.__setitem__(name, value),
    )
    assert scores == [1.0, 0.25]
    assert reward.__name__ == "gsm8k"
    assert logged == {"gsm8k/acc": 0.5, "gsm8k/format": 1.0}


@pytest.mark.slow
def test_verl_reads_every_recipes_parquet_and_its_rows_score_with_the_recipes_reward(tmp_path):
    """Slow (imports verl, trains a tokenizer): verl's RLHFDataset loads both formats; its rows feed our reward."""
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from arctic_rl_core.models.tiny import train_tokenizer
    from recipes.long_context_qa import data as lcqa_data
    from recipes.long_context_qa.reward import compute_score as lcqa_score
    from recipes.txt2sql import data as sql_data
    from recipes.txt2sql.reward import compute_score as sql_score

    tokenizer = train_tokenizer()
    gsm8k = write_split([gsm8k_row("1+1?", "2"), gsm8k_row("2+2?", "4", index=1)], tmp_path / "gsm8k", "train")
    sql = sql_data.prepare(tmp_path / "sql", "synthetic", splits=["train"], limit=4)["train"]
    lcqa = lcqa_data.prepare_synthetic(tmp_path / "lcqa", tokenizer, 1024, {"train": 1}, questions_per_context=2)
    answers = {
        "openai/gsm8k": (gsm8k_score, lambda truth: f"#### {truth}"),
        "synthetic_sql": (sql_score, lambda truth: f"<sql>{truth}</sql>"),
        "synthetic_long_context": (lcqa_score, lambda truth: f"<answer>{truth[0]}</answer>"),
    }
    config = OmegaConf.create(
        {"max_prompt_length": 2048, "filter_overlong_prompts_workers": 1, "cache_dir": str(tmp_path / "cache")}
    )
    for paths in (gsm8k, sql, lcqa["train"]):
        for file_format in ("parquet", "jsonl"):
            dataset = RLHFDataset(str(paths[file_format]), tokenizer, config)
            assert len(dataset) == len(pq.read_table(paths["parquet"]))
            assert_rows_score_full_marks(dataset, answers)


def assert_rows_score_full_marks(dataset, answers) -> None:
    for item in (dataset[i] for i in range(len(dataset))):
        assert item["raw_prompt"][-1]["role"] == "user"
        compute_score, answer = answers[item["data_source"]]
        truth = item["reward_model"]["ground_truth"]
        assert compute_score(item["data_source"], answer(truth), truth, item["extra_info"])["score"] == 1.0
