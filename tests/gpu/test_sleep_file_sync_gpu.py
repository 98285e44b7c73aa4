"""While training sleeps its weights are only in host memory: a file sync reads them there.

Its own module: the sleep-mode test keeps a module-scoped deployment (and its Ray
cluster) alive, and one process runs one local Ray cluster at a time.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.grpo_batch import GRPO, grpo_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_file_sync_reads_the_sleeping_weights_and_an_ipc_sync_is_refused(tmp_path):
    model = build_tiny_model(tmp_path / "model", TinySpec(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2))
    client = create_arctic_rl_client(
        ArcticRLClientConfig(
            model_name=str(model), comm_protocol="ray", training_gpus=1, sampling_gpus=1, colocate=True,
            ray_auto_attach=False, ds_config={"zero_optimization": {"stage": 1}},
            training_config={"dtype": "bfloat16", "optimizer": {"lr": 1e-3}},
            vllm_config={"gpu_memory_utilization": 0.1, "max_seq_len": 256},
            startup_timeout=300, job_ready_timeout=300,
        )
    )  # fmt: skip

    async def run() -> dict:
        try:
            await client.fwd_bwd(grpo_batch(), GRPO)
            await client.step()  # training now differs from the sampler's initial weights
            await client.sleep_training(mode="all")
            with pytest.raises(ValueError, match="wake_training"):
                await client.sync_weights(cuda_ipc=True)
            sync = await client.sync_weights(cuda_ipc=False)
            norms = await client.weight_norm()
            await client.wake_training()
            await client.fwd_bwd(grpo_batch(), GRPO)  # and training goes on
            return {**norms, "method": sync["method"]}
        finally:
            await client.shutdown()

    result = asyncio.run(run())
    assert result["method"] == "file"
    assert result["training_norm"] == pytest.approx(result["sampling_norm"], rel=1e-6)
