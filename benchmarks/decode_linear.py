"""Decode-batch projections: our split-K Triton kernel vs cuBLAS (``F.linear``) on the same weights, one GPU.

    python benchmarks/decode_linear.py [--sweep]

For each projection of a Qwen2-0.5B and a Qwen2.5-7B decoder layer, at 1, 16
and 64 rows, prints microseconds per call and the weight bytes moved per
second, with the weights cold in L2 as in a real step (each call reads one of
several copies, more than L2 holds together, replayed from a CUDA graph). The
gate/up row compares the fused ``silu(gate) * up`` kernel with cuBLAS plus the
engine's activation kernel. ``--sweep`` also times other tile shapes, which is
how ``pick_tiles`` was chosen.

The chain rows run a decoder layer's four projections back to back, each
feeding the next, over every layer's own weights: cuBLAS (with the separate
activation kernel), ours, and ours launched as programmatic dependents, which
prefetch their weights into L2 while the kernel before them finishes. "Ours"
is what the engine runs: cuBLAS for the shapes ``pick_tiles`` declines.
``+norms`` adds the layer's two RMS norm kernels (with their residual adds),
as programmatic dependents too: its difference from ``ours+pdl`` is the most
that fusing the norms into the projections could save.

``--chain-parts`` prints what each projection adds to that chain, next to
its weights' read time, and what the chain's launches take with no work in
them: whether the chain's time over its weights' read is launches or reads.

``--chain-sweep`` times the chain as the engine's decode step runs it (each
norm split between the projections around it: ``into_residual`` and
``row_norm``) with other tiles for each projection, one projection at a time
(coordinate descent, two rounds), and prints the fastest set against
``pick_tiles``' in the same process.

``--chain-stages 4 6 8`` times the same chain with each projection's
software pipeline this many stages deep (fewer where shared memory or the
slice's steps allow no more), the settings in turn and then in reverse: how
much of each projection's latency after its wait is its K loop's loads
coming back a few steps at a time. With ``--sweep-json`` it writes the
fastest setting's tiles for ``fca.py --linear-tiles``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from fca import graph_us
from sampling import copy_bandwidth
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from arctic_rl_core.engines.sampling.native import triton_ops
from arctic_rl_core.engines.sampling.native.decode_linear import (
    MAX_STAGES,
    LinearTiles,
    decode_linear,
    num_sms,
    pick_tiles,
)

# (model, projection, output features, input features, gated)
SHAPES = (
    ("qwen2-0.5b", "qkv", 1152, 896, False),
    ("qwen2-0.5b", "o", 896, 896, False),
    ("qwen2-0.5b", "gate_up", 4864, 896, True),
    ("qwen2-0.5b", "down", 896, 4864, False),
    ("qwen2.5-7b", "qkv", 4608, 3584, False),
    ("qwen2.5-7b", "o", 3584, 3584, False),
    ("qwen2.5-7b", "gate_up", 18944, 3584, True),
    ("qwen2.5-7b", "down", 3584, 18944, False),
)
# Each model's head dimension: its q/k/v projection's tiles are one head wide (the rotary epilogue's).
HEAD_DIM = {"qwen2-0.5b": 64, "qwen2.5-7b": 128}
ROWS = (1, 16, 64)
COLD_BYTES = 512 << 20  # several times an H200's 50 MB of L2


def layer_weights(model: str, layers: int) -> tuple[dict[str, tuple[int, int, bool]], list[dict[str, torch.Tensor]]]:
    """``model``'s projection shapes by name, and ``layers`` layers' own random bf16 weights for them."""
    shapes = {name: (n, k, gated) for m, name, n, k, gated in SHAPES if m == model}
    weights = [{name: torch.randn((2 * n if gated else n), k, device="cuda", dtype=torch.bfloat16) * 0.02
                for name, (n, k, gated) in shapes.items()} for _ in range(layers)]  # fmt: skip
    return shapes, weights


def chain(model: str, rows: int, layers: int) -> None:
    """A layer's projections back to back over ``layers`` layers' weights: microseconds per layer, three ways."""
    device = torch.device("cuda")
    shapes, weights = layer_weights(model, layers)
    hidden = shapes["o"][0]
    x0 = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())

    def run(mode: str):
        def linear(x, weight, gated=False):
            """As the engine does it: our kernel where ``pick_tiles`` takes the shape, else cuBLAS."""
            n = weight.shape[0] // 2 if gated else weight.shape[0]
            tiles = None if mode == "cublas" else pick_tiles(x.shape[0], n, x.shape[1], num_sms(device), gated)
            if tiles is None:
                out = F.linear(x, weight)
                return triton_ops.silu_and_mul(out) if gated else out
            return decode_linear(x, weight, gated=gated, tiles=tiles, pdl=mode.startswith("ours+pdl"))

        def norm(x):
            """The layer's RMS norm with its residual add, where ``+norms`` runs it (what fusing it would save)."""
            return triton_ops.rms_norm(x, norm_weight, 1e-6, residual)[0] if mode.endswith("+norms") else x

        def step(i):
            w = weights[i]
            o = linear(linear(norm(x0), w["qkv"])[:, :hidden], w["o"])
            return linear(linear(norm(o), w["gate_up"], gated=True), w["down"])

        return step

    norm_weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    residual = torch.zeros(rows, hidden, device=device, dtype=torch.bfloat16)
    modes = ("cublas", "ours", "ours+pdl", "ours+pdl+norms")
    results = {mode: graph_us(run(mode), layers, replays=20) for mode in modes}
    outs = {mode: run(mode)(0).float() for mode in modes[:3]}
    diff = max((outs[m] - outs["cublas"]).abs().max().item() for m in outs)
    base = results["cublas"]
    print(f"{model:10s} chain of 4 projections, rows {rows:2d}, {layers} layers | "
          + " | ".join(f"{m} {us:6.1f} us ({base / us:4.2f}x)" for m, us in results.items())
          + f" | weights {layer_bytes / 1e6:.1f} MB/layer: {layer_bytes / results['ours+pdl'] / 1e6:.2f} TB/s with pdl"
          + f" | max |diff| {diff:.1e}", flush=True)  # fmt: skip


CHAIN = ("qkv", "o", "gate_up", "down")


def engine_chain_us(
    rows: int, tiles: dict[str, LinearTiles], weights: list[dict[str, torch.Tensor]], parts: int = len(CHAIN)
) -> float:
    """Microseconds per layer of the engine's chain over ``weights`` (``layer_weights``): q/k/v (``row_norm``), o
    (``into_residual``), gate/up (``row_norm``), down (``into_residual``), each a programmatic dependent, with these
    ``tiles`` by name; only the first ``parts`` of them (a later layer's q/k/v then reads what the last
    ``into_residual`` left, or the first input)."""
    device = torch.device("cuda")
    hidden = weights[0]["o"].shape[0]
    block_m = max(16, triton.next_power_of_2(rows))
    residual = torch.zeros(rows, hidden, device=device, dtype=torch.bfloat16)
    norm_weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    # The first q/k/v's input: rows of ones, their sums of squares as one part (rms 1).
    state = [torch.ones(rows, hidden, device=device, dtype=torch.bfloat16),
             torch.full((1, block_m), float(hidden), device=device)]  # fmt: skip

    def step(i):
        w = weights[i]
        x, squares = state
        qkv = decode_linear(x, w["qkv"], tiles=tiles["qkv"], pdl=True, row_norm=(squares, 1e-6))
        if parts < 2:
            return
        x, squares = decode_linear(qkv[:, :hidden], w["o"], tiles=tiles["o"], pdl=True,
                                   into_residual=(residual, norm_weight))  # fmt: skip
        if parts < 4:  # no down projection: the next layer reads what o left
            state[:] = x, squares
        if parts < 3:
            return
        act = decode_linear(x, w["gate_up"], gated=True, tiles=tiles["gate_up"], pdl=True, row_norm=(squares, 1e-6))
        if parts < 4:
            return
        state[:] = decode_linear(act, w["down"], tiles=tiles["down"], pdl=True, into_residual=(residual, norm_weight))

    return graph_us(step, len(weights), replays=20)


def engine_tiles(
    model: str, rows: int, shapes: dict[str, tuple[int, int, bool]], max_stages: int = MAX_STAGES
) -> dict[str, LinearTiles | None]:
    """``pick_tiles``' tiles for each of ``shapes`` (``layer_weights``) as the engine picks them: q/k/v one head
    wide, for its rotary epilogue; None where cuBLAS takes the projection. ``max_stages``: ``pick_tiles``'."""
    sms = num_sms(torch.device("cuda"))
    return {name: pick_tiles(rows, n, k, sms, gated, block_n=HEAD_DIM[model] if name == "qkv" else None,
                             max_stages=max_stages)
            for name, (n, k, gated) in shapes.items()}  # fmt: skip


@triton.jit
def _empty_dependent(X):
    """A launch that does nothing but what a programmatic dependent must: wait for the kernel before, release
    the one after."""
    gdc_wait()
    gdc_launch_dependents()


def chain_parts(model: str, rows: int, layers: int) -> None:
    """What each projection adds to the engine's chain (``pick_tiles``' tiles), next to what reading its weights
    takes at the device's copy bandwidth, and what the chain's launches cost with no work in them: where the
    chain's time over its weights' read goes, launches or reads."""
    device = torch.device("cuda")
    shapes, weights = layer_weights(model, layers)
    tiles = engine_tiles(model, rows, shapes)
    if None in tiles.values():
        print(f"{model} rows {rows}: cuBLAS takes some projections; no chain", flush=True)
        return
    bandwidth = copy_bandwidth()
    # Twice each, the prefixes in turn, so that drift over the run shows as a difference between the rounds.
    rounds = [[engine_chain_us(rows, tiles, weights, parts) for parts in range(1, len(CHAIN) + 1)] for _ in range(2)]
    flag = torch.zeros(1, device=device)
    grids = {}
    for name, (n, k, _) in shapes.items():  # as many programs as decode_linear launches
        tiles_n, split_k, _ = tiles[name].launch(n, k)
        grids[name] = (tiles_n * split_k,)

    def empty(i):
        for name in CHAIN:
            _empty_dependent[grids[name]](flag, launch_pdl=True)

    floor = graph_us(empty, layers, replays=20)
    print(f"{model:10s} engine chain, rows {rows:2d}, {layers} layers, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"its four launches with no work: {floor:.1f} us per layer", flush=True)  # fmt: skip
    before = [0.0, 0.0]
    for parts, name in enumerate(CHAIN):
        n, k, gated = shapes[name]
        read_us = (2 if gated else 1) * n * k * 2 / bandwidth * 1e6
        added = [r[parts] - b for r, b in zip(rounds, before)]
        before = [r[parts] for r in rounds]
        print(f"    + {name:7s} {added[0]:5.1f} / {added[1]:5.1f} us (chain {before[0]:5.1f} / {before[1]:5.1f}); "
              f"its weights read in {read_us:4.1f} us; tiles {dataclasses.astuple(tiles[name])}, "
              f"{grids[name][0]} programs", flush=True)  # fmt: skip


def chain_sweep(model: str, rows: int, layers: int) -> dict[str, LinearTiles] | None:
    """``engine_chain_us`` with each projection's other tiles, one projection at a time, two rounds: the fastest
    set found, by projection name (None where cuBLAS takes some projection, so there is no chain to sweep)."""
    shapes, weights = layer_weights(model, layers)
    head = HEAD_DIM[model]
    default = engine_tiles(model, rows, shapes)
    if None in default.values():
        print(f"{model} rows {rows}: cuBLAS takes some projections; no chain sweep", flush=True)
        return None
    best, best_us = dict(default), engine_chain_us(rows, default, weights)
    base_us = best_us
    for _ in range(2):
        for name, (n, k, gated) in shapes.items():
            for t in sweep_tiles(rows, n, k, gated, (head,) if name == "qkv" else (16, 32, 64), stages=None):
                if t == best[name]:
                    continue
                trial = {**best, name: t}
                try:
                    us = engine_chain_us(rows, trial, weights)
                except Exception as e:  # a set that fails to compile or run is reported, not fatal
                    print(f"    {name} {dataclasses.astuple(t)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                if us < best_us:
                    best, best_us = trial, us
    # Once more each, one after the other: the two sets' figures from the same stretch of the run.
    again = [engine_chain_us(rows, tiles, weights) for tiles in (default, best, default, best)]
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())
    print(f"{model:10s} engine chain, rows {rows:2d}, {layers} layers | pick_tiles {base_us:5.1f} us, again "
          f"{again[0]:5.1f} / {again[2]:5.1f} | best {best_us:5.1f} us, again {again[1]:5.1f} / {again[3]:5.1f} "
          f"({layer_bytes / min(again[1], again[3]) / 1e6:.2f} TB/s)", flush=True)  # fmt: skip
    for name in shapes:
        mark = "" if best[name] == default[name] else "   <- changed"
        print(f"    {name:7s} pick_tiles {dataclasses.astuple(default[name])}  best {dataclasses.astuple(best[name])}{mark}",
              flush=True)  # fmt: skip
    return best


def chain_stages(model: str, rows: int, layers: int, stage_counts: list[int]) -> dict[str, LinearTiles] | None:
    """``engine_chain_us`` with ``pick_tiles``' tiles, its pipeline capped at each of ``stage_counts`` stages (it
    takes fewer where a slice's steps or shared memory use no more), in turn and then in reverse, so that drift
    over the run shows: the fastest setting's tiles, by name (None where cuBLAS takes some projection)."""
    shapes, weights = layer_weights(model, layers)
    default = engine_tiles(model, rows, shapes)
    if None in default.values():
        print(f"{model} rows {rows}: cuBLAS takes some projections; no chain", flush=True)
        return None
    settings = {s: engine_tiles(model, rows, shapes, max_stages=s) for s in stage_counts}
    times: dict[int, list[float]] = {s: [] for s in stage_counts}
    for s in [*stage_counts, *reversed(stage_counts)]:
        times[s].append(engine_chain_us(rows, settings[s], weights))
    print(f"{model:10s} engine chain, rows {rows:2d}, {layers} layers; pick_tiles' stages "
          + ", ".join(f"{name} {t.stages}" for name, t in default.items()), flush=True)  # fmt: skip
    for s in stage_counts:
        used = ", ".join(f"{name} {t.stages}" for name, t in settings[s].items())
        print(f"    stages up to {s:2d} ({used}): {times[s][0]:5.1f} / {times[s][1]:5.1f} us per layer", flush=True)
    best = min(stage_counts, key=lambda s: max(times[s]))
    return settings[best]


def swept_pick_tiles(path: str | Path):
    """``pick_tiles`` as the engine calls it, but with the tiles a ``--sweep-json`` file found for Qwen2-0.5B's
    projections: batches of up to 16 rows take the 16-row set, larger ones the 64-row set."""
    found = json.loads(Path(path).read_text())
    names = {(n, k, gated): name for m, name, n, k, gated in SHAPES if m == "qwen2-0.5b"}

    def pick(rows, n, k, num_sms, gated=False, block_n=None):
        tiles = pick_tiles(rows, n, k, num_sms, gated, block_n)
        name, bucket = names.get((n, k, gated)), "16" if rows <= 16 else "64"
        if tiles is None or name is None or bucket not in found:
            return tiles
        return LinearTiles(**found[bucket][name])

    return pick


def sweep_tiles(
    rows: int, n: int, k: int, gated: bool = False, block_ns: tuple[int, ...] = (16, 32, 64), stages=(3, 5)
) -> list[LinearTiles]:
    """Other tiles for one projection: output tiles of ``block_ns``, K split 1-16 ways, ``stages`` stages
    (None: as many as ``pick_tiles`` would fit)."""
    out = []
    for block_n in block_ns:
        for split_k in (1, 2, 4, 8, 16):
            if n % block_n or k // 128 < split_k:
                continue
            fit = pick_tiles(rows, n, k, 1, gated, block_n=block_n)
            for s in stages if stages else (fit.stages,):
                out.append(LinearTiles(block_n, 128, split_k, 4, s))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time other tile shapes")
    parser.add_argument("--model", default=None, help="only this model's shapes")
    parser.add_argument("--chain-only", action="store_true", help="only the back-to-back projection chains")
    parser.add_argument("--chain-sweep", action="store_true", help="only the engine's chain, with other tiles")
    parser.add_argument("--chain-parts", action="store_true",
                        help="only what each projection adds to the engine's chain, and its launches' floor")  # fmt: skip
    parser.add_argument("--chain-stages", type=int, nargs="+",
                        help="only the engine's chain, at each of these pipeline depths")  # fmt: skip
    parser.add_argument(
        "--sweep-json", help="--chain-sweep, --chain-stages: also write the fastest tiles here, by rows and name"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64], help="--chain-sweep's and --chain-parts' rows")
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = num_sms(device)
    print(f"device: {torch.cuda.get_device_name()}, {sms} SMs; bf16; weights cold in L2")
    if args.chain_parts:
        for rows in args.rows:
            chain_parts(args.model or "qwen2-0.5b", rows, 24)
        return
    if args.chain_sweep or args.chain_stages:
        found = {}
        for rows in args.rows:
            model = args.model or "qwen2-0.5b"
            if args.chain_stages:
                best = chain_stages(model, rows, 24, args.chain_stages)
            else:
                best = chain_sweep(model, rows, 24)
            if best is None:
                continue
            found[rows] = {name: dataclasses.asdict(t) for name, t in best.items()}
            if args.sweep_json:  # after each, so that a run cut short keeps what it found
                Path(args.sweep_json).write_text(json.dumps(found, indent=1))
        return
    for model, layers in (("qwen2-0.5b", 24), ("qwen2.5-7b", 4)):
        if not args.model or model == args.model:
            for rows in ROWS:
                chain(model, rows, layers)
    for model, name, n, k, gated in SHAPES:
        if args.chain_only or args.model and model != args.model:
            continue
        rows_out = 2 * n if gated else n
        copies = max(2, -(-COLD_BYTES // (rows_out * k * 2)))
        weights = [torch.randn(rows_out, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bias = torch.randn(n, device=device, dtype=torch.bfloat16) if name == "qkv" else None
        gbytes = rows_out * k * 2 / 1e9
        for rows in ROWS:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            if gated:

                def cublas(i, x=x):
                    return triton_ops.silu_and_mul(F.linear(x, weights[i]))
            else:

                def cublas(i, x=x):
                    return F.linear(x, weights[i], bias)

            reference = cublas(0).float()
            tiles = pick_tiles(rows, n, k, sms, gated)
            base = graph_us(cublas, copies, replays=20)
            line = f"{model:10s} {name:7s} {n:5d}x{k:5d} rows {rows:2d} | cuBLAS {base:7.1f} us {gbytes / base * 1e3:5.2f} TB/s"
            candidates = [tiles] if tiles else []
            if args.sweep:
                candidates += [t for t in sweep_tiles(rows, n, k) if t != tiles]
            results = []
            for t in candidates:

                def ours(i, x=x, t=t):
                    return decode_linear(x, weights[i], bias, gated=gated, tiles=t)

                err = (ours(0).float() - reference).abs().max().item()
                results.append((graph_us(ours, copies, replays=20), t, err))
            if tiles:
                us, _, err = results[0]
                line += (f" | ours {us:7.1f} us {gbytes / us * 1e3:5.2f} TB/s ({base / us:4.2f}x) "
                         f"bn {tiles.block_n} split {tiles.split_k} |diff| {err:.1e}")  # fmt: skip
            else:
                line += " | ours: declined (cuBLAS)"
            print(line, flush=True)
            if args.sweep and results:
                best = sorted(results, key=lambda r: r[0])[:3]
                print(
                    "    best: " + "; ".join(f"{us:.1f} us {dataclasses.astuple(t)}" for us, t, _ in best), flush=True
                )


if __name__ == "__main__":
    main()
