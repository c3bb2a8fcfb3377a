"""Run-time metadata that fails closed, on the GPU: every run path that reads live metadata on
the device (the decode and MLA wrappers and standalone functions, both block-sparse wrappers)
given corrupt values inside a captured CUDA graph (or an eager standalone call) never reads
out of bounds; the rows the contract names are written as zeros and every other row is
bit-identical to the run on valid metadata. Corruptions: a page ID outside the pools, CSR
offsets outside the page list, a length longer than the pages listed, packed query offsets
outside the query rows (those rows have no place: they are not written), route offsets
outside ``block_indices``, block IDs past the request, repeated or unsorted. The decode and MLA
wrappers also under balanced split-KV, whose other rows match within rounding (``TUNINGS``).

Run under ``compute-sanitizer --tool memcheck`` with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``
(every tensor its own allocation) to see that nothing is read past a tensor.
"""
from __future__ import annotations

import pytest
import torch

import prims_ts
from prims_ts.testing import cumsum0

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
BF16, I32 = torch.bfloat16, torch.int32
NAN = float("nan")


def _graph(fn):
    """fn captured once (after a warm-up): its replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _zero(t) -> bool:
    return bool((t == 0).all())


# Decode and MLA wrappers: the static split (never balanced by the plan's lengths), and balanced
# split-KV (over 7 CTAs, so that the small problems cut their units into parts). Under the latter
# the key tiles are shared out by every request's length, so a corrupt length re-cuts the other
# requests' ranges and their partials' rounding: their rows then match the good run within bf16
# rounding, not bit for bit (the rows the contract names are zeros either way).
TUNINGS = {"static": prims_ts.Tuning(balanced_split=False),
           "balanced": prims_ts.Tuning(balanced_split=True, balanced_ctas=7, merge_fan=2)}


def _same(a, b, tuning) -> bool:
    """The other rows as the good run's: bit-identical under static split-KV."""
    if not tuning.balanced_split:
        return torch.equal(a, b)
    return bool(torch.isfinite(a).all()) and torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------
# Paged decode and MLA decode
# ----------------------------------------------------------------------------


def _csr(lens, ps, gen):
    """CSR pages of `lens` over a shuffled pool with spare pages: (indptr, indices, last, P)."""
    n = [(s + ps - 1) // ps for s in lens]
    P = sum(n) + 5
    ids = torch.randperm(P, generator=gen)[:sum(n)].to(I32)
    last = [s - (k - 1) * ps for s, k in zip(lens, n)]
    return (torch.tensor(cumsum0(n), dtype=I32, device=DEVICE), ids.to(DEVICE),
            torch.tensor(last, dtype=I32, device=DEVICE), P)


@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("lens", [[40, 100, 70, 33], [3000, 2000, 2500, 1500]], ids=["one-split", "split-kv"])
def test_decode_wrapper_replay(lens, tuning):
    tuning = TUNINGS[tuning]
    gen = torch.Generator().manual_seed(len(lens) + lens[0])
    ps, hq, hkv, d = 16, 8, 2, 128
    indptr, indices, last, P = _csr(lens, ps, gen)
    cache = torch.randn(P, 2, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
    q = torch.randn(len(lens), hq, d, generator=gen).to(BF16).to(DEVICE)
    out = torch.full_like(q, NAN)
    w = prims_ts.BatchDecodePagedTSWrapper(tuning=tuning)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=BF16)
    replay = _graph(lambda: w.run(q, cache, out=out))
    replay()
    good = out.clone()
    assert torch.isfinite(good).all()
    keep_i, keep_p = indices.clone(), indptr.clone()

    indices[int(keep_p[1]) + 1] = P  # request 1 reads a page ID past the pool
    replay()
    assert _zero(out[1]) and _same(out[[0, 2, 3]], good[[0, 2, 3]], tuning)
    indices.copy_(keep_i)
    indices[int(keep_p[2])] = -7  # request 2: a negative page ID
    replay()
    assert _zero(out[2]) and _same(out[[0, 1, 3]], good[[0, 1, 3]], tuning)
    indices.copy_(keep_i)
    indptr[2] = 10**6  # request 1 ends and request 2 starts past kv_indices
    replay()
    assert _zero(out[1]) and _zero(out[2]) and _same(out[[0, 3]], good[[0, 3]], tuning)
    indptr.copy_(keep_p)
    replay()
    assert torch.equal(out, good)


def test_standalone_decode_lengths_and_pages():
    gen = torch.Generator().manual_seed(3)
    lens, ps, hq, hkv, d = [300, 2500, 77], 32, 16, 4, 128
    indptr, indices, _, P = _csr(lens, ps, gen)
    k = torch.randn(P, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
    v = torch.randn(P, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
    q = torch.randn(len(lens), hq, d, generator=gen).to(BF16).to(DEVICE)
    sl = torch.tensor(lens, dtype=I32, device=DEVICE)
    ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_workspace_size(
        len(lens), hq, hkv, d, ps, 4096, q_dtype=BF16, device=DEVICE), dtype=torch.uint8, device=DEVICE)
    out = torch.full_like(q, NAN)

    def run():
        return prims_ts.prims_ts_batch_decode_with_kv_cache(q, (k, v), ws, indptr, indices, sl, 4096, out=out)

    good = run().clone()
    sl[0] = 301 + 9 * ps  # longer than its listed pages (and within max_seq_len)
    run()
    assert _zero(out[0]) and torch.equal(out[1:], good[1:])
    sl[0] = lens[0]
    sl[1] = 5000  # longer than its pages (and than max_seq_len, which the launch's splits cover)
    run()
    assert _zero(out[1]) and torch.equal(out[[0, 2]], good[[0, 2]])
    sl[1] = lens[1]
    indices[int(indptr[1]) + 40] = 2**31 - 1  # a page ID far past the pool, in request 1's split-KV chunks
    run()
    assert _zero(out[1]) and torch.equal(out[[0, 2]], good[[0, 2]])


def test_packed_query_offsets_outside_the_rows():
    """Packed decode: a request whose query offsets leave the query rows writes nothing (its
    rows have no place); the others are unaffected."""
    gen = torch.Generator().manual_seed(5)
    lens, ps, hq, hkv, d = [60, 90, 45], 16, 8, 2, 128
    indptr, indices, last, P = _csr(lens, ps, gen)
    cache = torch.randn(P, 2, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
    qo = torch.tensor([0, 2, 5, 6], dtype=I32, device=DEVICE)
    q = torch.randn(6, hq, d, generator=gen).to(BF16).to(DEVICE)
    out = torch.full_like(q, NAN)
    w = prims_ts.BatchDecodePagedTSWrapper()
    w.plan(indptr, indices, last, hq, hkv, d, ps, qo_indptr=qo, q_data_type=BF16, max_seq_len_q=3)
    replay = _graph(lambda: w.run(q, cache, out=out))
    replay()
    good = out.clone()
    out.fill_(NAN)
    qo[3] = 7  # request 2 would end past the 6 query rows
    replay()
    assert torch.equal(out[:5], good[:5]) and torch.isnan(out[5:]).all()


def test_pages_a_tile_loads_outside_the_band():
    """A causal window's first tile starts below the window (tiles are BN-aligned): a bad page
    ID there is one the CTA would load, so the request is written as zeros."""
    gen = torch.Generator().manual_seed(9)
    lens, ps, hq, hkv, d = [300, 260], 16, 8, 2, 128
    indptr, indices, last, P = _csr(lens, ps, gen)
    cache = torch.randn(P, 2, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
    q = torch.randn(len(lens), hq, d, generator=gen).to(BF16).to(DEVICE)
    out = torch.full_like(q, NAN)
    w = prims_ts.BatchDecodePagedTSWrapper()
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=BF16, mask_type="causal", window_left=50)
    replay = _graph(lambda: w.run(q, cache, out=out))
    replay()
    good = out.clone()
    indices[int(indptr[0]) + 13] = P + 1000  # keys 208-223: below request 0's window (249..299), in its first tile
    replay()
    assert _zero(out[0]) and torch.equal(out[1], good[1])


def test_packed_queries_past_the_planned_bound():
    """A request given more queries than the plan's max_seq_len_q (its rows past the launch's row
    tiles have no tile): its tiles' rows are zeros, the rows past them untouched, the other
    requests unaffected; nothing is written past the workspace's partials."""
    gen = torch.Generator().manual_seed(13)
    lens, ps, hq, hkv, d = [900, 1500, 700], 16, 8, 2, 128
    indptr, indices, last, P = _csr(lens, ps, gen)
    cache = torch.randn(P, 2, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
    qo = torch.tensor([0, 2, 5, 7], dtype=I32, device=DEVICE)
    q = torch.randn(7, hq, d, generator=gen).to(BF16).to(DEVICE)
    out = torch.full_like(q, NAN)
    w = prims_ts.BatchDecodePagedTSWrapper()
    w.plan(indptr, indices, last, hq, hkv, d, ps, qo_indptr=qo, q_data_type=BF16)  # max_seq_len_q 3
    replay = _graph(lambda: w.run(q, cache, out=out))
    replay()
    good = out.clone()
    out.fill_(NAN)
    qo[2] = 6  # request 1: 4 queries
    replay()
    assert torch.equal(out[:2], good[:2]) and _zero(out[2:5]) and torch.isnan(out[5]).all()
    assert torch.isfinite(out[6]).all()
    qo[2] = 5
    replay()
    assert torch.equal(out, good)  # the split tickets and partials are intact


@pytest.mark.parametrize("tuning", list(TUNINGS))
@pytest.mark.parametrize("h", [16, 64], ids=["swapped", "twin"])
def test_mla_wrapper_replay(h, tuning):
    """16 heads take the swapped tile, 64 the twin (rows of 64 on sm_90a). Under balanced
    split-KV over 7 CTAs request 1's 22 key tiles are cut into 6 parts, which merge_fan=2 merges
    in two levels (three groups, then the groups): the poisoned page lies in the first group."""
    tuning = TUNINGS[tuning]
    gen = torch.Generator().manual_seed(11 + h)
    lens, ps = [100, 1400, 333, 64], 64
    cols = 24
    P = len(lens) * cols + 3
    table = torch.randperm(P, generator=gen)[:len(lens) * cols].to(I32).view(len(lens), cols).to(DEVICE)
    sl = torch.tensor(lens, dtype=I32, device=DEVICE)
    pool = torch.randn(P, ps, 576, generator=gen).to(BF16).to(DEVICE)
    q = torch.randn(len(lens), 1, h, 576, generator=gen).to(BF16).to(DEVICE)
    out = torch.full((len(lens), 1, h, 512), NAN, dtype=BF16, device=DEVICE)
    w = prims_ts.BatchMLADecodePagedTSWrapper(tuning=tuning)
    w.plan(table, sl, h, 512, 64, ps, seq_len_q=1, max_kv_len=cols * ps)
    replay = _graph(lambda: w.run(q, pool, bmm1_scale=0.04, out=out))
    replay()
    good = out.clone()
    keep = table.clone()
    table[1, 5] = P + 100
    replay()
    assert _zero(out[1]) and _same(out[[0, 2, 3]], good[[0, 2, 3]], tuning)
    table.copy_(keep)
    sl[2] = cols * ps + 1  # past the table's columns
    replay()
    assert _zero(out[2]) and _same(out[[0, 1, 3]], good[[0, 1, 3]], tuning)
    sl[2] = lens[2]
    replay()
    assert torch.equal(out, good)


# ----------------------------------------------------------------------------
# Block-sparse (paged and contiguous)
# ----------------------------------------------------------------------------


def _routes(B, hkv, rows, nblk, gen, density=0.6):
    ptr, ids = torch.zeros(B, hkv, rows + 1, dtype=I32), []
    for b in range(B):
        for h in range(hkv):
            for r in range(rows):
                ptr[b, h, r] = len(ids)
                sel = (torch.rand(nblk, generator=gen) < density).nonzero().flatten().tolist()
                ids += sel if len(sel) >= 2 else [0, 1]
            ptr[b, h, rows] = len(ids)
    return ptr.to(DEVICE), torch.tensor(ids, dtype=I32, device=DEVICE)


def _row(out, b, h, r, qb, g):
    return out[b, r * qb:(r + 1) * qb, h * g:(h + 1) * g]


def _others_equal(out, good, rows_bad, qb, g):
    """Every route row but `rows_bad` (a set of (b, h, r)) equals the good run."""
    B, sq, hq, _ = out.shape
    for b in range(B):
        for h in range(hq // g):
            for r in range(-(-sq // qb)):
                if (b, h, r) not in rows_bad and not torch.equal(_row(out, b, h, r, qb, g), _row(good, b, h, r, qb, g)):
                    return False
    return True


@pytest.mark.parametrize("contiguous", [False, True], ids=["paged", "contiguous"])
def test_block_sparse_replay(contiguous):
    gen = torch.Generator().manual_seed(17 + contiguous)
    B, sq, skv, hq, hkv, d, qb, kvb, ps = 2, 256, 1024, 8, 2, 128, 64, 64, 16
    g, rows, nblk = hq // hkv, sq // qb, skv // kvb
    ptr, ids = _routes(B, hkv, rows, nblk, gen)
    q = torch.randn(B, sq, hq, d, generator=gen).to(BF16).to(DEVICE)
    out = torch.full_like(q, NAN)
    if contiguous:
        k = torch.randn(B, skv, hkv, d, generator=gen).to(BF16).to(DEVICE)
        v = torch.randn_like(k)
        w = prims_ts.BlockSparseTSWrapper()
        w.plan(B, sq, skv, hq, hkv, d, qb, kvb, device=DEVICE, max_blocks_per_row=nblk, use_kv_valid_bits=False,
               q_data_type=BF16)
        pages = None
        replay = _graph(lambda: w.run(q, k, v, ptr, ids, out=out))
    else:
        indptr, pages, _, P = _csr([skv] * B, ps, gen)
        cache = torch.randn(P, 2, hkv, ps, d, generator=gen).to(BF16).to(DEVICE)
        w = prims_ts.BlockSparsePagedTSWrapper()
        w.plan(indptr, sq, skv, hq, hkv, d, qb, kvb, ps, max_blocks_per_row=nblk, use_kv_valid_bits=False,
               q_data_type=BF16)
        replay = _graph(lambda: w.run(q, cache, pages, ptr, ids, out=out))
    replay()
    good = out.clone()
    assert torch.isfinite(good).all()
    keep_ids, keep_ptr = ids.clone(), ptr.clone()

    def check(bad_rows):
        replay()
        assert all(_zero(_row(out, b, h, r, qb, g)) for b, h, r in bad_rows), bad_rows
        assert _others_equal(out, good, bad_rows, qb, g)
        ids.copy_(keep_ids)
        ptr.copy_(keep_ptr)

    at = int(keep_ptr[0, 1, 2])
    ids[at] = nblk  # (0, 1, 2): a block starting at Skv
    check({(0, 1, 2)})
    ids[at], ids[at + 1] = keep_ids[at + 1], keep_ids[at]  # unsorted
    check({(0, 1, 2)})
    ids[at + 1] = keep_ids[at]  # repeated
    check({(0, 1, 2)})
    ptr[1, 0, 2] = ids.shape[0] + 5  # (1, 0, 1) ends and (1, 0, 2) starts past block_indices
    check({(1, 0, 1), (1, 0, 2)})
    ptr[0, 0, 1] = -3  # (0, 0, 0) ends before it starts, (0, 0, 1) starts before block_indices
    check({(0, 0, 0), (0, 0, 1)})
    if pages is not None:
        keep_pages = pages.clone()
        blk = int(keep_ids[int(keep_ptr[1, 1, 3])])  # a block route row (1, 1, 3) reads
        pages[int(indptr[1]) + blk * kvb // ps] = 10**7  # its first page: past the pool
        users = {(1, h, r) for h in range(hkv) for r in range(rows)
                 if blk in keep_ids[int(keep_ptr[1, h, r]):int(keep_ptr[1, h, r + 1])].tolist()}
        check(users)
        pages.copy_(keep_pages)
    replay()
    assert torch.equal(out, good)
