"""``training_config.cuda_graphs`` through the client: DeepSpeed trains the same weights with the layers graphed.

Two deployments on one GPU (Ray, DeepSpeed ZeRO-1, bf16, ZoRRo Train on), one with
the decoder layers replayed as CUDA graphs, run the same SFT steps on batches whose
shape repeats, so the graphed side runs eagerly, then captures, then replays. The
losses and the trained weights must agree to bf16 noise, also after a sleep/wake
cycle (which frees the graphs and moves the weights, so the steps after it capture anew).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPEC = TinySpec(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512)
# Its loss depends on the weights (a first GRPO step's does not: its ratio is 1 whatever they are).
SFT = {"loss_fn": "sft"}
TOLERANCE = 5e-3  # on the loss, ~7 at the start: bf16 noise between the two runs


def shared_prompt_batch(seed: int) -> dict:
    """Two 96-token prompts, each followed by 4 different 32-token continuations: a ZoRRo-shaped batch."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, 1000, (2, 96), generator=g).repeat_interleave(4, dim=0)
    ids = torch.cat([prompts, torch.randint(3, 1000, (8, 32), generator=g)], dim=1)
    return {"args": [ids], "kwargs": {"attention_mask": torch.ones_like(ids)}}


def train(model_path, cuda_graphs: bool) -> tuple[list[float], list[float], list[float]]:
    client = create_arctic_rl_client(
        ArcticRLClientConfig(
            model_name=str(model_path), comm_protocol="ray", training_gpus=1, colocate=True, ray_auto_attach=False,
            ds_config={"zero_optimization": {"stage": 1}},
            training_config={
                "dtype": "bfloat16", "optimizer": {"lr": 1e-3}, "cuda_graphs": cuda_graphs,
                "zorro_train": {"enable": True},
            },
            startup_timeout=300, job_ready_timeout=300,
        )
    )  # fmt: skip

    async def run() -> tuple[list[float], list[float], list[float]]:
        losses, norms, replayed = [], [], []
        for step in range(7):
            if step == 4:
                await client.sleep_training(mode="all")
                await client.wake_training()
            out = await client.fwd_bwd(shared_prompt_batch(step % 2), SFT)
            await client.step()
            losses.append(out["loss"])
            norms.append((await client.weight_norm())["training_norm"])
            replayed.append(out["metrics"].get("cuda_graphs/replayed", 0.0))
        return losses, norms, replayed

    try:
        return asyncio.run(run())
    finally:
        asyncio.run(client.shutdown())


def test_graphed_layers_train_the_same_weights_as_eager_ones(tmp_path):
    model = build_tiny_model(tmp_path / "m", SPEC)
    eager_losses, eager_norms, _ = train(model, cuda_graphs=False)
    graphed_losses, graphed_norms, replayed = train(model, cuda_graphs=True)
    # Eager on first sight, captured on the second, replayed after; the same again after the wake.
    assert replayed == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert graphed_losses == pytest.approx(eager_losses, abs=TOLERANCE)
    assert graphed_norms == pytest.approx(eager_norms, rel=1e-3)
    # Training moved: the first batch's loss fell, by far more than the tolerance above.
    assert eager_losses[0] - eager_losses[2] > 10 * TOLERANCE
