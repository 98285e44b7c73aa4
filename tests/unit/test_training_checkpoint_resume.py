"""A resumed run continues as the uninterrupted one would, and a checkpoint path that would not resume is refused.

One real DeepSpeed rank (gloo, CPU) in a spawned process runs every scenario in turn.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.deepspeed_ranks import run_ranks

pytestmark = pytest.mark.slow

ROWS, WIDTH = 4, 12


def _rank(rank: int, port: int, model: str, dropout_model: str, scratch: str, results) -> None:
    from arctic_rl_core.config import TrainingConfig
    from arctic_rl_core.engines.batching import RowBatch
    from arctic_rl_core.engines.training.worker import DeepSpeedWorker, LossCall, WorkerSpec

    def worker(path: str, dtype: str = "float32", checkpoint: str | None = None, **optimizer) -> DeepSpeedWorker:
        training = TrainingConfig(dtype=dtype, optimizer={"lr": 1e-2, **optimizer})
        spec = WorkerSpec(path, "cpu", True, training, {"zero_optimization": {"stage": 0}},
                          checkpoint_path=checkpoint, threads=1)  # fmt: skip
        engine = DeepSpeedWorker(rank, 1, spec)
        engine.setup("127.0.0.1", port)
        return engine

    def train(engine: DeepSpeedWorker, seed: int) -> float:
        ids = torch.randint(5, 200, (ROWS, WIDTH), generator=torch.Generator().manual_seed(seed))
        loss_mask = torch.zeros(ROWS, WIDTH)
        loss_mask[:, 3:-1] = 1
        call = LossCall("sft", {}, [], float(loss_mask.sum()), float(ROWS), WIDTH)
        engine.fwd_bwd(RowBatch(ids, torch.ones_like(ids), loss_mask, {}), call)
        return engine.step()["grad_norm"]

    try:
        # bf16 at ZeRO-0: DeepSpeed's wrapper steps AdamW once with zero gradients when it is built.
        engine = worker(model, "bfloat16", weight_decay=0.1)
        wrapper = engine.engine.optimizer
        masters = [m for group in wrapper.fp32_groups for m in group]
        lows = [p for group in wrapper.fp16_groups for p in group]
        exact = all(torch.equal(m, p.float()) for m, p in zip(masters, lows))
        results.put((rank, "bf16 state after setup", (len(wrapper.optimizer.state), exact)))
        train(engine, 0)
        steps = {int(state["step"]) for state in wrapper.optimizer.state.values()}
        results.put((rank, "bf16 adam steps after one step", sorted(steps)))
        del engine

        # Dropout draws from the RNG: a resume must restore it to continue bit for bit.
        straight = worker(dropout_model, name="sgd")
        uninterrupted = [train(straight, seed) for seed in range(4)]
        del straight
        first = worker(dropout_model, name="sgd")
        for seed in range(2):
            train(first, seed)
        saved = first.save_checkpoint(str(Path(scratch) / "run"))
        del first
        resumed = worker(dropout_model, checkpoint=str(Path(scratch) / "run"), name="sgd")
        results.put((rank, "dropout grad norms", (uninterrupted[2:], [train(resumed, seed) for seed in (2, 3)])))
        del resumed

        refusals = []
        empty = Path(scratch) / "no-latest"
        shutil.copytree(saved["path"], empty / "global_step2")
        for wrong in (saved["path"], str(empty)):
            try:
                worker(dropout_model, checkpoint=wrong, name="sgd")
                refusals.append(None)
            except ValueError as exc:
                refusals.append(str(exc))
        results.put((rank, "refusals", (saved["path"], refusals)))
        fresh = worker(dropout_model, checkpoint=str(Path(scratch) / "new"), name="sgd")
        results.put((rank, "new path starts fresh", int(fresh.engine.global_steps)))
    except Exception as exc:  # reported, so the test fails with the cause rather than a timeout
        results.put((rank, "error", repr(exc)))


@pytest.fixture(scope="module")
def outcomes(tiny_model, tmp_path_factory) -> dict:
    dropout_model = tmp_path_factory.mktemp("dropout") / "model"
    shutil.copytree(tiny_model, dropout_model)
    config = json.loads((dropout_model / "config.json").read_text())
    (dropout_model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    scratch = tmp_path_factory.mktemp("checkpoints")
    return run_ranks(_rank, (tiny_model, str(dropout_model), str(scratch)), reports=5, deadline_s=300, world_size=1)


def test_bf16_zero0_adamw_starts_with_no_state_and_untouched_master_weights(outcomes):
    assert outcomes.get((0, "bf16 state after setup")) == (0, True), outcomes
    assert outcomes[(0, "bf16 adam steps after one step")] == [1]


def test_a_resumed_run_with_dropout_continues_bit_for_bit(outcomes):
    uninterrupted, resumed = outcomes[(0, "dropout grad norms")]
    assert resumed == uninterrupted


def test_a_checkpoint_path_that_would_not_resume_is_refused_naming_the_right_one(outcomes):
    tag_path, (inside, without_latest) = outcomes[(0, "refusals")]
    assert inside is not None and f"set checkpoint_path to {str(Path(tag_path).parent)!r}" in inside
    assert without_latest is not None and "holds checkpoints but no 'latest' file" in without_latest
    assert outcomes[(0, "new path starts fresh")] == 0
