"""The native engine on CUDA: HF-exact greedy in float32 with CUDA graphs, FCA on/off, sleep/wake, weights."""

import concurrent.futures
import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from arctic_rl_core.engines.runtime import clear_cublas_workspaces
from arctic_rl_core.engines.sampling.native import NativeEngine, decode_linear, model_runner
from arctic_rl_core.engines.sampling.protocol import SamplingEngineOptions, SamplingParams
from arctic_rl_core.models.tiny import TinySpec, build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 200, 300], [7] * 40]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("native-gpu")
    return {family: build_tiny_model(root / family, TinySpec(family=family)) for family in ("qwen2", "qwen3", "llama")}


def _engine(path, **options) -> NativeEngine:
    # 0.05 of the device for the engine's weights, activations and KV cache. Memory outside PyTorch's allocator
    # (the CUDA context, kernels the tests before loaded, other processes) is not counted in it (kv_cache_bytes).
    base = {"device": "cuda", "max_model_len": 256, "max_num_seqs": 16, "gpu_memory_utilization": 0.05}
    return NativeEngine(str(path), SamplingEngineOptions(**{**base, **options}))


def _close(a, b, tol):
    for x, y in zip(a, b, strict=True):
        assert x[0].token_ids == y[0].token_ids
        torch.testing.assert_close(torch.tensor(x[0].logprobs), torch.tensor(y[0].logprobs), atol=tol, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_float32_greedy_with_cuda_graphs_equals_hf_generate(models, family):
    engine = _engine(models[family])
    assert engine.runner.graphs
    outputs = engine.generate(PROMPTS, GREEDY)
    hf = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32).cuda()
    for prompt, (completion,) in zip(PROMPTS, outputs):
        ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert completion.token_ids == ids[0, len(prompt) :].tolist()


def test_graphs_and_eager_decode_agree(models):
    _close(_engine(models["qwen2"]).generate(PROMPTS, GREEDY),
           _engine(models["qwen2"], enforce_eager=True).generate(PROMPTS, GREEDY), 1e-5)  # fmt: skip


def test_decode_plans_serve_steps_until_a_context_outgrows_them(models, monkeypatch):
    """The runner replans only when a context passes its plan's room; results equal replanning every step."""
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    built = []
    plan_decode = model_runner.plan_decode
    monkeypatch.setattr(model_runner, "plan_decode", lambda *a, **k: built.append(1) or plan_decode(*a, **k))
    reused = _engine(models["qwen2"]).generate(PROMPTS, params)
    # Contexts of 3-40 tokens grow by 150 in 64-position chunks: a few plans each, not one per step.
    assert 3 <= len(built) <= 20

    built.clear()
    engine = _engine(models["qwen2"])
    engine.runner.reuse_decode_plans = False
    replanned = engine.generate(PROMPTS, params)
    assert len(built) >= 149
    _close(reused, replanned, 1e-4)


FOREST_PROMPTS = [list(range(30, 70)) + [80 + i] * (5 + 7 * i) for i in range(3)]
FOREST_PARAMS = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)


def test_fca_on_and_off_agree_in_float32(models):
    on = _engine(models["llama"], use_fca=True).generate(FOREST_PROMPTS, FOREST_PARAMS)
    off = _engine(models["llama"], use_fca=False).generate(FOREST_PROMPTS, FOREST_PARAMS)
    for a, b in zip(on, off):
        _close([[c] for c in a], [[c] for c in b], 1e-4)


def test_fca_on_and_off_agree_within_bfloat16_noise(models):
    on = _engine(models["llama"], dtype="bfloat16", use_fca=True).generate(FOREST_PROMPTS, FOREST_PARAMS)
    off = _engine(models["llama"], dtype="bfloat16", use_fca=False).generate(FOREST_PROMPTS, FOREST_PARAMS)
    _agree_within_bfloat16_noise(on, off)


def test_fca_with_plans_balanced_over_the_kernels_lanes_agrees_with_fca_off(models, monkeypatch):
    """The engine cuts shared prefixes to even out the kernel's programs (here as on a device with 4 per KV head)."""
    prompts = [list(range(30, 930))]  # 56 shared blocks of 16
    params = SamplingParams(n=16, max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
    engine = _engine(models["llama"], use_fca=True, max_model_len=1024)
    assert engine.runner._plan_lanes() is not None  # the graphs' capture built the kernel
    engine.runner._lanes = 4
    balanced = []
    plan_decode = model_runner.plan_decode

    def recording(forest, lengths, tiles, target_items, max_items, max_rows, lanes):
        plan = plan_decode(forest, lengths, tiles, target_items, max_items, max_rows, lanes)
        even = plan_decode(forest, lengths, tiles, target_items, max_items, max_rows)
        balanced.append(plan.wide_items.shape != even.wide_items.shape or (plan.wide_items != even.wide_items).any())
        return plan

    monkeypatch.setattr(model_runner, "plan_decode", recording)
    on = engine.generate(prompts, params)
    assert any(balanced)
    engine.shutdown()  # its memory back to the device before the next engine is built
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    off = _engine(models["llama"], use_fca=False, max_model_len=1024).generate(prompts, params)
    _close([[c] for c in on[0]], [[c] for c in off[0]], 1e-4)


def _agree_within_bfloat16_noise(a_outputs, b_outputs):
    """Rounding may flip a near-tie and the texts then part: log-probs agree while the tokens do, for most."""
    compared = 0
    for a, b in zip((c for r in a_outputs for c in r), (c for r in b_outputs for c in r)):
        for token_a, token_b, lp_a, lp_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            assert abs(lp_a - lp_b) < 0.05
            compared += 1
            if token_a != token_b:
                break
    assert compared >= 0.5 * 12 * 12


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_decode_projection_kernels_agree_with_cublas_within_bfloat16_noise(models, monkeypatch, family):
    """bf16 decode steps run their projections as ``decode_linear`` kernels, with the norms between them and the
    rotary embedding (Qwen3's q/k norms too) in their epilogues; without them (cuBLAS and the separate kernels)
    they agree."""
    calls = []
    kernel = decode_linear.decode_linear
    monkeypatch.setattr(decode_linear, "decode_linear", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    ours = _engine(models[family], dtype="bfloat16").generate(FOREST_PROMPTS, FOREST_PARAMS)
    assert len(calls) >= 4 * 2  # four projections per layer, in the warm-ups and captures at least
    assert any(k.get("rotary") for k in calls) and any(k.get("into_residual") for k in calls)
    assert any(k.get("row_norm") for k in calls)
    monkeypatch.setattr(decode_linear, "MAX_ROWS", 0)  # every batch is then too tall for the kernel
    cublas = _engine(models[family], dtype="bfloat16").generate(FOREST_PROMPTS, FOREST_PARAMS)
    _agree_within_bfloat16_noise(ours, cublas)


def test_an_engine_built_beside_another_gets_the_same_kv_cache(models):
    """The share is the engine's own: memory the process held before it (here, another engine) is not counted."""
    first = _engine(models["qwen2"])
    second = _engine(models["qwen2"])
    # Within one cuBLAS workspace (32 MiB): the first engine's warm-up may create the one both then use.
    # Counted from the device instead, the second would lose the first's whole share (4 GB on 80 GB).
    difference = abs(second.runner.num_blocks - first.runner.num_blocks) * first.runner.block_bytes
    assert difference <= 32 * 2**20 + first.runner.block_bytes  # and the rounding to whole blocks


def test_sleep_frees_device_memory_and_wake_restores_it(models):
    engine = _engine(models["qwen3"])
    before = engine.generate(PROMPTS, GREEDY)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    report = engine.sleep(2)
    freed = report["freed_bytes"]
    assert torch.cuda.memory_allocated() <= allocated - freed["kv_cache"] - freed["weights"]
    engine.wake()
    _close(engine.generate(PROMPTS, GREEDY), before, 1e-5)


def test_sleep_wake_cycles_on_another_thread_leave_no_memory_behind(models):
    """As in the sampling worker: built on one thread, woken (graphs recaptured) on the engine loop's.

    A matmul on a new thread gets a new cuBLAS handle, and with it a 32 MiB workspace. Allocated during a
    capture, that workspace used to outlive the graphs and stay through every later sleep (+33 MiB once).
    """
    clear_cublas_workspaces()  # earlier tests' workspaces would count against "before"
    before = torch.cuda.memory_allocated()
    engine = _engine(models["qwen2"])
    engine.generate(PROMPTS, GREEDY)
    engine.sleep(1)
    asleep = torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    print(f"asleep: weights {weights / 2**20:.1f} MiB, everything else {(asleep - before - weights) / 2**20:.1f} MiB")
    # Level 1 keeps the weights and small staging buffers; no cuBLAS workspace (32 MiB) stays behind.
    assert asleep - before - weights < 16 * 2**20
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as loop:
        for _ in range(3):
            loop.submit(lambda: (engine.wake(), engine.generate(PROMPTS, GREEDY))).result()
            assert engine.runner.graphs
            engine.sleep(1)
            assert torch.cuda.memory_allocated() == asleep
    engine.shutdown()


def test_load_weights_from_device_tensors_then_weight_norm_matches(models):
    engine = _engine(models["qwen2"])
    source = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32).cuda()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(1.5).add_(torch.randn_like(p), alpha=0.01)  # other weights, same shapes
    engine.load_weights((name, t.detach()) for name, t in source.state_dict().items())
    expected = float(sum(p.detach().double().pow(2).sum() for p in source.parameters()).sqrt())
    assert engine.weight_norm() == pytest.approx(expected, rel=1e-12)
    out = engine.generate([PROMPTS[0]], GREEDY)[0][0]
    ids = source.generate(torch.tensor([PROMPTS[0]], device="cuda"), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False)  # fmt: skip
    assert out.token_ids == ids[0, len(PROMPTS[0]) :].tolist()


@pytest.mark.parametrize("processed", [False, True])
def test_sampling_kernel_matches_the_torch_sampler(processed):
    from arctic_rl_core.engines.sampling.native import ops

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50000, generator=g) * 3
    temperature = torch.rand(16, generator=g) + 0.3
    temperature[:4] = 0
    floor = torch.full((16,), float("-inf"))
    floor[8:] = logits[8:].max(dim=-1).values - 2.0  # a top-k/top-p floor: a few tokens per row stay
    banned = logits.topk(2, dim=-1).indices.int()  # each row's two best, banned below min_tokens
    rows = ops.SamplingRows(temperature, torch.randint(0, 2**32, (16,), generator=g),
                            torch.randint(0, 100, (16,), generator=g), banned, torch.randint(0, 110, (16,), generator=g))  # fmt: skip
    for step in (0, 7):
        cpu = ops.sample_tokens(logits, rows, step, floor, processed)
        gpu = ops.sample_tokens(
            logits.cuda(), ops.SamplingRows(*(t.cuda() for t in rows)), step, floor.cuda(), processed
        )
        assert gpu[0].cpu().tolist() == cpu[0].tolist()
        torch.testing.assert_close(gpu[1].cpu(), cpu[1], atol=1e-4, rtol=0)


def test_sampled_tokens_come_back_through_reused_host_slots_and_a_late_read_raises():
    from arctic_rl_core.engines.sampling.native.sampler import HostSlots, SampledTokens

    slots = HostSlots(4)
    steps = [
        SampledTokens.copy_to_host(
            torch.full((3,), i, device="cuda"), torch.full((3,), -float(i), device="cuda"), slots
        )
        for i in range(HostSlots.SLOTS + 1)
    ]
    assert steps[1].values() == ([1] * 3, [-1.0] * 3)
    assert steps[-1].values() == ([HostSlots.SLOTS] * 3, [-float(HostSlots.SLOTS)] * 3)
    with pytest.raises(RuntimeError, match="reused"):
        steps[0].values()  # its slot now holds the last step's tokens
