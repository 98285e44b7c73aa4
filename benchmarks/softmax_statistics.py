"""Log-probs (and entropy) of logits rows, forward + backward: the torch path vs the fused Triton kernels.

    python benchmarks/softmax_statistics.py            # N=16384 rows, V=151936 (Qwen2), bf16
    python benchmarks/softmax_statistics.py --sweep    # also the kernels' tile width and warps

Both paths run in the same process on the same logits through
``arctic_rl_core.processors.post``. GB/s counts the least traffic the work
needs (forward: read the logits; backward: read them and write their
gradient), so a path that makes more passes shows a lower figure.
"""

from __future__ import annotations

import argparse

import torch

from arctic_rl_core.processors import post
from arctic_rl_core.processors.softmax_kernels import softmax_statistics, softmax_statistics_backward


def cuda_ms(fn, iters: int) -> float:
    """Mean milliseconds of ``fn()`` after one warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def compare_paths(logits, labels, iters: int) -> None:
    rows, vocab = logits.shape
    size = logits.numel() * logits.element_size()
    chunk_rows = post._rows_per_chunk(vocab, None)
    weights = torch.randn(rows, device=logits.device)
    for want_entropy in (False, True):
        what = "log-probs + entropy" if want_entropy else "log-probs"
        for fused in (False, True):

            def forward(fused=fused, want_entropy=want_entropy):
                return post._SoftmaxStatistics.apply(logits, labels, want_entropy, chunk_rows, fused)

            def forward_backward(forward=forward):
                logprobs, entropy = forward()
                loss = (logprobs * weights).sum() + (entropy * weights).sum()
                return torch.autograd.grad(loss, logits)

            fwd = cuda_ms(forward, iters)
            both = cuda_ms(forward_backward, iters)
            name = "triton" if fused else "torch "
            print(
                f"  {what:<20} {name}: fwd {fwd:7.2f} ms ({gbps(size, fwd):6.0f} GB/s)  "
                f"bwd {both - fwd:7.2f} ms ({gbps(2 * size, both - fwd):6.0f} GB/s)  "
                f"fwd+bwd {both:7.2f} ms ({gbps(3 * size, both):6.0f} GB/s)"
            )


def sweep(logits, labels, iters: int) -> None:
    size = logits.numel() * logits.element_size()
    ones = torch.ones(logits.shape[0], device=logits.device)
    print("  kernel tiles (log-probs + entropy):")
    for block_v, num_warps in ((2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        tiles = dict(block_v=block_v, num_warps=num_warps)
        logsumexp, _, entropy = softmax_statistics(logits, labels, True, **tiles)
        fwd = cuda_ms(lambda: softmax_statistics(logits, labels, True, **tiles), iters)
        bwd = cuda_ms(
            lambda: softmax_statistics_backward(logits, labels, logsumexp, entropy, ones, ones, **tiles), iters
        )
        print(
            f"    block_v {block_v:5d} warps {num_warps:2d}: fwd {fwd:6.2f} ms ({gbps(size, fwd):5.0f} GB/s)  "
            f"bwd {bwd:6.2f} ms ({gbps(2 * size, bwd):5.0f} GB/s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' tile widths and warps")
    args = parser.parse_args()

    torch.manual_seed(0)
    logits = torch.randn(args.rows, args.vocab, device="cuda", dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    gb = logits.numel() * logits.element_size() / 1e9
    print(f"N={args.rows} V={args.vocab} bf16 ({gb:.2f} GB of logits) on {torch.cuda.get_device_name()}")
    compare_paths(logits, labels, args.iters)
    if args.sweep:
        sweep(logits.detach(), labels, args.iters)


if __name__ == "__main__":
    main()
