"""Each ``sleep_training`` mode frees the GPU memory it says it frees, and ``wake_training`` brings it all back.

The deployment is real (Ray, DeepSpeed, bf16, AdamW after one step); memory is
read device-wide with ``cudaMemGetInfo`` from this process, so the worker's own
accounting is not what is checked. With P parameters: the bf16 weights (lp) are
2P bytes; the fp32 master weights (hp) and AdamW's two moments are 12P more.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from tests.grpo_batch import GRPO, grpo_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# About 120M parameters: the states differ by hundreds of MB, far above allocator noise.
SPEC = TinySpec(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4, intermediate_size=4096)


def used_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _parameter_count(path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module", params=[0, 1], ids=["zero0", "zero1"])
def deployment(request, tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("sleep-modes"), SPEC)
    client = create_arctic_rl_client(
        ArcticRLClientConfig(
            model_name=str(model), comm_protocol="ray", training_gpus=1, colocate=True, ray_auto_attach=False,
            ds_config={"zero_optimization": {"stage": request.param}},
            training_config={"dtype": "bfloat16", "optimizer": {"lr": 1e-5}},
            startup_timeout=300, job_ready_timeout=300, server_logs=True,
        )
    )  # fmt: skip

    async def first_step() -> None:
        await client.fwd_bwd(grpo_batch(), GRPO)
        await client.step()  # AdamW allocates its moments here

    asyncio.run(first_step())
    yield client, _parameter_count(model)
    asyncio.run(client.shutdown())


async def _sleep_and_wake(client, mode: str) -> tuple[int, int]:
    """Bytes freed by ``sleep_training(mode)`` and bytes taken back by ``wake_training``, device-wide.

    "non_lp+lp_params" is the seeds' CUDA-IPC order: two calls that together put everything to sleep.
    """
    await client.empty_training_cache()  # the last step's activations are cached blocks, not state
    awake = used_bytes()
    norm = (await client.weight_norm())["training_norm"]
    for part in mode.split("+"):
        slept = await client.sleep_training(mode=part)
    asleep = used_bytes()
    if mode == "all":
        # Nothing pins a segment while everything sleeps (a cuBLAS workspace once held 1 GiB that way).
        assert all(w["reserved_bytes"] <= 16 << 20 for w in slept["workers"]), slept
    assert (await client.weight_norm())["training_norm"] == norm  # read from host memory while asleep
    with pytest.raises(ValueError, match="wake_training"):
        await client.fwd_bwd(grpo_batch(), GRPO)  # refused, not run on weights that are not there
    await client.wake_training()
    await client.empty_training_cache()
    woke = used_bytes() - asleep  # before the norm below, whose temporaries stay cached
    assert (await client.weight_norm())["training_norm"] == norm  # nothing lost on the round trip
    return awake - asleep, woke


def test_each_sleep_mode_frees_its_states_and_wake_restores_them(deployment):
    client, parameters = deployment
    lp, hp_and_moments = 2 * parameters, 12 * parameters

    async def run() -> tuple[list, dict]:
        # lp_params twice: a second round trip frees the same (nothing stays behind, nothing grows).
        modes = ("lp_params", "non_lp", "all", "non_lp+lp_params", "lp_params")
        memory = [(mode, *await _sleep_and_wake(client, mode)) for mode in modes]
        # Training goes on after the round trips: the optimizer found its state again.
        metrics = await client.fwd_bwd(grpo_batch(), GRPO)
        await client.step()
        return memory, metrics

    memory, metrics = asyncio.run(run())
    print(f"P={parameters}: " + ", ".join(f"{m} freed {f / 2**20:.0f} MiB, woke {w / 2**20:.0f} MiB"
                                          for m, f, w in memory))  # fmt: skip
    freed = {mode: f for mode, f, _ in reversed(memory)}  # the first round trip of each mode
    # lp_params: the bf16 weights, and not the fp32 state.
    assert 0.9 * lp <= freed["lp_params"] <= 1.1 * lp + (64 << 20)
    assert abs(memory[-1][1] - freed["lp_params"]) <= 0.05 * lp
    # non_lp: the fp32 masters and moments, while the bf16 weights stay (a weight sync reads them).
    assert freed["non_lp"] >= 0.95 * hp_and_moments
    assert freed["all"] - freed["non_lp"] >= 0.9 * lp
    assert abs(freed["non_lp+lp_params"] - freed["all"]) <= 0.05 * freed["all"]
    # Waking takes back what sleeping freed, within allocator rounding.
    for mode, gone, back in memory:
        assert abs(back - gone) <= 0.05 * gone + (64 << 20), mode
    assert torch.isfinite(torch.tensor(metrics["loss"]))
