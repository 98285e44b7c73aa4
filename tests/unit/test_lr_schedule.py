"""The training engine's learning rates equal HF's and verl's schedulers, step for step; decay groups as configured.

Each case runs the framework's own scheduler (``transformers.get_scheduler``,
verl's ``get_*_schedule_with_warmup``) on a one-parameter optimizer and
compares the learning rate every optimizer step uses.
"""

import pytest
import torch
from transformers import get_scheduler
from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

from arctic_rl_core.config import OptimizerConfig
from arctic_rl_core.engines.training.deepspeed_setup import build_optimizer, lr_multiplier

LR = 1e-3


def _rates(scheduler_factory, optimizer_steps: int, interval: int = 1) -> list[float]:
    """The lr of each optimizer step, the scheduler stepped once every ``interval`` of them (verl: per training step)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = scheduler_factory(optimizer)
    rates = []
    for step in range(optimizer_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if (step + 1) % interval == 0:
            scheduler.step()
    return rates


def _ours(config: OptimizerConfig, optimizer_steps: int) -> list[float]:
    at = lr_multiplier(config)
    return [LR * at(step) for step in range(optimizer_steps)]


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 1, 7])
def test_hf_schedules(kind, warmup):
    total = 30
    config = OptimizerConfig(
        lr=LR, lr_scheduler_type="constant" if kind == "constant_with_warmup" else kind,
        warmup_steps=warmup, total_train_steps=total,
    )  # fmt: skip
    hf = _rates(lambda o: get_scheduler(kind, o, num_warmup_steps=warmup, num_training_steps=total), total)
    assert _ours(config, total) == pytest.approx(hf, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("interval", [1, 4])
@pytest.mark.parametrize("min_lr_ratio", [0.0, 0.1])
def test_verl_cosine_advanced_per_training_step(interval, min_lr_ratio):
    training_steps, warmup = 12, 3
    config = OptimizerConfig(
        lr=LR, lr_scheduler_type="cosine", warmup_steps=warmup, total_train_steps=training_steps,
        min_lr_ratio=min_lr_ratio, lr_schedule_interval=interval,
    )  # fmt: skip
    verl = _rates(
        lambda o: get_cosine_schedule_with_warmup(o, warmup, training_steps, min_lr_ratio=min_lr_ratio),
        training_steps * interval,
        interval,
    )
    ours = _ours(config, training_steps * interval)
    assert ours == pytest.approx(verl, rel=1e-12, abs=1e-15)
    assert ours[0] == 0.0 and ours[interval - 1] == 0.0  # the whole first training step runs at verl's lr 0


def test_verl_constant_with_warmup():
    config = OptimizerConfig(lr=LR, lr_scheduler_type="constant", warmup_steps=5, total_train_steps=20)
    verl = _rates(lambda o: get_constant_schedule_with_warmup(o, 5), 20)
    assert _ours(config, 20) == pytest.approx(verl, rel=1e-12, abs=1e-15)


def test_warmup_steps_override_the_proportion():
    assert OptimizerConfig(warmup_steps_proportion=0.5, total_train_steps=10).num_warmup_steps == 5
    assert OptimizerConfig(warmup_ratio=0.25, total_train_steps=10).num_warmup_steps == 2  # round(2.5), banker's
    assert OptimizerConfig(warmup_steps=3, warmup_steps_proportion=0.5, total_train_steps=10).num_warmup_steps == 3


@pytest.mark.parametrize(
    "no_decay_params, skipped",
    [(None, {"0.bias", "1.weight", "1.bias"}), ([], set()), (["0.bias", "1.bias"], {"0.bias", "1.bias"})],
)
def test_decay_groups(no_decay_params, skipped):
    """By default 1-D parameters are not decayed; a list names exactly the ones that are not ([]: none, as verl)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = OptimizerConfig(weight_decay=0.1, no_decay_params=no_decay_params)
    optimizer = build_optimizer(model.named_parameters(), config, "cpu")
    names = {id(p): name for name, p in model.named_parameters()}
    undecayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert undecayed == skipped and decayed == set(names.values()) - skipped


def test_no_decay_params_naming_no_parameter_is_refused_by_field():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"no_decay_params: the model has no trainable \['bais'\]"):
        build_optimizer(model.named_parameters(), OptimizerConfig(no_decay_params=["bias", "bais"]), "cpu")
