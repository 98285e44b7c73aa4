"""Where a native-engine decode step's device time goes, kernel by kernel, on one GPU.

    python benchmarks/decode_profile.py [--group 16] [--prompt-len 8192]

Builds the Qwen2-0.5B-shaped engine of ``fca.py``'s end-to-end case, decodes
a few steps of a G-completion rollout, then replays the decode CUDA graph
(FCA on, then off) under the profiler and prints each kernel's time per
step, against the weight-bandwidth bound of the non-attention work.
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from sampling import build_qwen2_05b, copy_bandwidth, gpu_ms, native_engine, weight_bytes

from arctic_rl_core.engines.sampling.protocol import SamplingParams

REPLAYS = 20


def kernel_table(replay, steps: int = REPLAYS) -> list[tuple[str, float, int]]:
    """(kernel name, microseconds per step, launches per step), longest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time
            count[event.name] += 1
    rows = [(name, us / steps, count[name] // steps) for name, us in total.items()]
    return sorted(rows, key=lambda r: -r[1])


def host_profile(engine, steps: int = 40) -> None:
    """The host's share of ``steps`` decode steps, by function (cProfile; its overhead inflates the total)."""
    import cProfile
    import pstats
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    print(f"  host: {wall_ms:.3f} ms per decode step wall (unprofiled); cProfile by own time, per step:")
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:18]
    for (file, line, func), (calls, _, own, cumulative, _) in rows:
        print(
            f"    {own / steps * 1e6:7.1f} us own {cumulative / steps * 1e6:8.1f} us cum  "
            f"{Path(file).name}:{line} {func}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qwen2-0.5b-random")
    args = parser.parse_args()
    path = build_qwen2_05b(args.model_dir)
    prompt = torch.randint(0, 151936, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(n=args.group, max_tokens=160, temperature=1.0, seed=0, ignore_eos=True)
    bandwidth = copy_bandwidth()
    for use_fca in (True, False):
        engine = native_engine(path, args.prompt_len + 128, args.group, use_fca=use_fca)
        engine.add_request(prompt, params, request_id="rollout")
        for _ in range(8):  # prefill, then decode steps: the staging buffers hold a real decode batch
            engine.step()
        graph = engine.runner.graphs[(args.group, use_fca)]
        step_ms = gpu_ms(graph.replay)
        rows = kernel_table(graph.replay)
        kernels_us = sum(r[1] for r in rows)
        wbytes = weight_bytes(engine.runner.model)
        # Kernels launched as programmatic dependents start before their predecessor ends and wait for it:
        # their times then include that wait, and add up to more than the step.
        overlap = "the rest is gaps between launches"
        if kernels_us > step_ms * 1e3:
            overlap = "more than the step: programmatic dependent launches overlap, and their times include the wait"
        print(f"\n[FCA {'on' if use_fca else 'off'}: G={args.group}, context {args.prompt_len + 8}, Qwen2-0.5B shape, "
              f"bf16] graph replay {step_ms * 1e3:.0f} us; kernels {kernels_us:.0f} us ({overlap}); "
              f"all weights once at {bandwidth / 1e12:.2f} TB/s: {wbytes / bandwidth * 1e6:.0f} us")  # fmt: skip
        for name, us, launches in rows[:16]:
            print(f"  {us:8.1f} us  {us / kernels_us:6.1%}  x{launches:<3d} {name[:110]}")
        if use_fca:
            host_profile(engine)
        while engine.has_unfinished():
            engine.step()
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
