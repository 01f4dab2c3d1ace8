"""Publication's wire format in one process: bucket plan, byte packing round trip, checksums. The broadcast
itself (2 train ranks + 1 receiver, bit-exact, a corrupted tensor named) is in tests/trainer/test_trainer_dist.py."""
import torch

from trainer.publish import ALIGN, checksum, pack_bucket, plan_buckets, tied_names, unpack_bucket


def test_bucket_plan_keeps_order_aligns_and_isolates_big_tensors():
    nbytes = [10, 6, 100, 4, 4, 30]
    buckets, offsets, sizes = plan_buckets(nbytes, bucket_bytes=40)
    assert sum(buckets, []) == list(range(len(nbytes)))
    assert [2] in buckets  # larger than a bucket: alone
    assert all(o % ALIGN == 0 for o in offsets)
    for b, size in zip(buckets, sizes):
        assert all(offsets[i] + nbytes[i] <= size for i in b)
        assert len(b) == 1 or size <= 40 + ALIGN


def test_pack_unpack_round_trip_with_mixed_dtypes_and_odd_sizes():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(7, generator=g),
               torch.tensor(2.5, dtype=torch.float16), torch.randn(2, 3, generator=g, dtype=torch.float64)]
    nbytes = [t.numel() * t.element_size() for t in tensors]
    buckets, offsets, sizes = plan_buckets(nbytes, bucket_bytes=1 << 20)
    assert len(buckets) == 1
    buf = pack_bucket(tensors, offsets, sizes[0], torch.device("cpu"))
    header = {"dtypes": [str(t.dtype) for t in tensors], "shapes": [tuple(t.shape) for t in tensors],
              "offsets": offsets}
    for got, want in zip(unpack_bucket(buf, buckets[0], header), tensors):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def test_checksum_sees_a_flipped_bit_and_swapped_elements():
    t = torch.randn(1001, generator=torch.Generator().manual_seed(1))   # 4004 bytes: a zero-padded last word
    h = checksum(t)
    assert -(1 << 63) <= h < 1 << 63
    for i in (0, 123, 1000):
        for bit in (0, 31):
            flipped = t.clone()
            flipped.view(torch.int32)[i] ^= 1 << bit
            assert checksum(flipped) != h, (i, bit)
    swapped = t.clone()
    swapped[[3, 5]] = swapped[[5, 3]]   # words 1 and 2: the same bytes in other places
    assert checksum(swapped) != h and float(swapped.double().sum()) == float(t.double().sum())
    assert checksum(t.clone()) == h
    assert checksum(t, chunk=7) == h  # chunking does not change the hash
    assert checksum(t[1:]) != checksum(t[:-1])
    assert checksum(t.view(7, 143).t()) == checksum(t.view(7, 143).t().contiguous())  # bytes in logical order


def test_tied_names():
    from tests.support.trainer import tiny_model
    assert tied_names(tiny_model(tied=True)) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_names(tiny_model(tied=False)) == {}
