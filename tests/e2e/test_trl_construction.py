"""ArcticGRPOTrainer refuses, at construction and before starting anything, what the arctic engines cannot run.

Every check runs before a deployment would start, so these tests need none.
The configs name a remote server on a closed port: had a check let a
configuration through, the trainer would fail to connect instead of raising
the error a test expects.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from arctic_rl_core import ArcticRLClientConfig  # noqa: E402
from arctic_rl_trl import ArcticGRPOTrainer, UnsupportedGRPOOption  # noqa: E402
from arctic_rl_trl.engine_config import (  # noqa: E402
    training_config_from_grpo,
    with_grpo_training_config,
    with_processed_logprobs,
)
from tests.installed import require  # noqa: E402


def constant_reward(completions, **_):
    return [0.0] * len(completions)


def grpo_args(tmp_path, **options) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        bf16=False, use_cpu=True, report_to=[], gradient_checkpointing=False, max_steps=2,
    )  # fmt: skip
    return GRPOConfig(**{**base, **options})


def arctic_config(model: str, **options) -> ArcticRLClientConfig:
    base = dict(
        model_name=model, backend="remote", host="127.0.0.1", port=9, device="cpu", training_gpus=1, sampling_gpus=1
    )
    return ArcticRLClientConfig(**{**base, **options})


def build(model, args, config, **trainer_options):
    dataset = Dataset.from_dict({"prompt": ["a b c", "d e f"]})
    return ArcticGRPOTrainer(
        model=model, reward_funcs=constant_reward, args=args, train_dataset=dataset, arctic_config=config,
        **trainer_options,
    )  # fmt: skip


def test_use_vllm_with_the_arctic_sampler_is_refused_by_name(tiny_model, tmp_path):
    with pytest.raises(UnsupportedGRPOOption, match=r"use_vllm=True: generation runs on the arctic sampling engine"):
        build(tiny_model, grpo_args(tmp_path, use_vllm=True), arctic_config(tiny_model))


def test_peft_config_is_refused_by_name(tiny_model, tmp_path):
    peft = require("peft", "pip install peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj"])
    with pytest.raises(UnsupportedGRPOOption, match=r"peft_config='LoraConfig': PEFT is not supported"):
        build(tiny_model, grpo_args(tmp_path), arctic_config(tiny_model), peft_config=lora)


def test_every_unsupported_option_is_listed_in_one_error(tiny_model, tmp_path):
    args = grpo_args(
        tmp_path, loss_type="cispo", importance_sampling_level="sequence", beta=0.1, top_entropy_quantile=0.2,
        min_p=0.1, optim="sgd",
    )  # fmt: skip
    with pytest.raises(UnsupportedGRPOOption) as caught:
        build(tiny_model, args, arctic_config(tiny_model, log_prob_gpus=1))
    message = str(caught.value)
    for option in ("loss_type='cispo'", "importance_sampling_level='sequence'", "use_bias_correction_kl=True",
                   "top_entropy_quantile=0.2", "min_p=0.1", "optim="):  # fmt: skip
        assert option in message


def test_kl_penalty_without_a_log_prob_job_names_the_missing_job(tiny_model, tmp_path):
    args = grpo_args(tmp_path, beta=0.04, use_bias_correction_kl=False)
    with pytest.raises(UnsupportedGRPOOption, match=r"arctic_config.log_prob_gpus=0: a log_prob job is needed"):
        build(tiny_model, args, arctic_config(tiny_model))


def test_a_different_model_than_the_deployment_is_refused(tiny_model, tmp_path):
    config = arctic_config(str(tmp_path / "another-model"))
    with pytest.raises(UnsupportedGRPOOption, match=r"model=.*the arctic engines load"):
        build(tiny_model, grpo_args(tmp_path), config)


def test_optimizer_settings_in_the_arctic_config_conflict_with_grpo_config(tiny_model, tmp_path):
    config = arctic_config(tiny_model, training_config={"optimizer": {"lr": 1e-5}, "dtype": "bfloat16"})
    with pytest.raises(UnsupportedGRPOOption) as caught:
        build(tiny_model, grpo_args(tmp_path), config)
    assert "training_config['optimizer']" in str(caught.value)
    assert "training_config['dtype']='bfloat16': GRPOConfig asks for 'float32'" in str(caught.value)


def test_exactly_one_of_arctic_config_and_arctic_client_is_required(tiny_model, tmp_path):
    with pytest.raises(TypeError, match="exactly one of arctic_config= .* or arctic_client="):
        ArcticGRPOTrainer(model=tiny_model, reward_funcs=constant_reward, args=grpo_args(tmp_path))


def test_grpo_config_sets_the_engine_optimizer_and_schedule(tmp_path):
    args = grpo_args(
        tmp_path, learning_rate=3e-6, adam_beta2=0.98, weight_decay=0.1, max_grad_norm=0.5,
        lr_scheduler_type="cosine", warmup_steps=2, gradient_checkpointing=True,
    )  # fmt: skip
    config = training_config_from_grpo(args, max_steps=20)
    assert config["optimizer"] == {
        "lr": 3e-6, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.98, "eps": 1e-8, "gradient_clipping": 0.5,
        "lr_scheduler_type": "cosine", "warmup_steps": 2, "total_train_steps": 20,
    }  # fmt: skip
    assert config["gradient_checkpointing"] is True
    assert config["dtype"] == "float32"


@pytest.mark.parametrize("schedule", ["constant", "constant_with_warmup", "linear", "cosine"])
def test_learning_rates_equal_hf_schedulers(tmp_path, schedule):
    """Each optimizer step's lr is HF's; "constant" has no warmup whatever warmup_steps says, as in HF."""
    import torch
    from transformers import get_scheduler

    from arctic_rl_core.config import OptimizerConfig
    from arctic_rl_core.engines.training.deepspeed_setup import lr_multiplier

    steps = 20
    args = grpo_args(tmp_path, lr_scheduler_type=schedule, warmup_steps=5)
    engine = lr_multiplier(OptimizerConfig(**training_config_from_grpo(args, max_steps=steps)["optimizer"]))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    hf = get_scheduler(args.lr_scheduler_type, optimizer, args.get_warmup_steps(steps), steps)
    assert [engine(step) for step in range(steps)] == pytest.approx([hf.lr_lambdas[0](step) for step in range(steps)])


def test_disable_dropout_on_a_model_with_dropout_is_refused_by_name(tmp_path):
    """TRL zeroes the dropout of its own copy; the engine's copy would keep it, so the option is refused."""
    from transformers import GPT2Config

    model = str(tmp_path / "tiny-gpt2")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, resid_pdrop=0.1).save_pretrained(model)
    with pytest.raises(UnsupportedGRPOOption, match=r"disable_dropout=True: the arctic training engine trains with"):
        build(model, grpo_args(tmp_path, disable_dropout=True), arctic_config(model))


@pytest.mark.parametrize("epsilon", [1.0, 1.5])
def test_epsilon_of_one_or_more_is_refused_by_name(tiny_model, tmp_path, epsilon):
    """The engine's clip keeps the ratio above 1 - epsilon > 0: it would refuse the first fwd_bwd instead."""
    args = grpo_args(tmp_path, epsilon=epsilon, epsilon_high=0.28)
    with pytest.raises(UnsupportedGRPOOption, match=rf"epsilon={epsilon!r}: the arctic grpo loss clips the ratio"):
        build(tiny_model, args, arctic_config(tiny_model))


def test_the_engine_decays_exactly_the_parameters_hfs_trainer_decays(tiny_model, tmp_path, monkeypatch):
    """HF picks them by name and norm-layer type, not by dimension: GPT-OSS's attention sinks are 1-D and
    decayed, its expert biases 2-D and not. The engine's AdamW gets HF's choice by name."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM, GptOssConfig, Trainer, TrainingArguments

    import arctic_rl_trl.trainer as trainer_module
    from arctic_rl_core.config import OptimizerConfig
    from arctic_rl_core.engines.training.deepspeed_setup import build_optimizer

    model_dir = tmp_path / "tiny-gpt-oss"
    config = GptOssConfig(vocab_size=512, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, layer_types=["full_attention"], router_aux_loss_coef=0.0)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    for tokenizer_file in Path(tiny_model).glob("*token*"):
        shutil.copy(tokenizer_file, model_dir)

    class Captured(Exception):
        pass

    sent = {}

    def capture(client_config):
        sent["optimizer"] = client_config.training_config["optimizer"]
        raise Captured

    monkeypatch.setattr(trainer_module, "create_arctic_rl_client", capture)
    with pytest.raises(Captured):
        build(str(model_dir), grpo_args(tmp_path, weight_decay=0.1), arctic_config(str(model_dir)))

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    names = {id(p): name for name, p in model.named_parameters()}

    def decayed(optimizer) -> set[str]:
        return {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}

    hf_args = TrainingArguments(output_dir=str(tmp_path / "hf"), weight_decay=0.1, use_cpu=True, report_to=[])
    hf = decayed(Trainer(model=model, args=hf_args).create_optimizer())
    engine = decayed(build_optimizer(model.named_parameters(), OptimizerConfig(**sent["optimizer"]), "cpu"))
    assert engine == hf
    assert "model.layers.0.self_attn.sinks" in hf and "model.layers.0.mlp.experts.down_proj_bias" not in hf


def test_forward_only_calls_take_trls_log_prob_batch_size_unless_mb_spec_names_its_own(tmp_path):
    args = grpo_args(tmp_path, per_device_train_batch_size=6, num_generations=3)
    plain = with_grpo_training_config(arctic_config("m"), args, 2).training_config
    assert plain["mb_spec"] == {"max_rows_per_forward_mb": 6}
    own = arctic_config("m", training_config={"mb_spec": {"max_tokens_per_mb": 64, "max_rows_per_forward_mb": 2}})
    assert with_grpo_training_config(own, args, 2).training_config["mb_spec"] == {
        "max_tokens_per_mb": 64,
        "max_rows_per_forward_mb": 2,
    }


def test_a_started_deployment_reports_processed_log_probs_as_trls_vllm_unless_its_config_names_a_mode():
    assert with_processed_logprobs(arctic_config("m")).vllm_config == {"logprobs_mode": "processed_logprobs"}
    own = arctic_config("m", vllm_config={"logprobs_mode": "raw_logprobs", "max_model_len": 64})
    assert with_processed_logprobs(own).vllm_config == {"logprobs_mode": "raw_logprobs", "max_model_len": 64}
