"""The SkyRL recipes: the recipes' rewards as skyrl-gym environments, and each CPU smoke run for 2 GRPO steps.

``recipes/<task>/skyrl/run_cpu_smoke.sh`` is a stock SkyRL command with
``trainer.override_entrypoint=recipes.skyrl_main`` (arctic-rl's backend with the
recipes' environments registered): a tiny Qwen2 made on the spot, synthetic
data from the recipe's generator, ZoRRo Train, no reference model, and an
entropy bonus (a random tiny model earns reward 0, so advantages are 0).
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
STEPS = 2


def scalars(tensorboard_dir: Path) -> dict[str, list[float]]:
    """Each logged scalar's values, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    tags = events.Tags()["scalars"]
    return {tag: [e.value for e in sorted(events.Scalars(tag), key=lambda e: e.step)] for tag in tags}


@pytest.fixture(scope="module")
def synthetic_sql_row(tmp_path_factory) -> dict:
    from recipes.common.records import read_jsonl
    from recipes.skyrl_data import convert
    from recipes.txt2sql.data import prepare

    out = tmp_path_factory.mktemp("sql")
    prepare(out / "verl", "synthetic", limit=1)
    return read_jsonl(convert(out / "verl", out / "skyrl", "txt2sql", ["train"])["train"]["jsonl"])[0]


def test_txt2sql_env_rewards_the_gold_query_and_reports_the_recipe_metrics(synthetic_sql_row):
    import skyrl_gym

    from recipes.skyrl_env import register_recipe_envs

    register_recipe_envs()
    env = skyrl_gym.make("txt2sql", env_config={}, extras=synthetic_sql_row)
    gold = synthetic_sql_row["reward_spec"]["ground_truth"]
    step = env.step(f"The query:\n<sql>{gold}</sql>")
    assert step["reward"] == 1.0 and step["done"]
    assert env.get_metrics() == {"acc": 1.0, "format": 1.0, "executable": 1.0, "gold_failed": 0.0}
    assert skyrl_gym.make("txt2sql", env_config={}, extras=synthetic_sql_row).step("no query")["reward"] == 0.0


def test_recipe_env_names_the_columns_a_row_lacks(synthetic_sql_row):
    import skyrl_gym

    from recipes.skyrl_env import register_recipe_envs

    register_recipe_envs()
    row = {key: value for key, value in synthetic_sql_row.items() if key != "extra_info"}
    with pytest.raises(ValueError, match=r"needs data_source, reward_spec.ground_truth and extra_info"):
        skyrl_gym.make("txt2sql", env_config={}, extras=row)


@pytest.mark.parametrize(
    "response", ["The total is 42.\n#### 42", "#### 42.0", "####42", "#### $42", "#### 42.00", "#### 41", "42"]
)
def test_gsm8k_env_scores_like_the_recipe_reward_on_verl_and_trl(response):
    # skyrl-gym's own gsm8k environment string-matches: "#### 42.0", "#### $18", "####42" scored 0 there.
    import skyrl_gym

    from recipes.common.records import to_skyrl_row
    from recipes.gsm8k.reward import compute_score
    from recipes.gsm8k.skyrl.data import ENV_CLASS
    from recipes.skyrl_env import register_recipe_envs

    register_recipe_envs()
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 6 x 7?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "42"},
        "extra_info": {"split": "test", "index": 0},
    }
    skyrl_row = to_skyrl_row(row, ENV_CLASS)
    env = skyrl_gym.make(skyrl_row["env_class"], env_config={}, extras=skyrl_row)
    expected = compute_score("openai/gsm8k", response, "42")
    step = env.step(response)
    assert step["reward"] == expected["score"] and step["done"]
    assert env.get_metrics() == {"acc": expected["acc"], "format": expected["format"]}
    if response in ("#### 42.0", "####42", "#### $42"):
        assert step["reward"] == 1.0


@pytest.fixture(scope="module", params=["txt2sql", "long_context_qa"])
def smoke_run(request, tmp_path_factory) -> tuple[str, Path]:
    task = request.param
    out = tmp_path_factory.mktemp(f"skyrl-{task}")
    env = {**os.environ, "OUT_DIR": str(out), "STEPS": str(STEPS), "PYTHON": sys.executable}
    env.pop("RAY_ADDRESS", None)
    command = ["bash", f"recipes/{task}/skyrl/run_cpu_smoke.sh"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"smoke run failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    return task, out


@pytest.mark.slow
def test_smoke_run_completes_every_step_with_finite_losses_and_real_gradients(smoke_run):
    _, out = smoke_run
    logged = scalars(out / "tensorboard")
    assert logged["trainer/global_step"] == [float(step) for step in range(1, STEPS + 1)]
    assert all(math.isfinite(loss) for loss in logged["policy/final_loss"])
    assert all(math.isfinite(norm) and norm > 0 for norm in logged["policy/grad_norm"])


@pytest.mark.slow
def test_smoke_run_scores_rollouts_in_the_recipe_environment(smoke_run):
    task, out = smoke_run
    logged = scalars(out / "tensorboard")
    metric = {"txt2sql": "environment/executable", "long_context_qa": "environment/f1"}[task]
    assert len(logged[metric]) == STEPS and all(0.0 <= value <= 1.0 for value in logged[metric])


@pytest.mark.slow
def test_smoke_run_trains_with_zorro_and_no_reference(smoke_run):
    """Each group of 2 samples shares its prompt, so ZoRRo computes it once: a ratio near 2 or more."""
    _, out = smoke_run
    assert all(ratio > 1.8 for ratio in scalars(out / "tensorboard")["policy/loss_metrics/zorro_train/dedup_ratio"])
    served = json.loads((out / "exports" / "arctic_rl_status.json").read_text())["served"]
    assert served["fwd_bwd"] == STEPS and served["step"] == STEPS
    assert served["fwd_no_grad"] == STEPS  # old log-probs only: use_kl_loss=false starts no reference
