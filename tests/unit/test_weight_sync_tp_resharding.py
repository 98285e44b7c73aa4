import types

import pytest
import torch

from arctic_rl_core.weight_sync.tp_resharding import AttentionHeads, tp_narrow, tp_shard, tp_shard_shape

HIDDEN, HEAD_DIM, INTER, VOCAB = 64, 8, 96, 48


def _layer(num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, kv = num_heads * HEAD_DIM, num_kv_heads * HEAD_DIM
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "lm_head.weight": (VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (q, HIDDEN),
        "model.layers.0.self_attn.q_proj.bias": (q,),
        "model.layers.0.self_attn.k_proj.weight": (kv, HIDDEN),
        "model.layers.0.self_attn.k_proj.bias": (kv,),
        "model.layers.0.self_attn.v_proj.weight": (kv, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, q),
        "model.layers.0.self_attn.q_norm.weight": (HEAD_DIM,),
        "model.layers.0.mlp.gate_proj.weight": (INTER, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (INTER, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTER),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.norm.weight": (HIDDEN,),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


SPLIT_DIM = {"embed_tokens": 0, "lm_head": 0, "q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0,
             "o_proj": 1, "down_proj": 1}  # fmt: skip


def _split_dim(name: str) -> int | None:
    return next((dim for key, dim in SPLIT_DIM.items() if f"{key}." in name), None)


@pytest.mark.parametrize("tp", [2, 4])
def test_shards_over_all_tp_ranks_reassemble_the_full_tensor(tp):
    heads = AttentionHeads(num_heads=8, num_kv_heads=4, head_dim=HEAD_DIM)
    for name, full in _layer(8, 4).items():
        shards = [tp_shard(name, full, p, tp, heads) for p in range(tp)]
        dim = _split_dim(name)
        if dim is None:
            assert all(s is full for s in shards), f"{name} should be replicated"
        else:
            assert torch.equal(torch.cat(shards, dim=dim), full), name
            assert all(s.shape[dim] == full.shape[dim] // tp for s in shards), name


def test_fewer_kv_heads_than_tp_ranks_gives_each_rank_the_kv_head_its_queries_use():
    heads = AttentionHeads(num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM)
    k = _layer(8, 2)["model.layers.0.self_attn.k_proj.weight"]
    shards = [tp_shard("model.layers.0.self_attn.k_proj.weight", k, p, 4, heads) for p in range(4)]
    # Ranks 0, 1 hold query heads 0-3, which attend to kv head 0; ranks 2, 3 hold heads 4-7 (kv head 1).
    assert torch.equal(shards[0], k[:HEAD_DIM]) and torch.equal(shards[1], k[:HEAD_DIM])
    assert torch.equal(shards[2], k[HEAD_DIM:]) and torch.equal(shards[3], k[HEAD_DIM:])


def test_shard_shapes_agree_with_the_shards():
    heads = AttentionHeads(num_heads=8, num_kv_heads=2, head_dim=HEAD_DIM)
    for name, full in _layer(8, 2).items():
        for p in range(4):
            assert tp_shard_shape(name, full.shape, p, 4, heads) == tuple(tp_shard(name, full, p, 4, heads).shape)


def test_row_parallel_biases_are_kept_whole():
    assert tp_narrow("model.layers.3.self_attn.o_proj.bias", (64,), 1, 2, None) is None
    assert tp_narrow("model.layers.3.mlp.down_proj.bias", (64,), 1, 2, None) is None


def test_tp_1_passes_any_name_through():
    assert tp_narrow("vision_tower.patch_embed.weight", (3, 4), 0, 1, None) is None


def test_unknown_parameter_and_indivisible_sizes_are_refused_by_name():
    heads = AttentionHeads(num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="no tensor-parallel rule for 'vision_tower.patch_embed.weight'"):
        tp_narrow("vision_tower.patch_embed.weight", (3, 4), 0, 2, heads)
    with pytest.raises(ValueError, match=r"lm_head.weight over tp=4: its vocabulary \(50, dim 0\)"):
        tp_narrow("lm_head.weight", (50, 8), 0, 4, heads)
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by 4"):
        tp_narrow("model.layers.0.self_attn.q_proj.weight", (6 * HEAD_DIM, 8), 0, 4, heads)
    with pytest.raises(ValueError, match="needs the model's AttentionHeads"):
        tp_narrow("model.layers.0.self_attn.q_proj.weight", (6 * HEAD_DIM, 8), 0, 2, None)
    with pytest.raises(ValueError, match="are the AttentionHeads those of this model"):
        tp_narrow("model.layers.0.self_attn.k_proj.weight", (3 * HEAD_DIM, 8), 0, 2, heads)


def test_attention_heads_from_hf_configs_with_and_without_head_dim():
    qwen2 = types.SimpleNamespace(num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    qwen3 = types.SimpleNamespace(num_attention_heads=16, num_key_value_heads=8, hidden_size=1024, head_dim=128)
    assert AttentionHeads.from_hf_config(qwen2) == AttentionHeads(14, 2, 64)
    assert AttentionHeads.from_hf_config(qwen3) == AttentionHeads(16, 8, 128)
