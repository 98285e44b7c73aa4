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


@pytest.mark.parametrize("zorro", [False, True], ids=["plain", "zorro"])
def test_cuda_graphs_off_cuda_leave_the_forward_eager_and_say_so(caplog, zorro):
    from arctic_rl_core.config import ZorroTrainConfig

    model = _model()
    prompt = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(2)).expand(3, -1)
    ids = torch.cat([prompt, torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(3))], 1)
    mask = torch.ones_like(ids)
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, 23:-1] = True
    config = ZorroTrainConfig(enable=zorro)

    with caplog.at_level("INFO", logger="arctic_rl_core.models.layer_graphs"):
        graphed = module.token_outputs(model, ids, mask, select, zorro=config, cuda_graphs=True)
    eager = module.token_outputs(model, ids, mask, select, zorro=config)
    torch.testing.assert_close(graphed.logprobs, eager.logprobs, rtol=0, atol=0)
    assert graphed.metrics["cuda_graphs/replayed"] == (0.0, 1.0)
    assert "cuda_graphs/replayed" not in eager.metrics
    assert "CUDA graphs of the decoder layers are off: the model is not on CUDA" in caplog.text


SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)  # fmt: skip
# Each family's final-logit transform, set far enough from neutral that leaving it out shows.
FINAL_LOGIT_TRANSFORMS = {
    "Gemma2Config": dict(final_logit_softcapping=0.5),
    "Gemma3TextConfig": dict(final_logit_softcapping=0.5),
    "CohereConfig": dict(logit_scale=4.0),
    "GraniteConfig": dict(logits_scaling=0.125),
    "FalconH1Config": dict(lm_head_multiplier=3.0, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                           mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8),
}  # fmt: skip


@pytest.mark.parametrize("family", list(FINAL_LOGIT_TRANSFORMS))
def test_log_probs_equal_the_hf_forward_for_models_that_scale_or_soft_cap_their_logits(family):
    """Gemma's soft cap and Cohere/Granite/Falcon-H1's scales live in the causal LM's forward, not its head."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, family)(**SMALL, **FINAL_LOGIT_TRANSFORMS[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    select = torch.zeros_like(ids, dtype=torch.bool)
    select[:, :-1] = True
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, :-1]
        expected = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        got = module.token_outputs(model, ids, torch.ones_like(ids), select).logprobs[:, :-1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
