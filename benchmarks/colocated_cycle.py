"""Colocated RL cycles on one device: GPU memory per phase, weight-norm equality, train/sample log-prob gap.

    python benchmarks/colocated_cycle.py --shape qwen2-0.5b --cycles 10          # on a GPU
    python benchmarks/colocated_cycle.py --shape tiny --cycles 3 --sync file      # anywhere

Training (DeepSpeed), native sampling and a DeepSpeed log-prob engine share
one device (``colocate=True``). The first rollouts come from the starting
weights, so every cycle is a full one: wake training, fwd_bwd + step on the
last rollouts, sync weights, sleep training, wake the sampler, generate, sleep
the sampler. Device memory in use is read after every phase; cycle 0 creates
the optimizer's state in its step, and from cycle 1 on no phase may grow. After the last cycle
the sampler's per-token log-probs are compared with the training engine's on
the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SHAPES = {
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    ),
    "qwen2-0.5b": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
    "qwen2-1.5b": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2
    ),
}


def build_model(shape: str, directory: Path) -> str:
    """A Qwen2 of the given shape with random weights and the tiny tokenizer (nothing downloaded)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from arctic_rl_core.models.tiny import train_tokenizer

    tokenizer = train_tokenizer()
    config = Qwen2Config(
        vocab_size=151936 if shape != "tiny" else len(tokenizer), max_position_embeddings=4096,
        tie_word_embeddings=shape != "qwen2-1.5b", eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def used_gib() -> float:
    if not torch.cuda.is_available():
        return 0.0
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _server_workers(server) -> list[tuple[str, object]]:
    """Runs inside the Ray server actor: every job's worker handles, named by job."""
    return [(job.name, worker) for job in server.manager.jobs.values() for worker in job.workers]


def _allocator_stats(_worker) -> dict:
    """Runs inside a worker: what PyTorch's allocator holds there (GiB), and the worker's pid."""
    stats = torch.cuda.memory_stats()
    return {
        "allocated": torch.cuda.memory_allocated() / 2**30,
        "reserved": torch.cuda.memory_reserved() / 2**30,
        "segments": stats.get("segment.all.current", 0),
        "alloc_retries": stats.get("num_alloc_retries", 0),
        "pid": os.getpid(),
    }


def _device_used_by_pid() -> dict[int, float]:
    """GiB of device memory per process as the driver counts it (CUDA context and kernels included)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
    return {int(pid): int(mib) / 1024 for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}


def per_process(client) -> dict[str, dict]:
    """Every engine process's allocator figures (read through Ray), then the driver's count for every
    other process on the device and for none (``--per-process``): the rows sum to the device total."""
    import ray

    server = client._transport.actor
    workers = ray.get(server.__ray_call__.remote(_server_workers))
    used = _device_used_by_pid()
    report = {}
    for name, worker in workers:
        stats = ray.get(worker.__ray_call__.remote(_allocator_stats))
        pid = stats.pop("pid")
        if pid in used:
            stats["device_used"] = used.pop(pid)
        report[f"{name} pid {pid}"] = stats
    # Every other process on the device (this driver's own CUDA context among them), then what the
    # driver counts against no process at all (its page tables and IPC mappings, for instance).
    for pid, gib in used.items():
        report[f"{'this driver' if pid == os.getpid() else 'other'} pid {pid}"] = {"device_used": gib}
    counted = sum(stats.get("device_used", 0.0) for stats in report.values())
    report["not counted against any process"] = {"device_used": used_gib() - counted}
    return report


async def cycles(client, args, tokenizer) -> dict:
    prompts = [f"Question {i}: what is {i} + {i + 1}?" for i in range(args.prompts)]
    params = {"max_tokens": args.new_tokens, "temperature": 1.0, "n": args.samples, "seed": 0}
    memory: list[dict[str, float]] = []
    norms = []
    rollouts, _ = to_batch(await client.generate(prompts=prompts, sampling_params=params), tokenizer)
    ipc = args.sync == "ipc"
    for cycle in range(args.cycles):
        phase: dict[str, float] = {}
        started = time.perf_counter()
        await client.wake_training()
        phase["wake_training"] = used_gib()
        await client.fwd_bwd(rollouts, {"loss_fn": "grpo", "config": {"eps_clip": 0.2}})
        await client.step()
        phase["train"] = used_gib()
        await client.sleep_training(mode="non_lp" if ipc else "all")
        sync = await client.sync_weights(cuda_ipc=ipc, low_memory=args.low_memory)
        norm = await client.weight_norm()
        norms.append(abs(norm["training_norm"] - norm["sampling_norm"]) / norm["training_norm"])
        phase["sync"] = used_gib()
        await client.sleep_training(mode="all")
        phase["sleep_training"] = used_gib()
        await client.wake_inference(tags=None)
        results = await client.generate(prompts=prompts, sampling_params=params)
        phase["generate"] = used_gib()
        await client.sleep_inference(level=1)
        phase["sleep_inference"] = used_gib()
        if args.per_process:
            for name, stats in per_process(client).items():
                print(
                    f"  {name}: "
                    + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()),
                    flush=True,
                )
        rollouts, sampled = to_batch(results, tokenizer)
        memory.append(phase)
        print(
            f"cycle {cycle}: " + "  ".join(f"{k} {v:.2f}" for k, v in phase.items())
            + f" GiB  | sync {sync['method']} {sync['seconds']:.2f}s  norm rel diff {norms[-1]:.1e}"
            + f"  | {time.perf_counter() - started:.1f}s",
            flush=True,
        )  # fmt: skip
    await client.wake_training()
    trained = await client.fwd_no_grad(rollouts, reference_model=False)
    mask = rollouts["context"]["response_mask"][:, 1:].bool()
    diff = (trained["log_probs_shifted"][:, :-1][mask] - sampled[:, 1:][mask]).abs()
    return {
        "memory": memory,
        "norm_rel_diffs": norms,
        "logprob_mean_abs": float(diff.mean()),
        "logprob_max_abs": float(diff.max()),
    }


def to_batch(results: list[dict], tokenizer) -> tuple[dict, torch.Tensor]:
    """Rollouts as a GRPO batch (rewards: longer completions win, a stand-in), plus the sampler's log-probs."""
    rows = [(r["prompt_token_ids"], o["token_ids"], o["logprobs"]) for r in results for o in r["outputs"]]
    width = max(len(p) + len(c) for p, c, _ in rows)
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention, response = torch.zeros_like(ids), torch.zeros_like(ids)
    sampled = torch.zeros(len(rows), width)
    for i, (p, c, lps) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention[i, : len(p) + len(c)] = 1
        response[i, len(p) : len(p) + len(c)] = 1
        sampled[i, len(p) : len(p) + len(c)] = torch.tensor(lps)
    lengths = response.sum(1).float()
    advantages = (lengths - lengths.mean()) / (lengths.std() + 1e-6)
    batch = {
        "args": [ids],
        "kwargs": {"attention_mask": attention},
        "context": {"response_mask": response, "advantages": advantages},
    }
    return batch, sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--sync", choices=["ipc", "file"], default="ipc")
    parser.add_argument("--low-memory", action="store_true")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--per-process", action="store_true", help="after each cycle, each engine's allocator figures (GiB)"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from arctic_rl_core import ArcticRLClientConfig, create_arctic_rl_client

    gpu = torch.cuda.is_available()
    model = build_model(args.shape, Path(tempfile.mkdtemp(prefix="arctic-cycle-")))
    tokenizer = AutoTokenizer.from_pretrained(model)
    client = create_arctic_rl_client(
        ArcticRLClientConfig(
            model_name=model, comm_protocol="ray", training_gpus=1, sampling_gpus=1, log_prob_gpus=1,
            log_prob_engine="deepspeed", colocate=True, ray_auto_attach=False, server_logs=True,
            ds_config={"zero_optimization": {"stage": 1}} if gpu else {},
            training_config={"dtype": "bfloat16" if gpu else "float32", "optimizer": {"lr": 1e-6}},
            vllm_config={"gpu_memory_utilization": 0.3, "max_seq_len": 1024},
        )
    )  # fmt: skip
    print(f"device memory in use after start: {used_gib():.2f} GiB", flush=True)

    async def run() -> dict:
        try:
            return await cycles(client, args, tokenizer)
        finally:
            await client.shutdown()

    result = asyncio.run(run())
    # Cycle 0's step creates AdamW's state (after its wake_training reading); from cycle 1 on, no phase may grow.
    memory = result["memory"]
    steady = memory[min(1, len(memory) - 1)]
    growth = max(later[k] - steady[k] for later in memory[1:] or [steady] for k in steady)
    print(f"memory growth over cycle 1, in any later cycle and phase: {growth:+.3f} GiB (max)")
    print(f"weight_norm relative difference after sync: max {max(result['norm_rel_diffs']):.2e}")
    print(
        f"sampler vs training log-probs on the same tokens: mean {result['logprob_mean_abs']:.3e}, max {result['logprob_max_abs']:.3e}"
    )


if __name__ == "__main__":
    main()
