"""PROTOTYPE: stock PyTorch SDPA decode over per-request KV in every layout and backend that runs, per fca.py case.

    (device, repo root) source .whl/setup.sh && python3 ab/sdpa/layouts.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from fca import graph_us  # noqa: E402

HEADS, KV_HEADS, DIM = 14, 2, 64
GROUP = HEADS // KV_HEADS
SCALE = DIM**-0.5
LAYERS = 16


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, label in ((64, "4x16"), (16, "1x16")):
        length = 8192 + 256
        kv = [tuple(torch.randn(n, KV_HEADS, length, DIM, generator=gen, device="cuda").to(torch.bfloat16)
                    for _ in range(2)) for _ in range(LAYERS)]
        q = torch.randn(n, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
        ref = None
        kv_bytes = n * length * KV_HEADS * DIM * 2 * 2
        layouts = {
            # a group's query heads as rows of one KV head (fca.py's choice)
            "rows": lambda layer: F.scaled_dot_product_attention(q.view(n, KV_HEADS, GROUP, DIM), *kv[layer],
                                                                 scale=SCALE).reshape(n, HEADS, DIM),
            # one query token per head, grouped-query attention in the kernel
            "gqa": lambda layer: F.scaled_dot_product_attention(q.view(n, HEADS, 1, DIM), *kv[layer], scale=SCALE,
                                                                enable_gqa=True).reshape(n, HEADS, DIM),
        }
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            for name, fn in layouts.items():
                out = {}

                def run(layer, fn=fn, backend=backend, out=out):
                    with sdpa_kernel(backend):
                        out["o"] = fn(layer)

                try:
                    us = graph_us(run)
                except Exception as e:  # a layout the backend refuses
                    print(f"  {label} {backend.name:20s} {name:5s}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                o = out["o"].float()
                if ref is None:
                    ref = o
                print(f"  {label} {backend.name:20s} {name:5s}: {us:7.1f} us  {kv_bytes / us / 1e6:5.2f} TB/s of "
                      f"its KV bytes  max|diff| vs the first {(o - ref).abs().max().item():.1e}", flush=True)
        del kv
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
