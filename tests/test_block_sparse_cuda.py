"""Paged block-sparse attention on the GPU against the float64 reference (issue 6's correctness
grid): ``BlockSparsePagedTSWrapper`` and ``block_sparse_attention_with_paged_kv_cache``.

Grid: mask (dense, causal) x (q_block, kv_block) in {(64, 8), (16, 16), (32, 32), (64, 64),
(128, 128), (32, 64)} x GQA 1/2/4/8 x cache form (combined ``[P, 2, Hkv, ps, D]`` or a
``(K, V)`` tuple); each cell launches twice, with valid bits (uint32 or int32, rotating) and
without. Inside the cells the page size (16/32/64/128), small q blocks (``8 / group``), the
empty-row pattern (none / every third row / a whole K/V head), the page-ID pattern
(non-identity permutation / IDs repeated across and within requests), the route layout
(segments back to back / scattered at absolute offsets with garbage between), Sq (a multiple
of q_block or not), the dtype and D (128 / 256) rotate so that every value of every axis
appears (``test_grid_rotation_covers_every_axis``): 192 launches. K/V lengths are not page or
block multiples. Further tests: D 128 and 256 over the kernel shapes, the benchmark's shape at
reduced size (B 1, Sq = Sk = 2048, H 32/8, 128-blocks, random routes with the diagonal),
all blocks == the paged decode reference, exact zeros for rows that see nothing, uint32 ==
int32 bits, long rows, output dtypes and scales, the wrapper (its copied page metadata, the
live page IDs of each run) and the one-shot, and the device checks.

Every compute test takes ``ring_variant`` (conftest: a ``prims_ts.Tuning`` of the producer
ring) and runs a ``BlockSparsePagedTSWrapper`` planned with it (the planned kernel key must be
the one ``BlockSparseKey.choose`` builds for that tuning); under the first variant (``loop0``,
the one every device runs) the one-shot (the default tuning) runs the same problems too.

Tolerance: ``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16 against
``prims_ts.reference.block_sparse_attention(..., compute_dtype=torch.float64)``, over the
whole output and per request; ``out`` is NaN-poisoned first and NaN never passes. Every cache
slot that no request uses holds NaN, CSR entries past a request's live pages hold garbage page
IDs and ``block_indices`` entries outside every route row hold garbage block IDs, so a kernel
that reads past a request's length, an unused page or outside its rows fails.

``DEVICE`` (and ``HOST``, the other device of the device checks) are module globals: a dry run
may set them to "cpu" (and "meta") and call the test functions with a Tuning directly.
"""
from __future__ import annotations

import math
from unittest import mock

import pytest
import torch

from prims_ts import Tuning
from prims_ts import reference as R
from prims_ts.cuda.block_sparse import BlockSparseKey, PreparedBlockSparse
from prims_ts.cuda.catalog import RING_VARIANTS
from prims_ts.cuda.keys import DTYPE_CODES, device_limits
from prims_ts.ops.block_sparse import BlockSparsePagedTSWrapper, block_sparse_attention_with_paged_kv_cache
from prims_ts.testing import TOLERANCE, assign_pages, cumsum0, reference_must_not_run, rel_err, stable_seed

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
HOST = "cpu"  # the device of the one misplaced tensor in the device checks
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
GARBAGE = (-1, 2**31 - 1, -2**31, 99999)  # CSR page entries past the live pages
BLOCK_GARBAGE = (-7, 2**31 - 1, -2**31, 77777)  # block_indices entries outside every route row
MASKS = ["dense", "causal"]
BLOCKS = [(64, 8), (16, 16), (32, 32), (64, 64), (128, 128), (32, 64)]  # (q_block, kv_block)
GROUPS = [1, 2, 4, 8]
FORMS = ["combined", "tuple"]
PAGE_SIZES = [16, 32, 64, 128]
BENCH_N = 2048  # test_benchmark_shape_reduced: Sq = Sk
LONG_ROW = 16384  # test_long_rows
# the ring variant whose cells also run the one-shot (the default tuning): every device runs it
ONESHOT_TUNING = RING_VARIANTS["loop0"]


def sync():
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def bits_tensor(words, kind):
    """Python words in [0, 2**32) -> int32 (two's complement) or uint32 (the same bits), on the device."""
    t = torch.tensor([[w - 2**32 if w >= 2**31 else w for w in row] for row in words], dtype=I32)
    return (t.view(torch.uint32) if kind == "uint32" else t).to(DEVICE)


def random_routes(lens, sq, hkv, q_block, kv_block, g, *, density=0.5, empty="some", diag=True):
    """routes[b][h][r]: each block of request b with probability ``density``; ``diag``: the blocks holding
    the row's causal diagonal always in; ``empty``: "none", "some" (every third row) or "head" (the last
    K/V head of request 0 selects nothing)."""
    n_rows = -(-sq // q_block)
    routes = []
    for b, sk in enumerate(lens):
        nblk = -(-sk // kv_block)
        heads = []
        for h in range(hkv):
            rows = []
            for r in range(n_rows):
                sel = set((torch.rand(nblk, generator=g) < density).nonzero().flatten().tolist())
                if diag:
                    t0, t1 = r * q_block, min(sq, (r + 1) * q_block)
                    lo, hi = max(0, sk - sq + t0), min(sk - 1, max(0, sk - sq + t1 - 1))
                    sel |= set(range(lo // kv_block, hi // kv_block + 1))
                if not sel:
                    sel = {int(torch.randint(0, nblk, (1,), generator=g))}
                if (empty == "some" and (b + h + r) % 3 == 1) or (empty == "head" and b == 0 and h == hkv - 1):
                    sel = set()
                rows.append(sorted(sel))
            heads.append(rows)
        routes.append(heads)
    return routes


def encode_routes(routes, layout, g):
    """(block_indptr nested lists, flat block_indices): "compact" = (b, h) segments back to back;
    "scattered" = segments in a random order with garbage gaps between and after them."""
    B, H = len(routes), len(routes[0])
    segs = [(b, h) for b in range(B) for h in range(H)]
    if layout == "scattered":
        segs = [segs[i] for i in torch.randperm(len(segs), generator=g).tolist()]
    ptr, flat = [[None] * H for _ in range(B)], []
    for k, (b, h) in enumerate(segs):
        if layout == "scattered":
            flat += [BLOCK_GARBAGE[(k + i) % 4] for i in range(1 + k % 3)]
        offs = [len(flat)]
        for row in routes[b][h]:
            flat += row
            offs.append(len(flat))
        ptr[b][h] = offs
    if layout == "scattered":
        flat += [BLOCK_GARBAGE[1], BLOCK_GARBAGE[0]]
    return ptr, flat


class Problem:
    """A block-sparse problem: CSR and BSR tables built on the host (CPU generator), data on the device."""

    def __init__(self, seq_lens, sq, hq, hkv, d, ps, q_block, kv_block, dtype, seed, *, form="combined",
                 kind="perm", slack=1, extra_pages=3, poison=True, bits=None, density=0.5, empty="some",
                 diag=True, layout="compact", routes=None, max_seq_len_kv=None):
        g = torch.Generator().manual_seed(seed)
        dg = torch.Generator(device=DEVICE).manual_seed(seed)
        B = len(seq_lens)
        self.lens, self.B, self.sq, self.hq, self.hkv, self.d, self.ps = list(seq_lens), B, sq, hq, hkv, d, ps
        self.q_block, self.kv_block, self.dtype = q_block, kv_block, dtype
        self.max_seq_len_kv = max_seq_len_kv or max(seq_lens)
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        P, live = assign_pages(n_live, kind, extra_pages, g)
        self.live = live
        slack_of = [(slack + b) % 3 if slack else 0 for b in range(B)]
        self.slack_of = slack_of
        indices = []
        for b in range(B):
            indices += live[b] + [GARBAGE[(b + i) % len(GARBAGE)] for i in range(slack_of[b])]
        self.num_pages = P
        self.indptr = torch.tensor(cumsum0([n + s for n, s in zip(n_live, slack_of)]), dtype=I32, device=DEVICE)
        self.indices = torch.tensor(indices, dtype=I32, device=DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=I32, device=DEVICE)
        if form == "combined":
            self.cache = torch.randn(P, 2, hkv, ps, d, generator=dg, device=DEVICE).to(dtype)
            self.k, self.v = self.cache[:, 0], self.cache[:, 1]
        else:
            self.k = torch.randn(P, hkv, ps, d, generator=dg, device=DEVICE).to(dtype)
            self.v = torch.randn(P, hkv, ps, d, generator=dg, device=DEVICE).to(dtype)
            self.cache = (self.k, self.v)
        if poison:
            used = torch.zeros(P, ps, dtype=torch.bool)
            for b, sk in enumerate(seq_lens):
                j = torch.arange(sk)
                used[torch.tensor(live[b], dtype=torch.long)[j // ps], j % ps] = True
            unused = (~used).to(DEVICE)[:, None, :, None].expand_as(self.k)
            self.k.masked_fill_(unused, NAN)
            self.v.masked_fill_(unused, NAN)
        self.q = torch.randn(B, sq, hq, d, generator=dg, device=DEVICE).to(dtype)
        self.routes = routes if routes is not None else random_routes(
            seq_lens, sq, hkv, q_block, kv_block, g, density=density, empty=empty, diag=diag)
        ptr, flat = encode_routes(self.routes, layout, g)
        self.block_indptr = torch.tensor(ptr, dtype=I32, device=DEVICE)
        self.block_indices = torch.tensor(flat, dtype=I32, device=DEVICE)
        self.bits = None
        if bits is not None:
            words = torch.randint(0, 2**32, (B, -(-self.max_seq_len_kv // 32)), generator=g,
                                  dtype=torch.int64).tolist()
            words[0][0] |= 1 << 31
            self.bits = bits_tensor(words, bits)

    @property
    def most_blocks(self) -> int:
        """The largest number of blocks in one route row (the plan's max_blocks_per_row)."""
        return max((len(row) for heads in self.routes for rows in heads for row in rows), default=0)

    def call(self, q=None, **kw):
        """The one-shot (the default tuning), with the seed's length bound (max_seq_len_kv + seq_lens_kv)."""
        return block_sparse_attention_with_paged_kv_cache(
            self.q if q is None else q, self.cache, self.indptr, self.indices, self.block_indptr, self.block_indices,
            self.q_block, self.kv_block, max_seq_len_kv=self.max_seq_len_kv, seq_lens_kv=self.seq_lens,
            kv_valid_bits=self.bits, **kw)

    def plan(self, tuning, mask="dense", out_dtype=None) -> BlockSparsePagedTSWrapper:
        """A wrapper planned with `tuning`: FlashInfer's seq_len_kv is the problem's bound, seq_lens_kv
        the live lengths, max_blocks_per_row the routes' largest row."""
        w = BlockSparsePagedTSWrapper(tuning=tuning)
        w.plan(self.indptr, self.sq, self.max_seq_len_kv, self.hq, self.hkv, self.d, self.q_block, self.kv_block,
               self.ps, max_blocks_per_row=self.most_blocks, use_kv_valid_bits=self.bits is not None,
               seq_lens_kv=self.seq_lens, mask_type=mask, q_data_type=self.dtype, o_data_type=out_dtype)
        check_key(self, w, tuning, mask == "causal")
        return w

    def run(self, w, q=None, **kw):
        """The wrapper's run with the problem's live page IDs, routes and valid bits."""
        return w.run(self.q if q is None else q, self.cache, self.indices, self.block_indptr, self.block_indices,
                     kv_valid_bits=self.bits, **kw)

    def ref(self, mask="dense", sm_scale=None):
        return R.block_sparse_attention(self.q, self.k, self.v, self.indptr, self.indices, self.block_indptr,
                                        self.block_indices, self.q_block, self.kv_block, self.seq_lens,
                                        kv_valid_bits=self.bits, mask_type=mask, sm_scale=sm_scale,
                                        compute_dtype=torch.float64)


def check_key(pb: Problem, w, tuning, causal: bool) -> None:
    """The plan keeps `tuning`, and (on CUDA) its prepared launch is the kernel that
    BlockSparseKey.choose builds for it; on sm_90a a 64+-key block takes the tuning's ring choices."""
    plan = w._plan
    assert plan.static.tuning == tuning and plan.tuning_code == tuning.encode()
    arch = device_limits(plan.device)[0]
    rows = min(pb.q_block, pb.sq) * (pb.hq // pb.hkv)
    key = BlockSparseKey.choose(DTYPE_CODES[pb.dtype], pb.d, causal, pb.kv_block, rows, arch, tuning)
    if arch == "sm_90a" and pb.kv_block % 64 == 0 and tuning.portable:
        assert key.arch == 80, key.name
    elif arch == "sm_90a" and pb.kv_block % 64 == 0:
        loop = tuning.loop_for(pb.d)
        assert key.arch == 90 and key.loop == (loop if key.bm == 128 else min(loop, 1)), key.name
        assert key.persistent == tuning.persistent and key.copy_tpr == tuning.copy_for(pb.d), key.name
    if plan.launch is not None:
        assert plan.launch.key == key, (plan.launch.key.name, key.name)


def compare(pb: Problem, results, ref, tol) -> None:
    for label, out in results:
        err = rel_err(out, ref)
        assert err <= tol, f"{label}: rel err {err:.3e}"
        for b in range(pb.B):
            e = rel_err(out[b], ref[b])
            assert e <= tol, f"{label}, request {b} (len {pb.lens[b]}): rel err {e:.3e}"


def check(pb: Problem, tuning, mask="dense", sm_scale=None, out_dtype=None, tol=None, ref=None):
    """Run into NaN-poisoned outs (the wrapper planned with `tuning`; under ONESHOT_TUNING the
    one-shot too); compare with the float64 reference, whole and per request.
    Returns ([(label, out)], ref)."""
    odt = out_dtype or pb.dtype
    w = pb.plan(tuning, mask, out_dtype)
    out = torch.full(pb.q.shape, NAN, dtype=odt, device=DEVICE)
    assert pb.run(w, sm_scale=sm_scale, out=out) is out
    results = [("wrapper", out)]
    if tuning == ONESHOT_TUNING:
        one = torch.full(pb.q.shape, NAN, dtype=odt, device=DEVICE)
        assert pb.call(mask_type=mask, sm_scale=sm_scale, out=one) is one
        results.append(("one-shot", one))
    sync()
    ref = pb.ref(mask, sm_scale) if ref is None else ref
    compare(pb, results, ref, tol or max(TOLERANCE[pb.dtype], TOLERANCE[odt]))
    return results, ref


# ----------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------


def grid_cell(mask, q_block, kv_block, group, form):
    """The rotated axes of one grid cell."""
    i = BLOCKS.index((q_block, kv_block)) * 4 + GROUPS.index(group)  # 0..23 inside a (mask, form) cell
    c = i + 2 * MASKS.index(mask) + 3 * FORMS.index(form)
    small = group > 1 and c % 3 == 0  # q_block 8 / group (4, 2, 1)
    return dict(ps=PAGE_SIZES[(i + c // 4) % 4], q_block=8 // group if small else q_block,
                empty=("none", "some", "head")[c % 3], kind=("perm", "repeated")[(c // 2) % 2],
                layout=("compact", "scattered")[(c // 3) % 2], dtype=(BF16, FP16)[(i + c // 5) % 2],
                d=256 if c % 5 == 2 else 128, ragged=c % 4 != 1, bits=("uint32", "int32")[(c // 2 + i) % 2],
                hkv=(1 if c % 2 else 2) if group == 8 else 2)


def test_grid_rotation_covers_every_axis():
    for mask in MASKS:
        for form in FORMS:
            cells = [grid_cell(mask, qb, kvb, g, form) for qb, kvb in BLOCKS for g in GROUPS]
            for key, values in (("ps", PAGE_SIZES), ("empty", ["none", "some", "head"]),
                                ("kind", ["perm", "repeated"]), ("layout", ["compact", "scattered"]),
                                ("dtype", [BF16, FP16]), ("d", [128, 256]), ("ragged", [True, False]),
                                ("bits", ["uint32", "int32"]), ("q_block", [1, 2, 4])):
                got = {c[key] for c in cells}
                assert set(values) <= got, (mask, form, key, got)
    # every page size meets every kv block somewhere in the grid
    pairs = {(grid_cell(m, qb, kvb, g, f)["ps"], kvb) for m in MASKS for f in FORMS for qb, kvb in BLOCKS
             for g in GROUPS}
    assert pairs == {(ps, kvb) for ps in PAGE_SIZES for _, kvb in BLOCKS}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("group", GROUPS, ids=[f"gqa{g}" for g in GROUPS])
@pytest.mark.parametrize("q_block,kv_block", BLOCKS, ids=[f"q{q}-kv{k}" for q, k in BLOCKS])
@pytest.mark.parametrize("mask", MASKS)
def test_block_sparse_grid(ring_variant, mask, q_block, kv_block, group, form):
    c = grid_cell(mask, q_block, kv_block, group, form)
    qb, ps = c["q_block"], c["ps"]
    sq = 2 * qb + (qb // 2 + 1 if c["ragged"] else 0) if qb >= 8 else 13 + 3 * qb
    lens = [1 if mask == "dense" else sq, sq + 3 * kv_block + 5, sq + 4 * ps + 7]
    for bits in (c["bits"], None):
        pb = Problem(lens, sq, group * c["hkv"], c["hkv"], c["d"], ps, qb, kv_block, c["dtype"],
                     stable_seed(mask, q_block, kv_block, group, form, bits), form=form, kind=c["kind"],
                     bits=bits, empty=c["empty"], layout=c["layout"], max_seq_len_kv=max(lens) + 40)
        check(pb, ring_variant, mask)


# ----------------------------------------------------------------------------
# Head dims, kernel shapes, the benchmark's shape
# ----------------------------------------------------------------------------

SHAPES = [(64, 8), (128, 16), (32, 32), (64, 64), (128, 128), (128, 192), (256, 64), (1, 128)]  # (q_block, kv_block)


@pytest.mark.parametrize("q_block,kv_block", SHAPES, ids=[f"q{q}-kv{k}" for q, k in SHAPES])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask", MASKS)
def test_head_dims_and_kernel_shapes(ring_variant, mask, d, q_block, kv_block):
    """D 128 and 256 over the tile shapes the host picks (short rows and long rows, blocks below, equal to
    and above the key tile, 192-key blocks that are not a multiple of 128); GQA 8 (Hq 16 / Hkv 2)."""
    group = 8
    sq = min(300, 2 * q_block + 5) if q_block > 1 else 9
    lens = [sq + 5, sq + 1000, sq + 2 * kv_block + 1]
    pb = Problem(lens, sq, 2 * group, 2, d, 32, q_block, kv_block, BF16, stable_seed("dims", mask, d, q_block),
                 bits="uint32" if kv_block % 64 else None, density=0.4)
    check(pb, ring_variant, mask)


@pytest.mark.parametrize("density", [0.5, 0.25, 0.1])
@pytest.mark.parametrize("mask", MASKS)
def test_benchmark_shape_reduced(ring_variant, mask, density):
    """The issue's benchmark at reduced size: B 1, Sq = Sk = 2048, Hq 32 / Hkv 8, D 128, 128-blocks, page 64,
    random routes that include the diagonal."""
    n, hq, hkv = BENCH_N, 32, 8
    pb = Problem([n], n, hq, hkv, 128, 64, 128, 128, BF16, stable_seed("bench", mask, density), density=density,
                 empty="none", slack=0)
    selected = sum(len(row) for heads in pb.routes for rows in heads for row in rows)
    total = hkv * (n // 128) ** 2
    assert selected < total * min(1.0, density + 0.2)
    check(pb, ring_variant, mask)


# ----------------------------------------------------------------------------
# Semantics on the GPU
# ----------------------------------------------------------------------------


def all_blocks(lens, sq, hkv, q_block, kv_block):
    n_rows = -(-sq // q_block)
    return [[[list(range(-(-sk // kv_block))) for _ in range(n_rows)] for _ in range(hkv)] for sk in lens]


@pytest.mark.parametrize("kv_block", [8, 32, 64, 128])
@pytest.mark.parametrize("mask", MASKS)
def test_all_blocks_equal_decode_reference(ring_variant, mask, kv_block):
    """Every block selected: the paged decode reference with fixed [B, SQ, Hq, D] queries."""
    sq, hq, hkv, q_block = 40, 16, 4, 16
    lens = [sq, 1000, sq + 3 * kv_block + 1]
    pb = Problem(lens, sq, hq, hkv, 128, 32, q_block, kv_block, FP16, stable_seed("all", mask, kv_block),
                 routes=all_blocks(lens, sq, hkv, q_block, kv_block), layout="scattered")
    ref = R.batch_decode(pb.q, pb.k, pb.v, pb.indptr, pb.indices, pb.seq_lens, mask_type=mask,
                         compute_dtype=torch.float64)
    check(pb, ring_variant, mask, ref=ref)


@pytest.mark.parametrize("kv_block", [8, 64, 128])
@pytest.mark.parametrize("mask", MASKS)
def test_rows_that_see_nothing_are_exact_zeros(ring_variant, mask, kv_block):
    """Rows without blocks, rows whose blocks' keys are all invalid, and (causal, Sq == Sk) rows whose blocks
    lie above the diagonal write exact zeros; the rest of the output is right."""
    q_block = 16
    sq = 4 * q_block
    sk = max(sq, 2 * kv_block)
    nblk = -(-sk // kv_block)
    # K/V head 0: row 0 nothing, row 1 block 0 (made invalid below), rows 2-3 every block;
    # K/V head 1: row 0 only the last block (above the diagonal for causal when Sq == Sk), rows 1-3 block 0
    routes = [[[[], [0], list(range(nblk)), list(range(nblk))], [[nblk - 1], [0], [0], [0]]]]
    pb = Problem([sk], sq, 8, 2, 128, 16, q_block, kv_block, BF16, stable_seed("zeros", mask, kv_block),
                 routes=routes, bits="int32", max_seq_len_kv=sk)
    words = [[0xFFFFFFFF] * (-(-sk // 32))]
    for j in range(kv_block):  # block 0 invalid
        words[0][j // 32] &= ~(1 << (j % 32))
    pb.bits = bits_tensor(words, "int32")
    results, ref = check(pb, ring_variant, mask)
    zero_rows = [(0, 0), (0, 1)]  # (K/V head, route row)
    if mask == "causal" and sk == sq and (nblk - 1) * kv_block > q_block - 1:
        zero_rows.append((1, 0))
    zero_rows += [(1, r) for r in (1, 2, 3)]  # block 0 is invalid for every row
    for label, out in results:
        for h, r in zero_rows:
            rows = out[0, r * q_block:(r + 1) * q_block, h * 4:(h + 1) * 4]
            assert (ref[0, r * q_block:(r + 1) * q_block, h * 4:(h + 1) * 4] == 0).all(), (h, r)
            assert (rows == 0).all(), (label, h, r)
        assert (out[0, 2 * q_block:, :4] != 0).any(dim=-1).all(), label


def test_valid_bits_uint32_equals_int32(ring_variant):
    outs = []
    for kind in ("uint32", "int32"):
        pb = Problem([300, 77, 1000], 50, 16, 2, 128, 32, 16, 32, BF16, stable_seed("bits"), bits=kind)
        outs.append(dict(check(pb, ring_variant, "causal")[0]))
    assert outs[0].keys() == outs[1].keys()
    for label in outs[0]:
        torch.testing.assert_close(outs[0][label], outs[1][label], rtol=0, atol=0)


@pytest.mark.parametrize("kv_block", [8, 64])
def test_long_rows(ring_variant, kv_block):
    """Rows of many blocks (Sk 16384: 2048 8-key blocks or 256 64-key blocks per row) next to short ones."""
    lens = [LONG_ROW, 100, 5000]
    pb = Problem(lens, 32, 8, 2, 128, 128, 32, kv_block, BF16, stable_seed("long", kv_block), density=0.7,
                 empty="none", slack=0)
    check(pb, ring_variant, "causal")
    check(pb, ring_variant, "dense")


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_out_dtype_and_scales(ring_variant, dtype, out_dtype):
    pb = Problem([300, 77, 1000], 40, 16, 4, 128, 32, 8, 64, dtype, stable_seed("odt", str(dtype), str(out_dtype)),
                 bits="uint32")
    for scale in (0.02, None, 0.3):
        results, _ = check(pb, ring_variant, "causal", sm_scale=scale, out_dtype=out_dtype)
        assert all(out.dtype == out_dtype for _, out in results)
    # the functional forms (no out): the output dtype is the plan's (default: the query's)
    res = [("wrapper functional", pb.run(pb.plan(ring_variant, "causal", out_dtype))),
           ("wrapper functional, default out dtype", pb.run(pb.plan(ring_variant, "causal")))]
    if ring_variant == ONESHOT_TUNING:
        res.append(("one-shot functional", pb.call(mask_type="causal")))
    sync()
    assert res[0][1].dtype == out_dtype and all(out.dtype == dtype for _, out in res[1:])
    ref = pb.ref("causal")
    for label, out in res:
        assert out.shape == pb.q.shape, label
        assert rel_err(out, ref) <= max(TOLERANCE[dtype], TOLERANCE[out.dtype]), label


def test_strided_query(ring_variant):
    """Query heads sliced out of a fused projection (head stride > D)."""
    pb = Problem([300, 77], 40, 8, 2, 128, 16, 16, 16, BF16, stable_seed("strided"), poison=False)
    fused = torch.zeros(2, 40, 12, 128, dtype=BF16, device=DEVICE)
    fused[:, :, 2:10] = pb.q
    q = fused[:, :, 2:10]
    assert not q.is_contiguous()
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device=DEVICE)
    assert pb.run(pb.plan(ring_variant, "causal"), q=q, out=out) is out
    results = [("wrapper", out)]
    if ring_variant == ONESHOT_TUNING:
        one = torch.full(pb.q.shape, NAN, dtype=BF16, device=DEVICE)
        pb.call(q=q, mask_type="causal", out=one)
        results.append(("one-shot", one))
    sync()
    compare(pb, results, pb.ref("causal"), TOLERANCE[BF16])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mask", MASKS)
def test_wrapper_and_oneshot(ring_variant, mask, form):
    pb = Problem([1000, 64, 2049, 130], 64, 32, 8, 128, 64, 64, 128, FP16, stable_seed("wrapper", mask, form),
                 form=form, bits="int32", layout="scattered")
    ref = pb.ref(mask, 0.07)
    w = pb.plan(ring_variant, mask, FP32)
    out = torch.full(pb.q.shape, NAN, dtype=FP32, device=DEVICE)
    assert pb.run(w, sm_scale=0.07, out=out) is out
    sync()
    compare(pb, [("wrapper", out)], ref, TOLERANCE[FP16])
    res = pb.run(pb.plan(ring_variant, mask), sm_scale=0.07)
    sync()
    assert res.dtype == FP16
    compare(pb, [("wrapper functional", res)], ref, TOLERANCE[FP16])
    # the one-shot is the default tuning's plan and run: bitwise the default-tuned wrapper's output
    one = pb.call(mask_type=mask, sm_scale=0.07)
    default = pb.run(pb.plan(Tuning(), mask), sm_scale=0.07)
    sync()
    compare(pb, [("one-shot", one)], ref, TOLERANCE[FP16])
    torch.testing.assert_close(one, default, rtol=0, atol=0)
    # FlashInfer's length bound alone: seq_len_kv, every request that long
    full = [pb.max_seq_len_kv] * pb.B
    pf = Problem(full, 64, 32, 8, 128, 64, 64, 128, FP16, stable_seed("wrapper-full", mask, form), form=form,
                 layout="scattered")
    one = block_sparse_attention_with_paged_kv_cache(pf.q, pf.cache, pf.indptr, pf.indices, pf.block_indptr,
                                                     pf.block_indices, 64, 128, seq_len_kv=pf.max_seq_len_kv,
                                                     mask_type=mask, sm_scale=0.07)
    wf = BlockSparsePagedTSWrapper(tuning=ring_variant)
    wf.plan(pf.indptr, 64, pf.max_seq_len_kv, 32, 8, 128, 64, 128, 64, max_blocks_per_row=pf.most_blocks,
            use_kv_valid_bits=False, mask_type=mask, q_data_type=FP16)
    check_key(pf, wf, ring_variant, mask == "causal")
    res = pf.run(wf, sm_scale=0.07)
    sync()
    compare(pf, [("one-shot, seq_len_kv", one), ("wrapper, seq_len_kv", res)], pf.ref(mask, 0.07), TOLERANCE[FP16])
    # the plan copied paged_kv_indptr and seq_lens_kv: changing the caller's tensors has no effect
    saved_ip, saved_lens = pb.indptr.clone(), pb.seq_lens.clone()
    pb.indptr.zero_()
    pb.seq_lens.fill_(1)
    out.fill_(NAN)
    pb.run(w, sm_scale=0.07, out=out)
    sync()
    pb.indptr.copy_(saved_ip)
    pb.seq_lens.copy_(saved_lens)
    compare(pb, [("wrapper, caller's metadata changed", out)], ref, TOLERANCE[FP16])
    # each run takes the live page IDs: move every page elsewhere in the pool, remap the live IDs
    perm = torch.randperm(pb.num_pages, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    if form == "combined":
        moved = torch.empty_like(pb.cache)
        moved[perm] = pb.cache
        pb.cache, pb.k, pb.v = moved, moved[:, 0], moved[:, 1]
    else:
        k2, v2 = torch.empty_like(pb.k), torch.empty_like(pb.v)
        k2[perm], v2[perm] = pb.k, pb.v
        pb.cache, pb.k, pb.v = (k2, v2), k2, v2
    ids, ip, new_id = pb.indices.tolist(), pb.indptr.tolist(), perm.tolist()
    for b in range(pb.B):  # the live entries only: the garbage past them stays garbage
        for i in range(ip[b], ip[b] + len(pb.live[b])):
            ids[i] = new_id[ids[i]]
    pb.indices = torch.tensor(ids, dtype=I32, device=DEVICE)
    out.fill_(NAN)
    assert pb.run(w, sm_scale=0.07, out=out) is out
    sync()
    compare(pb, [("wrapper, moved pages", out)], pb.ref(mask, 0.07), TOLERANCE[FP16])


@pytest.mark.parametrize("form", FORMS)
def test_runs_after_the_first_take_new_addresses_routes_and_strides(form):
    """A plan's later runs whose operands are laid out as its last checked run's (the fast path,
    ``cuda.keys.Accepted``): new q and out tensors and new routes (another length of
    block_indices) give the reference; a query of other strides is checked and relaunched, and
    the contiguous one after it is right again; an out overlapping q, or a misaligned one, is still
    refused."""
    tuning = ONESHOT_TUNING
    lens = [700, 333]
    dense = Problem(lens, 64, 16, 4, 128, 32, 64, 64, BF16, stable_seed("again", form), form=form, density=0.9)
    sparse = Problem(lens, 64, 16, 4, 128, 32, 64, 64, BF16, stable_seed("again", form), form=form, density=0.3)
    assert sparse.block_indices.shape != dense.block_indices.shape
    w = dense.plan(tuning, "causal")
    for pb in (dense, dense, sparse, dense):
        pb.q = torch.randn_like(pb.q)
        out = torch.full(pb.q.shape, NAN, dtype=BF16, device=DEVICE)
        assert w.run(pb.q, pb.cache, pb.indices, pb.block_indptr, pb.block_indices, out=out) is out
        sync()
        compare(pb, [("run", out)], pb.ref("causal"), TOLERANCE[BF16])
    fused = torch.zeros(2, 64, 20, 128, dtype=BF16, device=DEVICE)
    for label, q in (("strided q", fused[:, :, 2:18]), ("contiguous q", dense.q)):
        q.copy_(torch.randn_like(dense.q))
        dense.q = q
        out = dense.run(w)
        sync()
        compare(dense, [(label, out)], dense.ref("causal"), TOLERANCE[BF16])
    with pytest.raises(ValueError, match="out must not overlap q"):
        dense.run(w, out=dense.q)
    spare = torch.empty(dense.q.numel() + 8, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="16-byte aligned"):
        dense.run(w, out=spare[1:1 + dense.q.numel()].view(dense.q.shape))


def test_same_launch_twice_is_bitwise_equal(ring_variant):
    pb = Problem([1500, 300], 100, 16, 4, 128, 32, 32, 64, BF16, stable_seed("det"), bits="uint32")
    a, _ = check(pb, ring_variant, "causal")
    b, _ = check(pb, ring_variant, "causal")
    assert [label for label, _ in a] == [label for label, _ in b]
    for (label, x), (_, y) in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=label)


# ----------------------------------------------------------------------------
# Host checks that only apply to device tensors
# ----------------------------------------------------------------------------


def _must_not_launch(*args, **kwargs):
    raise AssertionError("the block-sparse kernel was launched although validation should have failed first")


def _no_launch():
    """Within the block neither the CUDA kernel nor the CPU kernel (the reference) may run."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(PreparedBlockSparse, "run", _must_not_launch))
    stack.enter_context(reference_must_not_run("block_sparse_attention"))
    return stack


ONESHOT_MISPLACED = ["paged_kv_indptr", "paged_kv_indices", "block_indptr", "block_indices", "seq_lens_kv",
                     "kv_valid_bits", "q", "out", "cache"]
WRAPPER_MISPLACED = ONESHOT_MISPLACED  # plan: paged_kv_indptr, seq_lens_kv; run: the others


@pytest.mark.parametrize("entry,name", [("oneshot", n) for n in ONESHOT_MISPLACED]
                         + [("wrapper", n) for n in WRAPPER_MISPLACED])
def test_tensor_on_the_host_refused(entry, name):
    """One argument on the CPU, the rest on the GPU: refused before any launch, naming the argument."""
    pb = Problem([40, 9], 8, 8, 2, 128, 16, 8, 8, BF16, stable_seed("host", name), bits="uint32", poison=False)
    args = dict(q=pb.q, paged_kv_cache=pb.cache, paged_kv_indptr=pb.indptr, paged_kv_indices=pb.indices,
                block_indptr=pb.block_indptr, block_indices=pb.block_indices, q_block_size=8, kv_block_size=8)
    kw = dict(max_seq_len_kv=pb.max_seq_len_kv, seq_lens_kv=pb.seq_lens, kv_valid_bits=pb.bits)
    if name == "out":
        kw["out"] = torch.empty(pb.q.shape, dtype=BF16, device=HOST)
    elif name == "cache":
        args["paged_kv_cache"] = pb.cache.to(HOST)
    elif name in args:
        args[name] = args[name].to(HOST)
    else:
        kw[name] = kw[name].to(HOST)
    match = {"cache": "paged_kv_cache", "q": r"\bq\b|paged_kv_cache"}.get(name, name)
    with _no_launch():
        with pytest.raises(ValueError, match=match):
            if entry == "oneshot":
                block_sparse_attention_with_paged_kv_cache(*args.values(), **kw)
            else:
                w = BlockSparsePagedTSWrapper()
                w.plan(args["paged_kv_indptr"], pb.sq, pb.max_seq_len_kv, pb.hq, pb.hkv, pb.d, 8, 8, pb.ps,
                       max_blocks_per_row=pb.most_blocks, use_kv_valid_bits=True, seq_lens_kv=kw["seq_lens_kv"],
                       q_data_type=BF16)
                w.run(args["q"], args["paged_kv_cache"], args["paged_kv_indices"], args["block_indptr"],
                      args["block_indices"], kv_valid_bits=kw["kv_valid_bits"], out=kw.get("out"))


def test_tuple_v_on_the_host_refused():
    """The V pool of a (K, V) tuple on the host (K on the GPU): refused before any launch."""
    pb = Problem([40, 9], 8, 8, 2, 128, 16, 8, 8, BF16, stable_seed("host_v"), form="tuple", poison=False)
    cache = (pb.k, pb.v.to(HOST))
    with _no_launch():
        with pytest.raises(ValueError, match="paged_kv_cache"):
            block_sparse_attention_with_paged_kv_cache(
                pb.q, cache, pb.indptr, pb.indices, pb.block_indptr, pb.block_indices, 8, 8,
                max_seq_len_kv=pb.max_seq_len_kv, seq_lens_kv=pb.seq_lens)
        w = pb.plan(Tuning())
        with pytest.raises(ValueError, match="paged_kv_cache"):
            w.run(pb.q, cache, pb.indices, pb.block_indptr, pb.block_indices)


@pytest.mark.parametrize("dtype,shift", [(BF16, 2), (FP32, 4)], ids=["bf16+2", "fp32+4"])
def test_misaligned_out_refused(dtype, shift):
    """A contiguous out whose start the kernel's paired stores cannot use: refused before any launch (the
    launch is patched out, so a miss fails here instead of faulting the device)."""
    pb = Problem([40, 9], 8, 8, 2, 128, 16, 8, 8, BF16, stable_seed("misaligned", shift), poison=False)
    n = pb.q.numel() * torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(n + 64, dtype=torch.uint8, device=DEVICE)
    start = (-buf.data_ptr()) % 16 + shift
    out = buf[start:start + n].view(dtype).view(pb.q.shape)
    with _no_launch():
        with pytest.raises(ValueError, match=r"\bout\b"):
            pb.call(out=out)  # the one-shot's output dtype is out's
        w = pb.plan(Tuning(), out_dtype=dtype)
        with pytest.raises(ValueError, match=r"\bout\b"):
            pb.run(w, out=out)


def test_math_constants(ring_variant):
    """The default scale is 1 / sqrt(D) on the GPU too."""
    pb = Problem([200, 33], 16, 8, 2, 256, 32, 8, 16, BF16, stable_seed("scale"))
    w = pb.plan(ring_variant, "causal", FP32)
    a = pb.run(w, out=torch.empty(pb.q.shape, dtype=FP32, device=DEVICE))
    b = pb.run(w, sm_scale=1.0 / math.sqrt(256), out=torch.empty(pb.q.shape, dtype=FP32, device=DEVICE))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    if ring_variant == ONESHOT_TUNING:
        a = pb.call(mask_type="causal", out=torch.empty(pb.q.shape, dtype=FP32, device=DEVICE))
        b = pb.call(mask_type="causal", sm_scale=1.0 / math.sqrt(256),
                    out=torch.empty(pb.q.shape, dtype=FP32, device=DEVICE))
        torch.testing.assert_close(a, b, rtol=0, atol=0)
