"""arctic-rl as SkyRL's compute backend, behind a config toggle.

A SkyRL command gains ``trainer.override_entrypoint=arctic_rl_skyrl.entrypoint``
(and, optionally, ``trainer.arctic_rl={...}``): SkyRL keeps its loop, data,
environments, rewards and advantages; arctic-rl trains, samples and computes
log-probs. See README.md beside this file.
"""

from arctic_rl_skyrl.algorithm import LossPlan, UnsupportedSkyRLSetting, check_supported, loss_plan
from arctic_rl_skyrl.config import ArcticRLConfig, ArcticSkyRLTrainConfig, client_config, placement

__all__ = [
    "ArcticRLConfig",
    "ArcticSkyRLTrainConfig",
    "LossPlan",
    "UnsupportedSkyRLSetting",
    "check_supported",
    "client_config",
    "loss_plan",
    "placement",
]
