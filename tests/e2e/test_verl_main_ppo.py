"""verl's own ``python -m verl.trainer.main_ppo`` with the arctic backend, on CPU: 3 GRPO steps and a validation.

The run is the CPU smoke recipe (``recipes/gsm8k/verl/arctic_gsm8k_cpu.yaml``)
on GSM8K problems prepared by the recipe's data script from the local copy,
with a tiny model built on the spot: stock verl 0.9.1, a real Ray cluster,
arctic-rl's server with DeepSpeed training and reference jobs and the native
sampler. verl's file logger records every step's metrics, including the
arctic server's own count of the operations it served.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.gsm8k.data import prepare

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "gsm8k" / "verl"
STEPS = 3


def main_ppo(work: Path, overrides: list[str], env: dict | None = None, timeout: int = 1800):
    command = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(RECIPE),
               "--config-name", "arctic_gsm8k_cpu", *overrides]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    environment.pop("RAY_ADDRESS", None)  # a cluster of its own, never another test's
    return subprocess.run(command, cwd=work, env=environment, capture_output=True, text=True, timeout=timeout)


def data_overrides(work: Path, model: str) -> list[str]:
    splits = prepare(work / "gsm8k", source="local", limit=8)
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={splits['train']['parquet']}",
        f"data.val_files={splits['test']['parquet']}",
        f"trainer.default_local_dir={work / 'checkpoints'}",
    ]


@pytest.fixture(scope="module")
def steps(tmp_path_factory, tiny_model) -> dict[int, dict]:
    """verl's logged metrics of a whole CPU run, by training step."""
    work = tmp_path_factory.mktemp("verl-main-ppo")
    metrics = work / "metrics.jsonl"
    result = main_ppo(work, data_overrides(work, tiny_model), env={"VERL_FILE_LOGGER_PATH": str(metrics)})
    assert result.returncode == 0, f"main_ppo failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {record["step"]: record["data"] for record in records}


def test_main_ppo_runs_three_steps_with_finite_losses_and_gradients(steps):
    assert set(range(1, STEPS + 1)) <= set(steps)
    for step in range(1, STEPS + 1):
        for key in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/arctic/kl"):
            assert math.isfinite(steps[step][key]), f"step {step}: {key}={steps[step][key]}"
    # The reward varies within groups (any number scores 0.5), so GRPO's advantages and gradients are not all zero.
    assert any(steps[step]["actor/grad_norm"] > 0 for step in range(1, STEPS + 1))


def test_main_ppo_validates_once_after_the_last_step(steps):
    validated = [step for step, data in steps.items() if "val-core/openai/gsm8k/acc/mean@1" in data]
    assert validated == [STEPS]


def test_arctic_server_served_generate_fwd_bwd_step_and_sync_weights(steps):
    """The server's own counters at the last training step (read by the engine after its optimizer step)."""
    served = {
        op: steps[STEPS][f"actor/arctic/served_max/{op}"]
        for op in ("generate", "fwd_bwd", "step", "sync_weights", "fwd_no_grad")
    }
    assert served["fwd_bwd"] == STEPS and served["step"] == STEPS
    assert served["generate"] >= STEPS
    assert served["sync_weights"] >= STEPS  # verl syncs once at start and after every step
    assert served["fwd_no_grad"] >= 2 * STEPS  # old log-probs on the training job, reference on the log-prob job


def test_sampler_log_probs_equal_the_training_engine_log_probs_of_the_same_tokens(steps):
    """verl compares the rollout's log-probs with the actor's recomputation: equal layouts, equal weights."""
    for step in range(1, STEPS + 1):
        assert steps[step]["training/rollout_probs_diff_max"] < 1e-4


def test_main_ppo_refuses_a_critic_at_startup_naming_the_setting(tmp_path, tiny_model):
    result = main_ppo(tmp_path, [*data_overrides(tmp_path, tiny_model), "algorithm.adv_estimator=gae"], timeout=600)
    assert result.returncode != 0
    assert "algorithm.adv_estimator='gae' is not supported by the arctic backend" in result.stderr
    assert "Started a local Ray instance" not in result.stderr  # refused in the driver, before Ray
