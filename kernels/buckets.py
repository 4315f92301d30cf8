"""The keys kernel configs are tuned and looked up under: shapes rounded to buckets, so that one tuned config serves
every call whose shape falls in the bucket."""

from __future__ import annotations

import math

DEFAULT_TILE_ROWS = 128  # rows of one tensor-core attention tile on current NVIDIA parts (guideline 3)


def next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def rows_bucket(rows: int, tile_rows: int = DEFAULT_TILE_ROWS) -> int:
    """G·(1+D) against the tile: the next power of two while it fits one tile, whole tiles above."""
    if rows <= tile_rows:
        return min(next_pow2(rows), tile_rows)
    return math.ceil(rows / tile_rows) * tile_rows


def kv_bucket(kv_len: int) -> int:
    return next_pow2(max(kv_len, 16))


def vocab_bucket(vocab_size: int) -> int:
    return next_pow2(vocab_size)
