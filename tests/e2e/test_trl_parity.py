"""The same GRPO script with TRL's GRPOTrainer and with ArcticGRPOTrainer trains the same way.

Both runs start from one tiny Qwen2 (float32), read the same dataset with
the same seed, and take their completions from one fixed rollout function,
so the comparison is about training, not sampling luck. The config exercises
what the mapping must get right: gradient accumulation over two micro-batches
(dapo's step-wide token normalization), a KL penalty against the reference
(served by the arctic log-prob job), clip-higher and a sampling temperature,
with TRL's default importance-sampling correction left on: like GRPOTrainer
without vLLM, the arctic trainer must not weigh the rollout function's
made-up log-probs.
The arctic side runs the real server, Ray actors and DeepSpeed engines on CPU,
with ZoRRo Train on: each group's shared prompt is computed once.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client  # noqa: E402
from arctic_rl_trl import ARCTIC_CHECKPOINT, ArcticGRPOTrainer, training_config_from_grpo  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.e2e.trl_rollouts import PROMPTS, fixed_rollout, multiple_of_three_share  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 2


class LogRecorder(TrainerCallback):
    def __init__(self):
        self.steps: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps.append(dict(logs))


def grpo_args(output_dir: Path) -> GRPOConfig:
    return GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        max_steps=STEPS,
        learning_rate=1e-3,
        beta=0.04,
        use_bias_correction_kl=False,
        epsilon_high=0.28,
        temperature=0.9,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )


def run(trainer_class, model: str, output_dir: Path, **arctic) -> LogRecorder:
    recorder = LogRecorder()
    trainer = trainer_class(
        model=model, reward_funcs=multiple_of_three_share, args=grpo_args(output_dir),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), rollout_func=fixed_rollout, callbacks=[recorder],
        **arctic,
    )  # fmt: skip
    trainer.train()
    return trainer, recorder


def engine_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The module weights of a ZeRO-0 DeepSpeed checkpoint written by save_checkpoint."""
    tag = (checkpoint / "latest").read_text().strip()
    return torch.load(checkpoint / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """(vanilla logs, arctic logs, initial, vanilla and arctic weights) of one run of each trainer."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("trl-parity")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    vanilla, vanilla_logs = run(GRPOTrainer, tiny_model, root / "vanilla")

    config = ArcticRLClientConfig(
        model_name=tiny_model, host="127.0.0.1", port=free_port(), device="cpu", training_gpus=1, log_prob_gpus=1,
        log_prob_engine="deepspeed",
        training_config={
            **training_config_from_grpo(grpo_args(root), STEPS), "zorro_train": {"enable": True, "min_shared_tokens": 2}
        },
        ray_auto_attach=False, server_logs=False,
    )  # fmt: skip
    client = create_arctic_rl_client(config)
    try:
        arctic, arctic_logs = run(ArcticGRPOTrainer, tiny_model, root / "arctic", arctic_client=client)
        arctic.save_model(str(root / "arctic" / "final"))
        arctic_state = engine_weights(root / "arctic" / "final" / ARCTIC_CHECKPOINT)
        arctic.shutdown()
    finally:
        asyncio.run(client.shutdown())
    return vanilla_logs.steps, arctic_logs.steps, initial, vanilla.model.state_dict(), arctic_state


def test_first_step_loss_matches_grpo_trainer(runs):
    vanilla, arctic, *_ = runs
    assert len(vanilla) == len(arctic) == STEPS
    assert arctic[0]["loss"] == pytest.approx(vanilla[0]["loss"], rel=1e-4)


def test_every_step_matches_in_loss_grad_norm_kl_and_entropy(runs):
    vanilla, arctic, *_ = runs
    for ours, theirs in zip(arctic, vanilla, strict=True):
        for name in ("loss", "grad_norm", "entropy", "reward"):
            assert ours[name] == pytest.approx(theirs[name], rel=1e-4), name
        assert ours["kl"] == pytest.approx(theirs["kl"], rel=1e-4, abs=1e-7)
    assert arctic[1]["kl"] > 0, "the second step must see a policy that moved away from the reference"


def test_updated_weights_match_grpo_trainer(runs):
    *_, initial, vanilla, arctic = runs
    assert vanilla.keys() == arctic.keys()
    update_gap = torch.stack([(arctic[k] - vanilla[k]).norm() for k in vanilla]).norm()
    update = torch.stack([(vanilla[k] - initial[k]).norm() for k in vanilla]).norm()
    assert update > 0
    assert float(update_gap / update) < 1e-4
