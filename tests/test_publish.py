"""Publication's wire format in one process: bucket plan, byte packing round trip, checksums. The broadcast
itself (2 train ranks + 1 receiver, bit-exact, a corrupted tensor named) is in tests/test_trainer_dist.py."""
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
    t = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    s, h = checksum(t)
    assert s == float(t.double().sum())
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1
    swapped = t.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert checksum(flipped)[1] != h and checksum(swapped)[1] != h
    assert checksum(swapped)[0] == s or abs(checksum(swapped)[0] - s) < 1e-9  # the sum alone would miss it
    assert checksum(t.clone())[1] == h
    assert checksum(t, chunk=7) == (s, h)  # chunking does not change the hash


def test_tied_names():
    from tests.test_trainer import tiny_model
    assert tied_names(tiny_model(tied=True)) == {"lm_head.weight": "model.embed_tokens.weight"}
    assert tied_names(tiny_model(tied=False)) == {}
