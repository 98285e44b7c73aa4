"""The policy TRL holds: the model's class, config and generation config, without weights.

GRPOTrainer needs a model object for its config, its generation config, the
Trainer's bookkeeping and model cards. With ArcticGRPOTrainer the weights live
on the arctic training engine, so the driver builds the model on the meta
device and gives every parameter and buffer an empty CPU tensor: nothing is
read from disk and nothing of model size is allocated, and any code that
would run this model fails at once instead of silently using stale weights.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel


def weightless_model(name_or_path: str, **config_kwargs) -> PreTrainedModel:
    """``AutoModelForCausalLM`` of ``name_or_path`` with empty parameters, and its saved generation config."""
    config = AutoConfig.from_pretrained(name_or_path, **config_kwargs)
    remote_code = config_kwargs.get("trust_remote_code", False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=remote_code)
    empty_weights(model)
    try:
        model.generation_config = GenerationConfig.from_pretrained(name_or_path)
    except OSError:
        pass  # no generation_config.json: keep the one derived from the model config, as from_pretrained does
    return model


def empty_weights(model: nn.Module) -> None:
    """Replace every parameter and buffer by a zero-element CPU tensor of the same dtype."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = nn.Parameter(torch.empty(0, dtype=param.dtype), param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(0, dtype=buffer.dtype)
