"""The acceptance run: SkyRL's own ``main_base`` with the toggle trains a tiny model on GSM8K through arctic-rl.

``recipes/gsm8k/skyrl/run_cpu_smoke.sh`` is the stock SkyRL command plus
``trainer.override_entrypoint=recipes.skyrl_main`` (``arctic_rl_skyrl.entrypoint``
with the recipes' environments registered, GSM8K's reward among them): a tiny Qwen2 made
on the spot, 16 problems from ../shared/data/gsm8k, 3 GRPO steps on CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def scalars(tensorboard_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("skyrl-smoke")
    env = {**os.environ, "OUT_DIR": str(out), "STEPS": str(STEPS), "PYTHON": sys.executable}
    # An entropy bonus gives the random tiny model (reward 0 everywhere, so advantages 0) a real gradient.
    command = ["bash", "recipes/gsm8k/skyrl/run_cpu_smoke.sh", "trainer.algorithm.use_entropy_loss=true"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"smoke run failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return out


@pytest.mark.slow
def test_skyrl_main_base_with_the_toggle_completes_every_step(smoke_run):
    logged = scalars(smoke_run / "tensorboard")
    assert [step for step, _ in logged["trainer/global_step"]] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_losses_and_gradients_are_finite_and_real(smoke_run):
    logged = scalars(smoke_run / "tensorboard")
    losses = [value for _, value in logged["policy/final_loss"]]
    grad_norms = [value for _, value in logged["policy/grad_norm"]]
    assert len(losses) == STEPS and all(math.isfinite(v) and v != 0.0 for v in losses)
    assert len(grad_norms) == STEPS and all(math.isfinite(v) and v > 0.0 for v in grad_norms)


@pytest.mark.slow
def test_sampler_and_trainer_log_probs_agree_through_skyrl(smoke_run):
    """SkyRL compares the sampler's log-probs with the training engine's on the same tokens; a layout slip shows here."""
    logged = scalars(smoke_run / "tensorboard")
    assert all(value < 1e-3 for _, value in logged["policy/rollout_train_logprobs_abs_diff_max"])


@pytest.mark.slow
def test_arctic_server_served_the_run(smoke_run):
    served = json.loads((smoke_run / "exports" / "arctic_rl_status.json").read_text())["served"]
    assert served["fwd_bwd"] == STEPS and served["step"] == STEPS
    assert served["generate"] == STEPS
    assert served["sync_weights"] == STEPS + 1  # before the first rollout, then after every step
    assert served["fwd_no_grad"] == 2 * STEPS  # old log-probs (policy) and the KL reference, per step
