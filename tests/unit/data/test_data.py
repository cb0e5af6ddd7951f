"""The memory-mapped loader: deterministic, world-size independent."""

from __future__ import annotations

import numpy as np
import torch

from lmyard.data import shards as fmt
from lmyard.data.loader import TokenStream, TrainBatches


def _stream(tmp_path, sizes=(1000, 777, 1500)):
    paths, start = [], 0
    for i, n in enumerate(sizes):
        p = tmp_path / f"train_{i:06d}.bin"
        fmt.write_shard(p, np.arange(start, start + n) % 60000, fmt.VERSION_U16)
        paths.append(str(p))
        start += n
    return TokenStream(paths), start


def test_stream_reads_across_shard_boundaries(tmp_path):
    stream, total = _stream(tmp_path)
    assert stream.total == total
    assert stream.read(990, 20).tolist() == list(range(990, 1010))
    assert stream.read(1770, 10).tolist() == list(range(1770, 1780))


def test_targets_are_inputs_shifted_by_one(tmp_path):
    stream, _ = _stream(tmp_path)
    x, y = TrainBatches(stream, 16, 4, 1, 0, 1).micro_batch(0, 0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x.shape == (4, 16)


def _global_step(stream, world, accum, micro_batch, cursor):
    """Every sequence one optimizer step reads, across all ranks and micro-steps, sorted."""
    rows = []
    for rank in range(world):
        tb = TrainBatches(stream, 32, micro_batch, accum, rank, world)
        for m in range(accum):
            x, _ = tb.micro_batch(cursor, m)
            rows.extend(tuple(r) for r in x.tolist())
    return sorted(rows)


def test_token_order_does_not_depend_on_world_size(tmp_path):
    stream, _ = _stream(tmp_path)
    # 16 sequences per step as 1 rank x 4 micro-steps x 4, 2 ranks x 2 x 4, 4 ranks x 1 x 4
    for cursor in (0, 16, 80):
        one = _global_step(stream, 1, 4, 4, cursor)
        assert one == _global_step(stream, 2, 2, 4, cursor) == _global_step(stream, 4, 1, 4, cursor)


def test_loader_is_deterministic_and_wraps_after_an_epoch(tmp_path):
    stream, total = _stream(tmp_path)
    a = TrainBatches(stream, 32, 4, 1, 1, 2)
    b = TrainBatches(stream, 32, 4, 1, 1, 2)
    assert torch.equal(a.micro_batch(40, 0)[0], b.micro_batch(40, 0)[0])
    n_seq = (total - 1) // 32
    assert torch.equal(a.micro_batch(n_seq, 0)[0], a.micro_batch(0, 0)[0])


def _order(stream, world, accum, micro_batch, steps, seed, start=0):
    """The global sequences of `steps` optimizer steps from cursor `start`, in global order (rank-major per micro-step)."""
    per_step = world * accum * micro_batch
    out = []
    for step in range(steps):
        cursor = start + step * per_step
        for m in range(accum):
            for rank in range(world):
                tb = TrainBatches(stream, 32, micro_batch, accum, rank, world, shuffle_seed=seed)
                out.extend(tuple(r) for r in tb.micro_batch(cursor, m)[0][:, :4].tolist())
    return out


def test_shuffled_order_is_the_same_for_any_world_size(tmp_path):
    stream, _ = _stream(tmp_path)
    one = _order(stream, 1, 4, 2, 6, seed=7)
    assert one == _order(stream, 2, 2, 2, 6, seed=7) == _order(stream, 4, 1, 2, 6, seed=7)
    assert one != _order(stream, 1, 4, 2, 6, seed=None), "the seed must change the order"


def test_shuffled_resume_mid_epoch_continues_bit_for_bit(tmp_path):
    stream, _ = _stream(tmp_path)
    uninterrupted = _order(stream, 2, 1, 4, 20, seed=3)  # 20 steps of 8 sequences: 160 of 102 per epoch
    resumed = _order(stream, 2, 1, 4, 7, seed=3) + _order(stream, 2, 1, 4, 13, seed=3, start=7 * 8)
    assert resumed == uninterrupted


def test_every_epoch_reads_every_sequence_once_in_a_new_order(tmp_path):
    stream, total = _stream(tmp_path)
    tb = TrainBatches(stream, 32, 4, 1, 0, 1, shuffle_seed=11)
    n = tb.n_seq
    first, second = tb.order(0, n), tb.order(n, n)
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))
    assert first.tolist() != second.tolist() and first.tolist() != list(range(n))
    assert np.array_equal(tb.order(n - 3, 6), np.concatenate([first[-3:], second[:3]]))  # across the epoch edge
    assert tb.epoch(n + n // 2) == 1.5 and tb.tokens_per_epoch == n * 32


def test_repeating_data_is_a_warning_with_the_numbers(tmp_path):
    stream, _ = _stream(tmp_path)
    tb = TrainBatches(stream, 32, 4, 2, 0, 1, shuffle_seed=1)  # 8 sequences a step, 102 in an epoch
    assert tb.repeat_warning(12) is None  # 96 sequences: less than one epoch
    text = tb.repeat_warning(30)
    assert "train.max_steps=30 reads 7,680 tokens, 2.35 epochs" in text
    assert "(3,264 tokens in 102 sequences of 32): data repeats from step 13 on" in text
