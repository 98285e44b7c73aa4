"""Weight sync: CUDA IPC, low-memory IPC and file sync against a device-to-device copy; the coordinator against NCCL.

    python benchmarks/weight_sync.py                     # one GPU: Qwen2-0.5B and 1.5B shapes
    python benchmarks/weight_sync.py --split             # 2+ GPUs: WeightSyncCoordinator vs NCCL broadcast
    python benchmarks/weight_sync.py --device cpu        # anywhere: file sync and the gloo coordinator (small shape)

Weights are random, in bf16, laid out as Qwen2's Hugging Face parameters
(nothing is downloaded). Every sync lands in a second process that holds the
native sampling engine's model (fused QKV and gate/up projections) and loads
each received tensor into it with the engine's own ``WeightLoader``, so a row's
time runs from the sender's first byte to the receiver's last copy.

Colocated (one device), in one run per shape, the sender's weights laid out
two ways:
- ``flat``: views of one flat buffer, as DeepSpeed ZeRO-1/2 keeps its 16-bit
  parameters; the buffer is shared in place, nothing is packed;
- ``separate``: one tensor per parameter (ZeRO-0, plain modules); they are
  packed into flattened buckets of ``--bucket-mb``.
Rows:
- baseline: one device-to-device copy of all the weights' bytes;
- ``ipc``: a repeat sync in an IPC session (plan, buffers, handles and the
  receiver's mappings kept), as a training engine syncs between its sleeps
  (target: <= 3x the copy);
- ``low-memory``: the same, one bucket at a time;
- ``one-shot``: each sync plans, exports, maps and frees its buckets, as the
  first sync after training wakes does;
- ``per-parameter handles``: one IPC handle per tensor, the design buckets replace;
- ``file``: safetensors shards written to ``--file-dir`` and loaded by the receiver.

Split (``--split``): training rank 0 on GPU 0 sends to inference workers on
the next GPUs through the coordinator; baseline: an NCCL broadcast of the
same bytes from GPU 0 to those GPUs, in the same processes. On CPU both run
over gloo.
"""

from __future__ import annotations

import argparse
import functools
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from arctic_rl_core.config import WeightSyncConfig
from arctic_rl_core.weight_sync import (
    AttentionHeads,
    IpcMappings,
    IpcSession,
    TrainingRank,
    TransferSchedule,
    WeightSyncCoordinator,
    read_weights,
    receive_over_connection,
    send_over_connection,
    tp_shard_shape,
    write_weights,
)

DTYPE = torch.bfloat16
IPC_TARGET = 3.0


@dataclass(frozen=True)
class Qwen2Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def attention(self) -> AttentionHeads:
        return AttentionHeads(self.heads, self.kv_heads, self.hidden // self.heads)

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """Qwen2ForCausalLM's parameters, in ``named_parameters`` order."""
        h, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.self_attn.q_proj.weight", (h, h)), (f"{p}.self_attn.q_proj.bias", (h,)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.k_proj.bias", (kv,)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.bias", (kv,)),
                (f"{p}.self_attn.o_proj.weight", (h, h)),
                (f"{p}.mlp.gate_proj.weight", (self.intermediate, h)),
                (f"{p}.mlp.up_proj.weight", (self.intermediate, h)),
                (f"{p}.mlp.down_proj.weight", (h, self.intermediate)),
                (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
            ]  # fmt: skip
        out.append(("model.norm.weight", (h,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, h)))
        return out


SHAPES = {
    "qwen2-0.5b": Qwen2Shape(896, 4864, 24, 14, 2, 151936, tied=True),
    "qwen2-1.5b": Qwen2Shape(1536, 8960, 28, 12, 2, 151936, tied=True),
    "small": Qwen2Shape(256, 768, 4, 4, 2, 8192, tied=False),
}


def random_weights(shape: Qwen2Shape, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.empty(dims, dtype=DTYPE, device=device).uniform_(-0.05, 0.05, generator=g)
        for name, dims in shape.parameters()
    }


def flat_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same values as views of one flat buffer, the way DeepSpeed ZeRO-1/2 holds 16-bit parameters."""
    buffer = torch.cat([t.flatten() for t in weights.values()])
    views, offset = {}, 0
    for name, tensor in weights.items():
        views[name] = buffer[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
    return views


def nbytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in weights.values())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_seconds(run, repeats: int, device: torch.device) -> float:
    run()  # warm-up: CUDA context, IPC mappings, allocator, NCCL communicators
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Row:
    shape: str
    method: str
    seconds: float
    nbytes: int
    baseline: float | None

    def line(self) -> str:
        ratio = f"{self.seconds / self.baseline:7.2f}x" if self.baseline else "   base"
        gbps = self.nbytes / self.seconds / 1e9
        return f"{self.shape:<12} {self.method:<44} {self.seconds * 1e3:10.2f} ms {gbps:8.2f} GB/s {ratio}"


# ----- colocated: a receiver process on the same device


def receiver_main(ctrl, data, shape: Qwen2Shape, device: str) -> None:
    """The sampler's side: the native engine's model (fused QKV and gate/up) loads every sync, as in a sampler."""
    from transformers import Qwen2Config

    from arctic_rl_core.engines.sampling.native.model import CausalLM, ModelSpec
    from arctic_rl_core.engines.sampling.native.weights import WeightLoader

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = Qwen2Config(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied,
    )  # fmt: skip
    loader = WeightLoader(CausalLM(ModelSpec.from_hf_config(config), config, 16, DTYPE, device))
    expected = dict(shape.parameters())

    def load(weights) -> None:
        loader.load(weights, batched=True)

    mappings = IpcMappings() if device.type == "cuda" else None
    while True:
        command = ctrl.recv()
        if command[0] == "ipc":
            receive_over_connection(data, load, expected=expected, mappings=mappings)
        elif command[0] == "forget":
            ctrl.send(mappings.forget())
        elif command[0] == "file":
            loader.load(read_weights(command[1], expected=expected, device=str(device)))
            synchronize(device)
            ctrl.send("loaded")
        else:
            return


def colocated_rows(name: str, shape: Qwen2Shape, args, device: torch.device) -> list[Row]:
    weights = random_weights(shape, device)
    total = nbytes(weights)
    ctx = mp.get_context("spawn")
    ctrl, ctrl_there = ctx.Pipe()
    data, data_there = ctx.Pipe()
    receiver = ctx.Process(target=receiver_main, args=(ctrl_there, data_there, shape, str(device)))
    receiver.start()
    bucket_size = args.bucket_mb << 20
    rows: list[Row] = []
    try:
        source = torch.empty(total, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        copy = median_seconds(functools.partial(target.copy_, source), args.repeats, device)
        del source, target  # free the baseline's buffers before the sync paths allocate theirs
        label = "d2d copy" if device.type == "cuda" else "memcpy"
        rows.append(Row(name, f"{label} (baseline)", copy, total, None))

        if device.type == "cuda":
            flat = flat_weights(weights)

            def ipc(source: dict, size: int, low_memory: bool, session: IpcSession | None = None):
                def run() -> None:
                    ctrl.send(("ipc",))
                    send_over_connection(data, source.items(), bucket_size=size, low_memory=low_memory, session=session)

                return run

            def in_session(source: dict, low_memory: bool) -> float:
                session = IpcSession(device)
                seconds = median_seconds(ipc(source, bucket_size, low_memory, session), args.repeats, device)
                ctrl.send(("forget",))
                ctrl.recv()
                session.close()
                return seconds

            for layout, source, method in (
                ("flat", flat, "ipc in place"),
                ("separate", weights, f"ipc, {args.bucket_mb} MB buckets"),
            ):
                for low_memory in (False, True):
                    label = f"{layout}: {method}" + (", low-memory" if low_memory else "")
                    rows.append(Row(name, label, in_session(source, low_memory), total, copy))
                    one_shot = median_seconds(ipc(source, bucket_size, low_memory), args.repeats, device)
                    rows.append(Row(name, f"{label}, one-shot", one_shot, total, copy))
            del flat
            per_parameter = median_seconds(ipc(weights, 1, False), args.repeats, device)
            rows.append(Row(name, "separate: ipc per-parameter handles", per_parameter, total, copy))

        with tempfile.TemporaryDirectory(dir=args.file_dir) as scratch:
            directory = Path(scratch) / "weights"

            def file_sync() -> None:
                write_weights(weights.items(), directory, shard_size=args.shard_mb << 20)
                ctrl.send(("file", str(directory)))
                ctrl.recv()

            rows.append(
                Row(
                    name,
                    f"file ({args.file_dir or tempfile.gettempdir()})",
                    median_seconds(file_sync, max(1, args.repeats // 2), device),
                    total,
                    copy,
                )
            )
    finally:
        ctrl.send(("stop",))
        receiver.join(timeout=60)
    return rows


# ----- split placement: one process per device


def split_member(rank: int, name: str, args, ports: tuple[int, int], device_type: str, results) -> None:
    shape = SHAPES[name]
    config = WeightSyncConfig(
        training_gpus=1,
        inference_replicas=args.replicas,
        inference_tp=args.tp,
        base_port=ports[1],
        bucket_size=args.bucket_mb << 20,
        timeout_s=600,
    )
    schedule = TransferSchedule.from_config(config)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A default group of its own, as DeepSpeed's would be: the coordinator must live beside it.
    init = f"tcp://127.0.0.1:{ports[0]}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=schedule.world_size)
    member = schedule.member(rank)
    coordinator = WeightSyncCoordinator(config, member, device=device, heads=shape.attention)
    full = random_weights(shape, device) if isinstance(member, TrainingRank) else None
    if full is None:
        expected = {
            n: tp_shard_shape(n, dims, member.tp_rank, args.tp, shape.attention) for n, dims in shape.parameters()
        }
        params = {n: torch.zeros(dims, dtype=DTYPE, device=device) for n, dims in expected.items()}
    total = sum(torch.Size(d).numel() for _, d in shape.parameters()) * DTYPE.itemsize
    flat = torch.empty(total, dtype=torch.uint8, device=device)

    def sync() -> None:
        if full is not None:
            coordinator.send(full.items())
        else:
            for n, tensor in coordinator.receive(expected):
                params[n].copy_(tensor)

    def broadcast() -> None:
        dist.broadcast(flat, src=0)

    timings = {}
    for label, run in (("broadcast", broadcast), ("coordinator", sync)):
        run()
        samples = []
        for _ in range(args.repeats):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            run()
            synchronize(device)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a sync ends when its last member is done
            samples.append(elapsed.item())
        timings[label] = statistics.median(samples)
    if rank == 0:
        results.put((timings, total))
    coordinator.close()
    dist.destroy_process_group()


def split_rows(name: str, args, device: torch.device) -> list[Row]:
    world = 1 + args.replicas * args.tp
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"--split with {args.replicas} replica(s) of tp {args.tp} needs {world} GPUs")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=split_member, args=(r, name, args, ports, device.type, results)) for r in range(world)]
    for p in procs:
        p.start()
    timings, total = results.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
    backend = "NCCL" if device.type == "cuda" else "gloo"
    # Each inference worker receives its tp shard: 1/tp of the bytes (norms aside).
    return [
        Row(name, f"{backend} broadcast (baseline)", timings["broadcast"], total, None),
        Row(name, f"coordinator ({args.replicas}x tp{args.tp})", timings["coordinator"], total // args.tp,
            timings["broadcast"]),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--shapes", default=None, help=f"comma-separated, from {sorted(SHAPES)}")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--shard-mb", type=int, default=1024, help="safetensors shard size of the file path")
    parser.add_argument("--file-dir", default=None, help="where the file path writes (default: the temp dir)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--split", action="store_true", help="coordinator across devices instead of colocated")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    names = args.shapes.split(",") if args.shapes else (["qwen2-0.5b", "qwen2-1.5b"] if cuda else ["small"])
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")

    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device: {where}; dtype {DTYPE}; {args.repeats} repeats, median; time = sender start to receiver done")
    rows: list[Row] = []
    for name in names:
        shape = SHAPES[name]
        print(
            f"{name}: {len(shape.parameters())} tensors, "
            f"{sum(torch.Size(d).numel() for _, d in shape.parameters()) * DTYPE.itemsize / 1e9:.2f} GB"
        )
        if not cuda or not args.split:
            rows += colocated_rows(name, shape, args, device)
        if not cuda or args.split:
            rows += split_rows(name, args, device)
    print(f"\n{'shape':<12} {'method':<44} {'time':>13} {'bandwidth':>13} {'vs base':>8}")
    for row in rows:
        print(row.line())
    for row in (
        r for r in rows if ": ipc" in r.method and "low-memory" not in r.method and "per-param" not in r.method
    ):
        ratio = row.seconds / row.baseline
        verdict = "met" if ratio <= IPC_TARGET else "NOT met"
        print(f"{row.shape} {row.method}: {ratio:.2f}x the copy; target <= {IPC_TARGET:.0f}x: {verdict}")


if __name__ == "__main__":
    main()
