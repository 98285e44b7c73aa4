"""SkyRL's algorithm settings as an arctic-rl loss, and the settings arctic-rl cannot honour.

Advantages (every estimator but GAE), KL-in-reward, dynamic sampling and
zero-variance filtering stay in SkyRL's trainer: they only change the tensors
it sends. What SkyRL's policy worker would compute, arctic's ``grpo`` loss
computes instead:

=======================================  =====================================================
SkyRL                                    arctic-rl ``processing``
=======================================  =====================================================
policy_loss_type regular / dual_clip     ``grpo``; dual_clip sets ``clip_ratio_c``
eps_clip_low, eps_clip_high              ``eps_clip``, ``eps_clip_high``
loss_reduction token_mean                ``loss_agg_mode="token-mean"``
loss_reduction sequence_mean             ``"seq-mean-token-mean"``
loss_reduction seq_mean_token_sum_norm   ``"seq-mean-token-sum-norm"``, horizon ``max_seq_len``
use_kl_loss, kl_loss_coef                ``kl_coef`` (0 without use_kl_loss) + reference log-probs
kl_estimator_type k1/k2/k3/abs           ``kl_estimator``
use_entropy_loss, entropy_loss_coef      ``entropy_coef``
off_policy_correction token TIS          decoupled PPO: ``prox_logp_shifted`` (recomputed
                                         log-probs), ``old_log_probs_shifted`` (rollout),
                                         ``behav_imp_weight_cap=token_tis_ratio_clip_high``
temperature                              post-processor ``temperature`` on the policy's forwards;
                                         reference log-probs at temperature 1 (as SkyRL's)
=======================================  =====================================================

SkyRL reduces the KL term as a sequence mean of token means and the entropy
term as a token mean, whatever ``loss_reduction`` says (``kl_agg_mode``,
``entropy_agg_mode``), and its sequence means divide by every row of the
mini-batch, rows its filters masked out included (``num_sequences``, per call).
SkyRL's entropy term is a token mean per micro-batch, weighted by the
micro-batch's rows: equal to arctic's with one micro-batch per worker.

Anything else that changes what the policy worker computes is refused at
startup by :func:`check_supported`, naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_vllm_sampling_params
from skyrl.train.config import SamplingParams, SkyRLTrainConfig

from arctic_rl_core.processors import LossConfigError, PostProcessingError, resolve_loss, resolve_post
from arctic_rl_skyrl.config import longest_prompt, longest_sequence
from arctic_rl_skyrl.inference_client import arctic_sampling_params

SUPPORTED_POLICY_LOSSES = ("regular", "dual_clip")

_AGG_MODES = {
    "token_mean": "token-mean",
    "sequence_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}


class UnsupportedSkyRLSetting(ValueError):
    """A SkyRL setting the arctic-rl backend cannot run; the message names it and what to use instead."""


@dataclass(frozen=True)
class LossPlan:
    """What every fwd_bwd of a run sends: the arctic loss, and which context tensors it needs."""

    loss_fn: str
    config: dict[str, Any]
    post: list[dict[str, Any]] = field(default_factory=list)
    reference: bool = False  # send ref_log_probs_shifted (SkyRL's base_action_log_probs)
    rollout_correction: bool = False  # decoupled PPO against the sampler's log-probs (token TIS)
    horizon: Optional[int] = None  # pad calls to this many columns: the Dr. GRPO normalizer

    def processing(self, rows: Optional[int] = None) -> dict[str, Any]:
        """The fwd_bwd processing of a mini-batch of ``rows`` rows, SkyRL's divisor for its sequence means."""
        config = dict(self.config) if rows is None else {**self.config, "num_sequences": rows}
        return {"loss_fn": self.loss_fn, "config": config, "post": list(self.post)}

    def forward_processing(self, reference: bool = False) -> Optional[dict[str, Any]]:
        """fwd_no_grad applies only the post-processors (temperature), so old and new log-probs match.

        The reference forward applies none: SkyRL's reference worker computes its
        log-probs at temperature 1.0 whatever the sampling temperature.
        """
        if reference or not self.post:
            return None
        return {"loss_fn": self.loss_fn, "config": {}, "post": list(self.post)}


def _unsupported(setting: str, value: Any, instead: str) -> UnsupportedSkyRLSetting:
    return UnsupportedSkyRLSetting(f"{setting}={value!r} is not supported by the arctic-rl backend; {instead}")


def loss_plan(cfg: SkyRLTrainConfig) -> LossPlan:
    """The arctic loss for ``cfg.trainer.algorithm``; raises :class:`UnsupportedSkyRLSetting` naming the setting."""
    algorithm = cfg.trainer.algorithm
    prefix = "trainer.algorithm"
    if algorithm.policy_loss_type not in SUPPORTED_POLICY_LOSSES:
        raise _unsupported(
            f"{prefix}.policy_loss_type", algorithm.policy_loss_type, f"use one of {', '.join(SUPPORTED_POLICY_LOSSES)}"
        )
    agg_mode = _AGG_MODES.get(algorithm.loss_reduction)
    if agg_mode is None:
        raise _unsupported(f"{prefix}.loss_reduction", algorithm.loss_reduction, f"use one of {', '.join(_AGG_MODES)}")
    horizon = None
    if algorithm.loss_reduction == "seq_mean_token_sum_norm":
        if algorithm.max_seq_len is None:
            raise UnsupportedSkyRLSetting(
                f"{prefix}.loss_reduction=seq_mean_token_sum_norm needs {prefix}.max_seq_len (its normalizer)"
            )
        horizon = int(algorithm.max_seq_len)
        _check_dr_grpo_horizon(cfg, horizon)
    config: dict[str, Any] = {
        "eps_clip": algorithm.eps_clip_low,
        "eps_clip_high": algorithm.eps_clip_high,
        "loss_agg_mode": agg_mode,
        "kl_coef": algorithm.kl_loss_coef if algorithm.use_kl_loss else 0.0,
        "kl_estimator": algorithm.kl_estimator_type,
        "entropy_coef": algorithm.entropy_loss_coef if algorithm.use_entropy_loss else 0.0,
        # SkyRL's policy worker: masked_mean(kl, mask, dim=-1).mean() and masked_mean(entropy, mask).
        "kl_agg_mode": "seq-mean-token-mean",
        "entropy_agg_mode": "token-mean",
    }
    if algorithm.policy_loss_type == "dual_clip":
        config["clip_ratio_c"] = algorithm.clip_ratio_c
    rollout_correction = _token_tis(cfg, config)
    temperature = algorithm.temperature
    post = [] if temperature in (None, 1.0) else [{"name": "temperature", "config": {"temperature": temperature}}]
    return LossPlan(
        loss_fn="grpo",
        config=config,
        post=post,
        reference=bool(algorithm.use_kl_loss),
        rollout_correction=rollout_correction,
        horizon=horizon,
    )


def _check_dr_grpo_horizon(cfg: SkyRLTrainConfig, horizon: int) -> None:
    """arctic pads rows to ``max_seq_len``, so every batch must fit in it; refuse now what would fail mid-run.

    SkyRL only warns when a batch is wider than ``max_seq_len`` and still divides by it.
    """
    setting = "trainer.algorithm.max_seq_len"
    if cfg.generator.step_wise_trajectories:
        raise UnsupportedSkyRLSetting(
            "trainer.algorithm.loss_reduction=seq_mean_token_sum_norm with generator.step_wise_trajectories=true "
            "is not supported by the arctic-rl backend: each step keeps its observation, so no "
            f"{setting} bounds a batch's rows; use another loss_reduction or whole trajectories"
        )
    widest = longest_sequence(cfg)
    if horizon < widest:
        bound = (
            "max(generator.max_input_length, trainer.max_prompt_length) + generator.sampling_params.max_generate_length"
        )
        if widest > longest_prompt(cfg) + cfg.generator.sampling_params.max_generate_length:
            bound += " + the EOS SkyRL appends after a stop string"
        raise _unsupported(
            setting,
            horizon,
            f"seq_mean_token_sum_norm pads every row to it, and a batch's rows reach {widest} tokens ({bound}); "
            f"set it to at least {widest}",
        )


def _token_tis(cfg: SkyRLTrainConfig, config: dict[str, Any]) -> bool:
    """Token-level TIS is arctic's decoupled PPO with a truncated behaviour weight; other corrections are refused."""
    algorithm = cfg.trainer.algorithm
    correction = algorithm.off_policy_correction
    prefix = "trainer.algorithm.off_policy_correction"
    if algorithm.use_tis:
        raise _unsupported("trainer.algorithm.use_tis", True, f'use {prefix}.tis_ratio_type="token"')
    for name in (
        "sequence_mask_metric",
        "outlier_token_is_threshold_low",
        "outlier_token_is_threshold_high",
        "token_mask_is_threshold_low",
        "token_mask_is_threshold_high",
    ):
        if getattr(correction, name) is not None:
            raise _unsupported(f"{prefix}.{name}", getattr(correction, name), 'only tis_ratio_type="token" is')
    if correction.tis_ratio_type is None:
        return False
    if correction.tis_ratio_type != "token":
        raise _unsupported(f"{prefix}.tis_ratio_type", correction.tis_ratio_type, 'use "token" or null')
    if cfg.generator.sampling_params.logprobs is None:
        raise UnsupportedSkyRLSetting(
            f"{prefix}.tis_ratio_type=token needs the sampler's log-probs: set generator.sampling_params.logprobs=1"
        )
    config["behav_imp_weight_cap"] = correction.token_tis_ratio_clip_high
    config["behav_imp_weight_mode"] = "truncate"
    return True


def check_supported(cfg: SkyRLTrainConfig) -> LossPlan:
    """Refuse, at startup, every setting whose work the arctic backend would silently skip; return the loss plan."""
    trainer = cfg.trainer
    generator = cfg.generator
    engine = generator.inference_engine
    refusals = [
        (trainer.critic.model.path is not None, "trainer.critic.model.path", trainer.critic.model.path,
         "arctic-rl trains no value model: use a critic-free estimator (grpo, rloo, reinforce++, maxrl)"),
        (trainer.algorithm.advantage_estimator == "gae", "trainer.algorithm.advantage_estimator", "gae",
         "GAE needs a value model; use grpo, rloo, reinforce++ or maxrl"),
        (trainer.policy.model.lora.rank > 0, "trainer.policy.model.lora.rank", trainer.policy.model.lora.rank,
         "arctic-rl trains all weights; set it to 0"),
        (trainer.hf_save_interval > 0, "trainer.hf_save_interval", trainer.hf_save_interval,
         "arctic-rl saves DeepSpeed checkpoints (trainer.ckpt_interval); set it to -1"),
        (trainer.update_ref_every_epoch, "trainer.update_ref_every_epoch", True,
         "the arctic reference engine keeps its initial weights"),
        (trainer.policy.torch_profiler_config.enable, "trainer.policy.torch_profiler_config.enable", True,
         "profile the arctic workers instead"),
        (trainer.fully_async.simulate_training, "trainer.fully_async.simulate_training", True,
         "run real training steps"),
        (trainer.algorithm.enable_sample_support_replay, "trainer.algorithm.enable_sample_support_replay", True,
         "arctic's sampler records no sample support"),
        (generator.vision_language_generator, "generator.vision_language_generator", True,
         "arctic-rl runs text-only models"),
        (engine.enable_return_routed_experts, "generator.inference_engine.enable_return_routed_experts", True,
         "arctic's sampler records no expert routes"),
        (engine.enable_return_sample_support_set, "generator.inference_engine.enable_return_sample_support_set",
         True, "arctic's sampler records no sample support"),
    ]  # fmt: skip
    for refused, setting, value, instead in refusals:
        if refused:
            raise _unsupported(setting, value, instead)
    _check_sampling_params("generator.sampling_params", generator.sampling_params)
    _check_sampling_params("generator.eval_sampling_params", generator.eval_sampling_params)
    plan = loss_plan(cfg)
    _check_loss_config(plan)
    return plan


def _check_sampling_params(path: str, params: Optional[SamplingParams]) -> None:
    """The sampling params SkyRL's generator will send (``get_vllm_sampling_params``), as the client will take them."""
    if params is None:
        return
    if params.min_p != 0.0:
        raise _unsupported(
            f"{path}.min_p", params.min_p, "arctic's sampler has temperature, top_p and top_k; set it to 0"
        )
    try:
        arctic_sampling_params(get_vllm_sampling_params(params))
    except ValueError as err:
        # min_p aside, only additional_kwargs can carry what arctic's sampler refuses.
        setting = f"{path}.additional_kwargs={params.additional_kwargs!r}" if params.additional_kwargs else path
        raise UnsupportedSkyRLSetting(f"{setting} is not supported by the arctic-rl backend: {err}") from None


# arctic's grpo config field -> the SkyRL setting it comes from.
_LOSS_SETTINGS = {
    "eps_clip": "trainer.algorithm.eps_clip_low",
    "eps_clip_high": "trainer.algorithm.eps_clip_high",
    "loss_agg_mode": "trainer.algorithm.loss_reduction",
    "kl_coef": "trainer.algorithm.kl_loss_coef",
    "kl_estimator": "trainer.algorithm.kl_estimator_type",
    "entropy_coef": "trainer.algorithm.entropy_loss_coef",
    "clip_ratio_c": "trainer.algorithm.clip_ratio_c",
    "behav_imp_weight_cap": "trainer.algorithm.off_policy_correction.token_tis_ratio_clip_high",
    "behav_imp_weight_mode": "trainer.algorithm.off_policy_correction.tis_ratio_type",
}


def _check_loss_config(plan: LossPlan) -> None:
    """Validate the loss and post-processors as arctic's server will at the first fwd_bwd, naming SkyRL's settings."""
    spec = resolve_loss(plan.loss_fn)
    try:
        spec.parse_config(plan.config)
    except LossConfigError as err:
        bad = [name for name, value in plan.config.items() if not _valid_alone(spec, name, value)]
        named = ", ".join(f"{_LOSS_SETTINGS.get(name, name)}={plan.config[name]!r}" for name in bad)
        raise UnsupportedSkyRLSetting(
            f"{named or 'trainer.algorithm'} is not supported by the arctic-rl backend: {err}"
        ) from None
    try:
        resolve_post(plan.post)
    except PostProcessingError as err:
        raise UnsupportedSkyRLSetting(
            "trainer.algorithm.temperature (from generator.sampling_params.temperature) is not supported by the "
            f"arctic-rl backend: {err}"
        ) from None


def _valid_alone(spec: Any, name: str, value: Any) -> bool:
    try:
        spec.parse_config({name: value})
    except LossConfigError:
        return False
    return True
