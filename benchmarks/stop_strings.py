"""Host time a decode step spends on stop strings: the native engine's incremental text vs decoding it all.

    python benchmarks/stop_strings.py [--batch 64] [--lengths 128,512,2048]

Completions with stop strings need their text at every token. Decoding the
whole completion each time (the baseline, measured in the same run) costs
O(length) per token; the engine's ``IncrementalDetokenizer`` decodes two
short windows. Both take the same token streams (real text, tokenized by the
tiny model's byte-level BPE tokenizer) and must produce the same text; the
figures are host time per decode step for ``--batch`` completions.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

from arctic_rl_core.engines.sampling.native.detokenizer import IncrementalDetokenizer, decode
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def corpus() -> str:
    """Answers from GSM8K's train split where it is beside the repository, else a fixed paragraph."""
    files = sorted(GSM8K.glob("*train*"))
    if files:
        return files[0].read_text(errors="replace")[:400_000]
    return "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 2000


def per_step_ms(streams: list[list[int]], length: int, step) -> float:
    """Mean host milliseconds of one decode step: ``step(i, tokens)`` for every completion, tokens 1..length."""
    start = time.perf_counter()
    for n in range(1, length + 1):
        for i, stream in enumerate(streams):
            step(i, stream[:n])
    return (time.perf_counter() - start) / length * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", default="128,512,2048")
    args = parser.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", TinySpec(family="qwen2"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    text_ids = tokenizer(corpus(), add_special_tokens=False)["input_ids"]
    print(f"{args.batch} completions, tokenizer vocabulary {len(tokenizer)}; host ms per decode step")
    for length in (int(x) for x in args.lengths.split(",")):
        streams = [text_ids[i * 997 : i * 997 + length] for i in range(args.batch)]
        full_texts: dict[int, str] = {}
        detokenizers = [IncrementalDetokenizer(0) for _ in streams]

        def whole(i, tokens):
            full_texts[i] = decode(tokenizer, tokens)

        def incremental(i, tokens):
            detokenizers[i].extend(tokenizer, tokens)

        baseline = per_step_ms(streams, length, whole)
        ours = per_step_ms(streams, length, incremental)
        assert all(d.text == full_texts[i] for i, d in enumerate(detokenizers)), "the two texts differ"
        print(f"  {length:5d} tokens: whole-text decode {baseline:8.2f} ms, incremental {ours:6.2f} ms, "
              f"{baseline / ours:6.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
