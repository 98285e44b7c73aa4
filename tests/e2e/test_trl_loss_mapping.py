"""GRPOConfig's loss options mapped onto the arctic grpo loss give TRL's loss and gradients, option by option.

Each case runs TRL's own ``GRPOTrainer._compute_loss`` on a real micro-batch
of a tiny model and, on the same batch and weights, the arctic grpo loss as
the training engine runs it (``token_outputs`` for the log-probs, then the
registered loss) with the processing and context that ArcticGRPOTrainer
sends. Old and reference log-probs are perturbed so that ratio clipping, the
dual clip and the KL term are all active. No deployment is needed: the
end-to-end path is covered by test_trl_parity.py.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from arctic_rl_core.engines.token_outputs import token_outputs  # noqa: E402
from arctic_rl_core.processors import loss_mask_from_context, resolve_post  # noqa: E402
from arctic_rl_trl.importance_sampling import ImportanceSamplingCorrection  # noqa: E402
from arctic_rl_trl.loss import LossMapping, completion_loss_mask, loss_batch  # noqa: E402
from tests.e2e.trl_rollouts import PROMPTS, fixed_rollout, multiple_of_three_share  # noqa: E402

CASES = {
    "dapo": dict(loss_type="dapo", gradient_accumulation_steps=2),
    "dapo-kl-entropy-clip-higher": dict(
        loss_type="dapo", beta=0.05, use_bias_correction_kl=False, entropy_coef=0.01, epsilon_high=0.28
    ),
    "grpo-kl": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False, gradient_accumulation_steps=2),
    "grpo-kl-far-reference": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    "bnpo-entropy": dict(loss_type="bnpo", entropy_coef=0.02, gradient_accumulation_steps=2),
    "dr_grpo-delta-temperature": dict(loss_type="dr_grpo", delta=1.5, epsilon=0.1, temperature=0.7),
    "dapo-token-truncate-is": dict(
        loss_type="dapo", vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.2
    ),
    "grpo-sequence-mask-is": dict(
        loss_type="grpo", vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_max=1.5
    ),
}
# Reference log-probs this far above the policy's put k3 past verl's clamp at 10 (TRL's k3 has no clamp).
REFERENCE_SHIFT = {"grpo-kl-far-reference": 4.0}


def trl_micro_batch(
    model_path: str, output_dir, options: dict, reference_shift: float = 0.0
) -> tuple[GRPOTrainer, dict]:
    accumulation = options.get("gradient_accumulation_steps", 1)
    args = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        bf16=False,
        use_cpu=True,
        report_to=[],
        gradient_checkpointing=False,
        seed=0,
        **options,
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    trainer = GRPOTrainer(
        model=model_path, reward_funcs=multiple_of_three_share, args=args, train_dataset=dataset,
        rollout_func=fixed_rollout,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    generator = torch.Generator().manual_seed(1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].shape[1],
    )  # fmt: skip
    # Off-policy old log-probs and a distinct reference, so clipping and the KL term act.
    inputs["old_per_token_logps"] = logps.detach() + 0.3 * torch.randn(logps.shape, generator=generator)
    if args.beta != 0.0:
        noise = 0.5 * torch.randn(logps.shape, generator=generator)
        inputs["ref_per_token_logps"] = logps.detach() + noise + reference_shift
    if "vllm_importance_sampling_mode" in options:
        sampler = inputs["old_per_token_logps"] + 0.2 * torch.randn(logps.shape, generator=generator)
        correction = ImportanceSamplingCorrection.from_args(args)
        inputs["importance_sampling_ratio"] = correction.ratio(
            inputs["old_per_token_logps"], sampler, completion_loss_mask(inputs)
        )
        trainer.use_vllm = True  # only so that TRL's _compute_loss applies the ratio, as it does after vLLM
    return trainer, inputs


def gradients(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("case", CASES)
def test_arctic_grpo_loss_and_gradients_equal_trl(case, tiny_model, tmp_path):
    trainer, inputs = trl_micro_batch(tiny_model, tmp_path, CASES[case], REFERENCE_SHIFT.get(case, 0.0))
    model = trainer.model

    model.zero_grad()
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = gradients(model)

    accumulation = trainer.current_gradient_accumulation_steps
    step_tokens = float(inputs["num_items_in_batch"]) * accumulation / trainer.args.steps_per_generation
    batch = loss_batch(inputs, LossMapping.from_args(trainer.args), accumulation, step_tokens)
    model.zero_grad()
    mask = loss_mask_from_context(batch.context, batch.rows.attention_mask)
    outputs = token_outputs(
        model, batch.rows.input_ids, batch.rows.attention_mask, mask > 0,
        post=resolve_post(batch.processing["post"]), entropy="grad",
    )  # fmt: skip
    arctic = batch.evaluate(outputs.logprobs, outputs.entropy)
    arctic.loss.backward()
    arctic_grads = gradients(model)

    assert trl_grads.norm() > 0
    clipped, _ = arctic.metrics["clip_frac"]
    assert clipped > 0, "the case must exercise ratio clipping"
    assert float(arctic.loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-7)
    assert float((arctic_grads - trl_grads).norm() / trl_grads.norm()) < 1e-4


def test_token_truncate_clamps_each_token_ratio():
    correction = ImportanceSamplingCorrection("token_truncate", clip_min=0.5, clip_max=2.0)
    trainer = torch.tensor([[0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-1.0, 0.1, 2.0]])
    ratio = correction.ratio(trainer, sampler, torch.ones(1, 3))
    assert ratio[0].tolist() == pytest.approx([2.0, float(torch.tensor(-0.1).exp()), 0.5])


def test_sequence_mask_zeroes_whole_sequences_outside_the_bounds():
    correction = ImportanceSamplingCorrection("sequence_mask", clip_min=None, clip_max=3.0)
    trainer = torch.zeros(2, 3)
    sampler = torch.tensor([[-0.5, -0.5, -9.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the -9 of row 0 is padding
    ratio = correction.ratio(trainer, sampler, mask)
    assert ratio.shape == (2, 1)
    assert ratio[0, 0] == pytest.approx(float(torch.tensor(1.0).exp()))
    assert ratio[1, 0] == 0.0  # e^1.5 > 3


def test_unscored_sampler_tokens_weigh_one():
    correction = ImportanceSamplingCorrection("token_mask", clip_min=0.9, clip_max=1.1)
    ratio = correction.ratio(torch.zeros(1, 2), torch.tensor([[float("nan"), 0.0]]), torch.ones(1, 2))
    assert ratio.tolist() == [[1.0, 1.0]]
