"""vLLM vs the native engine: generated tokens per second on the same prompts, in one run.

Both backends get the same tiny model, the same prompts (random token ids,
fixed by a seed) and the same sampling parameters (n completions each,
``max_tokens`` new tokens, EOS ignored so every completion has the same
length). Each is warmed up once, its prefix cache reset before every timed
call, and the best of ``--repeats`` calls is kept. The native engine runs
first: vLLM's in-process CPU worker binds the process's OpenMP threads.

    python benchmarks/sampling_vllm_cpu.py                 # CPU, tiny Qwen2
    python benchmarks/sampling_vllm_cpu.py --device cuda   # needs a CUDA vLLM build

``generate_throughput(backend, prompts, params)`` times any backend of the
sampling protocol; ``benchmarks/sampling.py`` may call it for its own cases.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass

import torch

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model


@dataclass
class Throughput:
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def generate_throughput(
    backend, prompt_token_ids: list[list[int]], params: SamplingParams, repeats: int = 3
) -> Throughput:
    """Best of ``repeats`` timed ``generate`` calls after one warm-up, each from an empty prefix cache."""
    backend.generate(prompt_token_ids, params)
    best: Throughput | None = None
    for _ in range(repeats):
        backend.reset_prefix_cache()
        start = time.perf_counter()
        results = backend.generate(prompt_token_ids, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for completions in results for c in completions)
        if best is None or tokens / seconds > best.tokens_per_second:
            best = Throughput(tokens, seconds)
    return best


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids below 3 are the tiny tokenizer's special tokens.
    return torch.randint(3, vocab_size, (count, length), generator=gen).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    from arctic_rl_core.engines.sampling.native import NativeEngine
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    spec = TinySpec(family="qwen2", num_layers=args.layers)
    model_path = str(build_tiny_model(tempfile.mkdtemp(prefix="tiny-qwen2-"), spec))
    prompts = random_prompts(args.prompts, args.prompt_len, spec.vocab_size, seed=0)
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    common = dict(device=args.device, dtype="float32", max_model_len=args.prompt_len + args.max_tokens + 16)
    engines = {
        "native": (NativeEngine, SamplingEngineOptions(**common)),
        # vLLM's CPU attention wants KV blocks of 32 tokens.
        "vllm": (VLLMBackend, SamplingEngineOptions(**common, block_size=32 if args.device == "cpu" else 16)),
    }

    print(
        f"{args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, {args.max_tokens} new tokens each; "
        f"tiny qwen2 ({args.layers} layers) on {args.device}, torch {torch.__version__}"
    )
    measured = {}
    for name, (engine_class, options) in engines.items():
        backend = engine_class(model_path, options)
        measured[name] = generate_throughput(backend, prompts, params, args.repeats)
        backend.shutdown()
        result = measured[name]
        print(f"  {name:<7}: {result.tokens_per_second:9.1f} tok/s  ({result.tokens} tokens in {result.seconds:.3f} s)")
    ratio = measured["vllm"].tokens_per_second / measured["native"].tokens_per_second
    print(f"  vllm / native: {ratio:.2f}x")


if __name__ == "__main__":
    main()
