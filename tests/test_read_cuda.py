"""The host's read of call metadata on the GPU (``runtime.read_int32``: one kernel writes the
ranges into host-mapped memory and raises a flag a block): the values of every range come back
in order, across the kernel's block boundaries; in stream order behind a queued kernel (the
spin then the blocking wait); from two threads on two streams at once; through
``host_values``' spans of vectors and row-strided tables."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from prims_ts.cuda import runtime
from prims_ts.ops import _validate as V

pytestmark = pytest.mark.cuda

I32 = torch.int32


def _read(tensors):
    got = runtime.read_int32(torch.cuda.current_device(), [(t.data_ptr(), t.numel()) for t in tensors])
    return got.copy()


def _want(tensors):
    return np.concatenate([t.cpu().numpy().reshape(-1) for t in tensors]) if tensors else np.zeros(0, np.int32)


@pytest.mark.parametrize("sizes", [(1,), (9, 8, 1024), (0, 5, 0), (4095, 1, 4096), (4097,), (70001, 3, 17),
                                   (300_000, 2), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_ranges_come_back_in_order(sizes):
    g = torch.Generator(device="cuda").manual_seed(sum(sizes))
    tensors = [torch.randint(-2**31, 2**31 - 1, (n,), device="cuda", dtype=I32, generator=g) for n in sizes]
    for _ in range(2):  # the second read reuses the buffers and bumps the flags' value
        assert np.array_equal(_read(tensors), _want(tensors))


def test_more_ranges_than_the_kernel_takes_are_refused():
    t = torch.zeros(4, device="cuda", dtype=I32)
    with pytest.raises(ValueError, match="at most 8"):
        _read([t] * 9)


def test_read_waits_for_the_kernels_queued_before_it():
    """The values written by work queued ahead of the read, including work that outlasts the
    spin (the blocking wait takes over), are the ones read."""
    t = torch.zeros(5000, device="cuda", dtype=I32)
    for cycles in (0, 10_000_000):  # ~0 and ~5 ms of queued work
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t.fill_(cycles + 7)
        assert (_read([t]) == cycles + 7).all()


def test_two_threads_read_on_their_own_streams():
    results, errors = {}, []

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                t = torch.arange(i, i + 10_000, device="cuda", dtype=I32)
                for _ in range(50):
                    got = _read([t, t[:3]])
                    if not np.array_equal(got, np.concatenate([np.arange(i, i + 10_000), np.arange(i, i + 3)])):
                        raise AssertionError(f"thread {i}: wrong values")
                results[i] = True
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i * 100_000,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(results) == 2


def test_host_values_of_vectors_and_row_strided_tables():
    wide = (torch.arange(7 * 33, dtype=I32) * 3 - 50).view(7, 33).cuda()
    tensors = [torch.tensor([4, -2, 9], dtype=I32, device="cuda"), wide[1:, 2:30], wide[3], wide[:1, :1]]
    for t, v in zip(tensors, V.host_values(*tensors)):
        assert v.dtype == np.int64 and v.tolist() == t.reshape(-1).tolist()


def test_a_kept_view_outlives_the_buffer_growing():
    """A read's array is a view of the reader's mapped buffer; a later, larger read moves the
    reader to a new buffer, and the old one stays allocated while a view of it lives."""
    import gc

    small = torch.arange(100, device="cuda", dtype=I32)
    kept = runtime.read_int32(torch.cuda.current_device(), [(small.data_ptr(), 100)])
    big = torch.ones(1 << 21, device="cuda", dtype=I32)
    assert (_read([big]) == 1).all()
    gc.collect()
    assert kept.tolist() == list(range(100))
