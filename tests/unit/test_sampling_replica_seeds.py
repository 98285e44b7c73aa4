"""Sampling replicas of one job draw different noise for unseeded requests, and the same for seeded ones."""

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.engines.sampling.worker import SamplingWorker


def test_replicas_sample_different_unseeded_completions_for_the_same_prompts(tiny_model):
    options = SamplingEngineOptions(max_model_len=64, max_num_seqs=8, seed=42)
    workers = [SamplingWorker(replica, tiny_model, "native", options) for replica in (0, 1)]
    try:
        prompts = [[5, 6, 7], [8, 9, 10]]
        unseeded = SamplingParams(n=2, max_tokens=8, temperature=1.0, ignore_eos=True)
        first, second = (w.generate(None, prompts, unseeded) for w in workers)
        assert [r["outputs"] for r in first] != [r["outputs"] for r in second]
        seeded = unseeded.model_copy(update={"seed": 3})
        first, second = (w.generate(None, prompts, seeded) for w in workers)
        assert [[o["token_ids"] for o in r["outputs"]] for r in first] == [
            [o["token_ids"] for o in r["outputs"]] for r in second
        ]
    finally:
        for worker in workers:
            worker.shutdown()
