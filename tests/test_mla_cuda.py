"""MLA decode on the GPU against the float64 reference (issue 5's correctness grid):
``BatchMLADecodePagedTSWrapper``, ``prims_ts_batch_decode_with_kv_cache_mla`` and the one-shot.

Grid: Q mode (fixed ``[B, SQ, H, 576]``, packed ``[T, H, 576]`` + ``qo_indptr``) x mask (dense,
causal) x H (8, 16, 32, 64, 128) x SQ (1..4; packed: per-request counts up to SQ); inside each
(Q mode, mask) cell the page size (16/32/64/128), the cache rank (``[P, ps, 576]`` or
``[P, 1, ps, 576]``), the dtype, the page-ID pattern (non-identity permutation / IDs repeated
across and within requests) and the length set (long: split-KV; short: one split, both checked
with ``prims_ts.cuda.decode.decode_policy``) rotate so that every value of every axis appears; a
separate test runs every page size with both cache ranks and both Q modes. K/V lengths include
1 (or the query count) and are not page multiples. Further tests: the sm_90a engines of rows of
16/32 (the swapped-operand tile with each producer copy, and the mma.sync tile), rows of 64 on
the twin tile (sm_90a's only 64-row tile), the twin's rerun and epilogues, split-KV and
one-split policies, batch sizes 1..512, a 131072-token request, output dtypes and scales, a
strided query, the wrapper (both run modes, bound metadata changed in place) and the one-shot.

Every split merge: every compute test takes ``split_merge`` (conftest: the cluster and ticket merges,
balanced split-KV) and runs a ``BatchMLADecodePagedTSWrapper`` planned with it (with the engine
tests' tuning fields on top); the plan's policy and kernel key must be the ones that tuning
selects. Under the default tuning (``Tuning()``) the standalone
``prims_ts_batch_decode_with_kv_cache_mla`` (always the default tuning) runs the same problem too.

Tolerance: ``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16 against
``prims_ts.reference.batch_mla_decode(..., compute_dtype=torch.float64)``, over the whole output
and per request; ``out`` is NaN-poisoned first and NaN never passes. Every cache slot that no
request uses holds NaN and block-table entries past a request's live pages hold garbage page
IDs, so a kernel that reads past a request's length, or an unused page, fails.

``DEVICE`` (and ``HOST``, the other device of the device checks) are module globals: a dry run
may set them to "cpu" (and "meta") and call the test functions with a Tuning directly.
"""
from __future__ import annotations

import dataclasses
import math
from unittest import mock

import numpy as np
import pytest
import torch

from prims_ts import (
    BatchMLADecodePagedTSWrapper,
    Tuning,
    batch_mla_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_mla_workspace_size,
    prims_ts_batch_decode_with_kv_cache_mla,
)
from prims_ts import reference as R
from prims_ts.cuda.decode import (MLA_DIM_QK, DecodeKey, PreparedDecode, balanced_by_lengths, balances,
                                   decode_policy)
from prims_ts.cuda.keys import DTYPE_CODES, device_limits
from prims_ts.testing import (TOLERANCE, assign_pages, check_decode_cluster, check_decode_workspace, chosen_splits,
                              cumsum0, merged_in_cluster, on_sm90_gpu, reference_must_not_run, rel_err, stable_seed)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
HOST = "cpu"  # the device of the misplaced workspace in the device checks
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
DQK, DV = 576, 512
KV_LORA_RANK, QK_ROPE_HEAD_DIM = 512, 64
SCALE = 1.0 / math.sqrt(DQK)
# the standalone function's launch (it reads no lengths: the static split) and split_merge "cluster";
# a plan of the default Tuning() balances uneven lengths (test_plan_balances_uneven_lengths)
STATIC = Tuning(balanced_split=False)
GARBAGE = (-1, 2**31 - 1, -2**31, 99999)
MASKS = ["dense", "causal"]
QMODES = ["fixed", "packed"]
HEADS = [8, 16, 32, 64, 128]
SQS = [1, 2, 3, 4]
PAGE_SIZES = [16, 32, 64, 128]
RANKS = [3, 4]
# length sets: "long" forces split-KV (max_seq_len 2600), "short" (max_seq_len 127) runs one split
LONG = [1, 17, 100, 257, 1033, 2500]
SHORT = [1, 17, 100, 127, 45]
LONGEST = 131072  # the long-request tests


def sync():
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def skip_off_sm90(what: str) -> None:
    """Skip on a CUDA device that is not sm_90a (`what` is that engine's only); a CPU dry run goes on."""
    if torch.device(DEVICE).type == "cuda" and not on_sm90_gpu(DEVICE):
        pytest.skip(f"{what} is sm_90a's")


def on_sm90() -> bool:
    """The device under test is sm_90a (the CPU of a dry run counts as the nominal H200)."""
    return device_limits(DEVICE)[0] == "sm_90a"


class Problem:
    """An MLA problem: block tables built on the host (CPU generator), data on the device. The
    table has the columns max_seq_len needs (a wrapper plans max_kv_len = max_seq_len), live
    pages first, garbage IDs after, and a row stride of cols + pad."""

    def __init__(self, seq_lens, h, ps, dtype, seed, *, qmode="fixed", sq=1, q_lens=None, max_seq_len_q=None,
                 rank=3, kind="perm", slack=1, pad=3, extra_pages=3, max_seq_len=None, poison=True):
        g = torch.Generator().manual_seed(seed)
        dg = torch.Generator(device=DEVICE).manual_seed(seed)
        B = len(seq_lens)
        self.seq_lens_list, self.B = list(seq_lens), B
        self.h, self.ps, self.dtype, self.qmode, self.rank = h, ps, dtype, qmode, rank
        self.max_seq_len = max_seq_len or max(seq_lens)
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        cols = max(max(n_live), -(-self.max_seq_len // ps)) + slack
        P, live = assign_pages(n_live, kind, extra_pages, g)
        self.live = live
        wide = torch.full((B, cols + pad), -1, dtype=I32)
        for b in range(B):
            wide[b, :cols] = torch.tensor(live[b] + [GARBAGE[(b + i) % len(GARBAGE)] for i in range(cols - n_live[b])],
                                          dtype=I32)
        self.num_pages = P
        self.block_tables = wide.to(DEVICE)[:, :cols]  # row stride cols + pad
        self.seq_lens = torch.tensor(seq_lens, dtype=I32, device=DEVICE)
        self.pool = torch.randn(P, ps, DQK, generator=dg, device=DEVICE).to(dtype)
        self.cache = self.pool.unsqueeze(1) if rank == 4 else self.pool
        if poison:
            used = torch.zeros(P, ps, dtype=torch.bool)
            for b, sk in enumerate(seq_lens):
                j = torch.arange(sk)
                used[torch.tensor(live[b], dtype=torch.long)[j // ps], j % ps] = True
            self.pool.masked_fill_((~used).to(DEVICE)[:, :, None].expand_as(self.pool), NAN)
        self.qo_indptr = None
        if qmode == "fixed":
            self.q_lens, self.max_seq_len_q = [sq] * B, sq
            self.q = torch.randn(B, sq, h, DQK, generator=dg, device=DEVICE).to(dtype)
        else:
            self.q_lens = list(q_lens)
            self.qo_indptr = torch.tensor(cumsum0(q_lens), dtype=I32, device=DEVICE)
            self.max_seq_len_q = max_seq_len_q or max(q_lens)
            self.q = torch.randn(sum(q_lens), h, DQK, generator=dg, device=DEVICE).to(dtype)
        nbytes = get_prims_ts_batch_decode_mla_workspace_size(B, h, KV_LORA_RANK, QK_ROPE_HEAD_DIM, ps,
                                                              self.max_seq_len, max_seq_len_q=self.max_seq_len_q,
                                                              q_dtype=dtype, device=DEVICE)
        self.workspace = torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE)

    @property
    def out_shape(self):
        return tuple(self.q.shape[:-1]) + (DV,)

    def planned(self, tuning):
        """The tuning a plan of `tuning` launches for this problem: balanced split-KV where the
        default leaves it to the plan's lengths and they are uneven (balanced_by_lengths)."""
        arch, sms, limit = device_limits(DEVICE)
        return balanced_by_lengths(tuning, np.asarray(self.seq_lens_list), self.B, 1, self.h, self.max_seq_len_q,
                                   MLA_DIM_QK, self.max_seq_len, sms, limit, arch)

    def policy(self, tuning=None):
        """The static policy of the problem, or (`tuning`) the one its plans take."""
        _, sms, limit = device_limits(DEVICE)
        balance = balances(tuning) if tuning else 0
        return decode_policy(self.B, 1, self.h, self.max_seq_len_q, MLA_DIM_QK, self.max_seq_len, sms, limit, balance)

    def call(self, q=None, **kw):
        """The standalone function (the default tuning)."""
        extra = dict(qo_indptr=self.qo_indptr, max_seq_len_q=self.max_seq_len_q) if self.qmode == "packed" else {}
        return prims_ts_batch_decode_with_kv_cache_mla(self.q if q is None else q, self.cache, self.workspace,
                                                       KV_LORA_RANK, QK_ROPE_HEAD_DIM, self.block_tables,
                                                       self.seq_lens, self.max_seq_len, **extra, **kw)

    def plan(self, tuning, mask_type="causal", out_dtype=BF16) -> BatchMLADecodePagedTSWrapper:
        """A wrapper planned with `tuning` for the standalone's static problem (max_kv_len =
        max_seq_len, the same max_seq_len_q: the same policy)."""
        w = BatchMLADecodePagedTSWrapper(tuning=tuning)
        if self.qmode == "packed":
            mode = dict(qo_indptr=self.qo_indptr, max_seq_len_q=self.max_seq_len_q)
        else:
            mode = dict(seq_len_q=self.max_seq_len_q)
        w.plan(self.block_tables, self.seq_lens, self.h, KV_LORA_RANK, QK_ROPE_HEAD_DIM, self.ps, **mode,
               q_data_type=self.dtype, o_data_type=out_dtype, mask_type=mask_type, max_kv_len=self.max_seq_len)
        check_plan(self, w, tuning, mask_type == "causal")
        return w

    def ref(self, mask_type="causal", bmm1_scale=SCALE, bmm2_scale=1.0):
        return R.batch_mla_decode(self.q, self.cache, self.block_tables, self.seq_lens, qo_indptr=self.qo_indptr,
                                  mask_type=mask_type, sm_scale=bmm1_scale, output_scale=bmm2_scale,
                                  compute_dtype=torch.float64)

    def request_slices(self):
        if self.qmode == "packed":
            qo = cumsum0(self.q_lens)
            return [slice(qo[b], qo[b + 1]) for b in range(self.B)]
        return [slice(b, b + 1) for b in range(self.B)]


def check_plan(pb: Problem, w, tuning, causal: bool) -> DecodeKey:
    """The plan keeps `tuning` (balanced by its lengths: Problem.planned); on CUDA its prepared
    launch has the problem's policy, the key that DecodeKey.of builds for that policy and tuning,
    and the tuning's split merge. Returns that key."""
    plan = w._plan
    tuning = pb.planned(tuning)
    assert plan.static.tuning == tuning and plan.tuning_code == tuning.encode()
    arch = device_limits(plan.device)[0]
    pol = pb.policy(tuning)
    key = DecodeKey.of(DTYPE_CODES[pb.dtype], MLA_DIM_QK, causal, pol, arch, tuning)
    if plan.launch is not None:
        assert plan.launch.key == key, (plan.launch.key.name, key.name)
        check_decode_cluster(plan, key, tuning, pol)
    return key


def compare(pb: Problem, results, ref: torch.Tensor, tol: float) -> None:
    for label, out in results:
        err = rel_err(out, ref)
        assert err <= tol, f"{label}: rel err {err:.3e}"
        for b, s in enumerate(pb.request_slices()):
            e = rel_err(out[s], ref[s])
            assert e <= tol, f"{label}, request {b} (len {pb.seq_lens_list[b]}, q {pb.q_lens[b]}): rel err {e:.3e}"


def check(pb: Problem, tuning, mask="causal", out_dtype=None, bmm1_scale=SCALE, bmm2_scale=1.0, tol=None):
    """Run into NaN-poisoned outs (the wrapper planned with `tuning`; under the default tuning the
    standalone function too); compare with the float64 reference, whole and per request.
    Returns ([(label, out)], ref)."""
    odt = out_dtype or BF16
    w = pb.plan(tuning, mask, odt)
    out = torch.full(pb.out_shape, NAN, dtype=odt, device=DEVICE)
    assert w.run(pb.q, pb.cache, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=out) is out
    results = [("wrapper", out)]
    if tuning == STATIC:
        one = torch.full(pb.out_shape, NAN, dtype=odt, device=DEVICE)
        res = pb.call(mask_type=mask, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=one, out_dtype=odt)
        assert res is one
        results.append(("standalone", one))
    sync()
    launch = w._plan.launch
    if tuning == STATIC and launch is not None and launch.policy.splits > 1:
        # the standalone's policy and launch shape are the wrapper's
        check_decode_workspace(pb.workspace, merged_in_cluster(launch))
    ref = pb.ref(mask, bmm1_scale, bmm2_scale)
    compare(pb, results, ref, tol or max(TOLERANCE[pb.dtype], TOLERANCE[odt]))
    return results, ref


# ----------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------


def grid_cell(qmode, mask, h, sq):
    """The rotated axes of one grid test: page size, cache rank, dtype, page-ID kind, length set."""
    cell = QMODES.index(qmode) * 2 + MASKS.index(mask)
    j = HEADS.index(h) * 4 + SQS.index(sq)  # 0..19 inside the cell
    return dict(ps=PAGE_SIZES[(j + cell) % 4], rank=RANKS[(j + j // 4 + cell) % 2],
                dtype=(BF16, FP16)[(j // 2 + cell) % 2], kind=("perm", "repeated")[(j // 3 + cell) % 2],
                lengths=("long", "short")[(j + j // 5 + cell) % 2])


def test_grid_rotation_covers_every_axis():
    """Inside every (Q mode, mask) cell every page size, rank, dtype, kind and length set appears,
    and every page size meets both length sets."""
    for qmode in QMODES:
        for mask in MASKS:
            cells = [grid_cell(qmode, mask, h, sq) for h in HEADS for sq in SQS]
            for key, values in (("ps", PAGE_SIZES), ("rank", RANKS), ("dtype", [BF16, FP16]),
                                ("kind", ["perm", "repeated"]), ("lengths", ["long", "short"])):
                assert {c[key] for c in cells} == set(values), (qmode, mask, key)
            assert {(c["ps"], c["lengths"]) for c in cells} == {(p, n) for p in PAGE_SIZES for n in ("long", "short")}


@pytest.mark.parametrize("sq", SQS, ids=[f"sq{s}" for s in SQS])
@pytest.mark.parametrize("h", HEADS, ids=[f"h{h}" for h in HEADS])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("qmode", QMODES)
def test_mla_grid(split_merge, qmode, mask, h, sq):
    c = grid_cell(qmode, mask, h, sq)
    lens = list(LONG if c["lengths"] == "long" else SHORT)
    B = len(lens)
    q_lens = [1 + (b + sq) % sq for b in range(B)]  # packed: counts 1..SQ, SQ reached
    if mask == "causal":
        lens[0] = sq if qmode == "fixed" else q_lens[0]  # the shortest legal length
    max_len = 2600 if c["lengths"] == "long" else 127
    pb = Problem(lens, h, c["ps"], c["dtype"], stable_seed("mla", qmode, mask, h, sq), qmode=qmode, sq=sq,
                 q_lens=q_lens, max_seq_len_q=sq, rank=c["rank"], kind=c["kind"], max_seq_len=max_len)
    pol = pb.policy()
    assert (pol.splits > 1) == (c["lengths"] == "long"), pol
    check(pb, split_merge, mask)


# ----------------------------------------------------------------------------
# Rows of 16/32 on sm_90a: the swapped-operand tile (the default there), with each producer
# copy (Tuning.copy_tpr) and the mma.sync tile (sm_80/sm_89's engine, selected with
# Tuning(mla_swapped=False)), on the same grid, with every split merge
# ----------------------------------------------------------------------------

SWAP_CELLS = [(8, 1), (8, 2), (8, 4), (16, 1), (16, 2), (32, 1)]  # (H, SQ): H x SQ <= 32
# name -> (tuning, swapped tile expected, its producer copy)
ROW_ENGINES = {"swapped_copy4": (Tuning(copy_tpr=4), True, 4), "swapped_copy8": (Tuning(copy_tpr=8), True, 8),
               "mma_sync": (Tuning(mla_swapped=False), False, 4)}


@pytest.fixture(params=list(ROW_ENGINES))
def row_tile(request):
    """The sm_90a engine of 16/32-row tiles: (its Tuning, swapped, producer copy)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the engine choice exists on sm_90a only")
    return ROW_ENGINES[request.param]


def with_merge(tuning: Tuning, split_merge: Tuning) -> Tuning:
    """`tuning` with split_merge's merge (balanced split-KV included)."""
    return dataclasses.replace(tuning, cluster_merge=split_merge.cluster_merge, balanced_split=split_merge.balanced_split,
                               balanced_ctas=split_merge.balanced_ctas, merge_fan=split_merge.merge_fan)


@pytest.mark.parametrize("hsq", SWAP_CELLS, ids=[f"h{h}_sq{q}" for h, q in SWAP_CELLS])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("qmode", QMODES)
def test_row_tile_engines_grid(row_tile, split_merge, qmode, mask, hsq):
    """The grid's rotation (page size, rank, dtype, page IDs, split or one split) on each
    engine; the policy's key must be the chosen engine's."""
    engine, swapped, tpr = row_tile
    tuning = with_merge(engine, split_merge)
    h, sq = hsq
    i = SWAP_CELLS.index(hsq) + 6 * (QMODES.index(qmode) * 2 + MASKS.index(mask))
    lengths = ("long", "short")[i % 2]
    lens = list(LONG if lengths == "long" else SHORT)
    B = len(lens)
    q_lens = [1 + (b + sq) % sq for b in range(B)]
    if mask == "causal":
        lens[0] = sq if qmode == "fixed" else q_lens[0]
    pb = Problem(lens, h, PAGE_SIZES[i % 4], (BF16, FP16)[(i // 2) % 2], stable_seed("swap", qmode, mask, h, sq),
                 qmode=qmode, sq=sq, q_lens=q_lens, max_seq_len_q=sq, rank=RANKS[(i // 4) % 2],
                 kind=("perm", "repeated")[(i // 3) % 2], max_seq_len=2600 if lengths == "long" else 127)
    assert (pb.policy().splits > 1) == (lengths == "long"), pb.policy()
    pol = pb.policy(tuning)
    key = DecodeKey.of(DTYPE_CODES[pb.dtype], DQK, mask == "causal", pol, "sm_90a", tuning)
    assert key.swap == swapped and key.bm == pol.bm and key.arch == (90 if swapped else 80), key.name
    assert key.copy_tpr == tpr, key.name
    if on_sm90():  # the planned launch is this key (check_plan compares it on CUDA)
        assert check_plan(pb, pb.plan(tuning, mask), tuning, mask == "causal") == key
    check(pb, tuning, mask)


WIDE_CELLS = [(64, 1), (128, 1), (16, 4), (32, 3)]  # H x SQ >= 64: the 64-row tile (sm_90a: the twin)


def wide_problem(qmode, mask, hsq, salt: str) -> "Problem":
    """A cell of the wide-row grid (H x SQ >= 64): the rotation over page size, rank, dtype,
    page IDs, long (split) or short lengths, such that every cell meets every axis."""
    h, sq = hsq
    i = WIDE_CELLS.index(hsq) + 5 * (QMODES.index(qmode) * 2 + MASKS.index(mask))
    lengths = ("long", "short")[i % 2]
    lens = list(LONG if lengths == "long" else SHORT)
    q_lens = [1 + (b + sq) % sq for b in range(len(lens))]
    if mask == "causal":
        lens[0] = sq if qmode == "fixed" else q_lens[0]
    return Problem(lens, h, PAGE_SIZES[i % 4], (BF16, FP16)[(i // 2) % 2], stable_seed(salt, qmode, mask, h, sq),
                   qmode=qmode, sq=sq, q_lens=q_lens, max_seq_len_q=sq, rank=RANKS[(i // 4) % 2],
                   kind=("perm", "repeated")[(i // 3) % 2], max_seq_len=2600 if lengths == "long" else 127)


@pytest.mark.parametrize("hsq", WIDE_CELLS, ids=[f"h{h}_sq{q}" for h, q in WIDE_CELLS])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("qmode", QMODES)
def test_wide_rows_twin(split_merge, qmode, mask, hsq):
    """Rows of 64 on the twin tile over the wide-row grid's rotation (every page size, split or
    one split)."""
    skip_off_sm90("the twin tile")
    tuning = with_merge(Tuning(), split_merge)
    pb = wide_problem(qmode, mask, hsq, "twin")
    key = DecodeKey.of(DTYPE_CODES[pb.dtype], DQK, mask == "causal", pb.policy(tuning), "sm_90a", tuning)
    assert key.twin and key.bm == 64, key.name
    if on_sm90():
        assert check_plan(pb, pb.plan(tuning, mask), tuning, mask == "causal") == key
    check(pb, tuning, mask)


@pytest.mark.parametrize("lengths", ["long", "short"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_twin_rerun(split_merge, dtype, mask, lengths):
    """The twin tile's rerun (H 128, SQ 1): in each request one head's query meets a key early in
    the request (the last tile a CTA takes) whose latent row is 4x that query, a score ~138 (log2)
    above the first tiles' maxima: P against the first pass's reference overflows fp32 (and f16
    long before), so only the rerun with the exact maxima gives a finite result. Split-KV (long:
    a spike in the first and in a middle split) and one split (short: 64 requests of 150-400
    keys, so that the spike lies past the first two tiles there too); the rerun carries the
    barrier phases on."""
    skip_off_sm90("the twin tile")
    tuning = with_merge(Tuning(), split_merge)
    lens = [2500, 1033, 300] if lengths == "long" else [400, 330, 257] + [150 + 4 * b for b in range(61)]
    pb = Problem(lens, 128, 64, dtype, stable_seed("twin-rerun", str(dtype), mask, lengths), sq=1,
                 max_seq_len=2600 if lengths == "long" else 400)
    assert (pb.policy().splits > 1) == (lengths == "long")
    for b, sk in enumerate(lens):
        head = (17 + 50 * b) % 128
        for j in ([5, 1100] if sk > 1100 else [5]):
            page = pb.live[b][j // pb.ps]
            pb.pool[page, j % pb.ps] = (4 * pb.q[b, 0, head].float()).to(dtype)
    key = DecodeKey.of(DTYPE_CODES[dtype], DQK, mask == "causal", pb.policy(tuning), "sm_90a", tuning)
    assert key.twin, key.name
    if on_sm90():
        assert check_plan(pb, pb.plan(tuning, mask), tuning, mask == "causal") == key
    check(pb, tuning, mask)


@pytest.mark.parametrize("out_dtype", [BF16, FP16, FP32])
def test_twin_epilogue_out_dtypes(split_merge, out_dtype):
    """The twin tile's two epilogues (H 128, SQ 2): with one split (64 requests) and 16-bit
    output its rows go through shared memory as 16-byte chunks, fp32 output and split-KV
    partials (2 requests) by store2; bmm scales on top."""
    skip_off_sm90("the twin tile")
    tuning = with_merge(Tuning(), split_merge)
    for lens in ([150 + 4 * b for b in range(64)], [3000, 77]):
        pb = Problem(lens, 128, 32, FP16, stable_seed("twin-out", str(out_dtype), len(lens)), sq=2,
                     max_seq_len=max(lens))
        assert (pb.policy().splits > 1) == (len(lens) == 2)
        assert DecodeKey.of("f16", DQK, True, pb.policy(tuning), "sm_90a", tuning).twin
        check(pb, tuning, "causal", out_dtype=out_dtype, bmm1_scale=0.7 * SCALE, bmm2_scale=1.5)


@pytest.mark.parametrize("out_dtype", [FP32, BF16])
def test_row_tile_engines_long_request_and_out_dtype(row_tile, split_merge, out_dtype):
    """One 131072-token request beside a 4-token one (H 16, SQ 2), bmm scales, output dtypes."""
    tuning = with_merge(row_tile[0], split_merge)
    pb = Problem([LONGEST, 4], 16, 64, BF16, stable_seed("swap-long", str(out_dtype)), sq=2, slack=0)
    check(pb, tuning, "causal", out_dtype=out_dtype, bmm1_scale=0.7 * SCALE, bmm2_scale=1.5)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("qmode", QMODES)
def test_every_page_size_both_ranks(split_merge, qmode, ps, rank):
    """Every page size with both cache ranks (H 16, SQ up to 3, split-KV), causal and dense."""
    pb = Problem([3, 17, 100, 257, 1033, 2500], 16, ps, BF16, stable_seed("pages", qmode, ps, rank), qmode=qmode,
                 sq=3, q_lens=[1, 3, 2, 3, 1, 2], rank=rank, kind="repeated" if ps == 64 else "perm",
                 max_seq_len=2600)
    assert pb.policy().splits > 1
    check(pb, split_merge, "causal")
    check(pb, split_merge, "dense")


# ----------------------------------------------------------------------------
# Split-KV and single-split policies, batch sizes, the long request
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [True, False], ids=["split_kv", "one_split"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("qmode", QMODES)
def test_split_policies(split_merge, qmode, mask, split):
    if split:  # few requests, long lengths
        lens, max_len = [20000, 4, 7777, 4096], 20000
    else:  # many requests (enough CTAs for the SMs), short lengths
        lens, max_len = [4 + (37 * i) % 250 for i in range(96)], 256
    B = len(lens)
    q_lens = [1 + i % 4 for i in range(B)]
    pb = Problem(lens, 32, 64, BF16, stable_seed("split", qmode, mask, split), qmode=qmode, sq=4, q_lens=q_lens,
                 max_seq_len_q=4, max_seq_len=max_len)
    pol = pb.policy()
    assert (pol.splits > 1) == split, pol
    check(pb, split_merge, mask)


@pytest.mark.parametrize("B", [1, 2, 64, 512])
@pytest.mark.parametrize("qmode", QMODES)
def test_batch_sizes(split_merge, B, qmode):
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(3, 700, (B,), generator=g).tolist()
    lens[0] = 3
    if B > 1:
        lens[-1] = 699
    q_lens = torch.randint(1, 4, (B,), generator=g).tolist()
    pb = Problem(lens, 16, 16, BF16, stable_seed("batch", B, qmode), qmode=qmode, sq=3, q_lens=q_lens,
                 max_seq_len_q=3, max_seq_len=700, kind="repeated" if B == 64 else "perm")
    check(pb, split_merge, "dense")
    check(pb, split_merge, "causal")


def test_one_request_of_131072_tokens(split_merge):
    """H 64, page 64, bf16: one 131072-token request beside a 4-token one (fixed SQ 4 and packed)."""
    lens = [LONGEST, 4]
    pb = Problem(lens, 64, 64, BF16, stable_seed("131072"), sq=4, slack=0)
    assert pb.policy().splits > 1
    check(pb, split_merge, "causal")
    check(pb, split_merge, "dense")
    del pb
    pk = Problem(lens[::-1], 64, 64, BF16, stable_seed("131072", "packed"), qmode="packed", q_lens=[1, 4],
                 max_seq_len_q=4, slack=0)
    check(pk, split_merge, "causal")
    del pk
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------
# Output dtypes, scales, strided query
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("lengths", ["long", "short"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_out_dtype_and_scales(split_merge, dtype, lengths, out_dtype):
    lens = LONG if lengths == "long" else SHORT
    pb = Problem(lens, 16, 32, dtype, stable_seed("odt", str(dtype), lengths, str(out_dtype)), qmode="packed",
                 q_lens=[1, 2, 1, 1, 1, 2][:len(lens)], max_seq_len=2600 if lengths == "long" else 127)
    tol = max(TOLERANCE[dtype], TOLERANCE[out_dtype])
    for bmm1, bmm2 in [(0.02, 1.7), (SCALE, 0.5), (0.1, 1.0)]:
        results, _ = check(pb, split_merge, "causal", out_dtype=out_dtype, bmm1_scale=bmm1, bmm2_scale=bmm2, tol=tol)
        assert all(out.dtype == out_dtype for _, out in results)
    # the functional forms (no out): the wrapper's run, and (default tuning) the standalone
    res = [("wrapper functional", pb.plan(split_merge, "causal", out_dtype).run(pb.q, pb.cache, bmm1_scale=SCALE))]
    if split_merge == STATIC:
        res.append(("standalone functional", pb.call(bmm1_scale=SCALE, out_dtype=out_dtype)))
    sync()
    for label, out in res:
        assert out.dtype == out_dtype and out.shape == pb.out_shape, label
    compare(pb, res, pb.ref("causal"), tol)
    # the defaults: causal, bmm1_scale 1.0, bmm2_scale 1.0, bfloat16 output
    w = BatchMLADecodePagedTSWrapper(tuning=split_merge)
    w.plan(pb.block_tables, pb.seq_lens, pb.h, KV_LORA_RANK, QK_ROPE_HEAD_DIM, pb.ps, qo_indptr=pb.qo_indptr,
           q_data_type=dtype, max_kv_len=pb.max_seq_len)
    res = [("wrapper defaults", w.run(pb.q, pb.cache))]
    if split_merge == STATIC:
        res.append(("standalone defaults", pb.call()))
    sync()
    for label, out in res:
        assert out.dtype == BF16, label
    compare(pb, res, pb.ref("causal", 1.0, 1.0), max(TOLERANCE[dtype], TOLERANCE[BF16]))


def test_strided_query(split_merge):
    """Query heads sliced out of a wider projection (token stride > H * 576)."""
    pb = Problem([2] + LONG[1:], 16, 16, BF16, stable_seed("strided"), sq=2, poison=False)  # causal: SQ <= Sk
    wide = torch.zeros(pb.B, 2, 20, DQK, dtype=BF16, device=DEVICE)
    wide[:, :, 2:18] = pb.q
    q = wide[:, :, 2:18]
    assert not q.is_contiguous()
    out = torch.full(pb.out_shape, NAN, dtype=BF16, device=DEVICE)
    assert pb.plan(split_merge).run(q, pb.cache, bmm1_scale=SCALE, out=out) is out
    results = [("wrapper", out)]
    if split_merge == STATIC:
        one = torch.full(pb.out_shape, NAN, dtype=BF16, device=DEVICE)
        pb.call(q=q, bmm1_scale=SCALE, out=one)
        results.append(("standalone", one))
    sync()
    compare(pb, results, pb.ref("causal"), TOLERANCE[BF16])


@pytest.mark.parametrize("h", [16, 128])
def test_plan_balances_uneven_lengths(h):
    """A plan of the default Tuning() reads its lengths: one request of 8192 keys beside fifteen
    of 100 launches balanced split-KV (H16, the swapped rows; H128, the twin on sm_90a, past its
    own bar: one of 32768 beside fifteen of 256), sixteen of one length the static split; each
    matches the reference (the one-shot, planned alike, too)."""
    long = 8192 if h == 16 else 32768
    for lens, balanced in (([long] + [100 if h == 16 else 256] * 15, True), ([long // 4] * 16, False)):
        pb = Problem(lens, h, 64, BF16, stable_seed("by-lengths", h, balanced))
        assert bool(pb.planned(Tuning()).balanced_split) == balanced
        results, ref = check(pb, Tuning())
        plan = pb.plan(Tuning())._plan
        assert bool(plan.static.tuning.balanced_split) == balanced
        if plan.launch is not None:
            assert plan.launch.key.balanced == balanced and (plan.launch.policy.balanced > 0) == balanced
        with chosen_splits() as got:
            one = batch_mla_decode_with_paged_kv_cache(pb.q, pb.cache, pb.block_tables, pb.seq_lens,
                                                       bmm1_scale=SCALE)
        assert [bool(t.balanced_split) for t in got] == [balanced]  # the one-shot's plan chose alike
        sync()
        compare(pb, [("one-shot", one)], ref, TOLERANCE[BF16])


def test_runs_after_the_first_take_new_addresses_scales_and_strides():
    """A plan's later runs whose operands are laid out as its last checked run's (the fast path,
    ``cuda.keys.Accepted``): new query, cache and out tensors and new scales give the
    reference; a query of other strides is checked and relaunched, and the contiguous one after
    it is right again; an out overlapping the cache, one of another dtype, or a misaligned one,
    is still refused."""
    pb = Problem([2] + LONG[1:], 16, 16, BF16, stable_seed("again"), sq=2)
    w = pb.plan(STATIC)
    for scales in ((SCALE, 1.0), (0.05, 1.0), (0.11, 0.7)):
        pb.q = torch.randn_like(pb.q)
        pb.cache = pb.cache.clone()
        out = torch.full(pb.out_shape, NAN, dtype=BF16, device=DEVICE)
        assert w.run(pb.q, pb.cache, bmm1_scale=scales[0], bmm2_scale=scales[1], out=out) is out
        sync()
        compare(pb, [(f"run, scales {scales}", out)], pb.ref("causal", *scales), TOLERANCE[BF16])
    wide = torch.zeros(pb.B, 2, 20, DQK, dtype=BF16, device=DEVICE)
    for label, q in (("strided query", wide[:, :, 2:18]), ("contiguous query", pb.q)):
        q.copy_(torch.randn_like(pb.q))
        pb.q = q
        out = w.run(q, pb.cache, bmm1_scale=SCALE)
        sync()
        compare(pb, [(label, out)], pb.ref("causal"), TOLERANCE[BF16])
    n = math.prod(pb.out_shape)
    with pytest.raises(ValueError, match="out must not overlap kv_cache"):
        w.run(pb.q, pb.cache, out=pb.cache.view(-1)[:n].view(pb.out_shape))
    with pytest.raises(ValueError, match="out_dtype"):
        w.run(pb.q, pb.cache, out=torch.empty(pb.out_shape, dtype=FP16, device=DEVICE))
    spare = torch.empty(n + 8, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(pb.q, pb.cache, out=spare[1:1 + n].view(pb.out_shape))


# ----------------------------------------------------------------------------
# Wrapper and one-shot
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("qmode", QMODES)
def test_wrapper_and_oneshot(split_merge, qmode, mask, rank):
    lens = [4, 33, 1000, 4097, 64]
    pb = Problem(lens, 128, 32, FP16, stable_seed("wrapper", qmode, mask, rank), qmode=qmode, sq=2,
                 q_lens=[4, 1, 2, 3, 1], rank=rank)
    ref = pb.ref(mask, 0.03, 1.3)
    w = BatchMLADecodePagedTSWrapper(tuning=split_merge)
    # packed: max_seq_len_q defaults to the largest count; fixed: SQ through max_seq_len_q (seq_len_q's alias)
    w.plan(pb.block_tables, pb.seq_lens, 128, KV_LORA_RANK, QK_ROPE_HEAD_DIM, 32, qo_indptr=pb.qo_indptr,
           max_seq_len_q=None if qmode == "packed" else 2, mask_type=mask, q_data_type=FP16, o_data_type=FP32)
    check_plan(pb, w, split_merge, mask == "causal")
    for validate in (True, False):
        out = torch.full(pb.out_shape, NAN, dtype=FP32, device=DEVICE)
        assert w.run(pb.q, pb.cache, bmm1_scale=0.03, bmm2_scale=1.3, out=out, validate=validate) is out
        sync()
        compare(pb, [(f"wrapper validate={validate}", out)], ref, TOLERANCE[FP16])
    res = w.run(pb.q, pb.cache, bmm1_scale=0.03, bmm2_scale=1.3)
    sync()
    assert res.dtype == FP32
    compare(pb, [("wrapper functional", res)], ref, TOLERANCE[FP16])
    one = batch_mla_decode_with_paged_kv_cache(pb.q, pb.cache, pb.block_tables, pb.seq_lens, qo_indptr=pb.qo_indptr,
                                               mask_type=mask, bmm1_scale=0.03, bmm2_scale=1.3, out_dtype=FP32)
    sync()
    compare(pb, [("one-shot", one)], ref, TOLERANCE[FP16])
    # a used page ID outside the cache: the one-shot refuses it, and so does run(validate=True) on the
    # bound table (both read the device metadata on the host)
    bad = pb.block_tables.clone()
    bad[1, 0] = pb.num_pages
    with pytest.raises(ValueError, match="block_tables"):
        batch_mla_decode_with_paged_kv_cache(pb.q, pb.cache, bad, pb.seq_lens, qo_indptr=pb.qo_indptr,
                                             mask_type=mask)
    saved = int(pb.block_tables[1, 0])
    pb.block_tables[1, 0] = pb.num_pages
    with mock.patch.object(PreparedDecode, "run", _must_not_launch), reference_must_not_run("batch_mla_decode"):
        with pytest.raises(ValueError, match="block_tables"):
            w.run(pb.q, pb.cache, bmm1_scale=0.03, bmm2_scale=1.3, validate=True)
    pb.block_tables[1, 0] = saved


def test_wrapper_bound_metadata_and_max_kv_len(split_merge):
    """A plan for max_kv_len above every request (the block table has the columns it needs) binds
    block_tables, seq_lens and qo_indptr: runs read their values changed in place (shorter
    lengths, pages moved elsewhere in the pool, queries moved between requests)."""
    ps = 64
    pb = Problem(LONG, 32, ps, BF16, stable_seed("bound"), qmode="packed", q_lens=[1, 2, 3, 4, 1, 2],
                 max_seq_len=8192)
    assert pb.block_tables.shape[1] >= 8192 // ps
    check(pb, split_merge, "causal")
    w = pb.plan(split_merge, "causal")
    out = torch.full(pb.out_shape, NAN, dtype=BF16, device=DEVICE)
    assert w.run(pb.q, pb.cache, bmm1_scale=SCALE, out=out) is out
    sync()
    compare(pb, [("planned", out)], pb.ref("causal"), TOLERANCE[BF16])
    # in place: every length halved (at least the request's queries), queries moved between
    # requests (the planned total, counts within the planned max_seq_len_q 4), pages moved
    new_lens = [max(1, n // 2) for n in LONG]
    new_q = [1, 2, 4, 3, 2, 1]
    assert sum(new_q) == sum(pb.q_lens) and max(new_q) <= pb.max_seq_len_q
    assert all(q <= n for q, n in zip(new_q, new_lens))
    pb.seq_lens.copy_(torch.tensor(new_lens, dtype=I32))
    pb.qo_indptr.copy_(torch.tensor(cumsum0(new_q), dtype=I32))
    pb.seq_lens_list, pb.q_lens = new_lens, new_q
    perm = torch.randperm(pb.num_pages, generator=torch.Generator().manual_seed(3))
    moved = torch.empty_like(pb.pool)
    moved[perm.to(DEVICE)] = pb.pool
    pb.pool.copy_(moved)
    live_cols = max(len(row) for row in pb.live)
    table = pb.block_tables[:, :live_cols].cpu()
    remapped = [[int(perm[int(table[b, c])]) if c < len(pb.live[b]) else int(table[b, c]) for c in range(live_cols)]
                for b in range(pb.B)]
    pb.block_tables[:, :live_cols] = torch.tensor(remapped, dtype=I32).to(DEVICE)
    ref = pb.ref("causal")
    for validate in (True, False):
        out.fill_(NAN)
        assert w.run(pb.q, pb.cache, bmm1_scale=SCALE, out=out, validate=validate) is out
        sync()
        compare(pb, [(f"changed in place, validate={validate}", out)], ref, TOLERANCE[BF16])


# ----------------------------------------------------------------------------
# Host checks that only apply to device tensors
# ----------------------------------------------------------------------------


def _must_not_launch(*args, **kwargs):
    raise AssertionError("the MLA kernel was launched although validation should have failed first")


@pytest.mark.parametrize("name", ["query", "kv_cache", "block_tables", "seq_lens", "out", "cpu_workspace"])
def test_workspace_overlap_and_device_refused(name):
    """The standalone's workspace must not share memory with any other argument, and lives on the device."""
    pb = Problem([20, 5], 8, 16, BF16, stable_seed("ws_overlap", name), slack=0, poison=False)
    assert pb.workspace.numel() <= 4096
    args = dict(query=pb.q, kv_cache=pb.cache, workspace_buffer=pb.workspace, kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=QK_ROPE_HEAD_DIM, block_tables=pb.block_tables, seq_lens=pb.seq_lens,
                max_seq_len=pb.max_seq_len)
    kw = {}
    nbytes = math.prod(pb.out_shape) * 2
    if name == "query":
        args["workspace_buffer"] = pb.q.view(-1).view(torch.uint8)
    elif name == "kv_cache":
        args["workspace_buffer"] = pb.pool.view(-1).view(torch.uint8)[:4096]
    elif name == "out":
        buf = torch.zeros(pb.workspace.numel() + nbytes, dtype=torch.uint8, device=DEVICE)
        args["workspace_buffer"] = buf[:pb.workspace.numel()]
        kw["out"] = buf[pb.workspace.numel() - 16:][:nbytes].view(BF16).view(pb.out_shape)
    elif name == "cpu_workspace":
        args["workspace_buffer"] = pb.workspace.to(HOST)
    else:
        buf = torch.zeros(8192, dtype=torch.uint8, device=DEVICE)
        meta = args[name]
        view = buf[:meta.numel() * 4].view(I32).view(meta.shape)
        view.copy_(meta)
        args[name] = view
        args["workspace_buffer"] = buf
    match = r"\bout\b|workspace_buffer" if name == "out" else "workspace_buffer"
    with mock.patch.object(PreparedDecode, "run", _must_not_launch), reference_must_not_run("batch_mla_decode"):
        with pytest.raises(ValueError, match=match):
            prims_ts_batch_decode_with_kv_cache_mla(*args.values(), **kw)
