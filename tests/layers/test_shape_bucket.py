"""shape_bucket.bucket: powers of two up to BUCKET, multiples of BUCKET above, never below n."""

from kvsplice.layers.shape_bucket import BUCKET, bucket


def test_bucket_sizes():
    assert [bucket(n) for n in (1, 2, 3, 5, 33, 64, 65, 128, 129)] == [1, 2, 4, 8, 64, 64, 128, 128, 192]


def test_buckets_cover_every_count_with_few_shapes():
    counts = range(1, 2049)
    assert all(n <= bucket(n) < max(2 * n, n + BUCKET) for n in counts)
    assert len({bucket(n) for n in counts}) == 7 + 2048 // BUCKET - 1
