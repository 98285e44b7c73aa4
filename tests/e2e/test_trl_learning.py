"""A short ArcticGRPOTrainer run on a synthetic task raises the reward on held-out prompts.

Task: answer with digits. The reward is the share of completion tokens that
are one of the tokenizer's ten single-digit tokens; a randomly initialized
tiny Qwen2 writes about 1% digits (10 of 1024 tokens). The trainer starts its
own deployment from an ArcticRLClientConfig over Ray (training engine and
native sampler on CPU), samples 8 completions for each of 4 prompts per step,
and evaluates 8 completions for each of 2 held-out prompts before and after
training. Seed 0; the threshold (mean held-out reward from <= 0.1 to >= 0.5)
is far beyond chance: 128 tokens at a 1% rate reach 50% with probability
below 1e-100.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from arctic_rl_core import ArcticRLClientConfig  # noqa: E402
from arctic_rl_trl import ARCTIC_CHECKPOINT, ArcticGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 16
WORDS = ["apple", "river", "stone", "cloud", "seven", "green", "table", "music", "light", "paper"]


class LogRecorder(TrainerCallback):
    def __init__(self):
        self.train: list[dict] = []
        self.eval: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "eval_reward" in logs:
            self.eval.append(dict(logs))
        elif "reward" in logs:
            self.train.append(dict(logs))


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    digits = {AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids(str(d)) for d in range(10)}

    def digit_share(completion_ids, **_):
        return [sum(token in digits for token in ids) / max(len(ids), 1) for ids in completion_ids]

    output_dir = tmp_path_factory.mktemp("trl-learning")
    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=32,
        num_generations=8,
        per_device_eval_batch_size=16,
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        eval_strategy="steps",
        eval_steps=STEPS,
        eval_on_start=True,
        save_strategy="steps",
        save_steps=STEPS,
        logging_steps=1,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    config = ArcticRLClientConfig(
        model_name=tiny_model, comm_protocol="ray", device="cpu", training_gpus=1, sampling_gpus=1,
        sampling_engine="native", ray_auto_attach=False, server_logs=False,
    )  # fmt: skip
    recorder = LogRecorder()
    trainer = ArcticGRPOTrainer(
        model=tiny_model,
        reward_funcs=digit_share,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Write digits after {w}:" for w in WORDS[:8]]}),
        eval_dataset=Dataset.from_dict({"prompt": [f"Write digits after {w}:" for w in WORDS[8:]]}),
        callbacks=[recorder],
        arctic_config=config,
    )
    try:
        trainer.train()
    finally:
        trainer.shutdown()
    return recorder, output_dir


def test_reward_on_held_out_prompts_rises(trained):
    recorder, _ = trained
    first, last = recorder.eval[0]["eval_reward"], recorder.eval[-1]["eval_reward"]
    assert len(recorder.eval) == 2
    assert first <= 0.1
    assert last >= 0.5, f"held-out reward went from {first} to {last}"


def test_sampler_follows_the_trained_policy_at_every_step(trained):
    recorder, _ = trained
    assert len(recorder.train) == STEPS
    # Log-probs of the sampler and the training engine agree only if each step's weights reached the sampler.
    assert max(log["sampling/sampling_logp_difference/max"] for log in recorder.train) < 1e-3
    assert any(log["grad_norm"] > 0 for log in recorder.train)
    assert all({"entropy", "clip_ratio/region_mean", "arctic/pg_loss"} <= log.keys() for log in recorder.train)


def test_checkpoint_holds_trl_state_and_the_engine_checkpoint(trained):
    _, output_dir = trained
    checkpoint = Path(output_dir) / f"checkpoint-{STEPS}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
    assert (checkpoint / ARCTIC_CHECKPOINT / "latest").read_text().strip() == f"global_step{STEPS}"
    assert (checkpoint / "config.json").exists() and (checkpoint / "tokenizer_config.json").exists()
