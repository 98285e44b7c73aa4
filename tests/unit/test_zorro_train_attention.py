"""The forest's attention under each kernel's layout: block mask and varlen sequences encode the dense pattern."""

import pytest
import torch
import torch.nn.functional as F

from arctic_rl_core.zorro.train import ForestAttention, VarlenLayout, build_prefix_forest
from arctic_rl_core.zorro.train.attention import FLEX_BLOCK
from arctic_rl_core.zorro.train.split_attention import SplitLayout
from tests.prompt_rows import padded

CPU = torch.device("cpu")


def grpo_forest(groups: int, prompt: int, samples: int, response: int):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(groups):
        p = torch.randint(3, 1000, (prompt,), generator=gen)
        rows += [torch.cat([p, torch.randint(3, 1000, (response,), generator=gen)]) for _ in range(samples)]
    input_ids = torch.stack(rows)
    select = torch.zeros_like(input_ids, dtype=torch.bool)
    select[:, prompt - 1 : -1] = True
    return build_prefix_forest(input_ids, torch.ones_like(input_ids), select)


def expand_block_mask(block_mask) -> torch.Tensor:
    """The token-level mask a block mask stands for: full blocks all True, partial blocks by mask_mod, others False."""
    length = block_mask.seq_lengths[0]
    dense = torch.zeros(length, length, dtype=torch.bool)
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    by_mask_mod = block_mask.mask_mod(0, 0, q, k)
    lists = [
        (block_mask.kv_num_blocks, block_mask.kv_indices, by_mask_mod),
        (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, torch.ones_like(by_mask_mod)),
    ]
    for counts, indices, values in lists:
        for qb in range(length // FLEX_BLOCK):
            for kb in indices[0, 0, qb, : counts[0, 0, qb]].tolist():
                rows = slice(qb * FLEX_BLOCK, (qb + 1) * FLEX_BLOCK)
                cols = slice(kb * FLEX_BLOCK, (kb + 1) * FLEX_BLOCK)
                assert not dense[rows, cols].any(), f"block ({qb}, {kb}) listed twice"
                dense[rows, cols] = values[rows, cols]
    return dense


@pytest.mark.parametrize("window", [None, 150])
def test_block_mask_expands_to_the_dense_forest_mask(window):
    forest = grpo_forest(groups=2, prompt=300, samples=3, response=90)
    dense = ForestAttention(forest, "dense", CPU).mask_for(window)[0, 0]
    blocks = ForestAttention(forest, "flex", CPU).mask_for(window)
    expanded = expand_block_mask(blocks)
    length = len(forest.token_ids)
    assert torch.equal(expanded[:length, :length], dense)
    # Padding tokens see only themselves.
    assert torch.equal(expanded[length:, :], torch.eye(len(expanded), dtype=torch.bool)[length:])


def test_block_mask_skips_blocks_of_other_samples_and_runs_shared_prompt_blocks_unmasked():
    forest = grpo_forest(groups=1, prompt=512, samples=4, response=257)
    blocks = ForestAttention(forest, "flex", CPU).mask
    total = blocks.kv_num_blocks.shape[-1] ** 2
    listed = int(blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum())
    # Causal attention over the packed sequence would list more than half the blocks; the forest far fewer.
    assert listed < 0.4 * total
    # The first block of the last sample's response reads the 4 prompt blocks without a mask, its own diagonal with.
    assert blocks.full_kv_num_blocks[0, 0, -2] == 4 and blocks.kv_num_blocks[0, 0, -2] == 1


def test_window_wider_than_every_row_reuses_the_full_mask():
    attention = ForestAttention(grpo_forest(groups=1, prompt=20, samples=2, response=5), "dense", CPU)
    assert attention.mask_for(4096) is attention.mask


def varlen_reference(q, k, v, layout: VarlenLayout, window):
    """FlashAttention varlen semantics, one sequence at a time: causal aligned to the bottom right, GQA."""
    out = torch.empty_like(q)
    cu_q, cu_k = layout.cu_seq_q.tolist(), layout.cu_seq_k.tolist()
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        allowed = (j <= i) & (i - j < window if window is not None else True)
        queries, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        segment = [t.transpose(0, 1) for t in (q[queries], k[keys], v[keys])]
        attended = F.scaled_dot_product_attention(*segment, attn_mask=allowed, enable_gqa=True)
        out[queries] = attended.transpose(0, 1)
    return out


def nested_forest():
    """A shared system prompt, two questions, three samples each, and a row that ends inside another's history."""
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(3, 1000, (12,), generator=gen).tolist()
    rows = []
    for question in (5, 9):
        prompt = system + torch.randint(3, 1000, (question,), generator=gen).tolist()
        rows += [(prompt, torch.randint(3, 1000, (n,), generator=gen).tolist()) for n in (4, 7, 6)]
    rows.append((system[:8], system[8:] + [1]))
    return build_prefix_forest(*padded(rows))


@pytest.mark.parametrize("window", [None, 7])
def test_varlen_sequences_over_gathered_ancestors_give_the_dense_forest_attention(window):
    forest = nested_forest()
    length = len(forest.token_ids)
    q, k, v = torch.randn(length, 4, 16), torch.randn(length, 2, 16), torch.randn(length, 2, 16)

    layout = VarlenLayout.of(forest)
    gathered = varlen_reference(q, k[layout.key_index], v[layout.key_index], layout, window)
    dense = ForestAttention(forest, "dense", CPU)
    expected = dense(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], sliding_window=window)
    torch.testing.assert_close(gathered, expected[0])
    assert layout.max_k == int(forest.positions.max()) + 1


def test_split_layout_passes_cover_each_query_once_per_ancestor_level():
    forest = nested_forest()
    layout = SplitLayout.of(forest)
    # system prompt -> questions -> samples: two levels of ancestors; the own pass is every node once.
    assert len(layout.ancestors) == 2
    assert torch.equal(layout.own.q_index, torch.arange(len(forest.token_ids)))
    for spans in layout.ancestors:
        queries = [q for q0, q1, _, _ in spans for q in range(q0, q1)]
        assert len(set(queries)) == len(queries), "a query appears twice within one pass"
        for q0, q1, k0, k1 in spans:  # a node's descendants follow its own tokens, up to its subtree's end
            assert k0 < k1 == q0 < q1 and int(forest.subtree_end[k0]) == q1


@pytest.mark.parametrize("forest", ["grpo", "nested"])
def test_split_passes_merged_by_lse_give_the_dense_attention_and_its_gradients(forest):
    forest = grpo_forest(groups=2, prompt=30, samples=3, response=9) if forest == "grpo" else nested_forest()
    length = len(forest.token_ids)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(1, heads, length, 16, generator=gen, dtype=torch.float64) for heads in (4, 2, 2)]
    grad_out = torch.randn(1, length, 4, 16, generator=gen, dtype=torch.float64)

    def run(kernel):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = ForestAttention(forest, kernel, CPU)(*leaves, scaling=0.3)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    for name, got, want in zip(("out", "dq", "dk", "dv"), run("varlen"), run("dense")):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=name)


def test_varlen_kernel_with_a_binding_window_is_refused_off_cuda():
    attention = ForestAttention(grpo_forest(groups=1, prompt=20, samples=2, response=5), "varlen", CPU)
    q, k = torch.randn(1, 2, attention.token_ids.numel(), 8), torch.randn(1, 1, attention.token_ids.numel(), 8)
    with pytest.raises(ValueError, match="binding sliding window needs CUDA"):
        attention(q, k, k, sliding_window=4)
