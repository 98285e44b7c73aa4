"""Long-context QA recipe: EM/F1 reward, HotpotQA and MuSiQue loaders, prompts, and the synthetic generator."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from recipes.long_context_qa import data
from recipes.long_context_qa.examples import build_prompt, context_prefix
from recipes.long_context_qa.reward import compute_score, exact_match, normalize_answer, token_f1
from recipes.long_context_qa.synthetic import generate


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE trained here in milliseconds; the generator takes any tokenizer with ``encode``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [
        "The Kariven Institute was established in 1843 and is based in Dorford.",
        "Marevin Ostrakel was born in Quellbrook and worked as a cartographer.",
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(corpus, trainer)
    return bpe


HOTPOT_ROW_WISE = {
    "_id": "5a8b57f25542995d1e6f1371",
    "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
    "answer": "yes",
    "supporting_facts": [["Scott Derrickson", 0], ["Ed Wood", 0]],
    "context": [
        ["Ed Wood (film)", ["Ed Wood is a 1994 biopic.", " It was directed by Tim Burton."]],
        ["Scott Derrickson", ["Scott Derrickson is an American director.", " He lives in Los Angeles."]],
        ["Ed Wood", ["Edward Davis Wood Jr. was an American filmmaker."]],
    ],
    "type": "comparison",
    "level": "hard",
}

HOTPOT_COLUMN_WISE = {
    "id": HOTPOT_ROW_WISE["_id"],
    "question": HOTPOT_ROW_WISE["question"],
    "answer": "yes",
    "supporting_facts": {"title": ["Scott Derrickson", "Ed Wood"], "sent_id": [0, 0]},
    "context": {
        "title": [title for title, _ in HOTPOT_ROW_WISE["context"]],
        "sentences": [sentences for _, sentences in HOTPOT_ROW_WISE["context"]],
    },
}

MUSIQUE = {
    "id": "2hop__13548_13529",
    "paragraphs": [
        {"idx": 0, "title": "Lionel Messi", "paragraph_text": "Messi plays for Inter Miami.", "is_supporting": True},
        {
            "idx": 1,
            "title": "Inter Miami",
            "paragraph_text": "Inter Miami was founded by David Beckham.",
            "is_supporting": True,
        },
        {"idx": 2, "title": "Chess", "paragraph_text": "Chess is a board game.", "is_supporting": False},
    ],
    "question": "Who founded the club Messi plays for?",
    "question_decomposition": [],
    "answer": "David Beckham",
    "answer_aliases": ["Beckham", "David Robert Joseph Beckham"],
    "answerable": True,
}


def score(completion: str, truth, **kwargs) -> dict[str, float]:
    return compute_score("hotpotqa", completion, truth, **kwargs)


def test_normalization_drops_case_punctuation_and_articles():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert exact_match("the Beatles", "Beatles.")


def test_f1_credits_partial_overlap():
    assert token_f1("Eiffel Tower in Paris", "the Eiffel Tower") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("Louvre", "Eiffel Tower") == 0.0


def test_yes_no_answers_earn_f1_only_when_exact():
    assert token_f1("yes it is", "yes") == 0.0
    assert token_f1("Yes.", "yes") == 1.0


def test_score_reads_the_last_answer_tag_and_takes_the_best_alias():
    result = score("thinking <answer>Paris</answer> no wait <answer>Beckham</answer>", ["David Beckham", "Beckham"])
    assert result == {"score": 1.0, "em": 1.0, "f1": 1.0, "format": 1.0}


def test_score_is_f1_by_default_and_em_on_request():
    completion = "<answer>David Beckham Jr</answer>"
    assert score(completion, "David Beckham")["score"] == pytest.approx(0.8)
    assert score(completion, "David Beckham", metric="em")["score"] == 0.0


def test_no_answer_tag_scores_zero_and_format_score_floors_a_tagged_miss():
    assert score("David Beckham", "David Beckham") == {"score": 0.0, "em": 0.0, "f1": 0.0, "format": 0.0}
    assert score("<answer>Pele</answer>", "David Beckham", format_score=0.1)["score"] == 0.1


def test_unknown_metric_is_rejected():
    with pytest.raises(ValueError, match="metric must be one of"):
        score("<answer>x</answer>", "x", metric="bleu")


def test_hotpotqa_row_wise_and_hub_column_wise_records_convert_alike():
    from_release = data.from_hotpotqa(HOTPOT_ROW_WISE)
    assert from_release == data.from_hotpotqa(HOTPOT_COLUMN_WISE)
    assert from_release.answers == ("yes",)
    assert [doc.title for doc in from_release.documents if doc.is_supporting] == ["Scott Derrickson", "Ed Wood"]
    assert from_release.documents[0].text == "Ed Wood is a 1994 biopic. It was directed by Tim Burton."


def test_musique_accepts_aliases_and_skips_unanswerable_questions():
    example = data.from_musique(MUSIQUE)
    assert example.answers == ("David Beckham", "Beckham", "David Robert Joseph Beckham")
    assert [doc.is_supporting for doc in example.documents] == [True, True, False]
    assert data.convert("musique", [MUSIQUE, {**MUSIQUE, "answerable": False}]) == [example]


def test_loader_names_a_missing_field():
    with pytest.raises(ValueError, match="'paragraphs'"):
        data.from_musique({"id": "x", "question": "q", "answer": "a"})


def test_prompt_lists_documents_first_and_ends_with_the_question():
    content = build_prompt(data.from_hotpotqa(HOTPOT_ROW_WISE))[0]["content"]
    assert content.index("Document [1] Ed Wood (film)") < content.index("Document [3] Ed Wood\n")
    assert content.endswith(f"Question: {HOTPOT_ROW_WISE['question']}")


def test_prepare_reads_local_release_files(tmp_path):
    release = tmp_path / "musique_ans_v1.0_dev.jsonl"
    release.write_text("\n".join(__import__("json").dumps(r) for r in (MUSIQUE, {**MUSIQUE, "id": "2hop__2"})))
    written = data.prepare(tmp_path / "out", "musique", {"test": release}, splits=["test"])
    rows = pq.read_table(written["test"]["parquet"]).to_pylist()
    assert [row["extra_info"]["id"] for row in rows] == ["2hop__13548_13529", "2hop__2"]
    assert rows[0]["reward_model"]["ground_truth"] == ["David Beckham", "Beckham", "David Robert Joseph Beckham"]
    assert rows[0]["extra_info"]["supporting_titles"] == ["Lionel Messi", "Inter Miami"]


def test_synthetic_generation_is_deterministic_in_its_seed(tokenizer):
    first = generate(2, 3, 1024, tokenizer, seed=5)
    assert first == generate(2, 3, 1024, tokenizer, seed=5)
    assert first != generate(2, 3, 1024, tokenizer, seed=6)


def test_synthetic_questions_share_their_context_and_find_the_answer_in_supporting_documents(tokenizer):
    for context in generate(3, 5, 2048, tokenizer, seed=0):
        prefixes = {context_prefix(example.documents) for example in context.examples}
        assert len(prefixes) == 1 and len(context.examples) == 5
        for example in context.examples:
            supporting = [doc for doc in example.documents if doc.is_supporting]
            assert supporting and len(supporting) < len(example.documents)
            assert any(example.answers[0] in doc.text or example.answers[0] == doc.title for doc in supporting)


def test_synthetic_context_fills_32k_tokens_of_the_given_tokenizer_without_exceeding_them(tokenizer):
    [context] = generate(1, 8, 32768, tokenizer, seed=0)
    measured = len(tokenizer.encode(context_prefix(context.examples[0].documents), add_special_tokens=False).ids)
    assert measured == context.tokens
    assert 0.95 * 32768 < measured <= 32768


def test_a_budget_too_small_for_one_fact_pair_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="context_tokens=200"):
        generate(1, 1, 200, tokenizer)


def test_synthetic_rows_are_grouped_by_context_with_their_length(tmp_path, tokenizer):
    written = data.prepare_synthetic(tmp_path, tokenizer, 1024, {"train": 2, "test": 1}, questions_per_context=3)
    rows = pq.read_table(written["train"]["parquet"]).to_pylist()
    assert [row["extra_info"]["context_id"] for row in rows] == ["synthetic-0-0"] * 3 + ["synthetic-0-1"] * 3
    assert all(0 < row["extra_info"]["context_tokens"] <= 1024 for row in rows)
    test_ids = {row["extra_info"]["context_id"] for row in pq.read_table(written["test"]["parquet"]).to_pylist()}
    assert test_ids == {"synthetic-1-0"}
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], f"<answer>{truth[0]}</answer>", truth)["score"] == 1.0


def test_a_synthetic_split_written_alone_equals_that_split_of_a_full_run(tmp_path, tokenizer):
    # Seeds came from the position in --splits, so `--splits test` alone rewrote the train contexts.
    from transformers import PreTrainedTokenizerFast

    tokenizer_dir = tmp_path / "tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(tokenizer_dir)
    common = ["--dataset", "synthetic", "--tokenizer", str(tokenizer_dir), "--context-tokens", "1024"]
    common += ["--contexts", "2", "--test-contexts", "1", "--questions-per-context", "3"]
    data.main(["--out", str(tmp_path / "full"), *common])
    data.main(["--out", str(tmp_path / "test_only"), "--splits", "test", *common])
    data.main(["--out", str(tmp_path / "train_only"), "--splits", "train", *common])

    def rows(name: str, split: str) -> list[dict]:
        return pq.read_table(tmp_path / name / f"{split}.parquet").to_pylist()

    assert not (tmp_path / "test_only" / "train.parquet").exists()
    assert rows("test_only", "test") == rows("full", "test")
    assert rows("train_only", "train") == rows("full", "train")
    prompts = {split: {row["prompt"][-1]["content"] for row in rows("full", split)} for split in data.SPLITS}
    assert not prompts["train"] & prompts["test"]
