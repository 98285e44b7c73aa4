"""Many-to-many copies in one launch: exact for every size and alignment, and replayed by the native loader."""

import pytest
import torch

from arctic_rl_core.engines.sampling.native.model import CausalLM, ModelSpec
from arctic_rl_core.engines.sampling.native.weights import WeightLoader
from arctic_rl_core.weight_sync.batched_copy import CHUNK_WORDS, BatchedCopy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _pairs(seed: int):
    """Sources as views of one flat buffer (as a ZeRO buffer or an IPC bucket is), destinations separate."""
    sizes = [896 * 896, 128, 7, 8, 4 * CHUNK_WORDS * 4 + 8, 3, 151936 * 8, 1]
    flat = torch.randn(sum(sizes) + 1, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    flat = flat.to(torch.bfloat16)
    sources, offset = [], 1  # start one element in: some views are not 16-byte aligned
    for n in sizes:
        sources.append(flat[offset : offset + n])
        offset += n
    dests = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    # Different dtypes and a strided destination take the fallback path in the same call.
    sources.append(torch.randn(64, 32, device="cuda"))
    dests.append(torch.zeros(32, 64, dtype=torch.bfloat16, device="cuda").t())
    return dests, sources


def test_every_pair_is_copied_exactly_and_the_plan_replays():
    dests, sources = _pairs(0)
    copy = BatchedCopy(dests, sources)
    assert copy.chunks is not None and len(copy.rest) >= 2  # some pairs fast, some not
    for _ in range(2):  # the second time with new values at the same addresses
        copy(dests, sources)
        torch.cuda.synchronize()
        for d, s in zip(dests, sources):
            assert torch.equal(d, s.to(d.dtype))
        for s in sources:
            s.mul_(-2)


def test_loader_replays_a_repeat_load_and_replans_for_new_tensors():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)  # fmt: skip
    model = CausalLM(ModelSpec.from_hf_config(config), config, 16, torch.bfloat16, "cuda")
    hf = dict(AutoModelForCausalLM.from_config(config).named_parameters())
    loader = WeightLoader(model)

    def weights(seed):
        g = torch.Generator("cuda").manual_seed(seed)
        return [(n, torch.randn(p.shape, device="cuda", generator=g).to(torch.bfloat16)) for n, p in hf.items()]

    def check(loaded):
        torch.cuda.synchronize()
        for name, tensor in loaded:
            dest, _ = loader._destination(name)
            assert torch.equal(dest, tensor), name

    first = weights(0)
    assert loader.load(first, batched=True) == len(first)
    check(first)
    assert not loader.missing()
    (replay,) = loader._replays.values()
    for _, tensor in first:
        tensor.mul_(-1)
    loader.load(first, batched=True)  # same tensors: the recorded launch
    assert loader._replays[tuple(n for n, _ in first)] is replay
    check(first)
    second = weights(1)  # new tensors under the same names: planned again
    loader.load(second, batched=True)
    assert loader._replays[tuple(n for n, _ in second)] is not replay
    check(second)
