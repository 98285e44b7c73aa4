"""Two real DeepSpeed ranks (gloo, CPU) whose shards differ: one has fewer rows or micro-batches than the other.

ZeRO-3 gathers parameters in every forward, and those gathers are collectives: a rank that
runs fewer passes than another leaves it waiting forever. Each scenario must finish, and a
fwd_bwd split into micro-batches (unevenly, too) must produce the gradient of the whole batch:
ZeRO-3 adds up the micro-batches' gradients only when told that each backward is over.
"""

from __future__ import annotations

import pytest
import torch

from tests.deepspeed_ranks import run_ranks

pytestmark = pytest.mark.slow

DEADLINE_S = 150
ROWS, WIDTH = 5, 6


def _batch() -> torch.Tensor:
    return torch.randint(5, 200, (ROWS, WIDTH), generator=torch.Generator().manual_seed(0))


def _rank(rank: int, port: int, model: str, results) -> None:
    from arctic_rl_core.config import MicroBatchSpec, TrainingConfig
    from arctic_rl_core.engines.batching import RowBatch
    from arctic_rl_core.engines.training.worker import DeepSpeedWorker, LossCall, WorkerSpec

    try:
        # 8 tokens per micro-batch: one row of 6 each, so rank 0 (4 rows) runs 4 passes and rank 1 (1 row) one.
        training = TrainingConfig(dtype="float32", mb_spec={"max_tokens_per_mb": 8})
        stage3 = {"zero_optimization": {"stage": 3}}
        worker = DeepSpeedWorker(rank, 2, WorkerSpec(model, "cpu", True, training, stage3, threads=1))
        worker.setup("127.0.0.1", port)
        ids = _batch()
        mine = ids[:4] if rank == 0 else ids[4:]
        mask = torch.ones_like(mine)
        loss_mask = torch.zeros(len(mine), WIDTH)
        loss_mask[:, :-1] = 1
        # Forward-only in micro-batches too (before any step): rank 0 runs 4 passes, rank 1 one and 3 joins.
        shapes, forward = [], worker._outputs
        worker._outputs = lambda part, *args, **kwargs: (shapes.append(list(part.input_ids.shape)), forward(part, *args, **kwargs))[1]  # fmt: skip
        uneven = worker.fwd_no_grad(RowBatch(mine, mask), [], True)
        results.put((rank, "fwd_no_grad micro-batched", (list(shapes), uneven["log_probs_shifted"])))
        # A row bound instead of the token budget: rank 0 runs 2 passes of 2 rows, rank 1 one pass and a join.
        rows = MicroBatchSpec(max_rows_per_mb=1, max_rows_per_forward_mb=2)
        budget, worker.spec.training.mb_spec = worker.spec.training.mb_spec, rows
        shapes.clear()
        by_rows = worker.fwd_no_grad(RowBatch(mine, mask), [], True)
        results.put((rank, "fwd_no_grad by rows", (list(shapes), by_rows["log_probs_shifted"])))
        # A forward token budget of 18 (3 rows of 6): rank 0 runs passes of 3 and 1 rows, rank 1 one pass and a
        # join. It stays in place for fwd_bwd, which keeps the training budget of 8.
        worker.spec.training.mb_spec = budget.model_copy(update={"max_tokens_per_forward_mb": 18})
        shapes.clear()
        by_forward_budget = worker.fwd_no_grad(RowBatch(mine, mask), [], True)
        results.put((rank, "fwd_no_grad by forward budget", (list(shapes), by_forward_budget["log_probs_shifted"])))
        worker._outputs = forward
        call = LossCall("sft", {}, [], global_tokens=ROWS * (WIDTH - 1), global_seqs=ROWS, horizon=WIDTH)
        trained = worker.fwd_bwd(RowBatch(mine, mask, loss_mask, {}), call)
        results.put((rank, "fwd_bwd", trained["micro_batches"]))
        results.put((rank, "step", worker.step()))
        # Fewer sequences than ranks: rank 1 gets none.
        only = ids[:1] if rank == 0 else ids[:0]
        no_grad = worker.fwd_no_grad(RowBatch(only, torch.ones_like(only)), [], True)
        results.put((rank, "fwd_no_grad", list(no_grad["log_probs_shifted"].shape)))
        scored = worker.token_log_probs(RowBatch(only, torch.ones_like(only)), top_k=2)
        results.put((rank, "token_log_probs", {k: list(v.shape) for k, v in scored.items()}))
    except Exception as exc:  # reported, so the test fails with the cause rather than a timeout
        results.put((rank, "error", repr(exc)))


@pytest.fixture(scope="module")
def outcomes(tiny_model) -> dict:
    return run_ranks(_rank, (tiny_model,), reports=14, deadline_s=DEADLINE_S)


def _reference_grad_norm(model_path: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = _batch()
    logprobs = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-logprobs.sum() / (ROWS * (WIDTH - 1))).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


def test_zero3_fwd_bwd_with_uneven_micro_batches_finishes_with_the_whole_batch_gradient(outcomes, tiny_model):
    # The training budget of 8 tokens, one row per micro-batch, though the forward budget is 18.
    assert outcomes.get((0, "fwd_bwd")) == 4 and outcomes.get((1, "fwd_bwd")) == 1, outcomes
    grad_norm = outcomes[(0, "step")]["grad_norm"]
    assert grad_norm == pytest.approx(_reference_grad_norm(tiny_model), rel=1e-4)
    assert outcomes[(0, "step")]["micro_batches"] + outcomes[(1, "step")]["micro_batches"] == 5


def test_zero3_fwd_no_grad_in_uneven_micro_batches_finishes_with_the_whole_batch_log_probs(outcomes, tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = _batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (shapes0, got0), (shapes1, got1) = (outcomes[(r, "fwd_no_grad micro-batched")] for r in (0, 1))
    assert shapes0 == [[1, WIDTH]] * 4 and shapes1 == [[1, WIDTH]]  # the 8-token budget: one row per pass
    got = torch.cat([got0, got1])
    torch.testing.assert_close(got[:, :-1], expected, rtol=1e-5, atol=1e-5)
    assert (got[:, -1] == 0).all()
    (rows0, by_rows0), (rows1, by_rows1) = (outcomes[(r, "fwd_no_grad by rows")] for r in (0, 1))
    assert rows0 == [[2, WIDTH]] * 2 and rows1 == [[1, WIDTH]]  # max_rows_per_forward_mb=2
    torch.testing.assert_close(torch.cat([by_rows0, by_rows1]), got, rtol=0, atol=1e-6)
    (passes0, by_budget0), (passes1, by_budget1) = (outcomes[(r, "fwd_no_grad by forward budget")] for r in (0, 1))
    assert passes0 == [[3, WIDTH], [1, WIDTH]] and passes1 == [[1, WIDTH]]  # max_tokens_per_forward_mb=18
    torch.testing.assert_close(torch.cat([by_budget0, by_budget1]), got, rtol=0, atol=1e-6)


def test_zero3_fwd_no_grad_with_fewer_rows_than_ranks_finishes(outcomes):
    assert outcomes.get((0, "fwd_no_grad")) == [1, WIDTH] and outcomes.get((1, "fwd_no_grad")) == [0, WIDTH], outcomes


def test_token_log_probs_of_a_rank_without_rows_are_empty(outcomes):
    expected = {"log_probs_shifted": [0, WIDTH], "top_ids": [0, WIDTH, 2], "top_log_probs": [0, WIDTH, 2]}
    assert outcomes.get((1, "token_log_probs")) == expected, outcomes
    assert outcomes[(0, "token_log_probs")]["top_ids"] == [1, WIDTH, 2]
