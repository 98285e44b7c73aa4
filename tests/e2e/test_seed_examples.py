"""Every code example of the seeds (client-api.md, overview.md, configuration-reference.md), run as written.

Adapted only in model name (a tiny model made here) and GPU counts, over both
protocols. Where an example omits something our batch contract requires, the
test shows the error the user gets and then the call with it added.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import ray
import torch

from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_core.config import RECONNECT_ENV

pytestmark = pytest.mark.slow

PROTOCOLS = ["http", "ray"]


def grpo_inputs(model: str):
    """input_ids / attention_mask / old_lps / prox_lps / ref_lps as the client-api example names them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = ["What is 2 + 3? The answer is 5.", "What is 4 + 4? The answer is 8."]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    input_ids, attention_mask = encoded["input_ids"], encoded["attention_mask"]
    old_lps = torch.full(input_ids.shape, -2.0)
    return input_ids, attention_mask, old_lps, old_lps.clone(), old_lps - 0.1


@pytest.mark.parametrize(
    "comm_protocol, sampling_engine",
    [("http", "auto"), ("ray", "auto"), ("http", "vllm")],
    ids=["http", "ray", "http-vllm"],
)
def test_client_api_examples(comm_protocol, sampling_engine, tiny_model, tmp_path, monkeypatch):
    """On CPU "auto" samples with the native engine; the third run samples with vLLM's CPU build."""
    monkeypatch.chdir(tmp_path)  # save_checkpoint() with no path writes ./checkpoints
    # --- Creating a Client
    config = ArcticRLClientConfig(
        backend="local",
        comm_protocol=comm_protocol,  # or "http"
        model_name=tiny_model,
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=1,
        sampling_engine=sampling_engine,
    )
    client = create_arctic_rl_client(config)
    expected_class = {"http": "ArcticRLHTTPClient", "ray": "ArcticRLRayClient"}[comm_protocol]
    assert type(client).__name__ == expected_class

    async def examples():
        # --- Job ID Properties
        training_id = client.training_job_id  # int
        sampling_id = client.sampling_job_id  # int
        log_prob_id = client.log_prob_job_id  # int or None
        assert len({training_id, sampling_id, log_prob_id}) == 3

        # --- Forward-Backward Pass, verbatim: our grpo needs advantages, and says so.
        input_ids, attention_mask, old_lps, prox_lps, ref_lps = grpo_inputs(tiny_model)
        batch = {
            "args": [input_ids],
            "kwargs": {"attention_mask": attention_mask},
            "context": {
                "old_log_probs_shifted": old_lps,
                "prox_logp_shifted": prox_lps,
                "ref_log_probs_shifted": ref_lps,
            },
        }
        processing = {
            "loss_fn": "arctic_platform.rl.processors.grpo_loss",
            "config": {"eps_clip": 0.2},
            "post": [],
        }
        with pytest.raises(ValueError, match="advantages"):
            await client.fwd_bwd(batch=batch, processing=processing)
        batch["context"]["advantages"] = torch.tensor([1.0, -1.0])
        response = await client.fwd_bwd(batch=batch, processing=processing)
        assert torch.isfinite(torch.tensor(response["loss"]))
        assert {"clip_frac", "ratio_mean", "entropy"} <= set(response["metrics"])

        # --- Forward (No Gradient)
        mask = attention_mask
        response = await client.fwd_no_grad(
            batch={"args": [input_ids], "kwargs": {"attention_mask": mask}},
            reference_model=True,  # True -> log_prob_job_id, False -> training_job_id
        )
        assert response["log_probs_shifted"].shape == input_ids.shape

        # --- Optimizer Step / Save Checkpoint
        response = await client.step()
        assert response["step"] == 1 and response["grad_norm"] > 0
        response = await client.save_checkpoint()
        assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step1"

        # --- Generate Text
        results = await client.generate(
            prompts=["Hello, world!", "The future of AI is"],
            sampling_params={"max_tokens": 100, "temperature": 0.8},
        )
        assert [r["prompt"] for r in results] == ["Hello, world!", "The future of AI is"]
        assert all(1 <= len(r["outputs"][0]["token_ids"]) <= 100 for r in results)

        # --- Compute Log Probabilities
        response = await client.log_probs(prompts=["The capital of France is"], completions=["Paris"], top_k=1)
        assert response[0]["completion"] == "Paris" and all(lp <= 0 for lp in response[0]["token_log_probs"])

        # --- Sync Training Weights to Sampling
        response = await client.sync_weights(
            cuda_ipc=False,  # True: zero-copy CUDA IPC, False: CPU file path
            low_memory=False,  # Only applies to cuda_ipc=True path
        )
        assert response["status"] == "ok"

        # --- Weight Norm
        response = await client.weight_norm()
        # Returns: {"training_norm": float, "sampling_norm": float, ...}
        assert response["training_norm"] == pytest.approx(response["sampling_norm"], rel=1e-6)

        # --- Lifecycle Management: inference engine
        response = await client.sleep_inference(level=1)
        response = await client.wake_inference(tags=None)
        response = await client.reset_prefix_cache()
        # --- training engine
        response = await client.sleep_training(mode="all")
        assert all("mode" in worker for worker in response["workers"])
        response = await client.wake_training()
        response = await client.empty_training_cache()
        # --- log-probability engine
        response = await client.sleep_log_prob()
        response = await client.wake_log_prob()

        # --- Shutdown
        await client.shutdown()
        with pytest.raises(ValueError):
            client.training_job_id

    try:
        asyncio.run(examples())
    except BaseException:
        asyncio.run(client.shutdown())  # a failed example must not leave its server on the seeds' port
        raise


def test_ray_reconnection_example_from_a_ray_actor(tiny_model):
    config = ArcticRLClientConfig(backend="local", comm_protocol="ray", model_name=tiny_model, training_gpus=1)
    # driver process
    client = create_arctic_rl_client(config)
    reconnect_cfg = client.reconnect_config()  # returns ArcticRLClientConfig (Ray-serializable)
    assert reconnect_cfg.backend == "local" and reconnect_cfg.comm_protocol == "ray"
    assert reconnect_cfg.training_job_id == client.training_job_id

    @ray.remote(num_cpus=0)
    class ActorUsingArctic:
        def norm(self, reconnect_cfg):
            # Ray actor or different process
            actor_client = create_arctic_rl_client(reconnect_cfg)  # connects to same jobs, no /initialize
            return actor_client.training_job_id, asyncio.run(actor_client.weight_norm())["training_norm"]

    try:
        job_id, norm = ray.get(ActorUsingArctic.remote().norm.remote(reconnect_cfg))
        status = asyncio.run(client.status())
        assert job_id == client.training_job_id
        assert norm == pytest.approx(asyncio.run(client.weight_norm())["training_norm"])
        assert status["served"]["initialize"] == 1  # the actor sent none
    finally:
        asyncio.run(client.shutdown())


@pytest.mark.parametrize("comm_protocol", PROTOCOLS)
def test_overview_examples(comm_protocol, tiny_model):
    # --- Quick Start
    config = ArcticRLClientConfig(
        model_name=tiny_model,
        comm_protocol=comm_protocol,  # or "http"
        training_gpus=1,
        sampling_gpus=1,
        log_prob_gpus=0,
        colocate=True,
    )
    client = create_arctic_rl_client(config)
    try:
        # --- Reconnection: a child process attaches with ArcticRLClientConfig.reconnect_config()
        child = (
            "import asyncio\n"
            "from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client\n"
            "config = ArcticRLClientConfig.reconnect_config()\n"
            "client = create_arctic_rl_client(config)\n"
            "print(client.training_job_id, asyncio.run(client.weight_norm())['training_norm'])\n"
        )
        if comm_protocol == "http":  # a Ray client in another process needs a Ray driver of its own cluster
            out = subprocess.run(
                [sys.executable, "-c", child], capture_output=True, text=True, timeout=300, env=dict(os.environ)
            )
            assert out.returncode == 0, out.stderr[-3000:]
            job_id, norm = out.stdout.split()[-2:]
            assert int(job_id) == client.training_job_id
            assert float(norm) == pytest.approx(asyncio.run(client.weight_norm())["training_norm"])
        else:
            assert json.loads(os.environ[RECONNECT_ENV])["training_job_id"] == client.training_job_id
        results = asyncio.run(client.generate(["Hello"], {"max_tokens": 4}))
        assert len(results[0]["outputs"]) == 1
    finally:
        asyncio.run(client.shutdown())

    # --- Advanced Configuration
    config = ArcticRLClientConfig(
        model_name=tiny_model,
        comm_protocol=comm_protocol,
        training_gpus=1,
        sampling_gpus=1,
        training_config={
            "optimizer": {"lr": 1e-5, "weight_decay": 0.01},
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
        },
        vllm_config={
            "max_seq_len": 4096,
            "tensor_parallel_size": 1,
        },
        arctic_inference_config={
            "use_fca": True,
        },
    )
    client = create_arctic_rl_client(config)
    try:
        results = asyncio.run(client.generate(["Hello"] * 2, {"max_tokens": 4, "n": 4}))
        assert all(len(r["outputs"]) == 4 for r in results)
        ids = torch.tensor([r["prompt_token_ids"] + r["outputs"][0]["token_ids"] for r in results])
        out = asyncio.run(client.fwd_bwd({"args": [ids]}, {"loss_fn": "sft"}))
        assert torch.isfinite(torch.tensor(out["loss"]))
    finally:
        asyncio.run(client.shutdown())

    # --- ZoRRo Train
    config = ArcticRLClientConfig(
        model_name=tiny_model,
        comm_protocol=comm_protocol,
        training_gpus=1,
        training_config={"zorro_train": {"enable": True}},
    )
    client = create_arctic_rl_client(config)
    try:
        prompt = list(range(10, 60))
        ids = torch.tensor([prompt + [70 + i, 80 + i, 90 + i] for i in range(4)])
        response_mask = torch.zeros_like(ids)
        response_mask[:, len(prompt) :] = 1
        batch = {
            "args": [ids],
            "context": {"response_mask": response_mask, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])},
        }
        out = asyncio.run(client.fwd_bwd(batch, {"loss_fn": "grpo"}))
        assert torch.isfinite(torch.tensor(out["loss"]))
    finally:
        asyncio.run(client.shutdown())


def test_configuration_reference_examples():
    # Basic configuration with required fields
    config = ArcticRLClientConfig(model_name="meta-llama/Llama-2-7b", training_gpus=4, sampling_gpus=2)
    assert config.comm_protocol == "http" and config.port == 7000

    # Advanced configuration with training customization
    config = ArcticRLClientConfig(
        model_name="meta-llama/Llama-2-7b",
        backend="local",
        comm_protocol="http",
        training_gpus=4,
        sampling_gpus=2,
        log_prob_gpus=1,
        full_determinism=True,
        seed=123,
        training_config={
            "optimizer": {"lr": 1e-5, "weight_decay": 0.01, "lr_scheduler_type": "cosine"},
            "dtype": "bfloat16",
            "gradient_checkpointing": True,
        },
        startup_timeout=600.0,
        job_ready_timeout=900.0,
    )
    from arctic_rl_core.config import TrainingConfig

    assert TrainingConfig.model_validate(config.training_config).optimizer.lr_scheduler_type == "cosine"

    # Reconnecting to existing jobs
    config = ArcticRLClientConfig(
        model_name="meta-llama/Llama-2-7b",
        training_job_id=42,
        sampling_job_id=43,
        log_prob_job_id=44,
        host="192.168.1.100",
        port=7000,
    )
    assert config.reconnecting and config.for_initialize().training_job_id is None
