"""The native engine on CPU: HF-exact greedy decoding, the sampling parameters, sleep/wake, weights, caching, FCA."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from arctic_rl_core import ArcticRLClientConfig
from arctic_rl_core.engines.sampling.native import NativeEngine
from arctic_rl_core.engines.sampling.native.config import EngineConfig
from arctic_rl_core.engines.sampling.native.model_runner import GiB, kv_cache_bytes
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.errors import BadRequest
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model
from arctic_rl_core.server.manager import sampling_options
from arctic_rl_core.zorro.attention.forest import build_forest
from tests.sampling_reference import processed_logprobs

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 200, 300], [7] * 40]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    return {family: build_tiny_model(root / family, TinySpec(family=family)) for family in ("qwen2", "qwen3", "llama")}


def _engine(path, **options) -> NativeEngine:
    return NativeEngine(str(path), SamplingEngineOptions(**{"max_model_len": 128, "max_num_seqs": 16, **options}))


def _assert_same_completions(actual, expected):
    """Same tokens, texts and reasons; log-probs equal up to float32 reduction order (buffers may move)."""
    for got_request, want_request in zip(actual, expected, strict=True):
        for got, want in zip(got_request, want_request, strict=True):
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs))


def _hf_greedy(model, prompt, n):
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0]
    tokens = ids[len(prompt) :].tolist()
    logits = model(ids[None, :-1]).logits[0, len(prompt) - 1 :].float()
    return tokens, torch.log_softmax(logits, -1).gather(1, ids[len(prompt) :, None])[:, 0].tolist()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_greedy_tokens_and_logprobs_equal_hf_generate(models, family):
    engine = _engine(models[family])
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32)
    for prompt, (completion,) in zip(PROMPTS, outputs):
        tokens, logprobs = _hf_greedy(hf, prompt, 8)
        assert completion.token_ids == tokens
        assert completion.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_seeded_completions_do_not_depend_on_the_rest_of_the_batch(models):
    engine = _engine(models["qwen2"])
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0]
    crowded = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], params)[1]
    assert [c.token_ids for c in crowded] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in alone}) == 3  # the n completions draw different noise
    other_seed = engine.generate([PROMPTS[0]], params.model_copy(update={"seed": 8}))[0]
    assert [c.token_ids for c in other_seed] != [c.token_ids for c in alone]


def test_top_k_one_and_a_tiny_top_p_both_sample_the_greedy_tokens(models):
    engine = _engine(models["llama"])
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        sampled = engine.generate(PROMPTS, params.model_copy(update={"max_tokens": 6, "ignore_eos": True}))
        assert [o[0].token_ids for o in sampled] == [o[0].token_ids for o in greedy]
        # Log-probs are of the raw logits, not of the filtered distribution (which would give 0). The second
        # call reads the prompts' KV from the prefix cache, so they may differ from the first in the last bit.
        torch.testing.assert_close(
            torch.tensor([o[0].logprobs for o in sampled]), torch.tensor([o[0].logprobs for o in greedy]),
            atol=1e-5, rtol=0,
        )  # fmt: skip


def test_processed_logprobs_mode_scores_the_filtered_distribution_and_keeps_the_tokens(models):
    params = SamplingParams(n=2, max_tokens=8, temperature=0.7, top_k=20, top_p=0.8, seed=3, ignore_eos=True)
    raw = _engine(models["qwen2"]).generate(PROMPTS, params)
    processed = _engine(models["qwen2"], logprobs_mode="processed_logprobs").generate(PROMPTS, params)
    hf = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    for prompt, raw_request, request in zip(PROMPTS, raw, processed, strict=True):
        for raw_completion, completion in zip(raw_request, request, strict=True):
            assert completion.token_ids == raw_completion.token_ids  # the mode changes what is reported only
            ids = torch.tensor([prompt + completion.token_ids])
            with torch.no_grad():
                logits = hf(ids[:, :-1]).logits[0, len(prompt) - 1 :].float()
            expected = processed_logprobs(logits, completion.token_ids, 0.7, 20, 0.8)
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(expected), atol=1e-4, rtol=0)
            assert not torch.allclose(torch.tensor(completion.logprobs), torch.tensor(raw_completion.logprobs))


def test_vllm_config_logprobs_mode_reaches_the_engine_and_logit_modes_are_refused_by_name(models):
    def engine_config(vllm_config):
        config = ArcticRLClientConfig(model_name=str(models["qwen2"]), training_gpus=1, vllm_config=vllm_config)
        return EngineConfig.from_options(str(models["qwen2"]), sampling_options(config, "cpu"))

    assert engine_config(None).logprobs_mode == "raw_logprobs"
    assert engine_config({"logprobs_mode": "processed_logprobs"}).logprobs_mode == "processed_logprobs"
    with pytest.raises(
        BadRequest, match=r"vllm_config.logprobs_mode: Input should be 'raw_logprobs' or 'processed_logprobs'"
    ):
        engine_config({"logprobs_mode": "processed_logits"})


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 1e-45])
def test_a_temperature_below_1e_5_is_greedy(models, temperature):
    engine = _engine(models["llama"])
    greedy = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    params = SamplingParams(n=2, max_tokens=6, temperature=temperature, ignore_eos=True, seed=0, top_k=50, top_p=0.9)
    assert params.greedy and not params.model_copy(update={"temperature": 1e-5}).greedy
    sampled = engine.generate(PROMPTS, params)
    for got, want in zip(sampled, greedy, strict=True):
        assert [c.token_ids for c in got] == [want[0].token_ids] * 2
        torch.testing.assert_close(torch.tensor(got[0].logprobs), torch.tensor(want[0].logprobs), atol=1e-5, rtol=0)


def test_stop_string_ends_the_completion_and_is_trimmed_from_the_text(models):
    engine = _engine(models["qwen2"])
    free = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0][0]
    stop = free.text[4:6]
    stopped = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                           stop=stop))[0][0]  # fmt: skip
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]


def test_stop_token_ids_end_the_completion_unless_min_tokens_bans_them(models):
    engine = _engine(models["qwen3"])
    free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0][0]
    stop_id = free.token_ids[2]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[stop_id]))[0][0]  # fmt: skip
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)
    held = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, min_tokens=8,
                                                        stop_token_ids=[stop_id]))[0][0]  # fmt: skip
    assert stop_id not in held.token_ids and held.finish_reason == "length" and len(held.token_ids) == 8


def _copy_with_free_run(models, tmp_path):
    """A copy of the llama model whose config a test may edit, and its greedy completion with EOS ignored."""
    path = tmp_path / "eos-model"
    shutil.copytree(models["llama"], path)
    free = _engine(path).generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0][0]
    return path, free


def test_eos_from_generation_config_stops_unless_ignore_eos(models, tmp_path):
    path, free = _copy_with_free_run(models, tmp_path)
    eos = free.token_ids[3]
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    engine = _engine(path)
    stopped = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0))[0][0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    # Not the tokenizer's EOS: vLLM reports it as a stop token id.
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", eos)
    ignored = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0][0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_the_tokenizers_eos_stops_even_when_generation_config_lists_other_eos_ids(models, tmp_path):
    # A fine-tuned checkpoint whose tokenizer EOS changed while generation_config.json kept the base model's.
    path, free = _copy_with_free_run(models, tmp_path)
    eos = free.token_ids[2]
    generation_config = json.loads((path / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] not in free.token_ids
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["eos_token"] = AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(eos)
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    engine = _engine(path)
    assert engine.tokenizer.eos_token_id == eos
    stopped = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0))[0][0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)


def test_min_tokens_bans_eos_even_under_ignore_eos(models, tmp_path):
    path, free = _copy_with_free_run(models, tmp_path)
    eos = free.token_ids[0]
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, min_tokens=3)
    held = _engine(path).generate([PROMPTS[1]], params)[0][0]
    assert eos not in held.token_ids[:3] and held.finish_reason == "length" and len(held.token_ids) == 8


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_kv_cache_and_wake_restores_generation(models, level):
    engine = _engine(models["qwen2"])
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    before = engine.generate(PROMPTS, params)
    report = engine.sleep(level)
    assert report["freed_bytes"]["kv_cache"] > 0 and engine.runner.kv_cache is None
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    engine.wake(["weights"])
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate(PROMPTS, params)
    engine.wake(["kv_cache"])
    hits = engine.prefix_cache_stats()["hit_tokens"]
    _assert_same_completions(engine.generate(PROMPTS, params), before)
    assert engine.prefix_cache_stats()["hit_tokens"] == hits  # the cache did not survive the sleep


def test_load_weights_takes_hf_names_and_weight_norm_then_matches_the_source(models, tmp_path):
    engine = _engine(models["qwen3"])
    source_path = build_tiny_model(tmp_path / "other", TinySpec(family="qwen3", seed=5))
    source = AutoModelForCausalLM.from_pretrained(source_path, dtype=torch.float32)
    expected_norm = float(sum(p.double().pow(2).sum() for p in source.parameters()).sqrt())
    assert abs(engine.weight_norm() - expected_norm) > 1e-3
    engine.load_weights(source.state_dict().items())
    assert engine.weight_norm() == pytest.approx(expected_norm, rel=1e-12)
    tokens, _ = _hf_greedy(source, PROMPTS[0], 6)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0][0]
    assert out.token_ids == tokens

    engine.load_weights(models["qwen3"])  # a checkpoint directory works too
    assert engine.weight_norm() != pytest.approx(expected_norm, rel=1e-6)
    with pytest.raises(ValueError, match="model.layers.0.mlp.nope.weight"):
        engine.load_weights([("model.layers.0.mlp.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_tied_embeddings_load_and_count_once(tmp_path):
    path = build_tiny_model(tmp_path / "tied", TinySpec(family="qwen2", tie_word_embeddings=True))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = _engine(path)
    assert engine.weight_norm() == pytest.approx(float(sum(p.double().pow(2).sum() for p in hf.parameters()).sqrt()))
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0][0]
    assert out.token_ids == _hf_greedy(hf, PROMPTS[0], 6)[0]


def test_prefix_cache_hits_are_counted_and_reset_clears_them(models):
    engine = _engine(models["qwen2"], block_size=16)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.generate([PROMPTS[2]], params)
    assert engine.prefix_cache_stats()["hit_tokens"] == 0
    _assert_same_completions(engine.generate([PROMPTS[2]], params), first)
    assert engine.prefix_cache_stats()["hit_tokens"] == 32  # two full blocks before the 40th token
    engine.reset_prefix_cache()
    _assert_same_completions(engine.generate([PROMPTS[2]], params), first)
    assert engine.prefix_cache_stats()["hit_tokens"] == 32


def test_fca_on_equals_fca_off_on_three_level_forests_with_ragged_unaligned_suffixes(models):
    system, question1, question2 = list(range(30, 39)), list(range(50, 59)), list(range(70, 75))
    # Block size 4: the system prompt's 2 blocks are shared by all, question 1's 2 blocks by the first two prompts,
    # and the first prompt's answer block by its 2 completions (3 levels); prompt lengths are not block multiples.
    prompts = [system + question1 + [90, 91, 92, 93, 94, 95], system + question1 + [96], system + question2,
               system + [99]]  # fmt: skip
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    results = {}
    for use_fca in (True, False):
        engine = _engine(models["qwen2"], block_size=4, use_fca=use_fca)
        ids = [engine.add_request(p, params) for p in prompts]
        engine.step()  # prefill
        engine.step()  # first decode
        running = list(engine.scheduler.running)
        levels = build_forest([s.block_table for s in running], [s.num_tokens for s in running], 4).num_levels
        assert levels == 3
        outputs = {}
        while engine.has_unfinished():
            outputs.update({o.request_id: o.completions for o in engine.step()})
        results[use_fca] = [outputs[i] for i in ids]
    for with_fca, without in zip(results[True], results[False]):
        for a, b in zip(with_fca, without):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


def test_requests_added_between_steps_join_the_batch_and_generate_keeps_foreign_outputs(models):
    engine = _engine(models["llama"])
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    expected = engine.generate([PROMPTS[0], PROMPTS[1]], params)
    first = engine.add_request(PROMPTS[0], params, request_id="a")
    engine.step()
    second = engine.add_request(PROMPTS[1], params, request_id="b")
    assert engine.generate([PROMPTS[2]], params.model_copy(update={"max_tokens": 8}))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.completions for o in engine.step()})
    _assert_same_completions([outputs[first], outputs[second]], expected)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(PROMPTS[0], params, request_id="c")
        engine.add_request(PROMPTS[0], params, request_id="c")


def test_aborted_requests_free_their_blocks_and_return_nothing(models):
    engine = _engine(models["llama"])
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True), request_id="gone")
    engine.step()
    engine.abort_request("gone")
    assert engine.step() == []
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"extra": {"max_num_batched_tokens": 512, "swap_space": 4}}, "swap_space"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"max_model_len": 1 << 20}, "max_position_embeddings"),
        ({"extra": {"zorro_inference": {"enable": "yes"}}}, "zorro_inference"),
    ],
)
def test_options_the_engine_cannot_honour_are_rejected_by_name(models, options, match):
    with pytest.raises(ValueError, match=match):
        _engine(models["qwen2"], **options)


def test_zorro_inference_alias_switches_fca(models):
    assert not _engine(models["qwen2"], extra={"zorro_inference": {"enable": False}}).config.use_fca


@pytest.mark.parametrize(("prompt", "match"), [([], "empty"), ([1] * 128, "max_model_len"), ([5, 10**6], "ints in")])
def test_invalid_prompts_are_rejected(models, prompt, match):
    with pytest.raises(ValueError, match=match):
        _engine(models["qwen2"]).add_request(prompt, SamplingParams())


def test_the_kv_cache_gets_the_engines_share_less_its_own_memory_whatever_others_hold():
    # 80 GiB card, a 0.3 share: 24 GiB, less 1 GiB of weights and 2 GiB of activations.
    others_hold = [0, 30 * GiB]  # a colocated trainer's memory does not shrink the share
    for held in others_hold:
        free = 80 * GiB - 1 * GiB - held
        assert kv_cache_bytes(80 * GiB, free, 0.3, own=GiB, activations=2 * GiB) == 21 * GiB
    with pytest.raises(ValueError, match=r"asks for 21.00 GiB of KV cache.*3.00 GiB free.*hold 74.00 GiB"):
        kv_cache_bytes(80 * GiB, 5 * GiB, 0.3, own=GiB, activations=2 * GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.01 \(0.80 GiB\) does not cover"):
        kv_cache_bytes(80 * GiB, 70 * GiB, 0.01, own=GiB, activations=2 * GiB)
