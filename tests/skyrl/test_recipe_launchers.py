"""Every SkyRL recipe launcher's command line is one SkyRL and arctic-rl's backend accept, GPU ones included.

The launchers are shell scripts that end in ``$PYTHON -m skyrl.train.entrypoints.main_base <overrides>``.
Here ``PYTHON`` is a stand-in that records each command instead of running it; the recorded
``main_base`` overrides go through ``parse_config``, the validation the entrypoints run first
(SkyRL's own checks and the arctic backend's). The GPU runs never start here.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAIN_BASE = ["-m", "skyrl.train.entrypoints.main_base"]
LAUNCHERS = [
    f"recipes/{task}/skyrl/{script}"
    for task in ("gsm8k", "txt2sql", "long_context_qa")
    for script in ("run_gpu.sh", "run_cpu_smoke.sh")
]
ENV_CLASS = {"gsm8k": "gsm8k_recipe", "txt2sql": "txt2sql", "long_context_qa": "long_context_qa"}


def recorded_main_base_overrides(launcher: str, tmp_path: Path) -> list[str]:
    records = tmp_path / "records"
    records.mkdir()
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "{records}/$(date +%s%N)"\n')
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IEXEC)
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.parquet").touch()  # the GPU launchers then skip their data preparation
    env = {**os.environ, "PYTHON": str(stand_in), "DATA_DIR": str(data), "OUT_DIR": str(tmp_path / "out")}
    subprocess.run(["bash", launcher], cwd=REPO, env=env, check=True, capture_output=True, timeout=60)
    commands = [path.read_bytes().split(b"\0")[:-1] for path in sorted(records.iterdir())]
    runs = [[arg.decode() for arg in command] for command in commands if command[:2] == [a.encode() for a in MAIN_BASE]]
    assert len(runs) == 1, commands
    return runs[0][2:]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_skyrl_launcher_command_validates_and_runs_the_recipe_environment(launcher, tmp_path):
    from arctic_rl_skyrl.entrypoint import parse_config

    overrides = recorded_main_base_overrides(launcher, tmp_path)
    cfg = parse_config(overrides)
    task = launcher.split("/")[1]
    assert cfg.environment.env_class == ENV_CLASS[task]
    # The recipes' environments are registered only by recipes.skyrl_main.
    assert "trainer.override_entrypoint=recipes.skyrl_main" in overrides
    if launcher.endswith("run_cpu_smoke.sh"):
        assert cfg.trainer.arctic_rl.device == "cpu"
        assert all(str(tmp_path) in str(path) for path in (cfg.trainer.ckpt_path, cfg.trainer.export_path))
