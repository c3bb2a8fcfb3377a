"""Paged decode semantics on CPU: the reference, the standalone function, the wrapper and the one-shot.

Two independent oracles:

* ``gathered_ref``: K/V of every request copied token by token out of the cache
  (``page = indices[indptr[b] + j // page_size]``, ``slot = j % page_size``) into
  packed contiguous storage, the query flattened to packed rows, then
  ``prims_ts.reference.batch_prefill`` (the contiguous path, tested against direct
  math in test_reference.py) in float64;
* ``naive_decode``: a float64 loop per (request, query token, head) that reads each
  key straight from its page and does the softmax by hand (small problems only).

``prims_ts.reference.batch_decode(..., compute_dtype=float64)`` must equal both to
float64 round-off. The public functions on CPU tensors must match them within the
project's tolerance (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16), write every
element of a NaN-poisoned ``out`` and return ``out`` itself.

Every cache slot that no request uses (whole unused pages, the tail of each request's
last page) holds NaN, and CSR entries past a request's live pages (allowed: a request
must own *at least* enough entries) hold garbage page IDs: reading either shows up.
"""
from __future__ import annotations

import math
from typing import Sequence

import pytest
import torch

from prims_ts import (
    BatchDecodePagedTSWrapper,
    batch_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_workspace_size,
    prims_ts_batch_decode_with_kv_cache,
)
from prims_ts import reference as R
from prims_ts.ops._validate import dtype_code
from prims_ts.testing import TOLERANCE, assign_pages, cumsum0, rel_err, relative_error, stable_seed

F64 = torch.float64
I32 = torch.int32
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")
GARBAGE = (-1, 2**31 - 1, -2**31, 123456)  # values written into CSR entries past the live pages


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def ip(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def ws_size(batch, hq, hkv, d, max_seq_len, max_seq_len_q=1, page_size=16):
    """The workspace for a query bound of max_seq_len_q, asked in the fixed multi-token form."""
    return get_prims_ts_batch_decode_workspace_size(batch, hq, hkv, d, page_size, max_seq_len,
                                                    seq_len_q=max_seq_len_q, device="cpu")


# ----------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------


class Decode:
    """One decode problem over CSR pages.

    qmode: "single" (query [B, Hq, D]), "fixed" ([B, sq, Hq, D]) or "packed" ([T, Hq, D] + qo_indptr).
    form:  "combined" ([P, 2, Hkv, ps, D]) or "tuple" ((K, V), each [P, Hkv, ps, D]).
    kind:  "perm" (distinct pages, non-identity order) or "repeated" (IDs shared across / within requests).
    slack: CSR entries per request past its live pages (hold garbage IDs).
    """

    def __init__(self, seq_lens, hq, hkv, d, ps, dtype, g, *, qmode="single", sq=1, q_lens=None,
                 max_seq_len_q=None, form="combined", kind="perm", slack=None, extra_pages=2, poison=True,
                 max_seq_len=None):
        B = len(seq_lens)
        self.seq_lens_list = list(seq_lens)
        self.hq, self.hkv, self.d, self.ps, self.dtype = hq, hkv, d, ps, dtype
        self.qmode, self.form = qmode, form
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        slack = list(slack) if slack is not None else [0] * B
        P, live = assign_pages(n_live, kind, extra_pages, g)
        indices = []
        for b in range(B):
            indices += live[b] + [GARBAGE[(b + i) % len(GARBAGE)] for i in range(slack[b])]
        self.num_pages = P
        self.live_pages = live
        self.indptr = ip(cumsum0([n + s for n, s in zip(n_live, slack)]))
        self.indices = ip(indices)
        self.seq_lens = ip(seq_lens)
        if form == "combined":
            self.cache = randn((P, 2, hkv, ps, d), dtype, g)
            self.k_pool, self.v_pool = self.cache[:, 0], self.cache[:, 1]
        else:
            self.k_pool, self.v_pool = randn((P, hkv, ps, d), dtype, g), randn((P, hkv, ps, d), dtype, g)
            self.cache = (self.k_pool, self.v_pool)
        if poison:
            unused = ~self.used_slots()[:, None, :, None].expand_as(self.k_pool)
            self.k_pool.masked_fill_(unused, NAN)
            self.v_pool.masked_fill_(unused, NAN)
        self.qo_indptr = None
        self.seq_len_q = 1
        if qmode == "single":
            self.q_lens = [1] * B
            self.q = randn((B, hq, d), dtype, g)
            self.max_seq_len_q = 1
        elif qmode == "fixed":
            assert sq > 1
            self.q_lens = [sq] * B
            self.seq_len_q = sq
            self.q = randn((B, sq, hq, d), dtype, g)
            self.max_seq_len_q = sq
        else:
            self.q_lens = list(q_lens)
            self.qo_indptr = ip(cumsum0(q_lens))
            self.q = randn((sum(q_lens), hq, d), dtype, g)
            self.max_seq_len_q = max_seq_len_q or max(q_lens)
        self.max_seq_len = max_seq_len or max(seq_lens)
        self.workspace = torch.zeros(self.ws_bytes(), dtype=torch.uint8)

    def ws_bytes(self):
        """The workspace size for this problem's static arguments, asked in its own query form."""
        return get_prims_ts_batch_decode_workspace_size(
            len(self.seq_lens_list), self.hq, self.hkv, self.d, self.ps, self.max_seq_len, **self.qkw(),
            q_dtype=self.dtype, device="cpu")

    def used_slots(self) -> torch.Tensor:
        used = torch.zeros(self.num_pages, self.ps, dtype=torch.bool)
        for b, sk in enumerate(self.seq_lens_list):
            pages = ip(self.live_pages[b]).long()
            j = torch.arange(sk)
            used[pages[j // self.ps], j % self.ps] = True
        return used

    def qkw(self):
        kw = {}
        if self.qmode == "fixed":
            kw["seq_len_q"] = self.seq_len_q
        if self.qmode == "packed":
            kw["qo_indptr"] = self.qo_indptr
            kw["max_seq_len_q"] = self.max_seq_len_q
        return kw

    def call(self, q=None, cache=None, **kw):
        return prims_ts_batch_decode_with_kv_cache(
            self.q if q is None else q, self.cache if cache is None else cache, self.workspace, self.indptr,
            self.indices, self.seq_lens, self.max_seq_len, **self.qkw(), **kw)

    def ref(self, **kw):
        return R.batch_decode(self.q, self.k_pool, self.v_pool, self.indptr, self.indices, self.seq_lens,
                              qo_indptr=self.qo_indptr, compute_dtype=F64, **kw)


def gather_contiguous(pool: torch.Tensor, indptr, indices, lens: Sequence[int]) -> torch.Tensor:
    """Packed [sum(lens), H, D] copy of the logical K (or V) rows, one token at a time."""
    ps = pool.shape[2]
    rows = []
    for b, sk in enumerate(lens):
        for j in range(sk):
            rows.append(pool[int(indices[int(indptr[b]) + j // ps]), :, j % ps, :])
    return torch.stack(rows)


def gathered_ref(pb: Decode, mask_type="dense", window_left=-1, bmm1_scale=None, bmm2_scale=1.0):
    lens = pb.seq_lens.tolist()
    k = gather_contiguous(pb.k_pool, pb.indptr, pb.indices, lens)
    v = gather_contiguous(pb.v_pool, pb.indptr, pb.indices, lens)
    assert not torch.isnan(k).any() and not torch.isnan(v).any(), "a used slot holds poison"
    q = pb.q.reshape(-1, pb.hq, pb.d)  # packed rows, request-major
    qo = ip(cumsum0(pb.q_lens))
    out = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=ip(cumsum0(lens)), mask_type=mask_type,
                          window_left=window_left, sm_scale=bmm1_scale, output_scale=bmm2_scale, compute_dtype=F64)
    return out.reshape(pb.q.shape)


def naive_decode(pb: Decode, mask_type="dense", window_left=-1, bmm1_scale=None, bmm2_scale=1.0) -> torch.Tensor:
    """Float64, one (request, query token, head) at a time; key j from page indices[indptr[b] + j // ps]."""
    scale = bmm1_scale if bmm1_scale is not None else 1.0 / math.sqrt(pb.d)
    group = pb.hq // pb.hkv
    q = pb.q.reshape(-1, pb.hq, pb.d)
    qo, lens, indptr = cumsum0(pb.q_lens), pb.seq_lens.tolist(), pb.indptr.tolist()
    out = torch.empty(q.shape, dtype=F64)
    for b, sk in enumerate(lens):
        sq = qo[b + 1] - qo[b]
        for i in range(sq):
            if mask_type == "dense":
                keys = list(range(sk))
            else:
                diag = sk - sq + i
                lo = 0 if window_left < 0 else max(0, diag - window_left)
                keys = list(range(lo, min(diag, sk - 1) + 1))
            for h in range(pb.hq):
                qv = q[qo[b] + i, h].to(F64)
                kv = []
                for j in keys:
                    page = int(pb.indices[indptr[b] + j // pb.ps])
                    kv.append((pb.k_pool[page, h // group, j % pb.ps].to(F64),
                               pb.v_pool[page, h // group, j % pb.ps].to(F64)))
                logits = [scale * float(torch.dot(qv, kj)) for kj, _ in kv]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                acc = torch.zeros(pb.d, dtype=F64)
                for wj, (_, vj) in zip(w, kv):
                    acc += wj * vj
                out[qo[b] + i, h] = acc / math.fsum(w) * bmm2_scale
    return out.reshape(pb.q.shape)


def check_public(pb: Decode, want: torch.Tensor, out_dtype=None, **kw):
    """Poisoned out is fully written and returned; the functional form gives the same values."""
    odt = out_dtype or pb.dtype
    out = torch.full(pb.q.shape, NAN, dtype=odt)
    assert pb.call(out=out, out_dtype=out_dtype, **kw) is out
    assert rel_err(out, want) <= TOLERANCE[pb.dtype]
    res = pb.call(out_dtype=out_dtype, **kw)
    assert res.dtype == odt and res.shape == pb.q.shape
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    return out


# ----------------------------------------------------------------------------
# Reference and standalone vs the oracles: every Q mode x mask x page size
# ----------------------------------------------------------------------------

MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 5)]
MASK_IDS = [f"{m}{w if w >= 0 else ''}" for m, w in MASKS]
QMODES = ["single", "fixed", "packed"]
HEADS = [(1, 2), (4, 2), (8, 1), (32, 1)]  # (group, Hkv)


def _mode_problem(qmode, mask, ps, i, g, **kw):
    """A 3-request problem (lengths 1 or the query count, 37 and 130: not page multiples) for one cell."""
    d = (64, 128, 256)[i % 3]
    group, hkv = HEADS[i % 4]
    sq = 2 + i % 3
    q_lens = [1, 4, 2]
    first = 1 if mask == "dense" or qmode == "single" else (sq if qmode == "fixed" else 1)
    lens = [first, 37, 130]
    return Decode(lens, group * hkv, hkv, d, ps, (FP16, BF16)[i % 2], g, qmode=qmode, sq=sq, q_lens=q_lens,
                  max_seq_len_q=4 + i % 2, form=("combined", "tuple")[(i // 2) % 2],
                  kind=("perm", "repeated")[(i // 3) % 2], slack=[i % 2, 0, 2], **kw)


@pytest.mark.parametrize("ps", [16, 32, 64, 128])
@pytest.mark.parametrize("mask,window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("qmode", QMODES)
def test_reference_and_standalone_match_gathered(qmode, mask, window, ps):
    i = QMODES.index(qmode) + MASKS.index((mask, window)) + ps // 16
    pb = _mode_problem(qmode, mask, ps, i, gen(stable_seed(qmode, mask, window, ps)))
    want = gathered_ref(pb, mask, window)
    got = pb.ref(mask_type=mask, window_left=window)
    assert got.dtype == F64 and got.shape == pb.q.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    check_public(pb, want, mask_type=mask, window_left=window)


NAIVE = [("single", "dense", -1), ("single", "causal", 2), ("fixed", "causal", -1), ("fixed", "causal", 0),
         ("fixed", "dense", -1), ("packed", "causal", 3), ("packed", "dense", -1)]


@pytest.mark.parametrize("qmode,mask,window", NAIVE, ids=[f"{q}-{m}{w if w >= 0 else ''}" for q, m, w in NAIVE])
def test_reference_matches_naive(qmode, mask, window):
    g = gen(stable_seed("naive", qmode, mask, window))
    lens = [1, 19, 40] if mask == "dense" else [3, 19, 40]
    pb = Decode(lens, 4, 2, 64, 16, BF16, g, qmode=qmode, sq=3, q_lens=[1, 3, 2],
                kind="repeated" if window >= 0 else "perm", slack=[1, 0, 1])
    want = naive_decode(pb, mask, window, bmm1_scale=0.07, bmm2_scale=1.3)
    got = pb.ref(mask_type=mask, window_left=window, sm_scale=0.07, output_scale=1.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    out = torch.full(pb.q.shape, NAN, dtype=FP32)
    pb.call(mask_type=mask, window_left=window, bmm1_scale=0.07, bmm2_scale=1.3, out=out)
    assert rel_err(out, want) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# Heads, head dims, cache forms, dtypes, output dtypes, scales
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["combined", "tuple"])
@pytest.mark.parametrize("group,hkv", HEADS, ids=[f"gqa{g}" for g, _ in HEADS])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_heads_dims_forms(d, group, hkv, form):
    i = (64, 128, 256).index(d) + group
    qmode = QMODES[i % 3]
    g = gen(stable_seed("heads", d, group, form))
    pb = Decode([1, 17, 64, 45], group * hkv, hkv, d, (16, 32, 64, 128)[i % 4], (BF16, FP16)[i % 2], g,
                qmode=qmode, sq=2, q_lens=[1, 2, 1, 3], form=form, kind=("repeated", "perm")[i % 2],
                slack=[1, 0, 0, 3])
    mask, window = ("causal", 7) if qmode != "fixed" else ("dense", -1)
    want = gathered_ref(pb, mask, window)
    torch.testing.assert_close(pb.ref(mask_type=mask, window_left=window), want, rtol=1e-12, atol=1e-12)
    check_public(pb, want, mask_type=mask, window_left=window)


@pytest.mark.parametrize("out_dtype", [None, FP32, FP16, BF16], ids=["out_default", "fp32", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_dtypes_and_out_dtypes(dtype, out_dtype):
    g = gen(stable_seed("dtypes", str(dtype), str(out_dtype)))
    pb = Decode([5, 33, 100], 8, 2, 128, 32, dtype, g, qmode="packed", q_lens=[2, 1, 3])
    want = gathered_ref(pb, "causal")
    check_public(pb, want, out_dtype=out_dtype, mask_type="causal")


def test_out_dtype_from_out():
    g = gen(5)
    pb = Decode([9, 40], 4, 2, 128, 16, FP16, g, qmode="fixed", sq=3, kind="repeated")
    want = gathered_ref(pb, "causal")
    for dt in (FP32, BF16, FP16):
        out = torch.full(pb.q.shape, NAN, dtype=dt)
        assert pb.call(mask_type="causal", out=out) is out
        assert rel_err(out, want) <= TOLERANCE[BF16 if dt == BF16 else FP16]


@pytest.mark.parametrize("qmode", QMODES)
def test_scales(qmode):
    g = gen(stable_seed("scales", qmode))
    pb = Decode([4, 20, 70], 8, 2, 128, 16, BF16, g, qmode=qmode, sq=4, q_lens=[4, 1, 2], kind="perm")
    for bmm1, bmm2 in [(0.02, 1.0), (0.3, 0.5), (None, 4.0), (1.0, 1e-3)]:
        want = gathered_ref(pb, "causal", -1, bmm1, bmm2)
        torch.testing.assert_close(pb.ref(mask_type="causal", sm_scale=bmm1, output_scale=bmm2), want,
                                   rtol=1e-12, atol=1e-12)
        out = torch.full(pb.q.shape, NAN, dtype=FP32)
        pb.call(mask_type="causal", bmm1_scale=bmm1, bmm2_scale=bmm2, out=out)
        assert rel_err(out, want) <= TOLERANCE[BF16]
    a = pb.call(mask_type="causal", out_dtype=FP32)
    b = pb.call(mask_type="causal", bmm1_scale=1.0 / math.sqrt(128), out_dtype=FP32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------
# Lengths, page IDs, CSR slack, static bounds, strides
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("ps", [16, 128])
def test_lengths_of_one_and_page_boundaries(ps):
    """seq_lens of 1, ps - 1, ps, ps + 1, 2 * ps + 3: the last page partially or exactly full."""
    g = gen(stable_seed("lens", ps))
    lens = [1, ps - 1, ps, ps + 1, 2 * ps + 3, 1]
    pb = Decode(lens, 4, 1, 128, ps, FP16, g, kind="repeated", slack=[2, 0, 1, 0, 0, 3])
    for mask, window in MASKS:
        want = gathered_ref(pb, mask, window)
        torch.testing.assert_close(pb.ref(mask_type=mask, window_left=window), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want, mask_type=mask, window_left=window)


def test_page_ids_repeated_within_and_across_requests():
    """Requests read the same pages several times (IDs in any order); the result equals the same
    logical K/V in contiguous storage."""
    g = gen(21)
    pb = Decode([70, 40, 16], 8, 2, 128, 16, BF16, g, kind="perm", extra_pages=0, poison=False)
    assert pb.indices.numel() == 9 and pb.num_pages == 9
    pb.indices.copy_(ip([2, 0, 2, 2, 1, 0, 2, 0, 2]))  # request 0: pages 2,0,2,2,1; 1: 0,2,0; 2: 2
    want = gathered_ref(pb, "dense")
    torch.testing.assert_close(pb.ref(), want, rtol=1e-12, atol=1e-12)
    check_public(pb, want)
    want = gathered_ref(pb, "causal", 20)
    check_public(pb, want, mask_type="causal", window_left=20)


def test_csr_slack_and_static_bounds():
    """A request may own more CSR entries than its live length needs (garbage IDs there are never read);
    max_seq_len / max_seq_len_q above the live values change nothing."""
    tight = Decode([30, 5, 64], 8, 2, 128, 32, BF16, gen(22), qmode="packed", q_lens=[3, 1, 2], slack=[0, 0, 0])
    loose = Decode([30, 5, 64], 8, 2, 128, 32, BF16, gen(22), qmode="packed", q_lens=[3, 1, 2], slack=[4, 1, 2],
                   max_seq_len=5000, max_seq_len_q=8)
    # the same generator draws: same live pages and data; only the CSR slack and the static bounds differ
    assert tight.live_pages == loose.live_pages
    for a, b in ((tight.q, loose.q), (tight.k_pool, loose.k_pool), (tight.v_pool, loose.v_pool)):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert loose.indices.numel() == tight.indices.numel() + 7
    assert loose.ws_bytes() > tight.ws_bytes()  # a split-KV key
    want = gathered_ref(tight, "causal", 2)
    torch.testing.assert_close(gathered_ref(loose, "causal", 2), want, rtol=0, atol=0)
    torch.testing.assert_close(loose.ref(mask_type="causal", window_left=2), want, rtol=1e-12, atol=1e-12)
    a = check_public(tight, want, mask_type="causal", window_left=2)
    b = check_public(loose, want, mask_type="causal", window_left=2)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_seq_lens_shorter_than_csr_capacity_uses_seq_lens():
    """The live length comes from seq_lens, not from the number of CSR entries."""
    g = gen(23)
    pb = Decode([64, 64], 4, 2, 128, 16, FP16, g, poison=False)
    full = pb.call(out_dtype=FP32)
    assert rel_err(full, gathered_ref(pb)) <= TOLERANCE[FP16]
    pb.seq_lens.copy_(ip([17, 1]))
    pb.seq_lens_list = [17, 1]
    want = gathered_ref(pb)
    check_public(pb, want)
    assert rel_err(full, want) > 0.1


def test_strided_query_and_combined_views():
    """Query sliced from a fused projection (heads strided); a tuple of the two halves of a combined cache."""
    g = gen(24)
    pb = Decode([20, 64, 9], 4, 2, 128, 32, BF16, g, kind="perm", poison=False)
    fused = torch.zeros(3, 8, 128, dtype=BF16)
    fused[:, 2:6] = pb.q
    q = fused[:, 2:6]
    assert not q.is_contiguous()
    combined = torch.stack([pb.k_pool, pb.v_pool], dim=1)
    want = gathered_ref(pb, "causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    assert pb.call(q=q, cache=(combined[:, 0], combined[:, 1]), mask_type="causal", out=out) is out
    assert rel_err(out, want) <= TOLERANCE[BF16]
    out2 = pb.call(q=q, cache=combined, mask_type="causal")
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


def test_inputs_not_modified():
    g = gen(25)
    pb = Decode([3, 8], 4, 2, 128, 16, BF16, g, qmode="packed", q_lens=[2, 3], slack=[1, 1])
    before = [t.clone() for t in (pb.q, pb.indptr, pb.indices, pb.seq_lens, pb.qo_indptr)]
    kc = pb.k_pool.clone()
    pb.call(mask_type="causal")
    for a, b in zip(before, (pb.q, pb.indptr, pb.indices, pb.seq_lens, pb.qo_indptr)):
        assert torch.equal(a, b)
    assert torch.equal(kc.isnan(), pb.k_pool.isnan())
    assert torch.equal(kc.nan_to_num(), pb.k_pool.nan_to_num())


def test_reference_fixed_sq_equals_packed():
    """[B, SQ, Hq, D] storage is the packed layout with equal query counts."""
    g = gen(26)
    pb = Decode([5, 40, 17], 8, 2, 64, 16, FP16, g, qmode="fixed", sq=3)
    qo = ip([0, 3, 6, 9])
    for mask, window in MASKS:
        a = pb.ref(mask_type=mask, window_left=window)
        b = R.batch_decode(pb.q.reshape(9, 8, 64), pb.k_pool, pb.v_pool, pb.indptr, pb.indices, pb.seq_lens,
                           qo_indptr=qo, mask_type=mask, window_left=window, compute_dtype=F64)
        torch.testing.assert_close(a.reshape(9, 8, 64), b, rtol=0, atol=0)


# ----------------------------------------------------------------------------
# BatchDecodePagedTSWrapper and the one-shot on CPU
# ----------------------------------------------------------------------------


def _last_page_len(pb: Decode):
    """FlashInfer's last_page_len for CSR without slack: len - (pages - 1) * ps."""
    return ip([sk - ((sk + pb.ps - 1) // pb.ps - 1) * pb.ps for sk in pb.seq_lens_list])


def _plan(pb: Decode, tuning=None, **kw) -> BatchDecodePagedTSWrapper:
    """A wrapper planned over pb's CSR pages (pb.last: its last_page_len) in pb's query mode."""
    w = BatchDecodePagedTSWrapper(tuning=tuning)
    w.plan(pb.indptr, pb.indices, pb.last, pb.hq, pb.hkv, pb.d, pb.ps, q_data_type=pb.dtype, **pb.qkw(), **kw)
    return w


def _ref_with_lens(pb: Decode, lens, *args):
    """gathered_ref with other K/V lengths (pb's own are restored)."""
    saved = pb.seq_lens.clone(), pb.seq_lens_list
    pb.seq_lens.copy_(ip(lens))
    pb.seq_lens_list = list(lens)
    try:
        return gathered_ref(pb, *args)
    finally:
        pb.seq_lens.copy_(saved[0])
        pb.seq_lens_list = saved[1]


@pytest.mark.parametrize("form", ["combined", "tuple"])
@pytest.mark.parametrize("mask,window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("qmode", QMODES)
def test_wrapper_equals_standalone(qmode, mask, window, form, split_merge):
    """Single, fixed multi-token (seq_len_q) and packed (qo_indptr) queries through the wrapper: equal to
    the standalone bit for bit and within tolerance of the oracle; the one-shot agrees."""
    g = gen(stable_seed("wrapper", qmode, mask, window, form))
    pb = Decode([3, 33, 100, 64], 8, 2, 128, 32, FP16, g, qmode=qmode, sq=3, q_lens=[1, 3, 2, 4],
                max_seq_len_q=5 if qmode == "packed" else None, form=form, kind=("perm", "repeated")[window > 0])
    pb.last = _last_page_len(pb)
    w = _plan(pb, split_merge, mask_type=mask, window_left=window, o_data_type=FP32)
    want = gathered_ref(pb, mask, window, 0.05, 1.5)
    standalone = pb.call(mask_type=mask, window_left=window, bmm1_scale=0.05, bmm2_scale=1.5, out_dtype=FP32)
    out = torch.full(pb.q.shape, NAN, dtype=FP32)
    for _ in range(2):  # a plan serves many runs
        out.fill_(NAN)
        assert w.run(pb.q, pb.cache, bmm1_scale=0.05, bmm2_scale=1.5, out=out) is out
        assert rel_err(out, want) <= TOLERANCE[FP16]
        torch.testing.assert_close(out, standalone, rtol=0, atol=0)
    res = w.run(pb.q, pb.cache, bmm1_scale=0.05, bmm2_scale=1.5)
    assert res.dtype == FP32 and res.shape == pb.q.shape
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    # scales are run arguments: another run of the same plan with other scales follows them
    other = w.run(pb.q, pb.cache, bmm2_scale=0.5)
    assert rel_err(other, gathered_ref(pb, mask, window, None, 0.5)) <= TOLERANCE[FP16]
    # the one-shot agrees
    one = batch_decode_with_paged_kv_cache(pb.q, pb.cache, pb.indptr, pb.indices, pb.last, **pb.qkw(),
                                           mask_type=mask, window_left=window, bmm1_scale=0.05, bmm2_scale=1.5,
                                           out_dtype=FP32)
    torch.testing.assert_close(one, out, rtol=0, atol=0)
    out2 = torch.full(pb.q.shape, NAN, dtype=FP32)
    assert batch_decode_with_paged_kv_cache(pb.q, pb.cache, pb.indptr, pb.indices, pb.last, **pb.qkw(),
                                            mask_type=mask, window_left=window, bmm1_scale=0.05, bmm2_scale=1.5,
                                            out=out2) is out2
    torch.testing.assert_close(out2, out, rtol=0, atol=0)


@pytest.mark.parametrize("qmode", QMODES)
def test_wrapper_run_reads_no_host_values_and_passes_its_plan(qmode):
    """run does no host read; the op gets the bound paged_kv_indptr / paged_kv_indices / qo_indptr
    themselves, the plan's own lengths (not the caller's last_page_len), the planned bounds and the
    wrapper's tuning string."""
    from prims_ts import Tuning
    from prims_ts.testing import recording_no_host_reads

    g = gen(stable_seed("recorded", qmode))
    pb = Decode([20, 5, 40], 8, 2, 128, 16, BF16, g, qmode=qmode, sq=2, q_lens=[2, 1, 3], max_seq_len_q=4)
    pb.last = _last_page_len(pb)
    tuning = Tuning(cluster_merge=False)
    w = _plan(pb, tuning, mask_type="causal", max_kv_len=100, o_data_type=FP32)
    out = torch.empty(pb.q.shape, dtype=FP32)
    with recording_no_host_reads("batch_decode", "batch_decode") as rec:
        assert w.run(pb.q, pb.cache).dtype == FP32
        assert w.run(pb.q, pb.cache, out=out) is out
    assert [c[0] for c in rec.calls] == ["batch_decode", "batch_decode_out"]
    for name, call in rec.calls:
        rest = call[4:] if name == "batch_decode" else call[5:]  # after (q, k, v, workspace[, out])
        kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q, max_seq_len_q, max_seq_len = rest[:7]
        assert kv_indptr is pb.indptr and kv_indices is pb.indices and qo_indptr is pb.qo_indptr
        assert seq_lens is not pb.last and torch.equal(seq_lens, pb.seq_lens)
        assert (seq_len_q, max_seq_len_q, max_seq_len) == (pb.seq_len_q if qmode == "fixed" else 1, pb.max_seq_len_q,
                                                          100)
        assert call[-1] == tuning.encode()
    assert rec.calls[0][1][-2] == dtype_code(FP32)


def test_wrapper_derives_lengths_at_plan():
    """plan derives each length (pages - 1) * page_size + last_page_len once: a later change to the
    caller's last_page_len has no effect on run; a new plan picks it up."""
    g = gen(31)
    pb = Decode([40, 64, 17], 8, 2, 128, 16, BF16, g, kind="perm", extra_pages=6, poison=False)
    pb.last = _last_page_len(pb)
    w = _plan(pb, mask_type="causal", window_left=9)
    want = gathered_ref(pb, "causal", 9)
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    w.run(pb.q, pb.cache, out=out)
    assert rel_err(out, want) <= TOLERANCE[BF16]
    pages = [3, 4, 2]
    for new_last in ([1, 16, 3], [8, 2, 16]):
        new_lens = [(n - 1) * 16 + last for n, last in zip(pages, new_last)]
        want_new = _ref_with_lens(pb, new_lens, "causal", 9)
        assert relative_error(want_new, want) > 0.05  # the change would show
        pb.last.copy_(ip(new_last))
        out.fill_(NAN)
        w.run(pb.q, pb.cache, out=out)
        assert rel_err(out, want) <= TOLERANCE[BF16], new_last  # still the planned lengths
        w2 = _plan(pb, mask_type="causal", window_left=9)
        assert rel_err(w2.run(pb.q, pb.cache), want_new) <= TOLERANCE[BF16], new_last


@pytest.mark.parametrize("qmode", ["single", "packed"])
def test_wrapper_reads_page_ids_live(qmode):
    """paged_kv_indices is bound: page IDs remapped in place between runs (inside the cache) change the
    result accordingly; moving pages' contents and remapping their IDs leaves it unchanged."""
    g = gen(stable_seed("remap", qmode))
    pb = Decode([40, 64, 17], 8, 2, 128, 16, BF16, g, qmode=qmode, q_lens=[3, 1, 2], kind="perm", extra_pages=9,
                poison=False)
    pb.last = _last_page_len(pb)
    w = _plan(pb, mask_type="causal", window_left=20)
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    w.run(pb.q, pb.cache, out=out)
    prev = out.clone()
    assert rel_err(prev, gathered_ref(pb, "causal", 20)) <= TOLERANCE[BF16]
    for shift in (1, 5):
        pb.indices.copy_((pb.indices + shift) % pb.num_pages)  # every entry another page
        want = gathered_ref(pb, "causal", 20)
        out.fill_(NAN)
        w.run(pb.q, pb.cache, out=out)
        assert rel_err(out, want) <= TOLERANCE[BF16], shift
        assert relative_error(out, prev) > 0.05, "the remap had no effect"
        prev = out.clone()
    # defragmentation: copy request 0's pages to unused pages, point its IDs there: the same bits
    used = set(pb.indices.tolist())
    free = [p for p in range(pb.num_pages) if p not in used]
    n0 = int(pb.indptr[1])
    assert len(free) >= n0
    for j in range(n0):
        src, dst = int(pb.indices[j]), free[j]
        pb.k_pool[dst].copy_(pb.k_pool[src])
        pb.v_pool[dst].copy_(pb.v_pool[src])
        pb.indices[j] = dst
    out.fill_(NAN)
    w.run(pb.q, pb.cache, out=out)
    torch.testing.assert_close(out, prev, rtol=0, atol=0)


def test_wrapper_replan():
    g = gen(32)
    a = Decode([3, 50], 4, 2, 128, 16, BF16, g, kind="perm")
    b = Decode([200], 32, 1, 256, 64, FP16, g, kind="repeated")
    c = Decode([9, 30, 4], 8, 2, 64, 32, BF16, g, qmode="packed", q_lens=[3, 1, 4])
    w = BatchDecodePagedTSWrapper()
    for pb, mask in ((a, "causal"), (b, "dense"), (c, "causal"), (a, "dense")):
        pb.last = _last_page_len(pb)
        w.plan(pb.indptr, pb.indices, pb.last, pb.hq, pb.hkv, pb.d, pb.ps, **pb.qkw(), mask_type=mask,
               q_data_type=pb.dtype, kv_data_type=pb.dtype)
        res = w.run(pb.q, pb.cache)
        assert res.dtype == pb.dtype
        assert rel_err(res, gathered_ref(pb, mask)) <= TOLERANCE[pb.dtype]


# ----------------------------------------------------------------------------
# get_prims_ts_batch_decode_workspace_size
# ----------------------------------------------------------------------------

WS_ARGS = [(b, hq, hkv, d, msq) for b in (1, 2, 5) for hq, hkv in ((4, 4), (8, 2), (32, 1)) for d in (64, 256)
           for msq in (1, 3)]


def test_workspace_size_positive_int_and_deterministic():
    for b, hq, hkv, d, msq in WS_ARGS:
        for L in (1, 64, 1000, 4096, 131072, 2_147_483_520):
            n = ws_size(b, hq, hkv, d, L, msq)
            assert type(n) is int and n > 0
            assert n == ws_size(b, hq, hkv, d, L, msq)
            assert n == get_prims_ts_batch_decode_workspace_size(b, hq, hkv, d, page_size=16, max_seq_len=L,
                                                                 seq_len_q=msq, max_seq_len_q=msq, device="cpu")
            packed = get_prims_ts_batch_decode_workspace_size(b, hq, hkv, d, 16, L, qo_indptr=ip(cumsum0([msq] * b)),
                                                              max_seq_len_q=msq, device="cpu")
            assert type(packed) is int and packed >= ws_size(b, hq, hkv, d, L, 1)
    # the default query bound is 1; a device string and a torch.device agree
    assert ws_size(2, 8, 2, 128, 4096) == get_prims_ts_batch_decode_workspace_size(
        2, 8, 2, 128, 16, 4096, device=torch.device("cpu"))


def test_workspace_size_grows_with_max_seq_len_q():
    for b, hq, hkv, d, _ in WS_ARGS:
        for L in (64, 4096, 131072):
            assert ws_size(b, hq, hkv, d, L, 4) >= ws_size(b, hq, hkv, d, L, 1)


def test_workspace_size_monotone_in_max_seq_len():
    for b in (1, 2, 4):
        for hq, hkv, d in ((1, 1, 128), (8, 2, 128), (32, 8, 64), (16, 8, 256)):
            prev, prev_L = 0, 0
            for L in list(range(1, 4200, 7)) + list(range(4200, 140000, 251)):
                n = ws_size(b, hq, hkv, d, L)
                assert n >= prev, f"B={b} Hq={hq} Hkv={hkv} D={d}: {n} bytes at max_seq_len {L} < {prev} at {prev_L}"
                prev, prev_L = n, L


def test_workspace_size_small_batch_short_keys_are_minimal():
    """A key with a single split needs no partials: the documented minimum is all it takes."""
    a = ws_size(1, 8, 2, 128, 1)
    assert a == ws_size(1, 8, 2, 128, 64) == ws_size(2, 8, 2, 128, 127)
    assert ws_size(1, 8, 2, 128, 32768) > a
