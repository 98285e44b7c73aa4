"""ZoRRo Train on vs off: one GRPO-shaped forward+backward on the same model, in one run.

Both sides run the same model, the same batch (G samples of one P-token prompt,
R-token responses) and the same head and loss, as the training engine does
them: ``arctic_rl_core.engines.token_outputs.selected_logprobs`` (the LM head
on the selected rows only, 1 GiB of logits at a time, recomputed in backward;
fused log-prob kernels on CUDA), and a clipped policy-gradient loss.
They differ only in how the selected hidden states are computed:
- plain: ``arctic_rl_core.models.forward.selected_hidden_states``, the engine's
  padded forward (SDPA);
- zorro: ``arctic_rl_core.zorro.train.selected_hidden_states``, the prefix forest
  packed once (FlashAttention varlen on CUDA in bf16 by default; ``--kernel flex``
  for FlexAttention), its planning included in the timing.

Reported per configuration: time per step, peak memory, their ratios, and the
relative difference of the parameter gradients. In bf16 its yardstick is the
exact gradient, computed by the plain path on an fp32 copy of the model: the
distance of each bf16 gradient from it is that side's bf16 noise, and their
ratio says how much ZoRRo adds to it. On CUDA also where the kernel time goes.

    python benchmarks/zorro_train.py                 # GPU: Qwen2-0.5B shape, bf16
    python benchmarks/zorro_train.py --tiny          # CPU: a tiny Qwen2, fp32, in seconds
    python benchmarks/zorro_train.py --cuda-graphs   # GPU: both sides' layers replayed as CUDA graphs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from arctic_rl_core.engines.token_outputs import selected_logprobs
from arctic_rl_core.models.forward import decoder_body, head_dim, lm_head
from arctic_rl_core.models.forward import selected_hidden_states as plain_selected_hidden_states
from arctic_rl_core.models.layer_graphs import release_layer_graphs
from arctic_rl_core.zorro import train as zorro_train
from arctic_rl_core.zorro.train import attention as zorro_attention

# Qwen/Qwen2-0.5B's config.json, with random weights.
QWEN2_0_5B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
CLIP = 0.2


@dataclass(frozen=True)
class Case:
    samples: int  # G
    prompt: int  # P
    response: int  # R
    checkpointing: bool  # gradient checkpointing on the plain side
    zorro_checkpointing: tuple[bool, ...]  # one zorro measurement per setting; targets apply to the first
    speedup_target: float | None = None
    memory_target: float | None = None

    @property
    def name(self) -> str:
        return f"G={self.samples} P={self.prompt} R={self.response}"


GPU_CASES = [
    Case(8, 2048, 512, checkpointing=False, zorro_checkpointing=(False,), speedup_target=2.2, memory_target=0.5),
    Case(16, 8192, 1024, checkpointing=True, zorro_checkpointing=(True, False), speedup_target=4.0, memory_target=0.35),
]
TINY_CASES = [
    Case(4, 64, 16, checkpointing=False, zorro_checkpointing=(False,)),
    Case(8, 256, 32, checkpointing=True, zorro_checkpointing=(True, False)),
]


def grpo_batch(case: Case, vocab: int, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (case.prompt,), generator=gen)
    responses = torch.randint(0, vocab, (case.samples, case.response), generator=gen)
    input_ids = torch.cat([prompt.expand(case.samples, -1), responses], dim=1)
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    select[:, case.prompt - 1 : -1] = True  # positions whose next token is a response token
    targets = torch.roll(input_ids, -1, dims=1)[select]
    advantages = torch.randn(case.samples, generator=gen)[:, None].expand(-1, case.response).reshape(-1)
    return [t.to(device) for t in (input_ids, torch.ones_like(input_ids), select, targets, advantages)]


def grpo_like_loss(model, rows, targets, advantages, normalizer: int) -> torch.Tensor:
    """Clipped policy-gradient loss on the engine's log-probs of ``targets`` at the selected ``rows``."""
    logprobs, _, _ = selected_logprobs(lm_head(model), rows, targets)
    ratio = torch.exp(logprobs - logprobs.detach())
    return -torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages).sum() / normalizer


def step(model, forward, batch, micro_batches: int = 1) -> None:
    """One forward+backward, optionally as gradient accumulation over micro-batches of rows."""
    input_ids, attention_mask, select, targets, advantages = batch
    model.zero_grad(set_to_none=True)
    selected_per_row = select.sum(-1).tolist()
    first_target = 0
    for part in torch.arange(len(input_ids)).chunk(micro_batches):
        b0, b1 = int(part[0]), int(part[-1]) + 1
        n = sum(selected_per_row[b0:b1])
        rows = forward(model, input_ids[b0:b1], attention_mask[b0:b1], select[b0:b1])
        chunk = slice(first_target, first_target + n)
        grpo_like_loss(model, rows, targets[chunk], advantages[chunk], normalizer=len(targets)).backward()
        first_target += n


def flat_grads(model) -> torch.Tensor:
    """All parameter gradients as one fp32 vector, on the CPU so that it does not weigh on the next peak."""
    return torch.cat([p.grad.float().flatten().cpu() for p in model.parameters() if p.grad is not None])


def fp32_grads(model, batch) -> torch.Tensor:
    """The exact gradient both bf16 sides approximate: the plain path on an fp32 copy.

    Checkpointed and one row at a time, to fit: SDPA has no fused fp32 kernel for this mask,
    and its math path holds a row's whole attention matrix.
    """
    model.zero_grad(set_to_none=True)
    exact = copy.deepcopy(model).float()
    set_checkpointing(exact, True)
    step(exact, plain_selected_hidden_states, batch, micro_batches=len(batch[0]))
    grads = flat_grads(exact)
    del exact
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return grads


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, forward, batch, device, warmup: int, iters: int) -> tuple[float, float | None]:
    """Seconds per step and peak memory in GB (None off CUDA)."""
    release_layer_graphs(decoder_body(model))  # each measurement holds only the graphs it captures
    if device.type == "cuda":
        torch.cuda.empty_cache()  # and the released pools leave the device
    for _ in range(warmup):
        step(model, forward, batch)
    model.zero_grad(set_to_none=True)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(iters):
        step(model, forward, batch)
    synchronize(device)
    seconds = (time.perf_counter() - start) / iters
    peak = (torch.cuda.max_memory_allocated(device) + graph_pool_bytes()) / 1e9 if device.type == "cuda" else None
    return seconds, peak


def graph_pool_bytes() -> int:
    """Device memory held by CUDA graphs' private pools.

    A capture's activations are free blocks of its pool between replays, so the
    allocator's peak misses them; the benchmark adds every such segment to it.
    """
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) != (0, 0))


KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "flex", "triton_tem")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas", "splitk")),
)


def kernel_profile(model, forward, batch) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """CUDA kernel milliseconds of one step, by kind, and every kernel's (ms, name), longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(model, forward, batch)
        torch.cuda.synchronize()
    totals = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    kernels = []
    for event in prof.key_averages():
        if event.self_device_time_total <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")
        totals[kind] += event.self_device_time_total / 1e3
        kernels.append((event.self_device_time_total / 1e3, event.key))
    return totals, sorted(kernels, reverse=True)


def gpu_idle(model, forward, batch, min_gap_us: float = 50.0):
    """Where one step leaves the GPU idle.

    Returns the step's ms (from the host's first op to the GPU's last kernel), the ms
    without a kernel running, how many such gaps there were, and the gaps of at least
    ``min_gap_us`` as (ms, ms into the step, the outermost host ops that ran meanwhile:
    what the GPU was waiting for).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    # Two steps: the profiler's own start-up lands in the first, which is left out.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            with record_function("benchmark.step"):
                step(model, forward, batch)
            torch.cuda.synchronize()
    events = prof.events()
    start = max(e.time_range.start for e in events if e.name == "benchmark.step")
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.start >= start
    )
    # What the host ran at the outermost level inside the step (named by its record_function labels).
    host = [
        e
        for e in events
        if e.device_type == DeviceType.CPU
        and e.cpu_parent is not None
        and e.cpu_parent.name == "benchmark.step"
        and e.time_range.start >= start
    ]
    end = max(k[1] for k in kernels)
    gaps, busy_until = [], start
    for k0, k1 in kernels:
        if k0 > busy_until:
            gaps.append((busy_until, k0))
        busy_until = max(busy_until, k1)
    named = []
    for g0, g1 in gaps:
        if g1 - g0 >= min_gap_us:
            ops = [e.name for e in host if e.time_range.start < g1 and e.time_range.end > g0]
            names = ", ".join(dict.fromkeys(ops).keys())
            named.append(((g1 - g0) / 1e3, (g0 - start) / 1e3, names[:100]))
    idle = sum(g1 - g0 for g0, g1 in gaps) / 1e3
    return (end - start) / 1e3, idle, len(gaps), sorted(named, reverse=True)


def sync_sites(model, forward, batch) -> collections.Counter:
    """Where one step makes the host wait for the GPU (file:line -> count), from CUDA's sync debug mode.

    A wait in the middle of a step empties the queue the host has built up, so a
    step of many small kernels then runs at the host's pace.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(model, forward, batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)
    )


def set_checkpointing(model, on: bool) -> None:
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def run_case(
    model, case: Case, device, warmup: int, iters: int, profile: bool, kernel: str, top: int, graphs: bool
) -> None:
    def zorro(*args):
        return zorro_train.selected_hidden_states(*args, kernel=kernel, cuda_graphs=graphs)

    def plain(*args):
        return plain_selected_hidden_states(*args)

    def plain_graphed(*args):
        return plain_selected_hidden_states(*args, cuda_graphs=True)

    batch = grpo_batch(case, model.config.vocab_size, device)
    plan_start = time.perf_counter()
    stats = zorro_train.build_prefix_forest(*batch[:3]).stats
    plan_ms = (time.perf_counter() - plan_start) * 1e3
    print(
        f"\n== {case.name}: {stats.tokens_real} tokens in the batch, {stats.tokens_packed} packed "
        f"(token bound {stats.tokens_real / stats.tokens_packed:.2f}x), forest planning {plan_ms:.1f} ms"
    )

    set_checkpointing(model, case.checkpointing)
    attention = model.config._attn_implementation.removeprefix("zorro_")
    # The baseline is the faster plain path: eager, or (with --cuda-graphs, where they run) graphed.
    plain_sides = [(plain, f"plain, padded batch ({attention}), checkpointing {on_off(case.checkpointing)}")]
    if graphs and not case.checkpointing:
        plain_sides.append((plain_graphed, f"plain, padded batch ({attention}), CUDA graphs"))
    plain_s = plain_mem = None
    for forward, label in plain_sides:
        seconds, peak = measure(model, forward, batch, device, warmup + 2 * (forward is plain_graphed), iters)
        print(f"   {label:<58}: {seconds * 1e3:8.1f} ms  {memory(peak)}")
        if profile:
            print_profile(model, "plain", forward, batch, top)
        if plain_s is None or seconds < plain_s:
            plain_s, plain_mem = seconds, peak
    step(model, plain, batch)
    plain_grads = flat_grads(model)
    exact = fp32_grads(model, batch) if model.dtype != torch.float32 else None
    plain_error = rel_diff(plain_grads, exact) if exact is not None else None

    for i, checkpointing in enumerate(case.zorro_checkpointing):
        set_checkpointing(model, checkpointing)
        # One more warm-up: the first call compiles FlexAttention for this shape; two more for
        # graphs: a shape is captured the second time it is seen, and replayed from the third.
        zorro_s, zorro_mem = measure(model, zorro, batch, device, warmup + 1 + 2 * graphs, iters)
        step(model, zorro, batch)
        zorro_grads = flat_grads(model)
        diff = rel_diff(zorro_grads, plain_grads)
        used = kernel if kernel != "auto" else zorro_train.default_kernel(device, model.dtype)
        graphed = graphs and not checkpointing
        if used == "varlen" and split_taken(model, batch, graphed):
            used += ", cuDNN split" if device.type == "cuda" else ", split in torch"
        label = f"zorro, prefix forest ({used}), checkpointing {on_off(checkpointing)}"
        if graphed:
            label += ", CUDA graphs"
        print(f"   {label:<58}: {zorro_s * 1e3:8.1f} ms  {memory(zorro_mem)}")
        targets = i == 0
        line = f"      speedup {plain_s / zorro_s:.2f}x over the faster plain path" + (
            f" (target >= {case.speedup_target}x)" if targets and case.speedup_target else ""
        )
        if plain_mem is not None:
            line += f", memory {zorro_mem / plain_mem:.2f}x" + (
                f" (target <= {case.memory_target}x)" if targets and case.memory_target else ""
            )
        print(line)
        line = f"      gradient rel. diff vs plain: {diff:.2e}"
        if exact is not None:
            zorro_error = rel_diff(zorro_grads, exact)
            line += (
                f"; vs the fp32 gradient: zorro {zorro_error:.2e}, plain {plain_error:.2e} "
                f"(zorro/plain {zorro_error / plain_error:.2f})"
            )
        print(line)
        if profile:
            print_profile(model, "zorro", zorro, batch, top)
    model.zero_grad(set_to_none=True)


def split_taken(model, batch, graphed: bool) -> bool:
    """Whether ZoRRo's varlen kernel splits this batch's forest onto cuDNN (the rule depends on graphs)."""
    size = head_dim(model.config)
    attention = zorro_attention.ForestAttention(zorro_train.build_prefix_forest(*batch[:3]), "varlen", batch[0].device)
    if graphed:
        key, _ = attention.graph_inputs(model.dtype, size)
        return key[0] == "split"
    return attention.takes_split(batch[0].device, model.dtype, size)


def memory(gb: float | None) -> str:
    return f"peak {gb:6.2f} GB" if gb is not None else "peak n/a (CPU)"


def print_profile(model, side: str, forward, batch, top: int) -> None:
    totals, kernels = kernel_profile(model, forward, batch)
    parts = ", ".join(f"{k} {v:.1f}" for k, v in totals.items())
    print(f"      CUDA kernel ms in one {side} step: {parts}; total {sum(totals.values()):.1f}")
    for ms, name in kernels[:top]:
        print(f"        {ms:8.2f} ms  {name[:110]}")
    sites = sync_sites(model, forward, batch)
    waits = ", ".join(f"{site} x{n}" for site, n in sites.most_common()) or "none"
    print(f"      host waits for the GPU in one {side} step ({sum(sites.values())}): {waits}")
    span, idle, count, long_gaps = gpu_idle(model, forward, batch)
    print(
        f"      GPU idle in one {side} step: {idle:.1f} of {span:.1f} ms, in {count} gaps between kernels; "
        f"{len(long_gaps)} of them >= 50 us" + (", the longest:" if long_gaps else "")
    )
    for ms, at, ops in long_gaps[:4]:
        print(f"        {ms:6.2f} ms at {at:6.1f} ms, while the host ran: {ops}")


# What each --compile-* flag compiles in place on both sides (by class-name suffix), and its header note.
# ZoRRo's forest attention is never traced: a compiled decoder layer breaks its graph there.
COMPILED = {
    "compile_blocks": (("RMSNorm", "MLP"), "norms and MLPs compiled"),
    "compile_layers": (("DecoderLayer",), "decoder layers compiled"),
}


def compile_modules(model, suffixes: tuple[str, ...]) -> None:
    for module in model.modules():
        if type(module).__name__.endswith(suffixes):
            module.compile(dynamic=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2 in fp32 (runs on CPU in seconds)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel time breakdown (CUDA)")
    parser.add_argument("--kernel", default="auto", choices=("auto", "varlen", "flex", "dense"))
    parser.add_argument("--top-kernels", type=int, default=0, help="also list the N longest kernels of each step")
    parser.add_argument(
        "--compile-blocks", action="store_true",
        help="torch.compile each RMSNorm and MLP (both sides): fewer, fused element-wise kernels",
    )  # fmt: skip
    parser.add_argument(
        "--compile-layers", action="store_true",
        help="torch.compile each decoder layer (both sides); ZoRRo's attention call stays eager",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="replay the decoder layers as CUDA graphs on both sides (where they run: not under checkpointing)",
    )  # fmt: skip
    parser.add_argument(
        "--split", default="auto", choices=("auto", "on", "off"),
        help="varlen kernel: split the forest onto cuDNN by the engine's rule (auto), wherever cuDNN runs (on), never (off)",
    )  # fmt: skip
    parser.add_argument("--samples", type=int, nargs="*", help="run only the cases with these G (default: all)")
    args = parser.parse_args()

    if args.split != "auto":
        threshold = 0 if args.split == "on" else 1 << 62
        zorro_attention.SPLIT_MIN_PAIRS = zorro_attention.SPLIT_MIN_PAIRS_GRAPHED = threshold
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = Qwen2Config(**(TINY if args.tiny else QWEN2_0_5B))
    torch.manual_seed(0)
    with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.to(device).train()
    notes = []
    for flag, (suffixes, note) in COMPILED.items():
        if getattr(args, flag):
            compile_modules(model, suffixes)
            notes.append(note)
    name = "tiny Qwen2 (fp32)" if args.tiny else "Qwen2-0.5B shape, random weights (bf16)"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if args.cuda_graphs:
        notes.append("decoder layers as CUDA graphs where they run")
    print("; ".join([f"{name} on {where}", f"torch {torch.__version__}", *notes]))
    for case in TINY_CASES if args.tiny else GPU_CASES:
        if args.samples and case.samples not in args.samples:
            continue
        profile = device.type == "cuda" and not args.no_profile
        run_case(
            model,
            case,
            device,
            args.warmup,
            args.iters,
            profile=profile,
            kernel=args.kernel,
            top=args.top_kernels,
            graphs=args.cuda_graphs and device.type == "cuda",
        )


if __name__ == "__main__":
    main()
