"""Hugging Face parameter names onto the native model's fused layout, from checkpoints or live tensors.

Names are the ones ``AutoModelForCausalLM.state_dict()`` uses (and so the
training engine's weight sync). ``q_proj``/``k_proj``/``v_proj`` land in row
slices of ``qkv_proj``, ``gate_proj``/``up_proj`` in ``gate_up_proj``; with tied
embeddings ``lm_head.weight`` is the embedding.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from arctic_rl_core.engines.sampling.native.model import CausalLM

# Buffers some checkpoints carry; they are derived from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shards(model: CausalLM) -> dict[str, tuple[str, slice]]:
    """HF projection name -> (our fused parameter name, rows it occupies)."""
    spec = model.spec
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", slice(0, q)),
        "self_attn.k_proj": ("self_attn.qkv_proj", slice(q, q + kv)),
        "self_attn.v_proj": ("self_attn.qkv_proj", slice(q + kv, q + 2 * kv)),
        "mlp.gate_proj": ("mlp.gate_up_proj", slice(0, inter)),
        "mlp.up_proj": ("mlp.gate_up_proj", slice(inter, 2 * inter)),
    }


class WeightLoader:
    """Copies named tensors into a ``CausalLM`` and remembers which parameter rows it filled."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.params = dict(model.named_parameters())
        self.shards = _shards(model)
        self.filled: set[tuple[str, int]] = set()

    def target(self, hf_name: str) -> tuple[str, slice] | None:
        """Our parameter name and row slice for an HF name; None for buffers we derive ourselves."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" and self.model.spec.tie_word_embeddings:
            name = "embed_tokens.weight"
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            module, _, kind = rest.rpartition(".")
            if module in self.shards:
                fused, rows = self.shards[module]
                return f"layers.{index}.{fused}.{kind}", rows
        if name not in self.params:
            raise ValueError(f"weight {hf_name!r} has no place in the native {self.model.spec.model_type} model")
        return name, slice(0, self.params[name].shape[0])

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy every ``(hf_name, tensor)``; returns how many were copied."""
        count = 0
        for hf_name, tensor in weights:
            target = self.target(hf_name)
            if target is None:
                continue
            name, rows = target
            param = self.params.get(name)
            if param is None:
                raise ValueError(f"weight {hf_name!r} maps to {name!r}, which this model does not have")
            dest = param.data[rows]
            if dest.shape != tensor.shape:
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}; expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            self.filled.add((name, rows.start))
            count += 1
        return count

    def missing(self) -> list[str]:
        """Parameters (or fused shards) that no loaded tensor has filled."""
        expected = set()
        for name, param in self.params.items():
            module = name.rsplit(".", 1)[0]
            starts = [rows.start for fused, rows in self.shards.values() if module.endswith(fused)]
            expected.update((name, start) for start in (starts or [0]))
        return sorted(f"{name}[{start}:]" if start else name for name, start in expected - self.filled)


def checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (or the single file given)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights at {str(path)!r}")
    return files


def iter_checkpoint(path: str | os.PathLike, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of a safetensors checkpoint, read straight onto ``device``."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_checkpoint(model: CausalLM, path: str | os.PathLike, device: torch.device) -> None:
    """Fill every parameter of ``model`` from a checkpoint; a parameter left unfilled is an error."""
    loader = WeightLoader(model)
    loader.load(iter_checkpoint(path, device))
    missing = loader.missing()
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks weights for {missing[:8]}"
                         f"{' and more' if len(missing) > 8 else ''}")  # fmt: skip
