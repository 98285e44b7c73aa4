"""The recipes' rewards as skyrl-gym environments, so SkyRL scores rollouts with the same ``compute_score``.

A SkyRL row (``recipes.common.records.to_skyrl_row``) names its environment in
``env_class``; ``skyrl_gym.make`` builds it with the row's other columns as
``extras``. ``RecipeEnv`` is single-turn: the model answers once and the
recipe's reward scores the answer. The numbers ``compute_score`` reports
besides the score (accuracy, format, ...) become the environment's metrics,
which SkyRL logs per environment.

SkyRL's trainer builds environments inside its own Ray task, so the ids must be
registered there: ``recipes.skyrl_main`` does it before the run starts.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from recipes.skyrl_data import REWARD_MODULES


class RecipeEnv(BaseTextEnv):
    """One answer to one prompt, scored by ``reward_module.compute_score`` against the row's ground truth."""

    def __init__(self, reward_module: str, env_config: Any = None, extras: Mapping[str, Any] | None = None):
        super().__init__()
        extras = extras or {}
        missing = [field for field in ("data_source", "reward_spec", "extra_info") if field not in extras]
        if missing or "ground_truth" not in extras["reward_spec"]:
            raise ValueError(
                f"a {reward_module} row needs data_source, reward_spec.ground_truth and extra_info "
                f"(recipes.common.records.to_skyrl_row writes them); got columns {sorted(extras)}"
            )
        self.compute_score = importlib.import_module(reward_module).compute_score
        self.data_source = extras["data_source"]
        self.ground_truth = extras["reward_spec"]["ground_truth"]
        self.extra_info = extras["extra_info"]
        self.metrics: dict[str, float] = {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        result = self.compute_score(self.data_source, action, self.ground_truth, self.extra_info)
        if isinstance(result, Mapping):
            reward = float(result["score"])
            self.metrics = {key: float(value) for key, value in result.items() if key != "score"}
        else:
            reward = float(result)
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})

    def get_metrics(self) -> dict[str, float]:
        return self.metrics


def register_recipe_envs() -> None:
    """Register each recipe's environment, rewarded by ``REWARD_MODULES[env_class]``, with skyrl-gym (once)."""
    for env_class, reward_module in REWARD_MODULES.items():
        if env_class not in skyrl_gym.registry:
            skyrl_gym.register(id=env_class, entry_point=RecipeEnv, kwargs={"reward_module": reward_module})
