"""Paged block-sparse semantics on CPU: the reference, the one-shot and the wrapper.

The oracle (``oracle``) is independent of ``prims_ts.reference``: it never reads the BSR
or CSR tensors. It takes the routes as Python lists (``routes[b][h][r]`` = the block IDs
of row r of request b's K/V head h), the live page IDs as Python lists and the valid-bit
words as Python ints; K/V of each request are gathered by advanced indexing
(``pool[page_of(j), :, j % page_size]``); it materialises the whole boolean mask
``[Hq, Sq, Sk]`` of each request (route blocks, then the bottom-right causal rule, then
the valid bits), and does a plain float64 softmax; a row with no visible key is zero.

``prims_ts.reference.block_sparse_attention(..., compute_dtype=float64)`` must equal it to
float64 round-off; the public one-shot ``block_sparse_attention_with_paged_kv_cache`` (in
both length forms: ``max_seq_len_kv`` + ``seq_lens_kv``, and FlashInfer's ``seq_len_kv``) and
``BlockSparsePagedTSWrapper.run`` on CPU tensors must match it within the project's
tolerance (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16), write every element of a
NaN-poisoned ``out`` and return ``out`` itself.

The wrapper's plan copies ``paged_kv_indptr`` and ``seq_lens_kv`` (changing them afterwards
has no effect until the next plan); the page IDs, routes and valid bits are live run inputs
(``test_wrapper_run_after_in_place_route_and_page_rewrite``, ``test_wrapper_plan_copies_*``).

Every cache slot that no request uses (whole unused pages, the tail of each request's
last page) holds NaN, CSR entries past a request's live pages hold garbage page IDs, and
``block_indices`` entries outside every route row hold garbage block IDs (the "scattered"
route layout also stores the (request, K/V head) segments out of order, with gaps, as the
absolute offsets of SPEC §5 allow): reading any of them shows up.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import reference as R
from prims_ts.ops.block_sparse import BlockSparsePagedTSWrapper, block_sparse_attention_with_paged_kv_cache
from prims_ts.testing import TOLERANCE, assign_pages, cumsum0, rel_err, stable_seed

F64 = torch.float64
I32 = torch.int32
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
NAN = float("nan")
GARBAGE = (-1, 2**31 - 1, -2**31, 123456)  # CSR page entries past the live pages
BLOCK_GARBAGE = (-7, 2**31 - 1, -2**31, 77777)  # block_indices entries outside every route row


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def ip(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def bits_tensor(words, kind: str) -> torch.Tensor:
    """Python words in [0, 2**32) -> int32 (two's complement) or uint32 (the same bits)."""
    t = torch.tensor([[w - 2**32 if w >= 2**31 else w for w in row] for row in words], dtype=I32)
    return t.view(torch.uint32) if kind == "uint32" else t


def encode_routes(routes, layout: str, g, capacity=None):
    """routes[b][h][r] (sorted block IDs) -> (block_indptr [B, Hkv, R + 1] as nested lists, flat block_indices).

    "compact": segments in (b, h) order, back to back. "scattered": the (b, h) segments in a random
    order with garbage gaps between them and after the last one. ``capacity`` pads with garbage."""
    B, H = len(routes), len(routes[0])
    segs = [(b, h) for b in range(B) for h in range(H)]
    if layout == "scattered":
        perm = torch.randperm(len(segs), generator=g).tolist()
        if perm == sorted(perm) and len(perm) > 1:
            perm = perm[::-1]
        segs = [segs[i] for i in perm]
    flat, ptr = [], [[None] * H for _ in range(B)]
    for k, (b, h) in enumerate(segs):
        if layout == "scattered":
            flat += [BLOCK_GARBAGE[(k + i) % 4] for i in range(1 + k % 3)]
        offs = [len(flat)]
        for row in routes[b][h]:
            flat += list(row)
            offs.append(len(flat))
        ptr[b][h] = offs
    if layout == "scattered":
        flat += [BLOCK_GARBAGE[1], BLOCK_GARBAGE[3]]
    if capacity is not None:
        assert len(flat) <= capacity
        flat += [BLOCK_GARBAGE[i % 4] for i in range(capacity - len(flat))]
    return ptr, flat


def diagonal_blocks(sk, sq, t0, t1, kv_block):
    """The KV blocks holding the causal diagonal keys of query tokens t0 .. t1 - 1."""
    lo, hi = max(0, sk - sq + t0), max(0, sk - sq + t1 - 1)
    return set(range(lo // kv_block, min(hi, sk - 1) // kv_block + 1))


def random_routes(lens, sq, hkv, q_block, kv_block, g, *, density=0.5, empty="some", diag=False):
    """routes[b][h][r]: each block of request b (those starting before its length) with probability
    ``density``; ``empty``: "none" (every row has a block), "some" (every third row empty), "head"
    (the last K/V head of request 0 selects nothing); ``diag``: the diagonal blocks always selected."""
    n_rows = -(-sq // q_block)
    routes = []
    for b, sk in enumerate(lens):
        nblk = -(-sk // kv_block)
        per_head = []
        for h in range(hkv):
            rows = []
            for r in range(n_rows):
                pick = (torch.rand(nblk, generator=g) < density).nonzero().flatten().tolist()
                sel = set(pick)
                if diag:
                    sel |= diagonal_blocks(sk, sq, r * q_block, min(sq, (r + 1) * q_block), kv_block)
                if empty == "none" and not sel:
                    sel = {int(torch.randint(0, nblk, (1,), generator=g))}
                if (empty == "some" and (b + h + r) % 3 == 1) or (empty == "head" and b == 0 and h == hkv - 1):
                    sel = set()
                rows.append(sorted(sel))
            per_head.append(rows)
        routes.append(per_head)
    return routes


# ----------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------


class Sparse:
    """One block-sparse problem over CSR pages (host tensors).

    form:   "combined" ([P, 2, Hkv, ps, D]) or "tuple" ((K, V), each [P, Hkv, ps, D]).
    kind:   "perm" (distinct pages, non-identity order) or "repeated" (IDs shared across / within requests).
    bits:   None, "uint32" or "int32" (kv_valid_bits words, random, bit 31 set somewhere).
    layout: the route encoding (see ``encode_routes``).
    """

    def __init__(self, seq_lens, sq, hq, hkv, d, ps, q_block, kv_block, dtype, g, *, form="combined", kind="perm",
                 slack=None, extra_pages=2, poison=True, density=0.5, empty="some", diag=False, bits=None,
                 bit_density=0.75, layout="compact", routes=None, max_seq_len_kv=None, capacity=None):
        B = len(seq_lens)
        self.lens = list(seq_lens)
        self.B, self.sq, self.hq, self.hkv, self.d, self.ps = B, sq, hq, hkv, d, ps
        self.q_block, self.kv_block, self.dtype, self.form = q_block, kv_block, dtype, form
        self.max_seq_len_kv = max_seq_len_kv or max(seq_lens)
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        slack = list(slack) if slack is not None else [b % 2 for b in range(B)]
        P, live = assign_pages(n_live, kind, extra_pages, g)
        indices = []
        for b in range(B):
            indices += live[b] + [GARBAGE[(b + i) % len(GARBAGE)] for i in range(slack[b])]
        self.num_pages, self.live_pages = P, live
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
        self.q = randn((B, sq, hq, d), dtype, g)
        self.routes = routes if routes is not None else random_routes(
            seq_lens, sq, hkv, q_block, kv_block, g, density=density, empty=empty, diag=diag)
        ptr, flat = encode_routes(self.routes, layout, g, capacity)
        self.block_indptr, self.block_indices = ip(ptr), ip(flat)
        self.bits_kind = bits
        self.words = None
        self.bits = None
        if bits is not None:
            n_words = -(-self.max_seq_len_kv // 32)
            on = (torch.rand(B, n_words, 32, generator=g) < bit_density).long()
            self.words = (on << torch.arange(32)).sum(-1).tolist()
            self.words[0][0] |= 1 << 31  # a negative int32 word
            self.bits = bits_tensor(self.words, bits)

    def used_slots(self) -> torch.Tensor:
        used = torch.zeros(self.num_pages, self.ps, dtype=torch.bool)
        for b, sk in enumerate(self.lens):
            pages = ip(self.live_pages[b]).long()
            j = torch.arange(sk)
            used[pages[j // self.ps], j % self.ps] = True
        return used

    def set_routes(self, routes, layout="compact", g=None):
        """New routes written in place into the existing block_indptr / block_indices (within capacity)."""
        ptr, flat = encode_routes(routes, layout, g or gen(0), capacity=self.block_indices.numel())
        self.block_indptr.copy_(ip(ptr))
        self.block_indices.copy_(ip(flat))
        self.routes = routes

    def oneshot(self, q=None, cache=None, bound="max_seq_len_kv", **kw):
        """The one-shot with the live lengths and ``max_seq_len_kv`` (the seed's form) or, ``bound="seq_len_kv"``,
        FlashInfer main's ``seq_len_kv`` bound."""
        return block_sparse_attention_with_paged_kv_cache(
            self.q if q is None else q, self.cache if cache is None else cache, self.indptr, self.indices,
            self.block_indptr, self.block_indices, self.q_block, self.kv_block, **{bound: self.max_seq_len_kv},
            seq_lens_kv=self.seq_lens, kv_valid_bits=self.bits, **kw)

    def longest_row(self) -> int:
        return max(len(row) for per_head in self.routes for rows in per_head for row in rows)

    def plan(self, mask_type="dense", w=None, max_blocks_per_row=None, **kw) -> BlockSparsePagedTSWrapper:
        """FlashInfer main's plan: the page offsets and the lengths (copied by the plan), the geometry,
        ``max_blocks_per_row`` (default: the routes' longest row) and the valid-bits flag."""
        w = w or BlockSparsePagedTSWrapper()
        kw.setdefault("seq_lens_kv", self.seq_lens)
        w.plan(self.indptr, self.sq, self.max_seq_len_kv, self.hq, self.hkv, self.d, self.q_block, self.kv_block,
               self.ps, max_blocks_per_row=self.longest_row() if max_blocks_per_row is None else max_blocks_per_row,
               use_kv_valid_bits=self.bits is not None, mask_type=mask_type, q_data_type=self.dtype, **kw)
        return w

    def run(self, w, q=None, **kw):
        """The live inputs: q, the cache, the page IDs, the routes and the valid bits."""
        return w.run(self.q if q is None else q, self.cache, self.indices, self.block_indptr, self.block_indices,
                     kv_valid_bits=self.bits, **kw)

    def ref(self, mask_type="dense", sm_scale=None, compute_dtype=F64):
        return R.block_sparse_attention(self.q, self.k_pool, self.v_pool, self.indptr, self.indices,
                                        self.block_indptr, self.block_indices, self.q_block, self.kv_block,
                                        self.seq_lens, kv_valid_bits=self.bits, mask_type=mask_type,
                                        sm_scale=sm_scale, compute_dtype=compute_dtype)


def oracle_mask(pb: Sparse, b: int, mask_type: str) -> torch.Tensor:
    """The full boolean mask [Hq, Sq, Sk] of request b from the Python routes, causal rule and bits."""
    sk, group = pb.lens[b], pb.hq // pb.hkv
    mask = torch.zeros(pb.hq, pb.sq, sk, dtype=torch.bool)
    for h in range(pb.hkv):
        for r, row in enumerate(pb.routes[b][h]):
            t0, t1 = r * pb.q_block, min(pb.sq, (r + 1) * pb.q_block)
            for c in row:
                assert 0 <= c * pb.kv_block < sk
                mask[h * group:(h + 1) * group, t0:t1, c * pb.kv_block:min(sk, (c + 1) * pb.kv_block)] = True
    if mask_type == "causal":
        i = torch.arange(pb.sq).view(-1, 1)
        j = torch.arange(sk).view(1, -1)
        mask &= (j <= sk - pb.sq + i).unsqueeze(0)
    if pb.words is not None:
        valid = torch.tensor([bool((pb.words[b][j // 32] >> (j % 32)) & 1) for j in range(sk)])
        mask &= valid.view(1, 1, sk)
    return mask


def oracle(pb: Sparse, mask_type="dense", sm_scale=None) -> torch.Tensor:
    """Float64 [B, Sq, Hq, D]: per request, gathered K/V, the materialised mask, a plain softmax."""
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(pb.d)
    group = pb.hq // pb.hkv
    out = torch.zeros(pb.B, pb.sq, pb.hq, pb.d, dtype=F64)
    for b, sk in enumerate(pb.lens):
        j = torch.arange(sk)
        pages = torch.tensor(pb.live_pages[b], dtype=torch.long)[j // pb.ps]
        k = pb.k_pool[pages, :, j % pb.ps].to(F64)  # [sk, Hkv, D]
        v = pb.v_pool[pages, :, j % pb.ps].to(F64)
        assert not torch.isnan(k).any() and not torch.isnan(v).any(), "a live slot holds poison"
        heads = torch.arange(pb.hq) // group
        kq, vq = k[:, heads], v[:, heads]  # [sk, Hq, D]
        s = torch.einsum("qhd,khd->hqk", pb.q[b].to(F64), kq) * scale  # [Hq, Sq, Sk]
        mask = oracle_mask(pb, b, mask_type)
        s = s.masked_fill(~mask, -math.inf)
        m = s.amax(dim=2, keepdim=True)
        m = torch.where(mask.any(dim=2, keepdim=True), m, torch.zeros_like(m))
        p = torch.exp(s - m) * mask
        den = p.sum(dim=2, keepdim=True)
        o = torch.einsum("hqk,khd->hqd", p, vq) / torch.where(den > 0, den, torch.ones_like(den))
        out[b] = o.permute(1, 0, 2)
    return out


def check_public(pb: Sparse, want: torch.Tensor, mask_type="dense", sm_scale=None, out_dtype=None):
    """One-shot into a poisoned out (returned, fully written); the functional form, the one-shot's
    FlashInfer form (seq_len_kv) and the wrapper (planned with o_data_type, out= and functional) give
    the same values bit for bit."""
    odt = out_dtype or pb.dtype
    tol = max(TOLERANCE[pb.dtype], TOLERANCE[odt])
    out = torch.full(pb.q.shape, NAN, dtype=odt)
    assert pb.oneshot(mask_type=mask_type, sm_scale=sm_scale, out=out) is out
    assert rel_err(out, want) <= tol
    if out_dtype is None:
        res = pb.oneshot(mask_type=mask_type, sm_scale=sm_scale)
        assert res.dtype == pb.dtype and res.shape == pb.q.shape
        torch.testing.assert_close(res, out, rtol=0, atol=0)
    out1 = torch.full(pb.q.shape, NAN, dtype=odt)
    assert pb.oneshot(mask_type=mask_type, sm_scale=sm_scale, out=out1, bound="seq_len_kv") is out1
    torch.testing.assert_close(out1, out, rtol=0, atol=0)
    w = pb.plan(mask_type, o_data_type=odt)
    out2 = torch.full(pb.q.shape, NAN, dtype=odt)
    assert pb.run(w, sm_scale=sm_scale, out=out2) is out2
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    res2 = pb.run(w, sm_scale=sm_scale)
    assert res2.dtype == odt
    torch.testing.assert_close(res2, out, rtol=0, atol=0)
    return out


# ----------------------------------------------------------------------------
# The reference and the public API vs the oracle
# ----------------------------------------------------------------------------

KV_BLOCKS = [8, 16, 32, 64, 128]
GROUPS = [1, 2, 4, 8]
PAGE_SIZES = [16, 32, 64, 128]
Q_BLOCKS = [1, 2, 3, 4, 8, 12, 16, 24, 32]  # filtered per group: q_block * group % 8 == 0


def grid_cell(mask, kv_block, group):
    """The rotated axes of one grid test."""
    i = KV_BLOCKS.index(kv_block) + 5 * GROUPS.index(group) + 20 * (mask == "causal")  # 0..39
    q_blocks = [qb for qb in Q_BLOCKS if qb * group % 8 == 0]
    return dict(ps=PAGE_SIZES[(i + i // 4) % 4], form=("combined", "tuple")[i % 2],
                kind=("perm", "repeated")[(i // 2) % 2], bits=(None, "uint32", "int32")[i % 3],
                empty=("none", "some", "head")[(i // 3) % 3], layout=("compact", "scattered")[(i // 5) % 2],
                dtype=(BF16, FP16)[(i // 2 + i // 5) % 2], rows=1 + i % 3,
                q_block=q_blocks[(KV_BLOCKS.index(kv_block) - 2 * (mask == "causal")) % len(q_blocks)],
                ragged=i % 4 != 0, d=256 if i % 7 == 3 else 128, hkv=1 if group == 8 and i % 2 else 2)


def test_grid_rotation_covers_every_axis():
    cells = [grid_cell(m, kvb, g) for m in ("dense", "causal") for kvb in KV_BLOCKS for g in GROUPS]
    for key, values in (("ps", PAGE_SIZES), ("form", ["combined", "tuple"]), ("kind", ["perm", "repeated"]),
                        ("bits", [None, "uint32", "int32"]), ("empty", ["none", "some", "head"]),
                        ("layout", ["compact", "scattered"]), ("dtype", [BF16, FP16]), ("ragged", [True, False]),
                        ("d", [128, 256]), ("rows", [1, 2, 3])):
        assert {c[key] for c in cells} == set(values), key
    for mask in ("dense", "causal"):
        for g in GROUPS:  # every group meets several q_block sizes, the small ones included
            qbs = {grid_cell(mask, kvb, g)["q_block"] for kvb in KV_BLOCKS}
            assert len(qbs) >= 3 and min(qbs) == 8 // math.gcd(8, g), (mask, g, qbs)


@pytest.mark.parametrize("group", GROUPS, ids=[f"gqa{g}" for g in GROUPS])
@pytest.mark.parametrize("kv_block", KV_BLOCKS, ids=[f"kv{k}" for k in KV_BLOCKS])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_reference_and_public_match_oracle(mask, kv_block, group):
    c = grid_cell(mask, kv_block, group)
    qb = c["q_block"]
    sq = c["rows"] * qb - (qb // 2 if c["ragged"] else 0)  # not a multiple of q_block when ragged (q_block > 1)
    ps = c["ps"]
    # lengths not multiples of the page or block size; causal needs Sq <= Sk
    lens = [1 if mask == "dense" else sq, 2 * kv_block + 5, ps + 3]
    lens = [max(n, sq) if mask == "causal" else n for n in lens]
    g = gen(stable_seed("grid", mask, kv_block, group))
    pb = Sparse(lens, sq, group * c["hkv"], c["hkv"], c["d"], ps, qb, kv_block, c["dtype"], g, form=c["form"],
                kind=c["kind"], bits=c["bits"], empty=c["empty"], layout=c["layout"], diag=mask == "causal",
                max_seq_len_kv=max(lens) + 7)
    want = oracle(pb, mask)
    got = pb.ref(mask)
    assert got.dtype == F64 and got.shape == pb.q.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert want.abs().sum() > 0
    check_public(pb, want, mask)


def test_reference_matches_oracle_with_scale_and_fp32_out():
    g = gen(1)
    pb = Sparse([40, 77], 9, 8, 2, 128, 16, 4, 16, BF16, g, kind="repeated", bits="int32", diag=True)
    for scale in (0.02, 0.3):
        want = oracle(pb, "causal", scale)
        torch.testing.assert_close(pb.ref("causal", scale), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want, "causal", scale, out_dtype=FP32)
    default = pb.oneshot(mask_type="causal", out=torch.empty(pb.q.shape, dtype=FP32))
    explicit = pb.oneshot(mask_type="causal", sm_scale=1.0 / math.sqrt(128), out=torch.empty(pb.q.shape, dtype=FP32))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_out_dtype_from_out(dtype, out_dtype):
    """The one-shot has no out_dtype: out's dtype decides; without out, q's dtype."""
    g = gen(stable_seed("odt", str(dtype), str(out_dtype)))
    pb = Sparse([33, 20], 6, 4, 2, 128, 16, 4, 8, dtype, g, bits="uint32")
    check_public(pb, oracle(pb, "causal"), "causal", out_dtype=out_dtype)


# ----------------------------------------------------------------------------
# All blocks selected: block-sparse is the paged decode problem with fixed [B, SQ, Hq, D] queries
# ----------------------------------------------------------------------------


def all_blocks(lens, sq, hkv, q_block, kv_block):
    n_rows = -(-sq // q_block)
    return [[[list(range(-(-sk // kv_block))) for _ in range(n_rows)] for _ in range(hkv)] for sk in lens]


def causal_blocks(lens, sq, hkv, q_block, kv_block):
    """Exactly the blocks holding some causally visible key of the row (the lower triangle)."""
    n_rows = -(-sq // q_block)
    routes = []
    for sk in lens:
        rows = []
        for r in range(n_rows):
            last = min(sq, (r + 1) * q_block) - 1
            rows.append(list(range((sk - sq + last) // kv_block + 1)))
        routes.append([list(rows) for _ in range(hkv)])
    return routes


@pytest.mark.parametrize("form", ["combined", "tuple"])
@pytest.mark.parametrize("kv_block", [8, 32, 64, 128])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_all_blocks_equal_batch_decode(mask, kv_block, form):
    """Every block selected (and, for causal, only the lower-triangle blocks): the result is
    reference.batch_decode with fixed [B, SQ, Hq, D] queries (seq_len_q > 1) and the same mask."""
    sq, hq, hkv, q_block = 7, 8, 2, 4
    lens = [sq + 2, 3 * kv_block + 1, 45]
    g = gen(stable_seed("all", mask, kv_block, form))
    maker = causal_blocks if mask == "causal" else all_blocks
    pb = Sparse(lens, sq, hq, hkv, 128, 16, q_block, kv_block, FP16, g, form=form, kind="repeated",
                routes=maker(lens, sq, hkv, q_block, kv_block), layout="scattered")
    want = R.batch_decode(pb.q, pb.k_pool, pb.v_pool, pb.indptr, pb.indices, pb.seq_lens, mask_type=mask,
                          compute_dtype=F64)
    torch.testing.assert_close(pb.ref(mask), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(oracle(pb, mask), want, rtol=1e-12, atol=1e-12)
    check_public(pb, want, mask)
    if mask == "causal":  # all blocks with the causal mask: the same
        pb.set_routes(all_blocks(lens, sq, hkv, q_block, kv_block), g=g)
        torch.testing.assert_close(pb.ref(mask), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want, mask)


def test_all_blocks_with_all_bits_set_equal_batch_decode():
    lens, sq = [20, 70], 5
    g = gen(3)
    pb = Sparse(lens, sq, 4, 1, 128, 32, 8, 16, BF16, g, routes=all_blocks(lens, sq, 1, 8, 16), bits="uint32",
                bit_density=1.0)
    assert all(w == 2**32 - 1 for row in pb.words for w in row)
    want = R.batch_decode(pb.q, pb.k_pool, pb.v_pool, pb.indptr, pb.indices, pb.seq_lens, mask_type="causal",
                          compute_dtype=F64)
    torch.testing.assert_close(pb.ref("causal"), want, rtol=1e-12, atol=1e-12)
    check_public(pb, want, "causal")


# ----------------------------------------------------------------------------
# Valid bits
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_valid_bits_uint32_equals_int32(mask):
    """The same bits as uint32 and as int32 words (bit 31 set: negative int32) give identical results;
    the bits do change the result; all-ones bits equal no bits."""
    lens, sq = [64, 100], 6
    outs = {}
    for kind in ("uint32", "int32", None):
        g = gen(stable_seed("bits", mask))  # the same draws: the same problem, only the bit dtype differs
        pb = Sparse(lens, sq, 8, 2, 128, 16, 2, 32, BF16, g, bits=kind or "uint32", empty="none", diag=True)
        if kind is None:
            pb.bits, pb.words = None, None
        else:
            assert pb.bits.dtype == (torch.uint32 if kind == "uint32" else I32)
            assert int(pb.bits.view(I32)[0, 0]) < 0
        want = oracle(pb, mask)
        torch.testing.assert_close(pb.ref(mask), want, rtol=1e-12, atol=1e-12)
        outs[kind] = check_public(pb, want, mask, out_dtype=FP32)
    torch.testing.assert_close(outs["uint32"], outs["int32"], rtol=0, atol=0)
    assert rel_err(outs["uint32"], outs[None].double()) > 0.05
    # all-ones words == no bits
    g = gen(stable_seed("bits", mask))
    pb = Sparse(lens, sq, 8, 2, 128, 16, 2, 32, BF16, g, bits="int32", empty="none", diag=True)
    pb.bits.fill_(-1)
    torch.testing.assert_close(pb.oneshot(mask_type=mask, out=torch.empty(pb.q.shape, dtype=FP32)), outs[None],
                               rtol=0, atol=0)


def test_valid_bits_word_and_bit_order():
    """Key j is bit j % 32 of word j // 32 (LSB first); words past the length and bits past Sk are ignored."""
    sk, sq = 70, 1
    g = gen(4)
    pb = Sparse([sk], sq, 8, 1, 128, 16, 1, 8, FP16, g, routes=all_blocks([sk], sq, 1, 1, 8), bits="uint32",
                max_seq_len_kv=200)
    for visible in ([0], [31], [32], [69], [5, 33, 64], list(range(0, 70, 3))):
        words = [0] * 7
        for j in visible:
            words[j // 32] |= 1 << (j % 32)
        words[2] |= 0xFFFFFFC0  # keys 70..95: past Sk, never visible
        words[5] = words[6] = 2**32 - 1  # words past the request's keys
        pb.words = [words]
        pb.bits = bits_tensor([words], "uint32")
        want = oracle(pb)
        got = pb.ref()
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        if len(visible) == 1:  # one visible key: the output is exactly V of that key
            j = visible[0]
            page = pb.live_pages[0][j // pb.ps]
            v = pb.v_pool[page, 0, j % pb.ps].to(F64)
            torch.testing.assert_close(got[0, 0], v.expand(8, -1), rtol=1e-12, atol=1e-12)
        check_public(pb, want)


# ----------------------------------------------------------------------------
# Rows with no visible key, empty routes
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_rows_without_visible_keys_are_zero(mask):
    """A row with no blocks selected, or whose blocks' keys are all invalid, is exactly zero (never NaN);
    the other rows are not."""
    sq, q_block, kv_block = 8, 2, 16
    lens = [64, 40]
    # request 0: no blocks | block 0 (keys 0..15, all invalid) | block 3 | blocks 1, 2
    # request 1: blocks 0, 1 | no blocks | block 2 | block 0
    routes = [[[[], [0], [3], [1, 2]]], [[[0, 1], [], [2], [0]]]]
    g = gen(stable_seed("empty", mask))
    pb = Sparse(lens, sq, 8, 1, 128, 16, q_block, kv_block, BF16, g, routes=routes, bits="uint32", layout="scattered")
    words = [[2**32 - 1, 2**32 - 1], [2**32 - 1, 2**32 - 1]]
    words[0][0] &= ~0xFFFF  # request 0: keys 0..15 invalid
    pb.words, pb.bits = words, bits_tensor(words, "uint32")
    want = oracle(pb, mask)
    empty_rows = [(0, 0), (0, 1), (1, 1)]  # (request, route row)
    for b, r in empty_rows:
        assert not oracle_mask(pb, b, mask)[:, r * q_block:(r + 1) * q_block].any()
    torch.testing.assert_close(pb.ref(mask), want, rtol=1e-12, atol=1e-12)
    out = check_public(pb, want, mask)
    for b in range(2):
        for r in range(4):
            rows = out[b, r * q_block:(r + 1) * q_block]
            if (b, r) in empty_rows:
                assert (rows == 0).all(), (b, r)
            else:
                assert (rows != 0).any(dim=-1).all(), (b, r)


def test_causal_blocks_above_the_diagonal_write_zeros():
    """Sq == Sk: token i sees keys <= i. Route rows 0 and 1 (tokens 0..7) select only block 1 (keys 8..15),
    entirely above their diagonal: they write zeros under causal, not under dense."""
    sq = sk = 16
    q_block, kv_block = 4, 8
    routes = [[[[1], [1], [0, 1], [1]]]]
    g = gen(6)
    pb = Sparse([sk], sq, 8, 1, 128, 16, q_block, kv_block, FP16, g, routes=routes)
    want = oracle(pb, "causal")
    assert (want[0, :8] == 0).all() and (want[0, 8:] != 0).any(dim=-1).all()
    torch.testing.assert_close(pb.ref("causal"), want, rtol=1e-12, atol=1e-12)
    out = check_public(pb, want, "causal")
    assert (out[0, :8] == 0).all()
    assert (oracle(pb, "dense")[0, :8] != 0).any(dim=-1).all()


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_no_blocks_at_all(mask):
    """Every route row empty (block_indices may even be empty): the output is all zeros."""
    lens, sq = [20, 9], 4
    routes = [[[[]] for _ in range(2)] for _ in lens]
    g = gen(7)
    pb = Sparse(lens, sq, 4, 2, 128, 16, 4, 8, BF16, g, routes=routes)
    assert pb.block_indices.numel() == 0
    want = torch.zeros(pb.q.shape, dtype=F64)
    torch.testing.assert_close(pb.ref(mask), want, rtol=0, atol=0)
    out = check_public(pb, want, mask)
    assert (out == 0).all()


# ----------------------------------------------------------------------------
# Lengths, blocks past the length, Sq vs q_block, page IDs, route layouts
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv_block", [8, 64])
def test_lengths_and_partial_last_blocks(kv_block):
    """Lengths 1, kv_block - 1, kv_block, kv_block + 1, page + 1: the last block partly past the length
    (its keys past Sk never seen), every block selected or the last one only."""
    ps = 16
    lens = [1, kv_block - 1, kv_block, kv_block + 1, ps + 1, 2 * kv_block + 3]
    sq, q_block = 3, 8
    for which in ("all", "last"):
        if which == "all":
            routes = all_blocks(lens, sq, 1, q_block, kv_block)
        else:
            routes = [[[[-(-sk // kv_block) - 1]]] for sk in lens]
        g = gen(stable_seed("lens", kv_block, which))
        pb = Sparse(lens, sq, 8, 1, 128, ps, q_block, kv_block, BF16, g, routes=routes, kind="repeated",
                    slack=[2, 0, 1, 0, 3, 0])
        want = oracle(pb, "dense")
        torch.testing.assert_close(pb.ref(), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want)


@pytest.mark.parametrize("sq,q_block,group", [(1, 8, 1), (1, 1, 8), (5, 64, 1), (3, 128, 2), (17, 3, 8),
                                              (9, 4, 2), (33, 16, 4)])
def test_sq_and_q_block_sizes(sq, q_block, group):
    """Sq = 1, q_block larger than Sq, Sq not a multiple of q_block, odd q_block with group 8."""
    lens = [sq + 30, 2 * sq + 1]
    g = gen(stable_seed("sq", sq, q_block, group))
    pb = Sparse(lens, sq, group, 1, 128, 16, q_block, 16, FP16, g, empty="none", bits="int32")
    assert pb.block_indptr.shape == (2, 1, -(-sq // q_block) + 1)
    for mask in ("dense", "causal"):
        want = oracle(pb, mask)
        torch.testing.assert_close(pb.ref(mask), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want, mask)


def test_page_ids_shuffled_and_repeated():
    """Requests read the same pages several times (IDs in any order, repeated within and across requests)."""
    lens = [70, 40, 16]
    g = gen(8)
    pb = Sparse(lens, 4, 8, 2, 128, 16, 4, 16, BF16, g, kind="perm", slack=[0, 0, 0], extra_pages=0, poison=False,
                density=0.7)
    assert pb.indices.numel() == 9 and pb.num_pages == 9
    pb.live_pages = [[2, 0, 2, 2, 1], [0, 2, 0], [2]]
    pb.indices.copy_(ip(sum(pb.live_pages, [])))
    for mask in ("dense", "causal"):
        want = oracle(pb, mask)
        torch.testing.assert_close(pb.ref(mask), want, rtol=1e-12, atol=1e-12)
        check_public(pb, want, mask)


def test_route_layouts_are_equivalent():
    """Absolute offsets: the (request, head) segments back to back or scattered (any order, garbage
    gaps) select the same blocks, bit for bit."""
    lens, sq = [50, 90, 33], 12
    g = gen(9)
    pb = Sparse(lens, sq, 8, 2, 128, 32, 4, 16, BF16, g, layout="compact", bits="uint32", diag=True)
    a = check_public(pb, oracle(pb, "causal"), "causal", out_dtype=FP32)
    ptr_before = pb.block_indptr.clone()
    for seed in (1, 2):
        ptr, flat = encode_routes(pb.routes, "scattered", gen(seed))
        pb.block_indptr, pb.block_indices = ip(ptr), ip(flat)
        assert not torch.equal(pb.block_indptr, ptr_before)
        b = check_public(pb, oracle(pb, "causal"), "causal", out_dtype=FP32)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_routes_shared_by_the_group():
    """All query heads of a K/V head's group use its routes; different K/V heads have different routes."""
    lens, sq = [64], 4
    routes = [[[[0], [1]], [[2, 3], []]]]  # K/V head 0: blocks 0 | 1; head 1: blocks 2, 3 | none
    g = gen(10)
    pb = Sparse(lens, sq, 8, 2, 128, 16, 2, 16, FP16, g, routes=routes)
    want = oracle(pb)
    out = check_public(pb, want)
    assert (out[0, 2:, 4:] == 0).all() and (out[0, 2:, :4] != 0).any(dim=-1).all()
    # K/V head 0, row 0 sees only keys 0..15: equal to attention over those keys alone
    page = pb.live_pages[0][0]
    k = pb.k_pool[page, 0].to(F64)  # [16, D]
    v = pb.v_pool[page, 0].to(F64)
    s = torch.einsum("qhd,kd->qhk", pb.q[0, :2, :4].to(F64), k) / math.sqrt(128)
    torch.testing.assert_close(want[0, :2, :4], torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)


def test_strided_query():
    """Query heads sliced out of a fused projection (head stride > D)."""
    g = gen(11)
    pb = Sparse([30, 45], 5, 4, 2, 128, 16, 4, 8, BF16, g)
    fused = torch.zeros(2, 5, 8, 128, dtype=BF16)
    fused[:, :, 2:6] = pb.q
    q = fused[:, :, 2:6]
    assert not q.is_contiguous()
    want = oracle(pb, "causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    assert pb.oneshot(q=q, mask_type="causal", out=out) is out
    assert rel_err(out, want) <= TOLERANCE[BF16]
    w = pb.plan("causal")
    torch.testing.assert_close(pb.run(w, q=q), out, rtol=0, atol=0)


def test_inputs_not_modified():
    g = gen(12)
    pb = Sparse([20, 37], 6, 4, 2, 128, 16, 4, 8, BF16, g, bits="int32", layout="scattered")
    tensors = (pb.q, pb.indptr, pb.indices, pb.seq_lens, pb.block_indptr, pb.block_indices, pb.bits)
    before = [t.clone() for t in tensors]
    cache = pb.cache.clone()
    pb.oneshot(mask_type="causal")
    pb.run(pb.plan("causal"))
    for a, b in zip(before, tensors):
        assert torch.equal(a, b)
    assert torch.equal(cache.isnan(), pb.cache.isnan())
    assert torch.equal(cache.nan_to_num(), pb.cache.nan_to_num())


# ----------------------------------------------------------------------------
# BlockSparsePagedTSWrapper on CPU
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [None, "int32"])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_wrapper_run_after_in_place_route_and_page_rewrite(mask, bits):
    """A plan serves many runs: page IDs, routes (within block_indices' capacity and the planned
    max_blocks_per_row) and valid bits are live run inputs, rewritten in place between runs; each run
    follows the new values (and differs from the previous run's)."""
    lens, sq, q_block, kv_block = [40, 64, 17], 6, 2, 16
    g = gen(stable_seed("wrapper", mask, bits))
    pb = Sparse(lens, sq, 8, 2, 128, 16, q_block, kv_block, BF16, g, kind="perm", extra_pages=6, poison=False,
                bits=bits, max_seq_len_kv=64, capacity=200, slack=[1, 0, 2])
    w = pb.plan(mask, max_blocks_per_row=4)  # ceil(64 / 16): any route fits
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    assert pb.run(w, sm_scale=0.1, out=out) is out
    prev = oracle(pb, mask, 0.1)
    assert rel_err(out, prev) <= TOLERANCE[BF16]
    counts = [int(pb.indptr[b + 1] - pb.indptr[b]) for b in range(3)]
    off = cumsum0(counts)
    for step in range(2):
        # new page IDs: each request keeps its CSR entry count; IDs anywhere in the cache, repeats allowed
        new_ids = torch.randint(0, pb.num_pages, (pb.indices.numel(),), generator=g, dtype=I32)
        pb.indices.copy_(new_ids)
        pb.live_pages = [new_ids[off[b]:off[b] + -(-n // 16)].tolist() for b, n in enumerate(lens)]
        pb.set_routes(random_routes(lens, sq, 2, q_block, kv_block, g, density=0.6, diag=True),
                      layout=("scattered", "compact")[step], g=g)
        assert pb.longest_row() <= 4
        if bits is not None:
            pb.words = [[int(x) for x in torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64)]
                        for _ in range(3)]
            pb.bits.copy_(bits_tensor(pb.words, bits))
        out.fill_(NAN)
        pb.run(w, sm_scale=0.1, out=out)
        want = oracle(pb, mask, 0.1)
        torch.testing.assert_close(pb.ref(mask, 0.1), want, rtol=1e-12, atol=1e-12)
        assert rel_err(out, want) <= TOLERANCE[BF16], step
        assert rel_err(out, prev) > 0.1, "the run did not follow the rewritten live inputs"
        prev = want


@pytest.mark.parametrize("bits", [None, "uint32"])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_wrapper_plan_copies_lengths_and_page_offsets(mask, bits):
    """plan copies paged_kv_indptr and seq_lens_kv: rewriting the caller's tensors in place afterwards (to
    another valid problem) changes nothing in a run, functional or out=; a new plan of the same tensors
    follows the new values."""
    old_lens, new_lens = [40, 64, 17], [16, 64, 33]
    sq, q_block, kv_block = 6, 2, 16
    g = gen(stable_seed("copies", mask, bits))
    routes = random_routes([min(a, b) for a, b in zip(old_lens, new_lens)], sq, 2, q_block, kv_block, g,
                           density=0.6, diag=mask == "causal")  # valid under both lengths
    pb = Sparse(old_lens, sq, 8, 2, 128, 16, q_block, kv_block, BF16, g, kind="perm", extra_pages=8, poison=False,
                bits=bits, max_seq_len_kv=64, slack=[1, 0, 4], routes=routes)
    assert pb.indptr.tolist() == [0, 4, 8, 14]
    for i in (3, 10, 11, 12, 13):  # the slack entries: valid page IDs, so that the new offsets are valid too
        pb.indices[i] = int(torch.randint(0, pb.num_pages, (1,), generator=g))
    w = pb.plan(mask)
    planned = oracle(pb, mask)
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    pb.run(w, out=out)
    assert rel_err(out, planned) <= TOLERANCE[BF16]
    # the caller rewrites both in place: request 0 gets 1 page (16 keys), request 1 entries 1..4, request 2
    # the last 9 entries (33 keys)
    pb.indptr.copy_(ip([0, 1, 5, 14]))
    pb.seq_lens.copy_(ip(new_lens))
    new = R.block_sparse_attention(pb.q, pb.k_pool, pb.v_pool, pb.indptr, pb.indices, pb.block_indptr,
                                   pb.block_indices, q_block, kv_block, pb.seq_lens, kv_valid_bits=pb.bits,
                                   mask_type=mask, compute_dtype=F64)
    assert rel_err(planned.float(), new) > 0.1  # the rewrite would matter
    out2 = torch.full(pb.q.shape, NAN, dtype=BF16)
    pb.run(w, out=out2)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    torch.testing.assert_close(pb.run(w), out, rtol=0, atol=0)
    # a new plan reads the new values: the oracle of the new problem
    w2 = pb.plan(mask)
    pb.lens = new_lens
    pb.live_pages = [pb.indices[o:o + -(-n // 16)].tolist() for o, n in zip([0, 1, 5], new_lens)]
    want = oracle(pb, mask)
    torch.testing.assert_close(new, want, rtol=1e-12, atol=1e-12)
    assert rel_err(pb.run(w2), want) <= TOLERANCE[BF16]
    torch.testing.assert_close(pb.run(w), out, rtol=0, atol=0)  # the first plan still runs its own copy


def test_wrapper_sm_scale_is_a_run_argument():
    """One plan, runs with different sm_scale values (and the default 1/sqrt(D)): each matches the oracle."""
    g = gen(15)
    pb = Sparse([50, 33], 5, 8, 2, 128, 16, 4, 16, FP16, g, bits="int32", diag=True)
    w = pb.plan("causal", o_data_type=FP32)
    outs = []
    for scale in (0.02, None, 0.3):
        out = torch.full(pb.q.shape, NAN, dtype=FP32)
        assert pb.run(w, sm_scale=scale, out=out) is out
        assert rel_err(out, oracle(pb, "causal", scale)) <= TOLERANCE[FP16], scale
        outs.append(out)
    assert rel_err(outs[0], outs[2].double()) > 0.05
    torch.testing.assert_close(pb.run(w, sm_scale=1.0 / math.sqrt(128)), outs[1], rtol=0, atol=0)


def test_wrapper_replan_and_functional_run():
    g = gen(13)
    a = Sparse([30, 9], 4, 4, 2, 128, 16, 4, 8, BF16, g)
    b = Sparse([200], 3, 8, 1, 256, 64, 8, 64, FP16, g, kind="repeated", bits="uint32")
    w = BlockSparsePagedTSWrapper()
    for pb, mask in ((a, "causal"), (b, "dense"), (a, "dense")):
        assert pb.plan(mask, w=w) is w
        res = pb.run(w)
        assert res.dtype == pb.dtype and res.shape == pb.q.shape
        assert rel_err(res, oracle(pb, mask)) <= TOLERANCE[pb.dtype]


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_flashinfer_length_form(mask):
    """FlashInfer main's form: seq_len_kv with no seq_lens_kv means every request has seq_len_kv keys; the
    one-shot and a plan without lengths equal the seed's max_seq_len_kv + full seq_lens_kv, bit for bit."""
    lens = [48, 48, 48]
    g = gen(stable_seed("fi", mask))
    pb = Sparse(lens, 7, 8, 2, 128, 16, 4, 16, BF16, g, bits="uint32", slack=[0, 2, 1], diag=True,
                layout="scattered")
    want = oracle(pb, mask)
    out = torch.full(pb.q.shape, NAN, dtype=BF16)
    assert block_sparse_attention_with_paged_kv_cache(
        pb.q, pb.cache, pb.indptr, pb.indices, pb.block_indptr, pb.block_indices, pb.q_block, pb.kv_block,
        seq_len_kv=48, kv_valid_bits=pb.bits, mask_type=mask, out=out) is out
    assert rel_err(out, want) <= TOLERANCE[BF16]
    torch.testing.assert_close(pb.oneshot(mask_type=mask), out, rtol=0, atol=0)
    w = pb.plan(mask, seq_lens_kv=None)
    torch.testing.assert_close(pb.run(w), out, rtol=0, atol=0)
