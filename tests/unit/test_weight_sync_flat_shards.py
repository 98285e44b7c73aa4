import pytest
import torch

from arctic_rl_core.weight_sync.flat_shards import flat_partition, partition_numel


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_flat_partitions_follow_zero3_and_reassemble_the_parameter(world):
    full = torch.arange(5 * 7, dtype=torch.float32).view(5, 7)
    shards = [flat_partition(full, rank, world) for rank in range(world)]
    assert all(s.partition.shape == (partition_numel(35, world),) and s.shape == (5, 7) for s in shards)
    flat = torch.cat([s.partition for s in shards])
    assert torch.equal(flat[:35].view(5, 7), full)
    assert not flat[35:].any()  # zero padding past the end


def test_flat_partition_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        flat_partition(torch.zeros(3), 2, 2)
