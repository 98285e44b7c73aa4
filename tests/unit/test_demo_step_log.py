"""The demo's per-step line reports only what its GRPO step can measure."""

import asyncio

import torch

from arctic_rl_core.demo import DEMO_MODEL, Demo, DemoConfig
from arctic_rl_core.models.tiny import build_tiny_model


class FakeClient:
    """Answers the demo's calls without a deployment: every sample answers ``0``."""

    def __init__(self, tokenizer_path: str):
        from transformers import AutoTokenizer

        self.zero = AutoTokenizer.from_pretrained(tokenizer_path)("0", add_special_tokens=False)["input_ids"]

    async def generate(self, prompt_token_ids, sampling_params):
        outputs = [{"text": "0", "token_ids": self.zero} for _ in range(sampling_params["n"])]
        return [{"outputs": outputs} for _ in prompt_token_ids]

    async def fwd_no_grad(self, batch, reference_model=False):
        return {"log_probs_shifted": torch.zeros(batch["args"][0].shape)}

    async def fwd_bwd(self, batch, loss):
        # What the grpo loss reports when the old log-probs come from the current weights.
        return {"metrics": {"approx_kl": 0.0, "clip_frac": 0.0, "entropy": 1.5}}

    async def step(self):
        return {"grad_norm": 0.25}

    async def sync_weights(self):
        return None


def test_grpo_step_log_has_no_kl_or_clip_columns_that_are_zero_by_construction(tmp_path):
    # One update per batch on old log-probs from the same weights: ratio 1, so KL and clip fraction
    # were always printed as 0.
    model_path = str(build_tiny_model(tmp_path / "model", DEMO_MODEL))
    config = DemoConfig(prompts_per_step=2, samples_per_prompt=2, out_dir=str(tmp_path), progress=False)
    log = asyncio.run(Demo(config, model_path, FakeClient(model_path)).grpo_step())
    assert "kl" not in log and "clip_frac" not in log
    assert log["entropy"] == 1.5 and log["grad_norm"] == 0.25 and 0.0 <= log["reward"] <= 1.0
