"""The native engine's configuration: ``SamplingEngineOptions`` plus the model's HF config, checked once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from arctic_rl_core.engines.sampling.native.model import ModelSpec
from arctic_rl_core.engines.sampling.protocol import LogprobsMode, SamplingEngineOptions

# Keys of ``options.extra`` the native engine understands; any other is rejected by name.
EXTRA_KEYS = {
    "max_num_batched_tokens": "tokens computed in one prefill step (default: max(16384, max_model_len))",
    "zorro_inference": 'alias of use_fca, as arctic_inference_config spells it: {"enable": bool}',
    "async_scheduling": "launch each decode step before reading the last one's tokens (default true)",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    hf_config: object
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    seed: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    block_size: int
    enable_prefix_caching: bool
    use_cuda_graphs: bool
    use_fca: bool
    eos_token_ids: frozenset[int]
    async_scheduling: bool = True
    logprobs_mode: LogprobsMode = "raw_logprobs"

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @classmethod
    def from_options(cls, model_path: str, options: SamplingEngineOptions) -> "EngineConfig":
        from transformers import AutoConfig

        unknown = sorted(set(options.extra) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"options.extra has keys the native engine does not know: {unknown}; "
                             f"it accepts {sorted(EXTRA_KEYS)}")  # fmt: skip
        if options.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={options.tensor_parallel_size}: the native engine runs one "
                             "device per replica; use tensor_parallel_size=1 or the vllm engine")  # fmt: skip
        if options.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu'")
        hf_config = AutoConfig.from_pretrained(model_path)
        spec = ModelSpec.from_hf_config(hf_config)

        max_model_len = options.max_model_len or spec.max_position_embeddings
        if max_model_len > spec.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                             f"{spec.max_position_embeddings}")  # fmt: skip
        if spec.sliding_window is not None and max_model_len > spec.sliding_window:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's sliding_window={spec.sliding_window}, which the "
                "native engine does not implement; set max_model_len <= sliding_window"
            )
        batched = options.extra.get("max_num_batched_tokens", max(16384, max_model_len))
        if not isinstance(batched, int) or batched < max_model_len:
            raise ValueError(f"options.extra['max_num_batched_tokens']={batched!r}: expected an int >= "
                             f"max_model_len={max_model_len} (prompts are not split across steps)")  # fmt: skip
        use_fca = options.use_fca
        if "zorro_inference" in options.extra:
            zorro = options.extra["zorro_inference"]
            if not isinstance(zorro, dict) or not isinstance(zorro.get("enable"), bool) or set(zorro) != {"enable"}:
                raise ValueError(f"options.extra['zorro_inference']={zorro!r}: expected {{'enable': bool}}")
            use_fca = zorro["enable"]
        async_scheduling = options.extra.get("async_scheduling", True)
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"options.extra['async_scheduling']={async_scheduling!r}: expected a bool")

        device = torch.device(options.device)
        return cls(
            model_path=str(model_path),
            hf_config=hf_config,
            spec=spec,
            device=device,
            dtype=DTYPES[options.dtype],
            seed=options.seed,
            max_model_len=max_model_len,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=batched,
            gpu_memory_utilization=options.gpu_memory_utilization,
            block_size=options.block_size,
            enable_prefix_caching=options.enable_prefix_caching,
            use_cuda_graphs=device.type == "cuda" and not options.enforce_eager,
            use_fca=use_fca,
            eos_token_ids=frozenset(eos_token_ids(model_path, hf_config)),
            async_scheduling=async_scheduling,
            logprobs_mode=options.logprobs_mode,
        )


def eos_token_ids(model_path: str, hf_config) -> set[int]:
    """generation_config.json's end-of-sequence ids, else the model config's; the engine adds the tokenizer's."""
    ids = None
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.exists():
        ids = json.loads(generation_config.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)
