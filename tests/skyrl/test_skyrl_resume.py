"""SkyRL's checkpoint resume through arctic-rl: the second run continues the first one's DeepSpeed state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def smoke(out: Path, steps: int) -> None:
    env = {**os.environ, "OUT_DIR": str(out), "STEPS": str(steps), "PYTHON": sys.executable}
    command = ["bash", "recipes/gsm8k/skyrl/run_cpu_smoke.sh", "trainer.ckpt_interval=1"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert result.returncode == 0, f"smoke run failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"


@pytest.mark.slow
def test_a_second_run_resumes_skyrl_and_the_arctic_training_engine_from_the_latest_checkpoint(tmp_path):
    smoke(tmp_path, steps=1)
    smoke(tmp_path, steps=2)
    served = json.loads((tmp_path / "exports" / "arctic_rl_status.json").read_text())["served"]
    # The second run trained only the step the first one had not.
    assert served["fwd_bwd"] == 1 and served["step"] == 1 and served["save_checkpoint"] == 1
    # arctic names a checkpoint by its DeepSpeed engine's own step count: 2 means it resumed at 1.
    assert (tmp_path / "ckpts" / "global_step_2" / "policy" / "latest").read_text() == "global_step2"
