"""Two real DeepSpeed ZeRO-3 ranks (gloo, CPU) whose LM head runs in chunks of two rows.

The head's logits are taken a chunk of rows at a time, and under ZeRO-3 each chunk's head call
gathers the head's weight: in forward, again when backward recomputes the chunk, and for its
gradient. Ranks with different numbers of loss tokens would run different numbers of head calls
and wait on each other's gathers forever; they must agree on one count and still give the
numbers of the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.deepspeed_ranks import run_ranks

pytestmark = pytest.mark.slow

DEADLINE_S = 150
ROWS, WIDTH = 5, 6
CHUNK_ROWS = 2


def _batch() -> torch.Tensor:
    return torch.randint(5, 200, (ROWS, WIDTH), generator=torch.Generator().manual_seed(0))


def _loss_mask() -> torch.Tensor:
    """Rows 0-2 (rank 0) train on all 5 next tokens, 8 chunks; rows 3-4 (rank 1) on one each, 1 chunk."""
    mask = torch.zeros(ROWS, WIDTH)
    mask[:3, :-1] = 1
    mask[3:, 2] = 1
    return mask


def test_agreed_chunks_past_a_ranks_rows_run_the_head_in_forward_and_backward_and_change_nothing(
    monkeypatch, tiny_model
):
    from transformers import AutoModelForCausalLM

    from arctic_rl_core.engines import token_outputs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    monkeypatch.setattr(token_outputs, "LOGIT_CHUNK_BYTES", CHUNK_ROWS * model.config.vocab_size * 4)
    calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: calls.append(None))
    ids, mask = _batch(), _loss_mask()

    def run(agree_chunks):
        model.zero_grad()
        calls.clear()
        out = token_outputs.token_outputs(model, ids, torch.ones_like(ids), mask > 0, agree_chunks=agree_chunks)
        out.logprobs.sum().backward()
        return out.logprobs, [p.grad.clone() for p in model.parameters()]

    own, own_grads = run(None)
    assert len(calls) == 2 * 9  # 17 rows in 9 chunks, each recomputed in backward
    agreed, agreed_grads = run(lambda chunks: chunks + 3)
    assert len(calls) == 2 * 12
    assert torch.equal(agreed, own)
    assert all(torch.equal(a, b) for a, b in zip(agreed_grads, own_grads))


def _rank(rank: int, port: int, model: str, results) -> None:
    from arctic_rl_core.config import TrainingConfig
    from arctic_rl_core.engines import token_outputs
    from arctic_rl_core.engines.batching import RowBatch
    from arctic_rl_core.engines.training.worker import DeepSpeedWorker, LossCall, WorkerSpec

    try:
        training = TrainingConfig(dtype="float32")
        stage3 = {"zero_optimization": {"stage": 3}}
        worker = DeepSpeedWorker(rank, 2, WorkerSpec(model, "cpu", True, training, stage3, threads=1))
        worker.setup("127.0.0.1", port)
        token_outputs.LOGIT_CHUNK_BYTES = CHUNK_ROWS * worker.model.config.vocab_size * 4  # float32 logits
        ids, loss_mask = _batch(), _loss_mask()
        mine = slice(0, 3) if rank == 0 else slice(3, ROWS)

        # Before any step, so the log-probs are the saved model's. 15 scored positions against 5.
        rows = ids[:3] if rank == 0 else ids[3:4]
        no_grad = worker.fwd_no_grad(RowBatch(rows, torch.ones_like(rows)), [], True)
        results.put((rank, "fwd_no_grad", no_grad["log_probs_shifted"].tolist()))
        # Rank 1 has no rows: its dummy pass meets rank 0's 8 chunks.
        rows = ids[:3] if rank == 0 else ids[:0]
        scored = worker.token_log_probs(RowBatch(rows, torch.ones_like(rows)), top_k=2)
        results.put((rank, "token_log_probs", scored["log_probs_shifted"].tolist()))

        call = LossCall("sft", {}, [], global_tokens=float(loss_mask.sum()), global_seqs=ROWS, horizon=WIDTH)
        batch = RowBatch(ids[mine], torch.ones_like(ids[mine]), loss_mask[mine], {})
        results.put((rank, "fwd_bwd", worker.fwd_bwd(batch, call)["micro_batches"]))
        results.put((rank, "step", worker.step()))
        # Rank 1 has no rows: a dummy backward against rank 0's 8 recomputed chunks.
        batch = batch if rank == 0 else batch.select(0, 0)
        results.put((rank, "fwd_bwd without rows", worker.fwd_bwd(batch, call)["micro_batches"]))
        results.put((rank, "second step", worker.step()["micro_batches"]))
    except Exception as exc:  # reported, so the test fails with the cause rather than a timeout
        results.put((rank, "error", repr(exc)))


@pytest.fixture(scope="module")
def outcomes(tiny_model) -> dict:
    return run_ranks(_rank, (tiny_model,), reports=12, deadline_s=DEADLINE_S)


def _reference(model_path: str) -> tuple[torch.Tensor, float]:
    """Shifted log-probs [ROWS, WIDTH] of the whole batch, and the gradient norm of its SFT loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids, mask = _batch(), _loss_mask()
    logprobs = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-(logprobs * mask[:, :-1]).sum() / mask.sum()).backward()
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
    return torch.nn.functional.pad(logprobs.detach(), (0, 1)), norm


def test_zero3_fwd_bwd_with_uneven_loss_tokens_finishes_with_the_whole_batch_gradient(outcomes, tiny_model):
    assert outcomes.get((0, "fwd_bwd")) == 1 and outcomes.get((1, "fwd_bwd")) == 1, outcomes
    _, grad_norm = _reference(tiny_model)
    assert outcomes[(0, "step")]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def test_zero3_fwd_bwd_of_a_rank_without_rows_meets_the_chunked_head_of_the_other(outcomes):
    assert outcomes.get((0, "fwd_bwd without rows")) == 1 and outcomes.get((1, "fwd_bwd without rows")) == 0, outcomes
    assert outcomes[(0, "second step")] == 1 and outcomes[(1, "second step")] == 0


def test_zero3_fwd_no_grad_with_uneven_rows_gives_the_whole_batch_log_probs(outcomes, tiny_model):
    assert (0, "fwd_no_grad") in outcomes and (1, "fwd_no_grad") in outcomes, outcomes
    expected, _ = _reference(tiny_model)
    got = torch.tensor(outcomes[(0, "fwd_no_grad")] + outcomes[(1, "fwd_no_grad")])
    torch.testing.assert_close(got, expected[:4], rtol=1e-5, atol=1e-5)


def test_zero3_token_log_probs_of_a_rank_without_rows_meets_the_chunked_head_of_the_other(outcomes, tiny_model):
    assert (0, "token_log_probs") in outcomes and outcomes.get((1, "token_log_probs")) == [], outcomes
    expected, _ = _reference(tiny_model)
    torch.testing.assert_close(torch.tensor(outcomes[(0, "token_log_probs")]), expected[:3], rtol=1e-5, atol=1e-5)
