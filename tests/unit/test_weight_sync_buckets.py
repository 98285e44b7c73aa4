import pytest
import torch

from arctic_rl_core.weight_sync.buckets import (
    ALIGNMENT,
    empty_bucket,
    pack_bucket,
    plan_buckets,
    plan_tensor_buckets,
    unpack_bucket,
)


def _mixed() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.steps", torch.arange(5, dtype=torch.int64)),
        ("d.mask", torch.tensor([True, False, True])),
        ("e.half", torch.randn(2, 3, generator=g).to(torch.float16)),
        ("f.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("g.empty", torch.empty(0, 4)),
    ]


def _round_trip(named, bucket_size):
    out = []
    for layout in plan_tensor_buckets(named, bucket_size):
        by_name = dict(named)
        data = pack_bucket(layout, [by_name[n] for n in layout.names], empty_bucket(layout, "cpu"))
        out.extend(unpack_bucket(layout, data))
    return out


@pytest.mark.parametrize("bucket_size", [1 << 20, 300])
def test_buckets_round_trip_mixed_dtypes_bit_exact(bucket_size):
    named = _mixed()
    back = _round_trip(named, bucket_size)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, want), (_, got) in zip(named, back):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_unpacked_tensors_are_views_of_the_bucket_not_copies():
    named = _mixed()
    [layout] = plan_tensor_buckets(named, 1 << 20)
    data = pack_bucket(layout, [t for _, t in named], empty_bucket(layout, "cpu"))
    views = dict(unpack_bucket(layout, data))
    for view in views.values():
        assert view.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    data.zero_()
    assert not views["a.weight"].any() and not views["d.mask"].any()


def test_buckets_stay_within_bucket_size_and_an_oversized_tensor_gets_its_own():
    named = [("small.0", torch.zeros(100)), ("big", torch.zeros(1000)), ("small.1", torch.zeros(100)),
             ("small.2", torch.zeros(100))]  # fmt: skip
    layouts = plan_tensor_buckets(named, 1024)
    assert [layout.names for layout in layouts] == [["small.0"], ["big"], ["small.1", "small.2"]]
    assert layouts[1].nbytes == 4000
    assert all(layout.nbytes <= 1024 for i, layout in enumerate(layouts) if i != 1)


def test_every_slot_starts_aligned_so_it_can_be_viewed_as_its_dtype():
    [layout] = plan_tensor_buckets(_mixed(), 1 << 20)
    offsets = [slot.offset for slot in layout.slots]
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    assert offsets == sorted(offsets)
    for prev, slot in zip(layout.slots, layout.slots[1:]):
        assert slot.offset >= prev.offset + prev.nbytes


def test_planning_is_deterministic_and_keeps_the_input_order():
    specs = [(f"layer.{i}", torch.bfloat16 if i % 2 else torch.float32, (i + 1, 33)) for i in range(40)]
    first, second = plan_buckets(specs, 4096), plan_buckets(list(specs), 4096)
    assert first == second
    assert [n for layout in first for n in layout.names] == [name for name, _, _ in specs]


def test_pack_refuses_a_tensor_that_does_not_match_its_slot():
    named = [("w", torch.zeros(2, 2))]
    [layout] = plan_tensor_buckets(named, 1024)
    with pytest.raises(ValueError, match=r"w: expected torch.float32 \[2, 2\], got torch.bfloat16 \[2, 2\]"):
        pack_bucket(layout, [torch.zeros(2, 2, dtype=torch.bfloat16)], empty_bucket(layout, "cpu"))
    with pytest.raises(ValueError, match="uint8 of 16 bytes"):
        pack_bucket(layout, [torch.zeros(2, 2)], torch.empty(15, dtype=torch.uint8))


def test_packing_parameters_gives_plain_bytes_outside_autograd():
    layer = torch.nn.Linear(4, 3)
    named = list(layer.named_parameters())
    [layout] = plan_tensor_buckets(named, 1024)
    data = pack_bucket(layout, [p for _, p in named], empty_bucket(layout, "cpu"))
    assert not data.requires_grad and data.grad_fn is None
    assert torch.equal(dict(unpack_bucket(layout, data))["weight"], layer.weight.detach())
