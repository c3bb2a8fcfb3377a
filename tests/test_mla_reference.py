"""MLA decode semantics on CPU: the reference, the standalone function, the wrapper and the one-shot.

Two independent float64 oracles:

* ``gathered_oracle``: each request's latent rows copied token by token out of the cache
  (``page = block_tables[b, j // page_size]``, ``slot = j % page_size``) into a contiguous
  ``[Sk, 576]`` matrix; per head, ``softmax(scale * q K^T)`` with the bottom-right causal rule
  written out as an explicit boolean matrix, times ``K[:, :512]``;
* ``naive_mla``: a loop per (request, query token, head) that reads each key straight from its
  page and does the softmax by hand (small problems only).

``prims_ts.reference.batch_mla_decode(..., compute_dtype=float64)`` must equal both to float64
round-off. The public functions on CPU tensors must match them within the project's tolerance
(``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16), write every element of a NaN-poisoned
``out`` and return ``out`` itself.

Every cache slot that no request uses (whole unused pages and the tail of each request's last
page) holds NaN, and block-table entries past a request's live pages hold garbage page IDs (the
contract constrains only the used ones): reading either shows up. Block tables are row-strided
views of wider tables (padding between rows), as the seed allows.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import (
    BatchMLADecodePagedTSWrapper,
    batch_mla_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_mla_workspace_size,
    prims_ts_batch_decode_with_kv_cache_mla,
)
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, assign_pages, cumsum0, rel_err, relative_error, stable_seed

F64 = torch.float64
I32 = torch.int32
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")
DQK, DV = 576, 512
RANK, ROPE = 512, 64  # kv_lora_rank, qk_rope_head_dim
GARBAGE = (-1, 2**31 - 1, -2**31, 123456)  # block-table entries past a request's live pages
SCALE = 1.0 / math.sqrt(DQK)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def ip(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


class MLA:
    """One MLA decode problem.

    qmode: "fixed" (query [B, SQ, H, 576]) or "packed" ([T, H, 576] + qo_indptr).
    rank:  3 (cache [P, ps, 576]) or 4 ([P, 1, ps, 576]).
    kind:  "perm" (distinct pages, non-identity order) or "repeated" (IDs shared across / within requests).
    cols:  block-table columns (default: the longest request's pages + 1); pad: padding between rows.
    """

    def __init__(self, seq_lens, h, ps, dtype, g, *, qmode="fixed", sq=1, q_lens=None, max_seq_len_q=None,
                 rank=3, kind="perm", cols=None, pad=3, extra_pages=2, poison=True, max_seq_len=None):
        B = len(seq_lens)
        self.B, self.h, self.ps, self.dtype, self.qmode, self.rank = B, h, ps, dtype, qmode, rank
        self.seq_lens_list = list(seq_lens)
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        cols = cols or max(n_live) + 1
        P, live = assign_pages(n_live, kind, extra_pages, g)
        self.num_pages, self.live_pages = P, live
        wide = torch.full((B, cols + pad), -77, dtype=I32)
        for b in range(B):
            row = live[b] + [GARBAGE[(b + i) % len(GARBAGE)] for i in range(cols - n_live[b])]
            wide[b, :cols] = ip(row)
        self.block_tables = wide[:, :cols]  # row stride cols + pad
        self.seq_lens = ip(seq_lens)
        self.pool = randn((P, ps, DQK), dtype, g)  # the 3-D pool; `cache` is the public view
        self.cache = self.pool.unsqueeze(1) if rank == 4 else self.pool
        if poison:
            self.pool.masked_fill_(~self.used_slots()[:, :, None].expand_as(self.pool), NAN)
        self.qo_indptr = None
        if qmode == "fixed":
            self.q_lens = [sq] * B
            self.q = randn((B, sq, h, DQK), dtype, g)
            self.max_seq_len_q = sq
        else:
            self.q_lens = list(q_lens)
            self.qo_indptr = ip(cumsum0(q_lens))
            self.q = randn((sum(q_lens), h, DQK), dtype, g)
            self.max_seq_len_q = max_seq_len_q or max(q_lens)
        self.max_seq_len = max_seq_len or max(seq_lens)
        self.workspace = torch.zeros(self.ws_bytes(), dtype=torch.uint8)

    @property
    def out_shape(self):
        return tuple(self.q.shape[:-1]) + (DV,)

    def ws_bytes(self):
        return get_prims_ts_batch_decode_mla_workspace_size(self.B, self.h, RANK, ROPE, self.ps, self.max_seq_len,
                                                            max_seq_len_q=self.max_seq_len_q, q_dtype=self.dtype,
                                                            device="cpu")

    def used_slots(self) -> torch.Tensor:
        used = torch.zeros(self.num_pages, self.ps, dtype=torch.bool)
        for b, sk in enumerate(self.seq_lens_list):
            pages = ip(self.live_pages[b]).long()
            j = torch.arange(sk)
            used[pages[j // self.ps], j % self.ps] = True
        return used

    def qkw(self):
        return dict(qo_indptr=self.qo_indptr, max_seq_len_q=self.max_seq_len_q) if self.qmode == "packed" else {}

    def call(self, q=None, cache=None, block_tables=None, **kw):
        return prims_ts_batch_decode_with_kv_cache_mla(
            self.q if q is None else q, self.cache if cache is None else cache, self.workspace, RANK, ROPE,
            self.block_tables if block_tables is None else block_tables, self.seq_lens, self.max_seq_len,
            **self.qkw(), **kw)

    def plan(self, w=None, **kw) -> BatchMLADecodePagedTSWrapper:
        """A wrapper planned over (and bound to) this problem's metadata."""
        w = w if w is not None else BatchMLADecodePagedTSWrapper()
        w.plan(self.block_tables, self.seq_lens, self.h, RANK, ROPE, self.ps, qo_indptr=self.qo_indptr,
               max_seq_len_q=self.max_seq_len_q, q_data_type=self.dtype, **kw)
        return w

    def oneshot(self, **kw):
        return batch_mla_decode_with_paged_kv_cache(self.q, self.cache, self.block_tables, self.seq_lens,
                                                    qo_indptr=self.qo_indptr, **kw)

    def ref(self, **kw):
        return R.batch_mla_decode(self.q, self.cache, self.block_tables, self.seq_lens, qo_indptr=self.qo_indptr,
                                  compute_dtype=F64, **kw)

    def request_rows(self):
        """Per request: its rows of the (packed-flattened) query."""
        qo = cumsum0(self.q_lens)
        return [slice(qo[b], qo[b + 1]) for b in range(self.B)]


def gather_latents(pb: MLA, b: int) -> torch.Tensor:
    """[Sk, 576] float64 copy of request b's latent rows, one token at a time."""
    rows = [pb.pool[int(pb.block_tables[b, j // pb.ps]), j % pb.ps] for j in range(pb.seq_lens_list[b])]
    return torch.stack(rows).to(F64)


def gathered_oracle(pb: MLA, mask_type="causal", sm_scale=1.0, output_scale=1.0) -> torch.Tensor:
    q = pb.q.reshape(-1, pb.h, DQK).to(F64)
    out = torch.empty(q.shape[0], pb.h, DV, dtype=F64)
    for b, rows in enumerate(pb.request_rows()):
        kv = gather_latents(pb, b)
        assert not torch.isnan(kv).any(), "a used slot holds poison"
        sk, sq = kv.shape[0], rows.stop - rows.start
        allowed = torch.ones(sq, sk, dtype=torch.bool)
        if mask_type == "causal":
            for i in range(sq):
                allowed[i, sk - sq + i + 1:] = False
        for h in range(pb.h):
            logits = sm_scale * (q[rows, h] @ kv.T)
            p = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
            out[rows, h] = output_scale * (p @ kv[:, :DV])
    return out.reshape(pb.out_shape)


def naive_mla(pb: MLA, mask_type="causal", sm_scale=1.0, output_scale=1.0) -> torch.Tensor:
    """Float64, one (request, query token, head) at a time; key j from page block_tables[b, j // ps]."""
    q = pb.q.reshape(-1, pb.h, DQK)
    out = torch.empty(q.shape[0], pb.h, DV, dtype=F64)
    for b, rows in enumerate(pb.request_rows()):
        sk, sq = pb.seq_lens_list[b], rows.stop - rows.start
        for i in range(sq):
            keys = range(sk) if mask_type == "dense" else range(min(sk - sq + i, sk - 1) + 1)
            lat = [pb.pool[int(pb.block_tables[b, j // pb.ps]), j % pb.ps].to(F64) for j in keys]
            for h in range(pb.h):
                qv = q[rows.start + i, h].to(F64)
                logits = [sm_scale * float(torch.dot(qv, row)) for row in lat]
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                acc = torch.zeros(DV, dtype=F64)
                for wj, row in zip(w, lat):
                    acc += wj * row[:DV]
                out[rows.start + i, h] = acc / math.fsum(w) * output_scale
    return out.reshape(pb.out_shape)


def check_public(pb: MLA, want: torch.Tensor, out_dtype=None, mask_type="causal", **scales):
    """Standalone, one-shot and wrapper (both run modes) on CPU: a poisoned out (of the output dtype:
    out_dtype, default bfloat16) is fully written and returned, the functional forms give the same
    values, all within tolerance of the oracle. ``scales``: bmm1_scale / bmm2_scale."""
    odt = out_dtype or BF16
    tol = max(TOLERANCE[pb.dtype], TOLERANCE[odt])
    kw = dict(scales, mask_type=mask_type)
    if out_dtype is not None:
        kw["out_dtype"] = out_dtype
    out = torch.full(pb.out_shape, NAN, dtype=odt)
    assert pb.call(out=out, **kw) is out
    assert rel_err(out, want) <= tol
    res = pb.call(**kw)
    assert res.dtype == odt and res.shape == pb.out_shape
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    one = torch.full(pb.out_shape, NAN, dtype=odt)
    assert pb.oneshot(out=one, max_seq_len_q=pb.max_seq_len_q, **kw) is one
    torch.testing.assert_close(one, out, rtol=0, atol=0)
    w = pb.plan(max_kv_len=pb.max_seq_len, o_data_type=odt, mask_type=mask_type)
    for validate in (True, False):
        got = torch.full(pb.out_shape, NAN, dtype=odt)
        assert w.run(pb.q, pb.cache, out=got, validate=validate, **scales) is got
        torch.testing.assert_close(got, out, rtol=0, atol=0)
    res = w.run(pb.q, pb.cache, **scales)
    assert res.dtype == odt
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    return out


# ----------------------------------------------------------------------------
# Reference and public functions vs the oracles: Q mode x mask x page size x cache rank
# ----------------------------------------------------------------------------

MASKS = ["dense", "causal"]
HEADS = [8, 16, 32, 64, 128]
PAGE_SIZES = [16, 32, 64, 128]


def _cell_problem(qmode, mask, ps, rank, i, g, **kw):
    """A 3-request problem (lengths: 1 or the query count, 37 and 130: not page multiples)."""
    h = HEADS[i % 5]
    sq = 1 + i % 4  # SQ 1..4
    q_lens = [1, 1 + (i + 1) % 4, 1 + (i + 2) % 4]
    first = 1 if mask == "dense" else (sq if qmode == "fixed" else q_lens[0])
    return MLA([first, 37, 130], h, ps, (BF16, FP16)[i % 2], g, qmode=qmode, sq=sq, q_lens=q_lens,
               max_seq_len_q=max(q_lens) + i % 2, rank=rank, kind=("perm", "repeated")[(i // 2) % 2], **kw)


@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("qmode", ["fixed", "packed"])
def test_reference_and_public_match_gathered(qmode, mask, ps, rank):
    i = (qmode == "packed") + 2 * MASKS.index(mask) + ps // 16 + rank
    pb = _cell_problem(qmode, mask, ps, rank, i, gen(stable_seed("mla", qmode, mask, ps, rank)))
    want = gathered_oracle(pb, mask, SCALE, 1.0)
    got = pb.ref(mask_type=mask, sm_scale=SCALE)
    assert got.dtype == F64 and got.shape == pb.out_shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    check_public(pb, want, mask_type=mask, bmm1_scale=SCALE)


NAIVE = [("fixed", "dense", 1), ("fixed", "causal", 3), ("fixed", "causal", 1), ("packed", "causal", None),
         ("packed", "dense", None)]


@pytest.mark.parametrize("qmode,mask,sq", NAIVE, ids=[f"{q}-{m}-sq{s}" for q, m, s in NAIVE])
def test_reference_matches_naive(qmode, mask, sq):
    g = gen(stable_seed("naive", qmode, mask, sq))
    pb = MLA([3, 19, 40], 8, 16, BF16, g, qmode=qmode, sq=sq, q_lens=[1, 3, 2], rank=3 if sq == 1 else 4,
             kind="repeated" if mask == "dense" else "perm")
    want = naive_mla(pb, mask, 0.05, 1.3)
    got = pb.ref(mask_type=mask, sm_scale=0.05, output_scale=1.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    out = torch.full(pb.out_shape, NAN, dtype=FP32)
    assert pb.call(mask_type=mask, bmm1_scale=0.05, bmm2_scale=1.3, out=out, out_dtype=FP32) is out
    assert rel_err(out, want) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# Heads, SQ, dtypes, output dtypes, scales, defaults
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("sq", [1, 2, 3, 4])
@pytest.mark.parametrize("h", HEADS)
def test_heads_and_query_lengths(h, sq):
    g = gen(stable_seed("heads", h, sq))
    pb = MLA([sq, 33, 70], h, 32, BF16, g, sq=sq, rank=3 + sq % 2, kind=("perm", "repeated")[h % 3 == 1])
    check_public(pb, gathered_oracle(pb, "causal", SCALE), bmm1_scale=SCALE)


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_dtypes_and_out_dtypes(dtype, out_dtype):
    g = gen(stable_seed("dtypes", str(dtype), str(out_dtype)))
    pb = MLA([5, 40, 17], 16, 16, dtype, g, qmode="packed", q_lens=[2, 3, 1])
    check_public(pb, gathered_oracle(pb, "causal", SCALE), out_dtype=out_dtype, bmm1_scale=SCALE)


def test_out_dtype_default_bfloat16_and_out_of_that_dtype():
    """Without out_dtype (or with None), the output is bfloat16, even for fp16 inputs; an out must have
    exactly the output dtype: its own dtype no longer decides (another one is refused)."""
    g = gen(41)
    pb = MLA([5, 40], 8, 16, FP16, g, sq=2)
    want = gathered_oracle(pb, "causal", SCALE)
    res = pb.call(bmm1_scale=SCALE)
    assert res.dtype == BF16 and rel_err(res, want) <= TOLERANCE[BF16]
    assert pb.call(bmm1_scale=SCALE, out_dtype=None).dtype == BF16
    assert pb.oneshot(bmm1_scale=SCALE).dtype == BF16
    assert pb.plan(o_data_type=None).run(pb.q, pb.cache, bmm1_scale=SCALE).dtype == BF16
    out = torch.full(pb.out_shape, NAN, dtype=BF16)
    assert pb.call(out=out, bmm1_scale=SCALE) is out  # bfloat16 out, default out_dtype
    assert rel_err(out, want) <= TOLERANCE[BF16]
    for odt in (FP32, FP16):
        out = torch.full(pb.out_shape, NAN, dtype=odt)
        with pytest.raises(ValueError, match=r"\bout\b.*out_dtype"):
            pb.call(out=out, bmm1_scale=SCALE)
        with pytest.raises(ValueError, match=r"\bout\b.*out_dtype"):
            pb.oneshot(out=out, bmm1_scale=SCALE)
        with pytest.raises(ValueError, match=r"\bout\b"):
            pb.plan().run(pb.q, pb.cache, out=out, bmm1_scale=SCALE)
        assert torch.isnan(out).all()  # refused before anything was written
        assert pb.call(out=out, out_dtype=odt, bmm1_scale=SCALE) is out
        assert rel_err(out, want) <= TOLERANCE[FP16]
        out.fill_(NAN)
        assert pb.oneshot(out=out, out_dtype=odt, bmm1_scale=SCALE) is out
        assert rel_err(out, want) <= TOLERANCE[FP16]
        out.fill_(NAN)
        assert pb.plan(o_data_type=odt).run(pb.q, pb.cache, out=out, bmm1_scale=SCALE) is out
        assert rel_err(out, want) <= TOLERANCE[FP16]


@pytest.mark.parametrize("qmode", ["fixed", "packed"])
def test_scales(qmode):
    g = gen(stable_seed("scales", qmode))
    pb = MLA([4, 50, 23], 16, 16, BF16, g, qmode=qmode, sq=3, q_lens=[3, 1, 4])
    for bmm1, bmm2 in [(0.02, 1.0), (0.1, 0.25), (SCALE, 3.0)]:
        want = gathered_oracle(pb, "causal", bmm1, bmm2)
        torch.testing.assert_close(pb.ref(sm_scale=bmm1, output_scale=bmm2), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want, bmm1_scale=bmm1, bmm2_scale=bmm2)
    # the seed's default bmm1_scale is 1.0 (not 1/sqrt(576))
    want = gathered_oracle(pb, "causal", 1.0, 1.0)
    assert rel_err(pb.call(), want) <= TOLERANCE[BF16]
    assert rel_err(pb.oneshot(), want) <= TOLERANCE[BF16]
    assert rel_err(pb.call(), gathered_oracle(pb, "causal", SCALE, 1.0)) > 0.1


# ----------------------------------------------------------------------------
# Pages, block tables, lengths
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lengths_of_one_and_page_boundaries(ps):
    """Lengths 1, ps - 1, ps, ps + 1, 2 ps and 2 ps + 1 with causal SQ 1 and dense SQ 2."""
    lens = [1, ps - 1, ps, ps + 1, 2 * ps, 2 * ps + 1]
    g = gen(stable_seed("bounds", ps))
    pb = MLA(lens, 8, ps, BF16, g, sq=1)
    check_public(pb, gathered_oracle(pb, "causal", SCALE), bmm1_scale=SCALE)
    pb = MLA(lens, 8, ps, BF16, g, sq=2, rank=4)
    check_public(pb, gathered_oracle(pb, "dense", SCALE), mask_type="dense", bmm1_scale=SCALE)


def test_page_ids_repeated_within_and_across_requests():
    g = gen(21)
    pb = MLA([40, 33, 64], 16, 16, BF16, g, kind="repeated", sq=2)
    assert len(set(pb.live_pages[0])) < len(pb.live_pages[0]) or pb.live_pages[0][0] == pb.live_pages[2][0]
    check_public(pb, gathered_oracle(pb, "causal", SCALE), bmm1_scale=SCALE)


def test_padded_and_contiguous_block_tables_agree():
    """A row-strided view (padding between rows), its contiguous copy and a single-column-wider table
    give the same bits; entries past each request's live pages are never read."""
    g = gen(22)
    pb = MLA([7, 40, 100], 32, 32, BF16, g, qmode="packed", q_lens=[2, 1, 3], pad=5)
    assert pb.block_tables.stride(0) > pb.block_tables.shape[1]
    want = gathered_oracle(pb, "causal", SCALE)
    a = pb.call(bmm1_scale=SCALE)
    assert rel_err(a, want) <= TOLERANCE[BF16]
    b = pb.call(block_tables=pb.block_tables.contiguous(), bmm1_scale=SCALE)
    wider = torch.cat([pb.block_tables, torch.full((pb.B, 3), 2**31 - 1, dtype=I32)], dim=1)
    c = pb.call(block_tables=wider, bmm1_scale=SCALE)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_tight_block_table_and_cache():
    """Block-table rows exactly as long as the longest request needs; a cache of exactly the used pages."""
    g = gen(23)
    lens = [64, 17, 33]
    pb = MLA(lens, 8, 16, BF16, g, cols=4, pad=0, extra_pages=0)
    assert pb.block_tables.shape[1] * 16 == max(lens)
    check_public(pb, gathered_oracle(pb, "causal", SCALE), bmm1_scale=SCALE)


def test_seq_lens_shorter_than_table_capacity_and_static_bound():
    """seq_lens decides the length (not the table width); max_seq_len may exceed every length."""
    g = gen(24)
    pb = MLA([5, 20, 3], 8, 16, FP16, g, cols=6, sq=3, max_seq_len=96)
    want = gathered_oracle(pb, "causal", SCALE)
    check_public(pb, want, bmm1_scale=SCALE)
    # an explicit max_kv_len up to the table's capacity (6 columns of 16)
    out = pb.oneshot(max_kv_len=pb.block_tables.shape[1] * pb.ps, bmm1_scale=SCALE)
    assert rel_err(out, want) <= TOLERANCE[FP16]
    w = pb.plan(max_kv_len=96)
    assert rel_err(w.run(pb.q, pb.cache, bmm1_scale=SCALE, validate=True), want) <= TOLERANCE[FP16]


def test_three_and_four_dim_caches_agree():
    g = gen(25)
    pb = MLA([9, 30, 64], 16, 16, BF16, g, qmode="packed", q_lens=[1, 4, 2])
    a = pb.call(bmm1_scale=SCALE)
    b = pb.call(cache=pb.pool.unsqueeze(1), bmm1_scale=SCALE)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    four = pb.pool.unsqueeze(1)
    assert four.data_ptr() == pb.pool.data_ptr()


def test_strided_query():
    """Query heads sliced out of a wider projection (head stride 576, token stride > H * 576)."""
    g = gen(26)
    pb = MLA([10, 40], 8, 16, BF16, g, sq=2, poison=False)
    wide = torch.zeros(pb.B, 2, 12, DQK, dtype=BF16)
    wide[:, :, 2:10] = pb.q
    q = wide[:, :, 2:10]
    assert not q.is_contiguous()
    want = gathered_oracle(pb, "causal", SCALE)
    assert rel_err(pb.call(q=q, bmm1_scale=SCALE), want) <= TOLERANCE[BF16]


def test_reference_fixed_sq_equals_packed():
    """[B, SQ, H, 576] storage is the packed layout with equal query counts."""
    g = gen(27)
    pb = MLA([5, 40, 17], 8, 16, FP16, g, sq=3)
    qo = ip([0, 3, 6, 9])
    for mask in MASKS:
        a = pb.ref(mask_type=mask, sm_scale=SCALE)
        b = R.batch_mla_decode(pb.q.reshape(9, 8, DQK), pb.cache, pb.block_tables, pb.seq_lens, qo_indptr=qo,
                               mask_type=mask, sm_scale=SCALE, compute_dtype=F64)
        torch.testing.assert_close(a.reshape(9, 8, DV), b, rtol=0, atol=0)


def test_reference_float32_and_float64_agree():
    g = gen(28)
    pb = MLA([5, 40, 17], 16, 32, BF16, g, qmode="packed", q_lens=[2, 3, 4])
    a = R.batch_mla_decode(pb.q, pb.cache, pb.block_tables, pb.seq_lens, qo_indptr=pb.qo_indptr, sm_scale=SCALE)
    assert a.dtype == FP32
    assert rel_err(a, pb.ref(sm_scale=SCALE)) < 1e-5


def test_inputs_not_modified():
    g = gen(29)
    pb = MLA([3, 8], 8, 16, BF16, g, qmode="packed", q_lens=[2, 3])
    before = [t.clone() for t in (pb.q, pb.block_tables, pb.seq_lens, pb.qo_indptr)]
    pool = pb.pool.clone()
    pb.call()
    pb.oneshot()
    for a, b in zip(before, (pb.q, pb.block_tables, pb.seq_lens, pb.qo_indptr)):
        assert torch.equal(a, b)
    assert torch.equal(pool.isnan(), pb.pool.isnan())
    assert torch.equal(pool.nan_to_num(), pb.pool.nan_to_num())


# ----------------------------------------------------------------------------
# Wrapper: one plan, many runs with changed metadata; re-plan; caller workspace
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("qmode", ["fixed", "packed"])
def test_wrapper_runs_with_rewritten_metadata(qmode, validate, split_merge):
    """plan binds block_tables, seq_lens and qo_indptr: plan with room (max_kv_len, max_seq_len_q), rewrite
    lengths, page IDs and query offsets in place within the plan; every run follows the live values."""
    g = gen(stable_seed("rewrite", qmode, validate))
    pb = MLA([40, 17, 5], 16, 16, BF16, g, qmode=qmode, sq=2, q_lens=[2, 1, 3], cols=6, extra_pages=8,
             poison=False)
    w = BatchMLADecodePagedTSWrapper(tuning=split_merge)
    w.plan(pb.block_tables, pb.seq_lens, 16, RANK, ROPE, 16, qo_indptr=pb.qo_indptr,
           max_seq_len_q=4 if qmode == "packed" else 2, max_kv_len=96, q_data_type=BF16, o_data_type=FP32)
    out = torch.full(pb.out_shape, NAN, dtype=FP32)
    prev = None
    for step, (new_lens, new_q) in enumerate([(None, None), ([96, 2, 49], [1, 2, 3]), ([4, 80, 16], [4, 1, 1])]):
        if new_lens is not None:
            pb.seq_lens.copy_(ip(new_lens))
            pb.seq_lens_list = new_lens
            pb.block_tables.copy_(torch.randint(0, pb.num_pages, tuple(pb.block_tables.shape), generator=g,
                                                dtype=I32))
            if qmode == "packed":
                pb.qo_indptr.copy_(ip(cumsum0(new_q)))
                pb.q_lens = new_q
        out.fill_(NAN)
        assert w.run(pb.q, pb.cache, bmm1_scale=SCALE, out=out, validate=validate) is out
        want = gathered_oracle(pb, "causal", SCALE)
        assert rel_err(out, want) <= TOLERANCE[BF16], step
        if prev is not None:
            assert relative_error(out, prev) > 0.05, "the rewrite had no effect"
        prev = out.clone()


def test_wrapper_replan():
    """One wrapper, re-planned for other shapes, dtypes, masks and query modes."""
    g = gen(31)
    a = MLA([3, 50], 8, 16, BF16, g)
    b = MLA([200], 128, 64, FP16, g, qmode="packed", q_lens=[4], rank=4, kind="repeated")
    c = MLA([20, 7, 33], 32, 32, BF16, g, sq=3, kind="repeated")
    w = BatchMLADecodePagedTSWrapper()
    for pb, mask in ((a, "causal"), (b, "dense"), (a, "dense"), (c, "causal"), (b, "causal")):
        pb.plan(w, mask_type=mask, o_data_type=pb.dtype)
        res = w.run(pb.q, pb.cache, bmm1_scale=SCALE)
        assert res.dtype == pb.dtype
        assert rel_err(res, gathered_oracle(pb, mask, SCALE)) <= TOLERANCE[pb.dtype]


def test_oneshot_derives_bounds():
    """Packed: max_seq_len_q defaults to the largest qo_indptr delta; an explicit larger one and a larger
    max_kv_len give the same values."""
    g = gen(32)
    pb = MLA([30, 7, 64], 32, 32, BF16, g, qmode="packed", q_lens=[3, 1, 4])
    a = batch_mla_decode_with_paged_kv_cache(pb.q, pb.cache, pb.block_tables, pb.seq_lens, qo_indptr=pb.qo_indptr,
                                             bmm1_scale=SCALE)
    b = batch_mla_decode_with_paged_kv_cache(pb.q, pb.cache, pb.block_tables, pb.seq_lens, qo_indptr=pb.qo_indptr,
                                             max_seq_len_q=9, max_kv_len=pb.block_tables.shape[1] * pb.ps,
                                             bmm1_scale=SCALE)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rel_err(a, gathered_oracle(pb, "causal", SCALE)) <= TOLERANCE[BF16]
