"""The arctic block of a SkyRL config, and the ArcticRLClientConfig a run derives from it."""

from __future__ import annotations

import pytest
import torch
from skyrl.train.utils import validate_cfg
from transformers import get_scheduler

from arctic_rl_core.config import OptimizerConfig
from arctic_rl_core.engines.sampling.protocol import check_prompt
from arctic_rl_core.engines.training.deepspeed_setup import lr_multiplier
from arctic_rl_skyrl.config import ArcticRLConfig, ArcticSkyRLTrainConfig, client_config, placement

BASE = [
    "trainer.policy.model.path=/models/tiny",
    "trainer.train_batch_size=8",
    "trainer.policy_mini_batch_size=4",
    "generator.n_samples_per_prompt=4",
]


def parse(*overrides: str):
    return ArcticSkyRLTrainConfig.from_cli_overrides([*BASE, *overrides])


def test_without_arctic_overrides_the_block_takes_its_defaults():
    cfg = parse()
    assert cfg.trainer.arctic_rl == ArcticRLConfig()


def test_one_flag_sets_several_arctic_settings():
    cfg = parse("trainer.arctic_rl={colocate: false, zorro_train: true, sampler: native, training_gpus: 2}")
    arctic = cfg.trainer.arctic_rl
    assert (arctic.colocate, arctic.zorro_train, arctic.sampler, arctic.training_gpus) == (False, True, "native", 2)


def test_dotted_keys_set_single_arctic_settings():
    assert parse("trainer.arctic_rl.zero_stage=2").trainer.arctic_rl.zero_stage == 2


def test_unknown_arctic_key_is_rejected_by_name():
    with pytest.raises(ValueError, match="zorro_trian"):
        parse("trainer.arctic_rl.zorro_trian=true")


def test_invalid_arctic_value_names_the_field_and_the_choices():
    with pytest.raises(
        ValueError, match=r"trainer\.arctic_rl\.sampler must be one of auto, native, vllm; got 'sglang'"
    ):
        parse("trainer.arctic_rl.sampler=sglang")


def test_placement_follows_skyrl_gpu_settings_by_default():
    cfg = parse(
        "trainer.placement.policy_num_gpus_per_node=4",
        "trainer.placement.policy_num_nodes=2",
        "generator.inference_engine.num_engines=3",
        "generator.inference_engine.tensor_parallel_size=2",
        "trainer.placement.colocate_all=false",
    )
    where = placement(cfg)
    # SkyRL's defaults keep the KL loss on, so the reference gets as many GPUs as training.
    assert (where.training_gpus, where.sampling_gpus, where.log_prob_gpus, where.colocate) == (8, 6, 8, False)
    assert where.cluster_gpus == 22


def test_no_reference_engine_without_kl():
    cfg = parse("trainer.algorithm.use_kl_loss=false")
    assert placement(cfg).log_prob_gpus == 0


def test_colocated_placement_needs_the_largest_job_only():
    where = placement(parse("trainer.arctic_rl={training_gpus: 4, sampling_gpus: 2, colocate: true}"))
    assert where.colocate and where.cluster_gpus == 4


def test_kl_without_a_reference_gpu_is_refused():
    with pytest.raises(ValueError, match="log_prob_gpus=0"):
        placement(parse("trainer.arctic_rl.log_prob_gpus=0"))


def test_client_config_carries_skyrl_optimizer_precision_and_schedule():
    cfg = parse(
        "trainer.policy.optimizer_config.lr=3e-6",
        "trainer.policy.optimizer_config.adam_betas=[0.9,0.95]",
        "trainer.policy.optimizer_config.weight_decay=0.1",
        "trainer.policy.optimizer_config.max_grad_norm=0.5",
        "trainer.policy.optimizer_config.scheduler=cosine",
        "trainer.policy.optimizer_config.num_warmup_steps=5",
        "trainer.bf16=false",
        "trainer.arctic_rl={zero_stage: 2, offload_optimizer: true, zorro_train: true}",
    )
    config = client_config(cfg, total_optimizer_steps=50)
    optimizer = config.training_config["optimizer"]
    assert optimizer == {
        "lr": 3e-6,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "gradient_clipping": 0.5,
        "lr_scheduler_type": "cosine",
        "total_train_steps": 50,
        "warmup_steps": 5,
        "no_decay_params": [],
    }
    assert config.training_config["dtype"] == "float32"
    assert config.training_config["zorro_train"] == {"enable": True}
    assert config.ds_config == {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert config.model_name == "/models/tiny"
    assert config.comm_protocol == "ray" and config.log_prob_engine == "deepspeed"


@pytest.mark.parametrize("scheduler", ["constant", "constant_with_warmup", "linear", "cosine"])
def test_learning_rates_equal_skyrl_schedulers(scheduler):
    """Every optimizer step's lr equals SkyRL's own scheduler (HF's get_scheduler, stepped per optimizer step)."""
    total, warmup = 24, 5
    cfg = parse(
        f"trainer.policy.optimizer_config.scheduler={scheduler}",
        f"trainer.policy.optimizer_config.num_warmup_steps={warmup}",
    )
    settings = OptimizerConfig(**client_config(cfg, total_optimizer_steps=total).training_config["optimizer"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=settings.lr)
    skyrl = get_scheduler(scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    at = lr_multiplier(settings)
    for step in range(total):
        assert settings.lr * at(step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        optimizer.step()
        skyrl.step()


def test_micro_batches_follow_skyrl_micro_batch_sizes_per_rank():
    cfg = parse("trainer.micro_train_batch_size_per_gpu=3", "trainer.micro_forward_batch_size_per_gpu=5")
    assert client_config(cfg, 10).training_config["mb_spec"] == {"max_rows_per_mb": 3, "max_rows_per_forward_mb": 5}


def test_token_budget_replaces_micro_batch_size():
    cfg = parse("trainer.max_tokens_per_microbatch=4096")
    assert client_config(cfg, 10).training_config["mb_spec"] == {"max_tokens_per_mb": 4096}


def test_scheduler_without_arctic_equivalent_is_refused_by_name():
    cfg = parse("trainer.policy.optimizer_config.scheduler=polynomial")
    with pytest.raises(ValueError, match="scheduler='polynomial'"):
        client_config(cfg, 10)


def test_sampler_context_fits_the_longest_prompt_plus_a_full_generation():
    single_turn = parse("trainer.max_prompt_length=256", "generator.sampling_params.max_generate_length=128")
    assert client_config(single_turn, 10).vllm_config["max_model_len"] == 256 + 128
    # Multi-turn, SkyRL's agent loop sends each turn's input of up to generator.max_input_length tokens
    # with max_tokens=max_generate_length.
    multi_turn = parse(
        "trainer.logger=console",
        "generator.max_turns=4",
        "generator.max_input_length=2048",
        "trainer.max_prompt_length=256",
        "generator.sampling_params.max_generate_length=256",
    )
    validate_cfg(multi_turn)
    assert client_config(multi_turn, 10).vllm_config["max_model_len"] == 2048 + 256
    check_prompt(list(range(1, 2049)), client_config(multi_turn, 10).vllm_config["max_model_len"], 4096)


def test_inference_engine_settings_reach_the_sampler_with_engine_init_kwargs_last_as_in_skyrl():
    engine = "generator.inference_engine"
    cfg = parse(f"{engine}.max_num_seqs=64",
                f"{engine}.engine_init_kwargs={{logprobs_mode: processed_logprobs, enforce_eager: true}}")  # fmt: skip
    sampler = client_config(cfg, 10).vllm_config
    assert sampler["max_num_seqs"] == 64
    assert sampler["logprobs_mode"] == "processed_logprobs"
    assert sampler["enforce_eager"] is True  # over inference_engine.enforce_eager (false)
    ours = parse(
        f"{engine}.engine_init_kwargs={{max_num_seqs: 8}}", "trainer.arctic_rl.sampler_config={max_num_seqs: 4}"
    )
    assert client_config(ours, 10).vllm_config["max_num_seqs"] == 4
