"""Each recipe's CPU smoke config, run for 2 GRPO steps through the Hydra entry point its GPU config uses.

Txt2SQL and long-context QA on verl (``python -m verl.trainer.main_ppo``), and
all three tasks on TRL (``python -m recipes.trl_main``): a tiny model built on
the spot, synthetic data from the recipes' generators (GSM8K: the real files in
``../shared/data``), the recipe's own reward, real Ray, DeepSpeed and the native
sampler. A random tiny model earns reward 0 almost everywhere, so the smoke
configs add an entropy bonus: a step that reaches the optimizer has a non-zero
gradient. GSM8K's verl run is ``test_verl_main_ppo.py``; the SkyRL recipes run
in ``tests/skyrl/`` (Python 3.12).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from recipes.gsm8k.data import prepare as prepare_gsm8k
from recipes.long_context_qa.data import prepare_synthetic
from recipes.txt2sql.data import prepare as prepare_txt2sql

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 2
CONTEXT_TOKENS = 1024


@dataclass(frozen=True)
class Smoke:
    """One recipe's CPU smoke run: its steps' logged metrics, by step, under the framework's own names."""

    framework: str
    task: str
    steps: dict[int, dict]

    def values(self, key: str) -> list[float]:
        return [self.steps[step][key] for step in range(1, STEPS + 1)]


def smoke_data(task: str, work: Path, tokenizer: str) -> dict[str, Path]:
    """The smoke configs' data, as their run_cpu_smoke.sh scripts make it."""
    if task == "gsm8k":
        splits = prepare_gsm8k(work / "data", "local", limit=16)
        return {"train": splits["train"]["parquet"], "eval": splits["test"]["parquet"]}
    if task == "txt2sql":
        splits = prepare_txt2sql(work / "data", "synthetic", limit=2)
        return {"train": splits["train"]["parquet"], "eval": splits["dev"]["parquet"]}
    splits = prepare_synthetic(work / "data", tokenizer, CONTEXT_TOKENS, {"train": 2, "test": 1}, 2)
    return {"train": splits["train"]["parquet"], "eval": splits["test"]["parquet"]}


def run(command: list[str], work: Path, env: dict[str, str]) -> None:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0", **env}
    environment.pop("RAY_ADDRESS", None)  # a cluster of its own, never another test's
    # Run in the test's own directory: anything written to a relative path stays out of the repository.
    result = subprocess.run(command, cwd=work, env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command[2]} failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"


def verl_smoke(task: str, work: Path, model: str) -> Smoke:
    data = smoke_data(task, work, model)
    metrics = work / "metrics.jsonl"
    command = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(REPO / "recipes" / task / "verl"),
               "--config-name", f"arctic_{task}_cpu", f"actor_rollout_ref.model.path={model}",
               f"data.train_files={data['train']}", f"data.val_files={data['eval']}",
               f"trainer.default_local_dir={work / 'checkpoints'}", f"hydra.run.dir={work / 'hydra'}"]  # fmt: skip
    run(command, work, {"VERL_FILE_LOGGER_PATH": str(metrics)})
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return Smoke("verl", task, {record["step"]: record["data"] for record in records})


def trl_smoke(task: str, work: Path, model: str) -> Smoke:
    data = smoke_data(task, work, model)
    command = [sys.executable, "-m", "recipes.trl_main", "--config-path", str(REPO / "recipes" / task / "trl"),
               "--config-name", f"arctic_{task}_cpu", f"model={model}", f"data.train_files={data['train']}",
               f"data.eval_files={data['eval']}", f"grpo.output_dir={work / 'run'}"]  # fmt: skip
    run(command, work, {})
    history = json.loads((work / "run" / "trainer_state.json").read_text())["log_history"]
    return Smoke("trl", task, {record["step"]: record for record in history if "loss" in record})


RUNS = {"verl": verl_smoke, "trl": trl_smoke}
# Each framework's names for the metrics the assertions read.
LOSS = {"verl": "actor/loss", "trl": "loss"}
GRAD_NORM = {"verl": "actor/grad_norm", "trl": "grad_norm"}
DEDUP = {"verl": "actor/arctic/zorro_train/dedup_ratio", "trl": "arctic/zorro_train/dedup_ratio"}
REWARD = {"verl": "critic/score/mean", "trl": "rewards/{task}/mean"}


@pytest.fixture(
    scope="module",
    params=[
        ("verl", "txt2sql"),
        ("verl", "long_context_qa"),
        ("trl", "gsm8k"),
        ("trl", "txt2sql"),
        ("trl", "long_context_qa"),
    ],
    ids=lambda param: "-".join(param),
)
def smoke(request, tmp_path_factory, tiny_model) -> Smoke:
    framework, task = request.param
    return RUNS[framework](task, tmp_path_factory.mktemp(f"{framework}-{task}"), tiny_model)


def test_smoke_config_completes_every_step_with_finite_losses_and_real_gradients(smoke):
    assert set(range(1, STEPS + 1)) <= set(smoke.steps)
    assert all(math.isfinite(loss) for loss in smoke.values(LOSS[smoke.framework]))
    assert all(math.isfinite(norm) and norm > 0 for norm in smoke.values(GRAD_NORM[smoke.framework]))


def test_smoke_config_scores_every_step_with_the_recipe_reward(smoke):
    rewards = smoke.values(REWARD[smoke.framework].format(task=smoke.task))
    assert all(0.0 <= reward <= 1.0 for reward in rewards)
    if smoke.framework == "trl":
        # The keys compute_score reports besides the score, logged by recipes.common.trl_reward.
        extra = {"gsm8k": "gsm8k/format", "txt2sql": "txt2sql/executable", "long_context_qa": "long_context_qa/f1"}[
            smoke.task
        ]
        assert all(0.0 <= value <= 1.0 for value in smoke.values(extra))


def test_zorro_train_computes_each_shared_prefix_once(smoke):
    """A Txt2SQL step is one prompt x 2 samples: about 2x. A GSM8K step is 2 problems x 4 samples of 16 tokens
    after a prompt of ~100: well over 2x. A long-context step is 2 questions x 2 samples on one context, kept
    together by the config's unshuffled order: nearly 4x, as the context is nearly the whole sequence."""
    expected = {"txt2sql": 1.8, "gsm8k": 2.0, "long_context_qa": 3.5}[smoke.task]
    assert all(ratio > expected for ratio in smoke.values(DEDUP[smoke.framework]))
