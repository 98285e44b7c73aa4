"""The forest's attention masks: the FlexAttention block mask encodes exactly the dense pattern."""

import pytest
import torch

from arctic_rl_core.zorro.train import ForestAttention, build_prefix_forest
from arctic_rl_core.zorro.train.attention import FLEX_BLOCK, pad_for_kernel


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


def attention_for(forest, kernel):
    _, positions, subtree_end = pad_for_kernel(forest.token_ids, forest.positions, forest.subtree_end, kernel)
    return ForestAttention(positions, subtree_end, kernel, max_position=int(forest.positions.max()))


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
                rows, cols = slice(qb * FLEX_BLOCK, (qb + 1) * FLEX_BLOCK), slice(kb * FLEX_BLOCK, (kb + 1) * FLEX_BLOCK)
                assert not dense[rows, cols].any(), f"block ({qb}, {kb}) listed twice"
                dense[rows, cols] = values[rows, cols]
    return dense


@pytest.mark.parametrize("window", [None, 150])
def test_block_mask_expands_to_the_dense_forest_mask(window):
    forest = grpo_forest(groups=2, prompt=300, samples=3, response=90)
    dense = attention_for(forest, "dense").mask_for(window)[0, 0]
    blocks = attention_for(forest, "flex").mask_for(window)
    expanded = expand_block_mask(blocks)
    length = len(forest.token_ids)
    assert torch.equal(expanded[:length, :length], dense)
    # Padding tokens see only themselves.
    assert torch.equal(expanded[length:, :], torch.eye(len(expanded), dtype=torch.bool)[length:])


def test_block_mask_skips_blocks_of_other_samples_and_runs_shared_prompt_blocks_unmasked():
    forest = grpo_forest(groups=1, prompt=512, samples=4, response=257)
    blocks = attention_for(forest, "flex").mask
    total = blocks.kv_num_blocks.shape[-1] ** 2
    listed = int(blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum())
    # Causal attention over the packed sequence would list more than half the blocks; the forest far fewer.
    assert listed < 0.4 * total
    # The first block of the last sample's response reads the 4 prompt blocks without a mask, its own diagonal with.
    assert blocks.full_kv_num_blocks[0, 0, -2] == 4 and blocks.kv_num_blocks[0, 0, -2] == 1


def test_window_wider_than_every_row_reuses_the_full_mask():
    attention = attention_for(grpo_forest(groups=1, prompt=20, samples=2, response=5), "dense")
    assert attention.mask_for(4096) is attention.mask
