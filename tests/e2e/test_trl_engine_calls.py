"""What ArcticGRPOTrainer asks of the engines during ``train()``, against a recording stand-in client.

The stand-in answers every call a real deployment would (log-probs of 0, a
grad norm that is 0 exactly when no loss token reached the step), so these
tests run TRL's own loop in seconds and check the calls and what TRL logs.
The numbers themselves are checked against real engines in test_trl_parity.py.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from arctic_rl_core import ArcticRLClientConfig  # noqa: E402
from arctic_rl_trl import ArcticGRPOTrainer  # noqa: E402
from tests.e2e.trl_rollouts import PROMPTS, fixed_rollout, multiple_of_three_share  # noqa: E402

MAX_TOKENS = 6
GRAD_NORM = 1.5  # what the stand-in reports for a step that had loss tokens


class RecordingClient:
    """An arctic client with a training and a sampling job; the engines' answers are made up, the calls kept."""

    training_job_id = "training"
    sampling_job_id = "sampling"

    def __init__(self, model: str, truncate_from_generate_call: int = 10**9, logprobs_mode: str = "raw_logprobs"):
        self.config = ArcticRLClientConfig(
            model_name=model, backend="remote", host="127.0.0.1", port=9, device="cpu", training_gpus=1,
            sampling_gpus=1, vllm_config={"logprobs_mode": logprobs_mode},
        )  # fmt: skip
        self.eos = AutoTokenizer.from_pretrained(model).eos_token_id
        self.truncate_from = truncate_from_generate_call
        self.generate_calls = 0
        self.fwd_bwd_masks: list[torch.Tensor] = []
        self.fwd_bwd_contexts: list[dict] = []
        self.fwd_no_grad_posts: list[list] = []
        self.steps: list[dict] = []
        self._tokens_since_step = False
        self._engine_step = 0

    @property
    def log_prob_job_id(self):
        raise ValueError("no log_prob job")

    async def generate(self, prompt_token_ids, sampling_params):
        """Completions of MAX_TOKENS tokens: ending with EOS, or (from the given call on) cut at the length limit."""
        self.generate_calls += 1
        truncated = self.generate_calls >= self.truncate_from
        outputs = []
        for p, prompt in enumerate(prompt_token_ids):
            completions = []
            for i in range(sampling_params["n"]):
                ids = [10 + (p * 7 + i * 3 + k) % 50 for k in range(MAX_TOKENS)]
                if not truncated:
                    ids[-1] = self.eos
                completions.append({"token_ids": ids, "logprobs": [-1.0] * len(ids)})
            outputs.append({"outputs": completions})
        return outputs

    async def fwd_no_grad(self, batch, reference_model, processing, return_entropy):
        self.fwd_no_grad_posts.append(processing["post"])
        rows, length = batch["args"][0].shape
        result = {"log_probs_shifted": torch.zeros(rows, length)}
        if return_entropy:
            result["entropy_shifted"] = torch.zeros(rows, length)
        return result

    async def fwd_bwd(self, batch, processing):
        mask = batch["context"]["loss_mask_shifted"]
        self.fwd_bwd_masks.append(mask)
        self.fwd_bwd_contexts.append(batch["context"])
        self._tokens_since_step |= bool(mask.any())
        return {"loss": 0.0, "metrics": {"clip_frac": 0.0}}

    async def step(self):
        self._engine_step += 1
        result = {"grad_norm": GRAD_NORM if self._tokens_since_step else 0.0, "lr": 0.0, "step": self._engine_step}
        self._tokens_since_step = False
        self.steps.append(result)
        return result

    async def sync_weights(self):
        return {}


class LogRecorder(TrainerCallback):
    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def grpo_args(tmp_path, **options) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=MAX_TOKENS, max_steps=3, learning_rate=1e-3, lr_scheduler_type="linear", bf16=False,
        use_cpu=True, report_to=[], gradient_checkpointing=False, logging_steps=1, save_strategy="no", seed=0,
    )  # fmt: skip
    return GRPOConfig(**{**base, **options})


def train(model: str, args: GRPOConfig, client: RecordingClient, **trainer_options) -> tuple[ArcticGRPOTrainer, list]:
    recorder = LogRecorder()
    trainer = ArcticGRPOTrainer(
        model=model, reward_funcs=multiple_of_three_share, args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), callbacks=[recorder], arctic_client=client,
        **trainer_options,
    )  # fmt: skip
    trainer.train()
    return trainer, recorder.logs


def test_a_step_with_no_loss_token_still_runs_fwd_bwd_and_step(tiny_model, tmp_path):
    """mask_truncated_completions and every completion of step 2 truncated: TRL's backward gives zero gradients
    and HF still steps AdamW and the LR schedule, so the engine must take that step too and log its grad norm."""
    client = RecordingClient(tiny_model, truncate_from_generate_call=2)
    trainer, logs = train(tiny_model, grpo_args(tmp_path, mask_truncated_completions=True), client)

    assert client.generate_calls == 3
    assert len(client.fwd_bwd_masks) == 3 * 2, "one fwd_bwd per micro-batch, empty ones included"
    assert [bool(m.any()) for m in client.fwd_bwd_masks] == [True, True, False, False, False, False]
    assert len(client.steps) == trainer.state.global_step == 3, "the engine takes every optimizer step HF takes"
    # The engine's LR schedule runs on its own step count (test_trl_construction checks it against HF's).
    assert client.steps[-1]["step"] == trainer.state.global_step
    assert [entry["grad_norm"] for entry in logs] == [GRAD_NORM, 0.0, 0.0], "the grad norm the engine reports"


def advantages_sent(client: RecordingClient) -> torch.Tensor:
    return torch.cat([context["advantages"].flatten() for context in client.fwd_bwd_contexts])


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_a_rollout_funcs_log_probs_weigh_nothing_as_in_trl(tiny_model, tmp_path, mode):
    """TRL applies vllm_importance_sampling_* only to vLLM's log-probs (use_vllm); with a rollout_func and
    use_vllm=False it keeps them unused. fixed_rollout reports -7 per token, far from the engine's 0 here: any
    correction would mask (sequence_mask) or cap (token_truncate) the advantages sent."""
    args = grpo_args(tmp_path, max_steps=1, temperature=0.7, vllm_importance_sampling_mode=mode)
    assert args.vllm_importance_sampling_correction  # TRL's default
    client = RecordingClient(tiny_model)
    _, logs = train(tiny_model, args, client, rollout_func=fixed_rollout)

    off = grpo_args(tmp_path, max_steps=1, temperature=0.7, vllm_importance_sampling_correction=False)
    reference = RecordingClient(tiny_model)
    train(tiny_model, off, reference, rollout_func=fixed_rollout)

    assert advantages_sent(client).abs().sum() > 0
    assert torch.equal(advantages_sent(client), advantages_sent(reference))
    assert not any(name.startswith("sampling/") for name in logs[0]), "no importance-sampling metrics"
    assert [] not in client.fwd_no_grad_posts, "no temperature-1 log-probs for a correction"
    assert len(client.fwd_no_grad_posts) == len(reference.fwd_no_grad_posts)


def test_the_arctic_samplers_log_probs_are_still_corrected(tiny_model, tmp_path):
    """Without a rollout_func the arctic sampler plays vLLM's part: its log-probs (-1 per token here, the
    engine's 0) get TRL's correction, sequence_mask with clip_max 3 by default, which masks every sequence."""
    client = RecordingClient(tiny_model)
    _, logs = train(tiny_model, grpo_args(tmp_path, max_steps=1), client)
    assert logs[0]["sampling/importance_sampling_ratio/max"] == 0.0
    assert advantages_sent(client).abs().sum() == 0


@pytest.mark.parametrize(("mode", "temperature_one_passes"), [("processed_logprobs", 0), ("raw_logprobs", 1)])
def test_the_trainer_side_of_the_correction_scores_what_the_sampler_scores(tiny_model, tmp_path, mode,
                                                                           temperature_one_passes):  # fmt: skip
    """Processed sampler log-probs are weighed against TRL's old log-probs at the sampling temperature (no
    extra pass); raw ones against log-probs at temperature 1, one more fwd_no_grad for the generation batch."""
    client = RecordingClient(tiny_model, logprobs_mode=mode)
    _, logs = train(tiny_model, grpo_args(tmp_path, max_steps=1, temperature=0.7), client)
    assert "sampling/importance_sampling_ratio/max" in logs[0]
    assert client.fwd_no_grad_posts.count([]) == temperature_one_passes
    at_temperature = [{"name": "temperature", "config": {"temperature": 0.7}}]
    assert client.fwd_no_grad_posts.count(at_temperature) == 1  # TRL's old log-probs of the generation batch
    assert len(client.fwd_no_grad_posts) == 1 + temperature_one_passes
