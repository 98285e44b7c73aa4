"""Forest Cascade Attention on one GPU: the fused kernel vs plain attention on the same KV, then end to end.

    python benchmarks/fca.py [--skip-e2e] [--even-chunks] [--tiles int32_offsets=0,wide_maxnreg=168]
                             [--shape qwen2.5-7b|llama-3-8b] [--linear-tiles tiles.json]

(Kernel variants side by side: ``benchmarks/fca_sweep.py``.)

Kernel: Qwen2-0.5B's attention shape (14 query heads, 2 KV heads, head dim
64, bf16, block size 16; ``--shape``: Qwen2.5-7B's 28/4/128 or Llama-3-8B's
32/8/128), one decode token per request, in two cases:
64 requests in 4 groups of 16 that each share an 8K prefix, and 16 requests
sharing one 8K prefix; every request has a 256-token suffix of its own.
Baselines measured in the same run: PyTorch SDPA over each request's
contiguous KV (its flash and cuDNN backends, each with the query heads as one
KV head's rows and as one token per head with ``enable_gqa``; the fastest is
the baseline, and flash's best is printed too), our kernel with no grouping on
the same paged KV, and the read floor (``fca_floor.py``: a kernel that only
reads the bytes FCA reads). Every method runs over 16 layers' worth of
separate KV buffers in one CUDA graph, so no layer's KV is still in L2 when it
is read again, as in a real model. Each time is the median of 30 replays, the
best of three such (our kernels' three taken in turn with each other).

End to end: the native engine's rollout time with FCA on vs off, at G=16
completions of one 8192-token prompt, 512 new tokens each, on a
Qwen2-0.5B-shaped model with random bf16 weights; and how far the bf16
log-probs of the two runs differ. ``--linear-tiles`` runs it again with the
decoder's projections in the tiles ``decode_linear.py --chain-sweep
--sweep-json tiles.json`` found.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

from arctic_rl_core.zorro.attention.forest import PrefixForest, build_forest
from arctic_rl_core.zorro.attention.plan import TileShape, plan_decode
from arctic_rl_core.zorro.attention.reference import paged_decode_attention

BLOCK = 16
LAYERS = 16


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """A model's attention as the kernel sees it: query heads, KV heads, head dimension."""

    name: str
    heads: int
    kv_heads: int
    dim: int

    @property
    def scale(self) -> float:
        return self.dim**-0.5


# --shape: the kernels at other models' attention (the end to end builds the Qwen2-0.5B shape only).
SHAPES = {
    "qwen2-0.5b": AttentionShape("Qwen2-0.5B", 14, 2, 64),
    "qwen2.5-7b": AttentionShape("Qwen2.5-7B", 28, 4, 128),
    "llama-3-8b": AttentionShape("Llama-3-8B", 32, 8, 128),
}
QWEN2_05B = SHAPES["qwen2-0.5b"]
HEADS, KV_HEADS, DIM, SCALE = QWEN2_05B.heads, QWEN2_05B.kv_heads, QWEN2_05B.dim, QWEN2_05B.scale


def graph_us(fn, layers: int = LAYERS, replays: int = 30) -> float:
    """Median microseconds of one ``fn(layer)`` call, replaying a CUDA graph of all layers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(layers):
            fn(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            fn(layer)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return sorted(times)[replays // 2]


def paged_batch(groups: int, per_group: int, prefix: int, suffix: int, shape: AttentionShape = QWEN2_05B) -> dict:
    """``groups`` groups of ``per_group`` requests sharing a prefix's blocks, in 16 layers' worth of paged KV."""
    n = groups * per_group
    prefix_blocks, suffix_blocks = prefix // BLOCK, -(-suffix // BLOCK)
    tables = []
    for g in range(groups):
        shared = list(range(g * prefix_blocks, (g + 1) * prefix_blocks))
        for r in range(per_group):
            own = groups * prefix_blocks + (g * per_group + r) * suffix_blocks
            tables.append(shared + list(range(own, own + suffix_blocks)))
    num_blocks = groups * prefix_blocks + n * suffix_blocks
    lengths = [prefix + suffix] * n
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    kv_shape = (num_blocks, BLOCK, shape.kv_heads, shape.dim)
    caches = [(randn(*kv_shape), randn(*kv_shape)) for _ in range(LAYERS)]
    q = randn(n, shape.heads, shape.dim)
    block_tables = torch.tensor(tables, dtype=torch.int32, device="cuda")
    positions = torch.tensor([x - 1 for x in lengths], dtype=torch.int32, device="cuda")
    return {"tables": tables, "lengths": lengths, "caches": caches, "q": q, "block_tables": block_tables,
            "positions": positions}  # fmt: skip


# Every kernel time in ``kernel_case`` is the best of this many, taken in turn with the other methods'. Taken once
# each, one after the other, the balanced and the even plans at 1 x 16 (the same plan there: the same items in the
# same order) timed 9.2 and 8.6 us on an H200, 9.4 and 9.0 on an H100: the order of measurement, not the plans.
ROUNDS = 3


def best_of_rounds(fns: dict, rounds: int = ROUNDS) -> dict:
    """``graph_us`` of each of ``fns``, ``rounds`` times in turn (drift over the run touches each alike): the best."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(graph_us(fn))
    return {name: min(t) for name, t in times.items()}


def best_us(fn) -> float:
    """``graph_us`` of ``fn``, the best of ``ROUNDS``: how ``kernel_case`` times the baselines and the read floor."""
    return min(graph_us(fn) for _ in range(ROUNDS))


# Stock SDPA decode, each way PyTorch offers it: (backend, name) x (query layout, name). On an H100 (2.11) neither
# backend is fastest in every case: at one group of 16 requests cuDNN with one token per head took 29.4 us, flash
# 51.1-51.3 in either layout; at 4 groups cuDNN 97.6-98.4, flash 101.4-101.6 (docs/benchmarks.md, eighteenth session).
SDPA_BACKENDS = (("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
                 ("cuDNN", torch.nn.attention.SDPBackend.CUDNN_ATTENTION))  # fmt: skip
SDPA_LAYOUTS = ("a KV head's query heads as rows", "one token per head, enable_gqa")


def sdpa_variants(q: torch.Tensor, kv: list, scale: float, time_us) -> dict:
    """The fastest stock SDPA decode (``"sdpa"``) and flash's fastest (``"sdpa_flash"``): (name, us, output).

    ``q`` is ``[n, heads, dim]``; ``kv`` per layer (K, V), each ``[n, kv_heads, length, dim]``. A backend that
    refuses a layout on this device is skipped (cuDNN needs a recent enough card and library).
    """
    n, heads, dim = q.shape
    kv_heads = kv[0][0].shape[1]
    queries = (q.view(n, kv_heads, heads // kv_heads, dim), q.view(n, heads, 1, dim))
    best = {}
    for backend_name, backend in SDPA_BACKENDS:
        for layout, query in zip(SDPA_LAYOUTS, queries):
            out = {}

            def run(layer, backend=backend, query=query, gqa=query.shape[1] != kv_heads, out=out):
                with torch.nn.attention.sdpa_kernel(backend):
                    out["o"] = F.scaled_dot_product_attention(query, *kv[layer], scale=scale, enable_gqa=gqa)

            try:
                us = time_us(run)
            except RuntimeError:  # no kernel of this backend for this layout here
                continue
            result = (f"{backend_name}, {layout}", us, out["o"].reshape(n, heads, dim))
            for key in ("sdpa",) + (("sdpa_flash",) if backend_name == "flash" else ()):
                if key not in best or us < best[key][1]:
                    best[key] = result
    if "sdpa" not in best:
        raise RuntimeError(f"no stock SDPA backend ({', '.join(name for name, _ in SDPA_BACKENDS)}) ran decode on "
                           f"{q.device}")  # fmt: skip
    return best


def kernel_case(
    groups: int, per_group: int, prefix: int, suffix: int, target_items: int, tiles: TileShape, with_sdpa: bool = True,
    shape: AttentionShape = QWEN2_05B,
) -> dict:  # fmt: skip
    from fca_floor import read_floor_us

    from arctic_rl_core.zorro.attention import triton_attention as kernel

    n = groups * per_group
    heads, kv_heads, dim, scale = shape.heads, shape.kv_heads, shape.dim, shape.scale
    batch = paged_batch(groups, per_group, prefix, suffix, shape)
    tables, lengths, caches, q = batch["tables"], batch["lengths"], batch["caches"], batch["q"]
    block_tables, positions = batch["block_tables"], batch["positions"]
    forest = build_forest(tables, lengths, BLOCK)
    uniform_plan = plan_decode(forest, lengths, tiles, target_items)
    plain_plan = plan_decode(PrefixForest.unshared(n), lengths, tiles, target_items)
    runs = {}

    def add(name, plan, wide):
        device_plan = kernel.DevicePlan.from_plan(plan, "cuda")
        workspace = kernel.Workspace.allocate(plan.num_partial_rows, heads, dim, "cuda", torch.bfloat16)
        out = torch.empty_like(q)

        def run(layer, device_plan=device_plan, workspace=workspace, out=out, wide=wide):
            kernel.paged_attention(q, *caches[layer], block_tables, positions, device_plan, workspace, scale, tiles,
                                   wide=wide, out=out)  # fmt: skip

        runs[name] = (run, out)
        return run

    add("fca_uniform", uniform_plan, True)(0)  # builds the kernel, whose programs the engine's plans balance
    add("plain", plain_plan, False)
    lanes = kernel.plan_lanes(heads, *caches[0], tiles, torch.bfloat16)
    start = time.perf_counter()
    fca_plan = plan_decode(forest, lengths, tiles, target_items, lanes=lanes)
    plan_ms = (time.perf_counter() - start) * 1e3
    add("fca", fca_plan, True)

    times = best_of_rounds({name: run for name, (run, _) in runs.items()})
    times["floor"] = read_floor_us(batch, groups, per_group, prefix, suffix, best_us)
    fca_out, plain_out = runs["fca"][1], runs["plain"][1]
    reference = paged_decode_attention(q.float(), caches[-1][0].float(), caches[-1][1].float(), block_tables, lengths,
                                       scale)  # fmt: skip
    sdpa_diff = float("nan")
    if with_sdpa:
        # SDPA over each request's contiguous KV; GQA as a group's query rows per KV head (flash's fastest decode).
        index = torch.arange(prefix + suffix, device="cuda")
        slots = (block_tables[:, index // BLOCK].long() * BLOCK + index % BLOCK).flatten()
        sdpa_kv = [
            tuple(c.flatten(0, 1)[slots].view(n, -1, kv_heads, dim).transpose(1, 2).contiguous() for c in cache)
            for cache in caches
        ]
        best = sdpa_variants(q, sdpa_kv, scale, best_us)
        sdpa_names = {key: name for key, (name, _, _) in best.items()}
        times.update({key: us for key, (_, us, _) in best.items()})
        sdpa_diff = (best["sdpa"][2].float() - reference).abs().max().item()
    token_bytes = 2 * kv_heads * dim * 2  # K and V, bf16
    return {
        "times": times,
        "plain_bytes": n * (prefix + suffix) * token_bytes,
        "fca_bytes": (groups * prefix + n * suffix) * token_bytes,
        "plan_ms": plan_ms,
        "items": (len(fca_plan.wide_items), len(fca_plan.narrow_items)),
        "lanes": lanes,
        "diff_fca_plain": (fca_out.float() - plain_out.float()).abs().max().item(),
        "diff_even_plain": (runs["fca_uniform"][1].float() - plain_out.float()).abs().max().item(),
        "diff_fca_ref": (fca_out.float() - reference).abs().max().item(),
        "diff_sdpa_ref": sdpa_diff,
        "sdpa_names": sdpa_names if with_sdpa else {},
    }


CASES = (("64 requests, 4 groups x 16", 4, 16, 6.0), ("16 requests, 1 group", 1, 16, 3.0))


def kernel_benchmark(tiles: TileShape, shape: AttentionShape = QWEN2_05B) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    target = 4 * sms // shape.kv_heads  # what the engine uses
    for label, groups, per_group, goal in CASES:
        r = kernel_case(groups, per_group, 8192, 256, target, tiles, shape=shape)
        t = r["times"]
        reduction = r["plain_bytes"] / r["fca_bytes"]
        print(f"\n[{label}, shared prefix 8192, suffix 256, {shape.name} attention]  ideal byte reduction "
              f"{reduction:.1f}x")  # fmt: skip
        rows = (("sdpa", r["plain_bytes"]), ("sdpa_flash", r["plain_bytes"]), ("plain", r["plain_bytes"]),
                ("fca_uniform", r["fca_bytes"]), ("fca", r["fca_bytes"]), ("floor", r["fca_bytes"]))  # fmt: skip
        for name, nbytes in rows:
            what = {"sdpa": "PyTorch SDPA, fastest way, per-request KV",
                    "sdpa_flash": "PyTorch SDPA flash, fastest layout", "plain": "our kernel, no grouping (paged)",
                    "fca_uniform": "FCA kernel, even chunks (no lanes)",
                    "fca": "FCA kernel (grouped prefix + suffix + merge)",
                    "floor": "read floor: FCA's bytes read, no math"}[name]  # fmt: skip
            how = f"  ({r['sdpa_names'][name]})" if name in r["sdpa_names"] else ""
            print(f"  {what:46s} {t[name]:8.1f} us  {nbytes / t[name] / 1e6:6.2f} TB/s of its KV bytes{how}")
        print(f"  FCA speedup vs SDPA: {t['sdpa'] / t['fca']:.1f}x (target {goal:.0f}x; even chunks "
              f"{t['sdpa'] / t['fca_uniform']:.1f}x; vs SDPA flash {t['sdpa_flash'] / t['fca']:.1f}x);  "
              f"vs our plain paged kernel: {t['plain'] / t['fca']:.1f}x")  # fmt: skip
        print(f"  FCA takes {t['fca'] / t['floor']:.2f}x the read floor (fca_floor.py), itself "
              f"{t['sdpa'] / t['floor']:.1f}x faster than SDPA (a kernel that only reads these bytes)")  # fmt: skip
        print(f"  plan: {r['items'][0]} group items + {r['items'][1]} single items over {r['lanes']} lanes, built "
              f"in {r['plan_ms']:.2f} ms "
              f"(the engine reuses it until the batch changes or a context outgrows it)")  # fmt: skip
        print(f"  bf16 max |FCA - plain| = {r['diff_fca_plain']:.2e} (even chunks: {r['diff_even_plain']:.2e});  "
              f"vs fp32 reference: FCA {r['diff_fca_ref']:.2e}, SDPA {r['diff_sdpa_ref']:.2e}")  # fmt: skip


def tile_shape(changes: str, shape: AttentionShape = QWEN2_05B) -> TileShape:
    """The engine's tile shape for this model, with ``name=value,...`` changes (``--tiles``): a variant to time."""
    tiles = TileShape(shape.heads // shape.kv_heads)
    for change in filter(None, changes.split(",")):
        name, _, value = change.partition("=")
        if name not in {field.name for field in dataclasses.fields(TileShape)} or not value.lstrip("-").isdigit():
            raise SystemExit(f"--tiles takes name=integer pairs of TileShape's fields, got {change!r}")
        kind = int if getattr(tiles, name) is None else type(getattr(tiles, name))  # wide_maxnreg: None or int
        tiles = dataclasses.replace(tiles, **{name: kind(int(value))})
    return tiles


def e2e_benchmark(
    model_dir: Path, group: int, prompt_len: int, new_tokens: int, tiles: TileShape, replan: bool = False,
    sync: bool = False, even_chunks: bool = False,
) -> None:  # fmt: skip
    from sampling import build_qwen2_05b, gpu_ms, native_engine

    from arctic_rl_core.engines.sampling.protocol import SamplingParams

    path = build_qwen2_05b(model_dir)
    prompt = torch.randint(0, 151936, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(n=group, max_tokens=new_tokens, temperature=1.0, seed=0, ignore_eos=True)
    results = {}
    for use_fca in (True, False):
        engine = native_engine(path, prompt_len + new_tokens + 16, group, use_fca=use_fca,
                               extra={"async_scheduling": not sync})  # fmt: skip
        engine.runner.reuse_decode_plans = not replan  # --replan-every-step: the engine as it was before
        engine.runner.balance_plans = not even_chunks  # --even-chunks: shared prefixes cut evenly, as before
        if tiles != engine.runner.tiles:  # --tiles: the graphs are captured again with the variant
            engine.runner.tiles = tiles
            engine.runner.capture_graphs()
        # Warm-up at full length on another prompt: the first 8K prefill of a process allocates and compiles.
        engine.generate([[(t + 1) % 151936 for t in prompt]], params.model_copy(update={"max_tokens": 8}))
        engine.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(prompt, params, request_id="rollout")
        engine.step()
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
        results[use_fca] = (total, prefill, outputs[0].completions)
        step_ms = (total - prefill) / (new_tokens - 1) * 1e3
        graph = engine.runner.graphs[(group, use_fca)]
        graph_ms = gpu_ms(graph.replay)
        state = "on " if use_fca else "off"
        print(f"  FCA {state}: decode step {step_ms:.3f} ms wall = graph replay (model, attention, "
              f"LM head) {graph_ms:.3f} ms + sampling and host work not overlapped {step_ms - graph_ms:.3f} ms "
              f"({'synchronous' if sync else 'asynchronous'} scheduling)")  # fmt: skip
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    (on, on_prefill, on_out), (off, off_prefill, off_out) = results[True], results[False]
    decode_tokens = group * (new_tokens - 1)
    print(f"\n[end to end: G={group}, prompt {prompt_len}, {new_tokens} new tokens, Qwen2-0.5B shape, bf16]")
    for label, total, prefill in (("off", off, off_prefill), ("on ", on, on_prefill)):
        rate = decode_tokens / (total - prefill)
        print(f"  FCA {label}: {total:7.3f} s rollout (prefill {prefill:.3f} s), decode {rate:8.0f} tok/s")
    decode_speedup = (off - off_prefill) / (on - on_prefill)
    print(f"  rollout speedup {off / on:.2f}x (target 1.5x); decode-only speedup {decode_speedup:.2f}x")
    diffs, total_tokens = [], 0
    for a, b in zip(on_out, off_out):
        # Log-probs of the same token in the same context: up to (and including) the first sampled difference.
        for token_a, token_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if token_a != token_b:
                break
            diffs.append(abs(lp_a - lp_b))
        total_tokens += len(a.token_ids)
    same = len(diffs)
    print(f"  bf16 FCA on vs off: max |logprob diff| {max(diffs):.3e} over {len(diffs)} tokens compared while the "
          f"sampled tokens agree; {same / total_tokens:.1%} of tokens identical before any divergence")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--replan-every-step", action="store_true", help="end to end without decode plan reuse")
    parser.add_argument("--sync-scheduling", action="store_true", help="end to end without asynchronous scheduling")
    parser.add_argument("--even-chunks", action="store_true", help="end to end without plans balanced over lanes")
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qwen2-0.5b-random")
    parser.add_argument("--tiles", default="", help="TileShape changes to time, as name=value,... (bools as 0/1)")
    parser.add_argument("--linear-tiles", help="end to end also with the projection tiles of decode_linear.py "
                        "--sweep-json's file, after pick_tiles' (same process)")  # fmt: skip
    parser.add_argument("--shape", choices=SHAPES, default="qwen2-0.5b",
                        help="the kernels at this model's attention (any other than the default skips the end to end)")  # fmt: skip
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    tiles = tile_shape(args.tiles, shape)
    print(f"device: {torch.cuda.get_device_name()}; tiles: {tiles}")
    if not args.skip_kernels:
        kernel_benchmark(tiles, shape)
    if not args.skip_e2e and shape == QWEN2_05B:

        def e2e():
            e2e_benchmark(args.model_dir, group=16, prompt_len=8192, new_tokens=512, tiles=tiles,
                          replan=args.replan_every_step, sync=args.sync_scheduling, even_chunks=args.even_chunks)  # fmt: skip

        e2e()
        if args.linear_tiles:
            from decode_linear import swept_pick_tiles

            from arctic_rl_core.engines.sampling.native import decode_linear

            print(f"\n[the same, with the projection tiles of {args.linear_tiles}]")
            with mock.patch.object(decode_linear, "pick_tiles", swept_pick_tiles(args.linear_tiles)):
                e2e()


if __name__ == "__main__":
    main()
