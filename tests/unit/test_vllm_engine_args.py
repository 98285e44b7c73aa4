"""How sampling options and vllm_config become vLLM engine arguments, and which backend a config selects."""

import logging

import pytest

from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions
from arctic_rl_core.engines.sampling.vllm import num_replicas, select_sampling_backend, vllm_engine_kwargs
from arctic_rl_core.engines.sampling.vllm.engine_args import CPU_KV_CACHE_BYTES, fca_requested
from tests.installed import require_vllm

pytestmark = pytest.mark.vllm
require_vllm()


def kwargs(**options):
    return vllm_engine_kwargs(SamplingEngineOptions(**options))


def test_seed_spelling_max_seq_len_becomes_vllm_max_model_len():
    assert kwargs(extra={"max_seq_len": 1024})["max_model_len"] == 1024


def test_vllm_engine_arguments_in_extra_pass_through():
    out = kwargs(extra={"max_logprobs": 50, "tensor_parallel_size": 2})

    assert out["max_logprobs"] == 50
    assert out["tensor_parallel_size"] == 2


def test_unknown_engine_argument_is_rejected_by_name():
    with pytest.raises(ValueError, match="max_seqlen"):
        kwargs(extra={"max_seqlen": 1024})


def test_extra_may_not_contradict_an_option_set_explicitly():
    with pytest.raises(ValueError, match="max_num_seqs"):
        kwargs(max_num_seqs=8, extra={"max_num_seqs": 16})


def test_alias_and_vllm_name_together_are_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        kwargs(extra={"max_seq_len": 1024, "max_model_len": 2048})


def test_log_probs_are_raw_unless_the_option_asks_for_processed_ones():
    assert kwargs()["logprobs_mode"] == "raw_logprobs"
    assert kwargs(logprobs_mode="processed_logprobs")["logprobs_mode"] == "processed_logprobs"
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingEngineOptions(logprobs_mode="raw_logits")  # logits are not log-probs
    with pytest.raises(ValueError, match="logprobs_mode"):
        kwargs(extra={"logprobs_mode": "processed_logits"})


def test_block_size_reaches_vllm_only_when_set():
    assert "block_size" not in kwargs()
    assert kwargs(block_size=32)["block_size"] == 32


def test_cpu_runs_eager_with_a_bounded_kv_cache_unless_told_otherwise():
    default = kwargs(device="cpu")
    assert default["enforce_eager"] is True
    assert default["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES

    assert kwargs(device="cpu", extra={"kv_cache_memory_bytes": 1 << 20})["kv_cache_memory_bytes"] == 1 << 20
    assert "kv_cache_memory_bytes" not in kwargs(device="cpu", gpu_memory_utilization=0.2)
    assert kwargs(device="cpu", enforce_eager=False)["enforce_eager"] is False


def test_cuda_engines_start_with_sleep_mode_enabled():
    assert kwargs(device="cuda")["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in kwargs(device="cpu")


def test_zorro_inference_enable_requests_fca_like_use_fca():
    assert fca_requested(SamplingEngineOptions(use_fca=False, extra={"zorro_inference": {"enable": True}}))
    assert not fca_requested(SamplingEngineOptions(use_fca=False))
    with pytest.raises(ValueError, match="zorro_inference"):
        fca_requested(SamplingEngineOptions(extra={"zorro_inference": True}))


def test_fca_without_arctic_inference_logs_that_the_native_engine_has_it(caplog):
    with caplog.at_level(logging.INFO, logger="arctic_rl_core.engines.sampling.vllm.engine_args"):
        out = kwargs(device="cpu", use_fca=True)

    assert "forest_cascade_attn_configs" not in out
    assert any("ArcticInference" in r.message or "arctic_inference" in r.message for r in caplog.records)
    assert any("native" in r.message for r in caplog.records)


def test_num_replicas_is_sampling_gpus_over_tensor_parallel_size():
    assert num_replicas(8, 4) == 2
    assert num_replicas(3, 1) == 3
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        num_replicas(6, 4)


def test_vllm_is_selected_by_name_where_its_build_matches_and_auto_keeps_cpu_on_native():
    from arctic_rl_core.engines.sampling import native
    from arctic_rl_core.engines.sampling.vllm import VLLMBackend

    assert select_sampling_backend("vllm", "cpu") is VLLMBackend
    assert select_sampling_backend("auto", "cpu") is native.NativeEngine


def test_native_is_selected_by_name_and_vllm_for_a_device_it_lacks_is_refused():
    from arctic_rl_core.engines.sampling import native

    assert select_sampling_backend("native", "cpu") is native.NativeEngine
    assert select_sampling_backend("auto", "cuda") is native.NativeEngine
    with pytest.raises(RuntimeError, match="sampling_engine='vllm'"):
        select_sampling_backend("vllm", "cuda")
    with pytest.raises(ValueError, match="sampling_engine"):
        select_sampling_backend("sglang", "cpu")
