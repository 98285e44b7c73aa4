"""arctic-rl for TRL: ``ArcticGRPOTrainer`` is ``trl.GRPOTrainer`` with the heavy compute on arctic-rl engines.

    from arctic_rl_core import ArcticRLClientConfig
    from arctic_rl_trl import ArcticGRPOTrainer

    trainer = ArcticGRPOTrainer(model, reward_funcs, args=grpo_config, train_dataset=dataset,
                                arctic_config=ArcticRLClientConfig(model_name=model, training_gpus=1, sampling_gpus=1))

See README.md for the GRPOConfig mapping.
"""

from arctic_rl_trl.compat import SUPPORTED_LOSS_TYPES, UnsupportedGRPOOption
from arctic_rl_trl.engine_config import training_config_from_grpo
from arctic_rl_trl.trainer import ARCTIC_CHECKPOINT, ArcticGRPOTrainer

__all__ = [
    "ARCTIC_CHECKPOINT",
    "ArcticGRPOTrainer",
    "SUPPORTED_LOSS_TYPES",
    "UnsupportedGRPOOption",
    "training_config_from_grpo",
]
