"""Paged prefill semantics on CPU: the reference, the public function and the wrapper.

Two independent oracles:

* ``gathered_ref``: K/V of every request copied token by token out of the pools
  (``page = table[b, j // page_size]``, ``slot = j % page_size``) into packed
  contiguous storage, then ``prims_ts.reference.batch_prefill`` (the contiguous
  path, already tested against direct math in test_reference.py) in float64;
* ``naive_paged``: a float64 loop per (request, row, head) that reads each key
  straight from its page and does the softmax by hand (small problems only).

``prims_ts.reference.batch_prefill_paged(..., compute_dtype=float64)`` must equal
both to float64 round-off. The public ``batch_prefill_with_paged_kv_cache`` and
``BatchPrefillPagedTSWrapper`` (planned over the CSR form of the same pages, which it
snapshots; ``qo_indptr`` stays bound) on CPU tensors must match them within the project's
tolerance (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16), write every
element of a NaN-poisoned ``out`` and return ``out`` itself.

Every pool slot that no request uses (whole unused pages, and the tail of each
request's last page) holds NaN: reading one would show up as NaN in the output.
"""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from prims_ts import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, cumsum0, rel_err, stable_seed

F64 = torch.float64
I32 = torch.int32
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")
GARBAGE = (-1, 2**31 - 1, -2**31, 123456)  # values written into unused table entries


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def ip(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


# ----------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------


class Paged:
    """One paged problem: q, pools, qo_indptr, block_tables (possibly a padded view), seq_lens."""

    def __init__(self, q_lens, kv_lens, hq, hkv, d, ps, dtype, g, kind="perm", extra_pages=3, poison=True):
        n_pages = [(sk + ps - 1) // ps for sk in kv_lens]
        B = len(q_lens)
        if kind == "repeated":
            # a small pool shared by every request: IDs repeat across requests (and within one)
            P = max(2, max(n_pages) // 2 + 1) + extra_pages
            rows = [torch.randint(0, P - extra_pages, (n,), generator=g).tolist() for n in n_pages]
            rows[-1][0] = rows[0][0]  # at least one ID shared by two requests
        else:
            P = sum(n_pages) + extra_pages
            perm = torch.randperm(P, generator=g).tolist()
            if perm[: sum(n_pages)] == sorted(perm[: sum(n_pages)]):
                perm = perm[::-1]
            rows, at = [], 0
            for n in n_pages:
                rows.append(perm[at:at + n])
                at += n
        C = max(n_pages) + (2 if kind == "padded" else 0)
        if kind == "padded":
            big = torch.empty(B, C + 5, dtype=I32)
            for b in range(B):
                big[b] = ip([GARBAGE[(b + c) % len(GARBAGE)] for c in range(C + 5)])
                big[b, :n_pages[b]] = ip(rows[b])
            table = big[:, :C]
            assert table.stride(0) == C + 5 and (B == 1 or not table.is_contiguous())
        else:
            table = torch.zeros(B, C, dtype=I32)
            for b in range(B):
                table[b, :n_pages[b]] = ip(rows[b])
        self.q_lens, self.kv_lens, self.ps, self.num_pages = list(q_lens), list(kv_lens), ps, P
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype
        self.q = randn((sum(q_lens), hq, d), dtype, g)
        self.k_cache = randn((P, hkv, ps, d), dtype, g)
        self.v_cache = randn((P, hkv, ps, d), dtype, g)
        self.qo_indptr = ip(cumsum0(q_lens))
        self.block_tables = table
        self.seq_lens = ip(kv_lens)
        if poison:
            self.poison_unused()

    def used_slots(self) -> torch.Tensor:
        used = torch.zeros(self.num_pages, self.ps, dtype=torch.bool)
        for b, sk in enumerate(self.seq_lens.tolist()):
            for j in range(sk):
                used[int(self.block_tables[b, j // self.ps]), j % self.ps] = True
        return used

    def poison_unused(self) -> None:
        unused = ~self.used_slots()  # [P, ps]
        mask = unused[:, None, :, None].expand_as(self.k_cache)
        self.k_cache.masked_fill_(mask, NAN)
        self.v_cache.masked_fill_(mask, NAN)

    def meta(self):
        return self.qo_indptr, self.block_tables, self.seq_lens

    def call(self, **kw):
        return batch_prefill_with_paged_kv_cache(self.q, self.k_cache, self.v_cache, *self.meta(), page_size=self.ps,
                                                 **kw)

    def ref(self, **kw):
        return R.batch_prefill_paged(self.q, self.k_cache, self.v_cache, *self.meta(), compute_dtype=F64, **kw)


def gather_contiguous(cache: torch.Tensor, table: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    """Packed [sum(lens), H, D] copy of the logical K (or V) rows, one token at a time."""
    ps = cache.shape[2]
    rows = []
    for b, sk in enumerate(lens):
        for j in range(sk):
            rows.append(cache[int(table[b, j // ps]), :, j % ps, :])
    return torch.stack(rows)


def gathered_ref(pb: Paged, mask_type="dense", window_left=-1, sm_scale=None, output_scale=1.0):
    lens = pb.seq_lens.tolist()
    k = gather_contiguous(pb.k_cache, pb.block_tables, lens)
    v = gather_contiguous(pb.v_cache, pb.block_tables, lens)
    assert not torch.isnan(k).any() and not torch.isnan(v).any(), "a used slot holds poison"
    return R.batch_prefill(pb.q, k, v, qo_indptr=pb.qo_indptr, kv_indptr=ip(cumsum0(lens)), mask_type=mask_type,
                           window_left=window_left, sm_scale=sm_scale, output_scale=output_scale, compute_dtype=F64)


def naive_paged(pb: Paged, mask_type="dense", window_left=-1, sm_scale=None, output_scale=1.0) -> torch.Tensor:
    """Float64, one (request, row, head) at a time; key j read from page table[b, j // ps], slot j % ps."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(pb.d)
    group = pb.hq // pb.hkv
    qo, lens = pb.qo_indptr.tolist(), pb.seq_lens.tolist()
    out = torch.empty(pb.q.shape, dtype=F64)
    for b in range(len(lens)):
        sq, sk = qo[b + 1] - qo[b], lens[b]
        for i in range(sq):
            if mask_type == "dense":
                keys = list(range(sk))
            else:
                diag = sk - sq + i
                lo = 0 if window_left < 0 else max(0, diag - window_left)
                keys = list(range(lo, min(diag, sk - 1) + 1))
            for h in range(pb.hq):
                if not keys:
                    out[qo[b] + i, h] = 0.0
                    continue
                qv = pb.q[qo[b] + i, h].to(F64)
                kv = [(pb.k_cache[int(pb.block_tables[b, j // pb.ps]), h // group, j % pb.ps].to(F64),
                       pb.v_cache[int(pb.block_tables[b, j // pb.ps]), h // group, j % pb.ps].to(F64)) for j in keys]
                logits = [scale * float(torch.dot(qv, kj)) for kj, _ in kv]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                acc = torch.zeros(pb.d, dtype=F64)
                for wj, (_, vj) in zip(w, kv):
                    acc += wj * vj
                out[qo[b] + i, h] = acc / math.fsum(w) * output_scale
    return out


# (q lens, kv lens) per mask: kv lengths 1, 17, 100, 129 are not page multiples (except 1 with nothing)
LENS = {
    "dense": ([3, 17, 40, 129], [1, 17, 100, 129]),  # dense: Sq > Sk allowed (3 > 1)
    "causal": ([1, 17, 64, 100], [1, 17, 100, 129]),
}
MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 5)]
KINDS = ["perm", "repeated", "padded"]


# ----------------------------------------------------------------------------
# Reference vs the two oracles, and the public function against them
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask,window", MASKS, ids=[f"{m}{w if w >= 0 else ''}" for m, w in MASKS])
@pytest.mark.parametrize("ps", [16, 32, 64, 128])
def test_reference_and_public_match_gathered(ps, mask, window, kind):
    g = gen(stable_seed(ps, mask, window, kind))
    dtype = FP16 if ps in (16, 64) else BF16
    q_lens, kv_lens = LENS[mask]
    pb = Paged(q_lens, kv_lens, 4, 1, 128, ps, dtype, g, kind)
    want = gathered_ref(pb, mask, window)
    got = pb.ref(mask_type=mask, window_left=window)
    assert got.dtype == F64 and got.shape == pb.q.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    out = torch.full(pb.q.shape, NAN, dtype=dtype)
    assert pb.call(mask_type=mask, window_left=window, out=out) is out
    assert rel_err(out, want) <= TOLERANCE[dtype]
    res = pb.call(mask_type=mask, window_left=window)
    assert res.dtype == dtype and res.shape == pb.q.shape
    torch.testing.assert_close(res, out, rtol=0, atol=0)


NAIVE = [("dense", -1, [2, 5, 3], [1, 17, 33]), ("causal", -1, [1, 5, 17], [1, 17, 33]),
         ("causal", 0, [1, 5, 17], [1, 17, 33]), ("causal", 3, [1, 5, 17], [2, 17, 40])]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask,window,q_lens,kv_lens", NAIVE, ids=[f"{m}{w if w >= 0 else ''}" for m, w, *_ in NAIVE])
def test_reference_matches_naive(mask, window, q_lens, kv_lens, kind):
    g = gen(stable_seed("naive", mask, window, kind))
    pb = Paged(q_lens, kv_lens, 4, 2, 128, 16, BF16, g, kind)
    want = naive_paged(pb, mask, window, sm_scale=0.07, output_scale=1.3)
    got = pb.ref(mask_type=mask, window_left=window, sm_scale=0.07, output_scale=1.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    out = torch.full(pb.q.shape, NAN, dtype=FP32)
    pb.call(mask_type=mask, window_left=window, sm_scale=0.07, output_scale=1.3, out=out)
    assert rel_err(out, want) <= TOLERANCE[BF16]


def test_reference_gather_pages_reads_table_order():
    """gather_pages: logical row j comes from page pages[j // ps], slot j % ps (pages in any order)."""
    g = gen(3)
    cache = randn((5, 2, 16, 128), F64, g)
    pages = ip([4, 0, 4, 2])
    got = R.gather_pages(cache, pages, 50)
    assert got.shape == (50, 2, 128)
    for j in range(50):
        torch.testing.assert_close(got[j], cache[int(pages[j // 16]), :, j % 16], rtol=0, atol=0)


# ----------------------------------------------------------------------------
# Heads, head dims, dtypes, output dtypes, scales, strides
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [None, FP32], ids=["out_default", "out_fp32"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_public_heads_dims_dtypes(group, d, dtype, out_dtype):
    g = gen(stable_seed(group, d, str(dtype), str(out_dtype)))
    hkv = 2
    pb = Paged([1, 30, 17], [17, 100, 129], hkv * group, hkv, d, 32, dtype, g, "padded")
    for mask, window in (("dense", -1), ("causal", 7)):
        want = gathered_ref(pb, mask, window)
        expect_dtype = out_dtype or dtype
        res = pb.call(mask_type=mask, window_left=window, out_dtype=out_dtype)
        assert res.dtype == expect_dtype and res.shape == pb.q.shape
        assert rel_err(res, want) <= TOLERANCE[dtype]
        out = torch.full(pb.q.shape, NAN, dtype=expect_dtype)
        assert pb.call(mask_type=mask, window_left=window, out_dtype=out_dtype, out=out) is out
        assert rel_err(out, want) <= TOLERANCE[dtype]


def test_public_out_dtype_from_out():
    g = gen(5)
    pb = Paged([5, 9], [9, 40], 4, 2, 128, 16, FP16, g, "repeated")
    want = gathered_ref(pb, "causal")
    for dt in (FP32, BF16, FP16):
        out = torch.full(pb.q.shape, NAN, dtype=dt)
        assert pb.call(mask_type="causal", out=out) is out
        assert rel_err(out, want) <= TOLERANCE[BF16 if dt == BF16 else FP16]


def test_public_scales():
    g = gen(6)
    pb = Paged([4, 20], [33, 20], 4, 1, 128, 16, BF16, g, "perm")
    for sm_scale, output_scale in [(0.02, 1.0), (0.3, 0.5), (None, 4.0)]:
        want = gathered_ref(pb, "causal", -1, sm_scale, output_scale)
        out = torch.full(pb.q.shape, NAN, dtype=FP32)
        pb.call(mask_type="causal", sm_scale=sm_scale, output_scale=output_scale, out=out)
        assert rel_err(out, want) <= TOLERANCE[BF16]
    a = pb.call(mask_type="causal", out_dtype=FP32)
    b = pb.call(mask_type="causal", sm_scale=1.0 / math.sqrt(128), out_dtype=FP32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_public_strided_q_and_pools_from_combined_cache():
    """q as a slice of a fused projection; k/v pools as the two halves of a [P, 2, Hkv, ps, D] cache."""
    g = gen(7)
    pb = Paged([6, 17], [20, 64], 4, 2, 128, 32, BF16, g, "perm", poison=False)
    fused = torch.zeros(pb.q.shape[0], 8, 128, dtype=BF16)
    fused[:, 2:6] = pb.q
    q = fused[:, 2:6]
    combined = torch.stack([pb.k_cache, pb.v_cache], dim=1)  # [P, 2, Hkv, ps, D]
    k, v = combined[:, 0], combined[:, 1]
    assert not q.is_contiguous() and not k.is_contiguous()
    want = gathered_ref(pb, "causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    batch_prefill_with_paged_kv_cache(q, k, v, *pb.meta(), page_size=32, mask_type="causal", out=out)
    assert rel_err(out, want) <= TOLERANCE[BF16]


def test_single_request_one_token():
    g = gen(8)
    pb = Paged([1], [1], 2, 2, 256, 128, FP16, g, "padded")
    for mask in ("dense", "causal"):
        want = gathered_ref(pb, mask)
        assert rel_err(pb.call(mask_type=mask), want) <= TOLERANCE[FP16]


def test_inputs_not_modified():
    g = gen(9)
    pb = Paged([3, 8], [17, 8], 4, 2, 128, 16, BF16, g, "padded")
    before = [t.clone() for t in (pb.q, pb.qo_indptr, pb.block_tables, pb.seq_lens)]
    kc = pb.k_cache.clone()
    pb.call(mask_type="causal")
    for a, b in zip(before, (pb.q, pb.qo_indptr, pb.block_tables, pb.seq_lens)):
        assert torch.equal(a, b)
    assert torch.equal(kc.isnan(), pb.k_cache.isnan())
    assert torch.equal(kc.nan_to_num(), pb.k_cache.nan_to_num())


# ----------------------------------------------------------------------------
# BatchPrefillPagedTSWrapper on CPU: plan over FlashInfer's CSR page metadata, run
# ----------------------------------------------------------------------------


def csr(table: torch.Tensor, lens: Sequence[int], ps: int):
    """FlashInfer's CSR page metadata (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) of a
    block table's used prefix: request b's pages are table[b, :ceil(lens[b] / ps)], its last page holds
    lens[b] - (pages - 1) * ps keys."""
    n = [(sk + ps - 1) // ps for sk in lens]
    indices = torch.cat([table[b, :n[b]] for b in range(len(lens))]).to(I32).contiguous()
    last = [sk - (nb - 1) * ps for sk, nb in zip(lens, n)]
    assert all(1 <= x <= ps for x in last)
    return ip(cumsum0(n)), indices, ip(last)


def _plan(pb: Paged, mask, window, **kw) -> BatchPrefillPagedTSWrapper:
    w = BatchPrefillPagedTSWrapper()
    w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, *csr(pb.block_tables, pb.seq_lens.tolist(), pb.ps),
           page_size=pb.ps, mask_type=mask, window_left=window, **kw)
    return w


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 4)])
def test_wrapper_plan_run(mask, window, kind):
    g = gen(stable_seed("w", mask, window, kind))
    pb = Paged([2, 17, 30], [17, 33, 64], 8, 2, 128, 16, FP16, g, kind)
    w = _plan(pb, mask, window, sm_scale=0.05, output_scale=1.5, out_dtype=FP32)
    want = gathered_ref(pb, mask, window, 0.05, 1.5)
    out = torch.full(pb.q.shape, NAN, dtype=FP32)
    for _ in range(2):  # a plan serves many runs
        out.fill_(NAN)
        assert w.run(pb.q, pb.k_cache, pb.v_cache, out=out) is out
        assert rel_err(out, want) <= TOLERANCE[FP16]
    res = w.run(pb.q, pb.k_cache, pb.v_cache)
    assert res.dtype == FP32
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    # the CSR plan means what the one-shot's block table means
    torch.testing.assert_close(pb.call(mask_type=mask, window_left=window, sm_scale=0.05, output_scale=1.5,
                                       out_dtype=FP32), out, rtol=0, atol=0)
    # new data in the same pools and q, same metadata
    pb.q.copy_(randn(pb.q.shape, FP16, g))
    used = pb.used_slots()[:, None, :, None].expand_as(pb.k_cache)
    pb.v_cache.copy_(torch.where(used, randn(pb.v_cache.shape, FP16, g), pb.v_cache))
    out.fill_(NAN)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    assert rel_err(out, gathered_ref(pb, mask, window, 0.05, 1.5)) <= TOLERANCE[FP16]


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", 3)])
def test_wrapper_csr_lengths_from_last_page_len(mask, window):
    """Request b's length is (pages - 1) * page_size + last_page_len[b]: full last pages, one-key last
    pages and single-page requests, over pages in any order with repeated IDs."""
    g = gen(stable_seed("last", mask, window))
    ps = 32
    pb = Paged([1, 9, 30, 5], [1, 32, 64 + 1, 96], 4, 2, 128, ps, BF16, g, "repeated")
    indptr, indices, last = csr(pb.block_tables, pb.seq_lens.tolist(), ps)
    assert last.tolist() == [1, 32, 1, 32]
    w = _plan(pb, mask, window)
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    assert rel_err(out, gathered_ref(pb, mask, window)) <= TOLERANCE[BF16]


@pytest.mark.parametrize("what", ["paged_kv_indices", "paged_kv_last_page_len", "paged_kv_indptr"])
def test_wrapper_snapshots_pages_at_plan(what):
    """plan copies the pages and lengths: rewriting the caller's CSR tensors in place afterwards (to
    values that would give another answer) changes nothing until the next plan."""
    g = gen(stable_seed("snapshot", what))
    pb = Paged([5, 17, 9], [20, 50, 40], 4, 2, 128, 16, BF16, g, "perm", extra_pages=4, poison=False)
    indptr, indices, last = csr(pb.block_tables, pb.seq_lens.tolist(), pb.ps)
    w = BatchPrefillPagedTSWrapper()
    w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, indptr, indices, last, page_size=pb.ps, mask_type="causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    want = gathered_ref(pb, "causal")
    assert rel_err(out, want) <= TOLERANCE[BF16]
    before = out.clone()

    if what == "paged_kv_indices":  # other pages of the pool
        indices.copy_(torch.randperm(pb.num_pages, generator=g)[:indices.numel()].to(I32))
    elif what == "paged_kv_last_page_len":  # shorter requests (still Sq <= Sk)
        last.copy_(ip([5, 2, 9]))
    else:  # the pages moved between requests (same total)
        indptr.copy_(ip([0, 3, 5, 9]))
    new_table = torch.zeros(3, 8, dtype=I32)
    new_lens = []
    ipl, idl, lal = indptr.tolist(), indices.tolist(), last.tolist()
    for b in range(3):
        pages = idl[ipl[b]:ipl[b + 1]]
        new_table[b, :len(pages)] = ip(pages)
        new_lens.append((len(pages) - 1) * pb.ps + lal[b])
    ref_new = R.batch_prefill_paged(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, new_table, ip(new_lens),
                                    mask_type="causal", compute_dtype=F64)
    assert rel_err(ref_new, want) > 0.1, "the rewrite must change the answer for this test to bite"

    out.fill_(NAN)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    torch.testing.assert_close(out, before, rtol=0, atol=0)
    # a new plan takes the rewritten metadata
    w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, indptr, indices, last, page_size=pb.ps, mask_type="causal")
    out.fill_(NAN)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    assert rel_err(out, ref_new) <= TOLERANCE[BF16]


@pytest.mark.parametrize("kind", ["perm", "repeated"])
def test_wrapper_run_after_page_remap(kind):
    """Move every page to a new physical slot (pool contents moved, the caller's paged_kv_indices
    rewritten in place): the planned snapshot still names the old slots, so run reads the old IDs from
    the moved pools until a new plan, whose output is the unchanged logical problem's."""
    g = gen(11 if kind == "perm" else 12)
    pb = Paged([5, 17, 40], [20, 50, 100], 4, 2, 128, 16, BF16, g, kind, poison=False)
    indptr, indices, last = csr(pb.block_tables, pb.seq_lens.tolist(), pb.ps)
    w = BatchPrefillPagedTSWrapper()
    w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, indptr, indices, last, page_size=pb.ps, mask_type="causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    want = gathered_ref(pb, "causal")
    assert rel_err(out, want) <= TOLERANCE[BF16]
    before = out.clone()

    P = pb.num_pages
    new_of_old = torch.randperm(P, generator=g)
    if torch.equal(new_of_old, torch.arange(P)):
        new_of_old = new_of_old.flip(0)
    for cache in (pb.k_cache, pb.v_cache):
        moved = torch.empty_like(cache)
        moved[new_of_old] = cache
        cache.copy_(moved)
    old_table = pb.block_tables.clone()
    indices.copy_(new_of_old[indices.long()].to(I32))
    n_used = [(sk + pb.ps - 1) // pb.ps for sk in pb.seq_lens.tolist()]
    for b, n in enumerate(n_used):  # the oracle's table: only the used prefix
        pb.block_tables[b, :n] = new_of_old[pb.block_tables[b, :n].long()].to(I32)
    torch.testing.assert_close(gathered_ref(pb, "causal"), want, rtol=0, atol=0)

    # no new plan: the old page IDs over the moved pools
    stale = R.batch_prefill_paged(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, old_table, pb.seq_lens,
                                  mask_type="causal", compute_dtype=F64)
    assert rel_err(stale, want) > 0.1, "the remap must change what the stale plan reads for this test to bite"
    out.fill_(NAN)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    assert rel_err(out, stale) <= TOLERANCE[BF16]
    # a new plan over the rewritten indices: the logical problem, hence the output, is unchanged
    w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, indptr, indices, last, page_size=pb.ps, mask_type="causal")
    out.fill_(NAN)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    assert rel_err(out, want) <= TOLERANCE[BF16]
    torch.testing.assert_close(out, before, rtol=0, atol=0)


def test_wrapper_run_after_new_q_offsets():
    """qo_indptr stays bound: rewriting its values in place within the planned bounds (same total, each
    count within the planned longest, Sq <= Sk) changes the next run's problem, while the caller's CSR
    page metadata, rewritten in place too, does not (the plan snapshotted it)."""
    g = gen(13)
    pb = Paged([10, 20, 6], [40, 60, 20], 4, 1, 128, 16, FP16, g, "perm", extra_pages=6, poison=False)
    indptr, indices, last = csr(pb.block_tables, pb.seq_lens.tolist(), pb.ps)
    w = BatchPrefillPagedTSWrapper()
    w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, indptr, indices, last, page_size=pb.ps, mask_type="causal")
    out = torch.full(pb.q.shape, NAN, dtype=FP16)
    w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
    assert rel_err(out, pb.ref(mask_type="causal")) <= TOLERANCE[FP16]
    for new_q in ([20, 10, 6], [1, 20, 15], [16, 18, 2]):
        assert max(new_q) <= 20 and sum(new_q) == 36 and all(a <= b for a, b in zip(new_q, pb.kv_lens))
        ref_before = pb.ref(mask_type="causal")
        pb.qo_indptr.copy_(ip(cumsum0(new_q)))
        indices.copy_(torch.randint(0, pb.num_pages, indices.shape, generator=g, dtype=I32))
        last.copy_(torch.randint(1, pb.ps + 1, last.shape, generator=g, dtype=I32))
        want = gathered_ref(pb, "causal")  # the new Q offsets, the planned pages and lengths
        torch.testing.assert_close(pb.ref(mask_type="causal"), want, rtol=1e-12, atol=1e-12)
        assert rel_err(ref_before, want) > 0.1, "the rewrite must change the answer for this test to bite"
        out.fill_(NAN)
        w.run(pb.q, pb.k_cache, pb.v_cache, out=out)
        assert rel_err(out, want) <= TOLERANCE[FP16], new_q


def test_wrapper_replan():
    g = gen(14)
    a = Paged([3, 5], [17, 5], 4, 2, 128, 16, BF16, g, "perm")
    b = Paged([9], [200], 8, 8, 256, 64, FP16, g, "padded")
    w = BatchPrefillPagedTSWrapper()
    for pb, mask in ((a, "causal"), (b, "dense"), (a, "dense")):
        w.plan(pb.q, pb.k_cache, pb.v_cache, pb.qo_indptr, *csr(pb.block_tables, pb.seq_lens.tolist(), pb.ps),
               page_size=pb.ps, mask_type=mask)
        assert rel_err(w.run(pb.q, pb.k_cache, pb.v_cache), gathered_ref(pb, mask)) <= TOLERANCE[pb.dtype]
