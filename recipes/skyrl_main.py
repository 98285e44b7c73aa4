"""The SkyRL recipes' entrypoint: arctic-rl's SkyRL backend with the recipes' environments registered.

    python -m skyrl.train.entrypoints.main_base <SkyRL overrides> environment.env_class=txt2sql \\
        trainer.override_entrypoint=recipes.skyrl_main trainer.arctic_rl='{zorro_train: true}'

It is ``arctic_rl_skyrl.entrypoint`` (same command line, same ``trainer.arctic_rl``
block, same checks) except for one thing: SkyRL builds its environments inside
the Ray task that runs the trainer, so that task registers the recipes'
environments (``recipes.skyrl_env``) before the run, as SkyRL's own examples of
custom environments do.
"""

from __future__ import annotations

import os
import sys

import ray
from skyrl.train.utils.utils import prepare_runtime_environment

from arctic_rl_core.server.ray_cluster import connect as connect_ray
from arctic_rl_skyrl.config import placement
from arctic_rl_skyrl.entrypoint import ArcticRLExp, parse_config
from recipes.skyrl_env import register_recipe_envs

# Forwarded to the Ray task, as arctic_rl_skyrl.entrypoint forwards them: where SkyRL logs, arctic-rl's settings.
FORWARDED_ENV_PREFIXES = ("ARCTIC_RL_", "TENSORBOARD_DIR", "WANDB_", "HF_")


@ray.remote(num_cpus=1)
def recipe_entrypoint(cfg) -> None:
    register_recipe_envs()
    ArcticRLExp(cfg).run()


def main() -> None:
    cfg = parse_config(sys.argv[1:])
    # Start (or join) Ray with CPU stand-ins for the jobs where there is no CUDA; the arctic server
    # the run starts inside the task lands in this same cluster.
    connect_ray(cfg.trainer.arctic_rl.ray_auto_attach, cpu_gpus=max(1, placement(cfg).cluster_gpus))
    from skyrl.backends.skyrl_train.utils.ppo_utils import sync_registries

    sync_registries()
    env_vars = prepare_runtime_environment(cfg)
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)})
    ray.get(recipe_entrypoint.options(runtime_env={"env_vars": env_vars}).remote(cfg))


if __name__ == "__main__":
    main()
