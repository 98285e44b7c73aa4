import json

import pytest
import torch

from arctic_rl_core.weight_sync import WeightMismatchError, WeightSyncError, read_weights, write_weights
from arctic_rl_core.weight_sync.file_sync import INDEX_NAME, stored_shapes


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
        "model.norm.weight": torch.randn(16, generator=g),
    }


@pytest.mark.parametrize("shard_size,shards", [(1 << 30, 1), (1100, 3)])
def test_file_sync_round_trips_bit_exact_in_one_or_several_shards(tmp_path, shard_size, shards):
    weights = _weights()
    directory = write_weights(weights.items(), tmp_path / "sync", shard_size=shard_size)
    assert len(list(directory.glob("*.safetensors"))) == shards
    back = list(read_weights(directory, expected={n: t.shape for n, t in weights.items()}))
    assert [n for n, _ in back] == list(weights)
    for name, tensor in back:
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name])


def test_a_new_sync_replaces_the_previous_weights_as_a_whole(tmp_path):
    target = tmp_path / "sync"
    write_weights(_weights(0).items(), target, shard_size=1100)
    newer = {k: v for k, v in _weights(1).items() if k != "model.norm.weight"}
    write_weights(newer.items(), target)
    assert list(tmp_path.iterdir()) == [target]  # no staging or retired directories left behind
    assert {p.name for p in target.iterdir()} == {INDEX_NAME, "model-00001-of-00001.safetensors"}
    back = dict(read_weights(target))
    assert back.keys() == newer.keys() and all(torch.equal(back[n], newer[n]) for n in newer)


def test_a_failed_write_leaves_the_previous_weights_untouched(tmp_path):
    target = tmp_path / "sync"
    write_weights(_weights(0).items(), target)
    before = (target / INDEX_NAME).read_text()
    unreadable = {**_weights(1), "model.extra": torch.empty(4, device="meta")}
    with pytest.raises(NotImplementedError):
        write_weights(unreadable.items(), target)
    assert list(tmp_path.iterdir()) == [target]
    assert (target / INDEX_NAME).read_text() == before
    assert torch.equal(dict(read_weights(target))["model.norm.weight"], _weights(0)["model.norm.weight"])


def test_write_refuses_to_replace_a_directory_holding_other_files(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="holds files other than safetensors weights"):
        write_weights(_weights().items(), checkpoint)
    assert (checkpoint / "config.json").exists()


def test_tensors_sharing_storage_are_written_as_separate_tensors(tmp_path):
    embed = torch.randn(8, 4)
    tied = {"model.embed_tokens.weight": embed, "lm_head.weight": embed}
    back = dict(read_weights(write_weights(tied.items(), tmp_path / "sync")))
    assert torch.equal(back["lm_head.weight"], embed) and torch.equal(back["model.embed_tokens.weight"], embed)


def test_receiver_refuses_a_mismatch_from_the_headers_before_reading_data(tmp_path):
    weights = _weights()
    directory = write_weights(weights.items(), tmp_path / "sync")
    expected = {n: t.shape for n, t in weights.items() if n != "model.norm.weight"}
    expected["model.layers.0.self_attn.q_proj.weight"] = (8, 16)
    with pytest.raises(WeightMismatchError) as info:
        read_weights(directory, expected=expected)
    assert "unexpected model.norm.weight" in str(info.value)
    assert "model.layers.0.self_attn.q_proj.weight [16, 16] (expected [8, 16])" in str(info.value)
    assert stored_shapes(directory) == {n: tuple(t.shape) for n, t in weights.items()}


def test_reading_a_directory_without_weights_names_it(tmp_path):
    with pytest.raises(WeightSyncError, match="no weights at .*model.safetensors.index.json is missing"):
        read_weights(tmp_path)


def test_the_directory_is_a_standard_sharded_safetensors_checkpoint(tmp_path):
    weights = _weights()
    directory = write_weights(weights.items(), tmp_path / "sync", shard_size=1100)
    index = json.loads((directory / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(weights)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
