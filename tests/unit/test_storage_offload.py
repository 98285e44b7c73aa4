"""Offloading storages: every view comes back whole, each sleep mode takes its part, a file export reads host copies.

The engine test runs a real DeepSpeed ZeRO-0 engine (fp32: a plain AdamW; bf16: DeepSpeed's
flat-buffer wrapper) in a spawned process, because DeepSpeed initializes torch.distributed.
On CPU the "device" bytes are host bytes, but the mechanism is the one the GPU runs.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from arctic_rl_core.engines.training.offload import StorageOffload, move_home, unique_storages

CPU = torch.device("cpu")


def test_every_view_of_an_offloaded_storage_is_whole_after_reload():
    flat = torch.arange(12, dtype=torch.float32)
    weight, bias = flat[:8].view(2, 4), flat[8:]
    offload = StorageOffload(CPU)
    storages = unique_storages([weight, bias, flat, None], CPU)
    assert len(storages) == 1  # three views, one storage

    assert offload.offload(storages) == 48
    assert flat.untyped_storage().nbytes() == 0  # the bytes are gone from the "device"
    assert torch.equal(offload.host_view(bias), torch.tensor([8.0, 9.0, 10.0, 11.0]))
    assert offload.offload(storages) == 0  # already off: not copied twice

    assert offload.reload() == 48
    assert torch.equal(weight, torch.arange(8.0).view(2, 4)) and torch.equal(bias, torch.arange(8.0, 12.0))
    assert not offload and offload.host_view(bias) is None


def _engine_round_trip(model_path: str, dtype: str, export_dir: Path) -> dict:
    from safetensors.torch import load_file

    from arctic_rl_core.config import TrainingConfig
    from arctic_rl_core.engines.runtime import free_port
    from arctic_rl_core.engines.training.worker import DeepSpeedWorker, WorkerSpec

    spec = WorkerSpec(model_name=model_path, device="cpu", trainable=True, training=TrainingConfig(dtype=dtype))
    worker = DeepSpeedWorker(0, 1, spec)
    worker.setup("127.0.0.1", free_port())
    engine = worker.engine
    for param in engine.module.parameters():
        # On CPU the weights may still map the checkpoint file (not resizable); on a GPU they are allocator memory.
        if not param.untyped_storage().resizable():
            param.data = param.data.clone()

    def train_step():
        ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
        engine.backward(engine(ids).logits.float().logsumexp(-1).mean())
        engine.step()

    train_step()  # AdamW's moments exist from here
    weights = [p for p in engine.module.parameters()]
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    moments = [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    before = [t.clone() for t in weights + moments]

    offload = worker._offload  # the worker's own, so its weight reads go through it (on CPU sleep() skips it)
    seen = {}
    offload.sleep("non_lp")
    seen["non_lp: weights kept"] = all(p.untyped_storage().nbytes() for p in weights)
    seen["non_lp: moments off"] = all(m.untyped_storage().nbytes() == 0 for m in moments)
    offload.sleep("lp_params")  # stacks: now everything is off
    seen["lp_params: weights off"] = all(p.untyped_storage().nbytes() == 0 for p in weights)
    seen["asleep"] = sorted(offload.asleep)
    seen["host view"] = all(torch.equal(offload.host_view(p), b) for p, b in zip(weights, before))
    # A file sync while asleep: the export reads every weight from its host copy.
    worker.export_weights(str(export_dir))
    exported = load_file(next(export_dir.glob("*.safetensors")))
    names = [name for name, _ in engine.module.named_parameters()]
    seen["exported asleep"] = all(torch.equal(exported[n], b) for n, b in zip(names, before))
    seen["woke"] = offload.wake()
    seen["restored"] = all(torch.equal(t, b) for t, b in zip(weights + moments, before))
    train_step()  # the optimizer finds its state again
    seen["trained"] = all(torch.isfinite(p).all() for p in weights) and not all(
        torch.equal(p, b) for p, b in zip(weights, before)
    )
    worker.shutdown()
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_deepspeed_engine_sleeps_part_by_part_and_wakes_exactly(tiny_model, dtype, tmp_path):
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        seen = pool.submit(_engine_round_trip, tiny_model, dtype, tmp_path / "export").result(timeout=300)
    assert seen == {
        "non_lp: weights kept": True,
        "non_lp: moments off": True,
        "lp_params: weights off": True,
        "asleep": ["lp_params", "non_lp"],
        "host view": True,
        "exported asleep": True,
        "woke": ["lp_params", "non_lp"],
        "restored": True,
        "trained": True,
    }


def test_moving_a_storage_home_keeps_its_bytes_and_views():
    flat = torch.arange(6, dtype=torch.float32)
    view = flat[2:].view(2, 2)
    before = flat.untyped_storage().data_ptr()
    assert move_home(unique_storages([view], CPU), None) == 24
    assert flat.untyped_storage().data_ptr() != before  # re-allocated ...
    assert torch.equal(view, torch.tensor([[2.0, 3.0], [4.0, 5.0]]))  # ... and every view sees the same bytes
