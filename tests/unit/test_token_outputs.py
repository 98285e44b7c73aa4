"""``token_outputs``: logits taken a chunk of rows at a time, recomputed in backward, change nothing."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from arctic_rl_core.engines import token_outputs as module


def _model():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=97, attn_implementation="sdpa")  # fmt: skip
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("entropy", ["none", "metric", "grad"])
def test_chunked_head_gives_the_same_outputs_and_gradients(monkeypatch, entropy):
    model = _model()
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, 5:-1] = True

    def run():
        model.zero_grad()
        out = module.token_outputs(model, ids, mask, select, entropy=entropy, post=lambda x: x / 0.7)
        loss = out.logprobs.sum() + (out.entropy.sum() if entropy == "grad" else 0)
        loss.backward()
        return out, [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = run()
    # 7 rows of logits per chunk: 42 selected rows in 6 chunks, each recomputed in backward.
    monkeypatch.setattr(module, "LOGIT_CHUNK_BYTES", 7 * 97 * 4)
    chunked, chunked_grads = run()
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, rtol=1e-6, atol=1e-6)
    if entropy != "none":
        torch.testing.assert_close(chunked.entropy, whole.entropy, rtol=1e-6, atol=1e-6)
    # Per chunk, the head's weight gradient is a sum of matmuls instead of one: float32 rounding only.
    for a, b in zip(chunked_grads, whole_grads):
        assert (a - b).norm() <= 1e-5 * b.norm()


def test_top_k_survives_chunking(monkeypatch):
    model = _model()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(2))
    select = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        whole = module.token_outputs(model, ids, torch.ones_like(ids), select, top_k=3)
        monkeypatch.setattr(module, "LOGIT_CHUNK_BYTES", 5 * 97 * 4)
        chunked = module.token_outputs(model, ids, torch.ones_like(ids), select, top_k=3)
    assert torch.equal(chunked.top_ids, whole.top_ids)
    torch.testing.assert_close(chunked.top_logprobs, whole.top_logprobs)
