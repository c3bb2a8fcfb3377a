"""Paged decode on the GPU against the float64 reference (issue 4's correctness grid):
``BatchDecodePagedTSWrapper``, ``prims_ts_batch_decode_with_kv_cache`` and the one-shot.

Grid: every Q mode (``[B, Hq, D]``, ``[B, SQ, Hq, D]`` with SQ 2..4, packed ``[T, Hq, D]`` +
``qo_indptr``) x mask (dense, causal, causal + window 0 and 37) x D 64/128/256 x GQA 1/4/8/32;
inside each (Q mode, mask) cell the page size (16/32/64/128), the cache form (combined
``[P, 2, Hkv, ps, D]`` or a ``(K, V)`` tuple), the dtype, the page-ID pattern (non-identity
permutation / IDs repeated across and within requests) and the length set (long: split-KV;
short: one split, both checked with ``prims_ts.cuda.decode.decode_policy``) rotate so that
every value of every axis appears. K/V lengths include 1 and are not page multiples. Further
tests: B from 1 to 512, one request of 131072 tokens, output dtypes and scales, the wrapper's
bound page IDs and the one-shot.

Every split merge: every compute test takes ``split_merge`` (conftest: the cluster and ticket merges,
balanced split-KV) and runs a ``BatchDecodePagedTSWrapper`` planned with it (the plan's policy and
kernel key must be the ones that tuning selects); under the default tuning (``Tuning()``) the
standalone ``prims_ts_batch_decode_with_kv_cache`` (always the default
tuning) runs the same problem too, over a CSR whose entries past each request's live pages
hold garbage page IDs (it only requires *live* IDs to index the cache; the wrapper's plan
checks every entry, so it gets the live pages only).

Tolerance: ``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16 against
``prims_ts.reference.batch_decode(..., compute_dtype=torch.float64)``, over the whole output
and per request; ``out`` is NaN-poisoned first and NaN never passes. Every cache slot that no
request uses holds NaN, so a kernel that reads past a request's length, or an unused page, fails.

``DEVICE`` (and ``HOST``, the other device of the device checks) are module globals: a dry run
may set them to "cpu" (and "meta") and call the test functions with a Tuning directly.
"""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from prims_ts import (
    BatchDecodePagedTSWrapper,
    Tuning,
    batch_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_workspace_size,
    prims_ts_batch_decode_with_kv_cache,
)
from prims_ts import reference as R
from prims_ts.cuda.decode import DecodeKey, PreparedDecode, balanced_by_lengths, balances, decode_policy
from prims_ts.cuda.keys import DTYPE_CODES, device_limits
from prims_ts.testing import (TOLERANCE, assign_pages, check_decode_cluster, check_decode_workspace, chosen_splits,
                              cumsum0, merged_in_cluster, reference_must_not_run, rel_err, stable_seed)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
HOST = "cpu"  # the device of the misplaced workspace in the device checks
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
# the standalone function's launch (it reads no lengths: the static split) and split_merge "cluster";
# a plan of the default Tuning() balances uneven lengths (test_plan_balances_uneven_lengths)
STATIC = Tuning(balanced_split=False)
GARBAGE = (-1, 2**31 - 1, -2**31, 99999)
MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 37)]
MASK_IDS = [f"{m}{w if w >= 0 else ''}" for m, w in MASKS]
QMODES = ["single", "fixed", "packed"]
DIMS = [64, 128, 256]
GROUPS = [1, 4, 8, 32]
PAGE_SIZES = [16, 32, 64, 128]
FORMS = ["combined", "tuple"]
# length sets: "long" forces split-KV, "short" (max_seq_len 127) runs one split for every D
LONG = [1, 17, 100, 257, 1033, 2500]
SHORT = [1, 17, 100, 127, 45]
Q_LENS = {"long": [1, 4, 2, 3, 1, 2], "short": [1, 4, 2, 3, 1]}
LONGEST = 131072  # test_one_request_of_131072_tokens


def sync():
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


class Problem:
    """A decode problem: CSR tables built on the host (CPU generator), data on the device.

    ``indptr``/``indices`` (the standalone's): live pages then garbage IDs per request;
    ``wr_indptr``/``wr_indices``/``last`` (the wrapper's FlashInfer CSR): the live pages only."""

    def __init__(self, seq_lens, hq, hkv, d, ps, dtype, seed, *, qmode="single", sq=1, q_lens=None,
                 max_seq_len_q=None, form="combined", kind="perm", slack=1, extra_pages=3, max_seq_len=None,
                 poison=True):
        g = torch.Generator().manual_seed(seed)
        dg = torch.Generator(device=DEVICE).manual_seed(seed)
        B = len(seq_lens)
        self.seq_lens_list, self.B = list(seq_lens), B
        self.hq, self.hkv, self.d, self.ps, self.dtype, self.qmode = hq, hkv, d, ps, dtype, qmode
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        P, live = assign_pages(n_live, kind, extra_pages, g)
        slack_of = [(slack + b) % 3 if slack else 0 for b in range(B)]
        indices = []
        for b in range(B):
            indices += live[b] + [GARBAGE[(b + i) % len(GARBAGE)] for i in range(slack_of[b])]
        self.num_pages = P
        self.indptr = torch.tensor(cumsum0([n + s for n, s in zip(n_live, slack_of)]), dtype=I32, device=DEVICE)
        self.indices = torch.tensor(indices, dtype=I32, device=DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=I32, device=DEVICE)
        self.wr_indptr = torch.tensor(cumsum0(n_live), dtype=I32, device=DEVICE)
        self.wr_indices = torch.tensor([p for row in live for p in row], dtype=I32, device=DEVICE)
        self.last = torch.tensor([sk - (n - 1) * ps for sk, n in zip(seq_lens, n_live)], dtype=I32, device=DEVICE)
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
        self.qo_indptr, self.seq_len_q = None, 1
        if qmode == "single":
            self.q_lens, self.max_seq_len_q = [1] * B, 1
            self.q = torch.randn(B, hq, d, generator=dg, device=DEVICE).to(dtype)
        elif qmode == "fixed":
            self.q_lens, self.seq_len_q, self.max_seq_len_q = [sq] * B, sq, sq
            self.q = torch.randn(B, sq, hq, d, generator=dg, device=DEVICE).to(dtype)
        else:
            self.q_lens = list(q_lens)
            self.qo_indptr = torch.tensor(cumsum0(q_lens), dtype=I32, device=DEVICE)
            self.max_seq_len_q = max_seq_len_q or max(q_lens)
            self.q = torch.randn(sum(q_lens), hq, d, generator=dg, device=DEVICE).to(dtype)
        self.max_seq_len = max_seq_len or max(seq_lens)
        nbytes = get_prims_ts_batch_decode_workspace_size(B, hq, hkv, d, ps, self.max_seq_len, **self.q_mode(),
                                                          q_dtype=dtype, device=DEVICE)
        self.workspace = torch.zeros(nbytes, dtype=torch.uint8, device=DEVICE)

    def q_mode(self) -> dict:
        """The query-mode keywords of the workspace size, the standalone call and the plan."""
        if self.qmode == "fixed":
            return dict(seq_len_q=self.seq_len_q)
        if self.qmode == "packed":
            return dict(qo_indptr=self.qo_indptr, max_seq_len_q=self.max_seq_len_q)
        return {}

    def planned(self, tuning):
        """The tuning a plan of `tuning` launches for this problem: balanced split-KV where the
        default leaves it to the plan's lengths and they are uneven (balanced_by_lengths)."""
        arch, sms, limit = device_limits(DEVICE)
        return balanced_by_lengths(tuning, np.asarray(self.seq_lens_list), self.B, self.hkv, self.hq // self.hkv,
                                   self.max_seq_len_q, self.d, self.max_seq_len, sms, limit, arch)

    def policy(self, tuning=None):
        """The static policy of the problem, or (`tuning`) the one its plans take."""
        _, sms, limit = device_limits(DEVICE)
        balance = balances(tuning) if tuning else 0
        return decode_policy(self.B, self.hkv, self.hq // self.hkv, self.max_seq_len_q, self.d, self.max_seq_len,
                             sms, limit, balance)

    def call(self, **kw):
        """The standalone function (the default tuning)."""
        return prims_ts_batch_decode_with_kv_cache(self.q, self.cache, self.workspace, self.indptr, self.indices,
                                                   self.seq_lens, self.max_seq_len, **self.q_mode(), **kw)

    def plan(self, tuning, mask_type="dense", window_left=-1, out_dtype=None) -> BatchDecodePagedTSWrapper:
        """A wrapper planned with `tuning` for the standalone's static problem (max_kv_len =
        max_seq_len, the same max_seq_len_q: the same policy)."""
        w = BatchDecodePagedTSWrapper("HND", tuning=tuning)
        w.plan(self.wr_indptr, self.wr_indices, self.last, self.hq, self.hkv, self.d, self.ps, **self.q_mode(),
               q_data_type=self.dtype, kv_data_type=self.dtype, o_data_type=out_dtype, mask_type=mask_type,
               window_left=window_left, max_kv_len=self.max_seq_len)
        check_plan(self, w, tuning, mask_type == "causal")
        return w

    def ref(self, mask_type="dense", window_left=-1, bmm1_scale=None, bmm2_scale=1.0):
        return R.batch_decode(self.q, self.k, self.v, self.indptr, self.indices, self.seq_lens,
                              qo_indptr=self.qo_indptr, mask_type=mask_type, window_left=window_left,
                              sm_scale=bmm1_scale, output_scale=bmm2_scale, compute_dtype=torch.float64)

    def request_slices(self):
        if self.qmode == "packed":
            qo = cumsum0(self.q_lens)
            return [slice(qo[b], qo[b + 1]) for b in range(self.B)]
        return [slice(b, b + 1) for b in range(self.B)]


def check_plan(pb: Problem, w, tuning, causal: bool) -> None:
    """The plan keeps `tuning` (balanced by its lengths: Problem.planned); on CUDA its prepared
    launch has the problem's policy, the key that DecodeKey.of builds for that policy and tuning,
    and the tuning's split merge."""
    plan = w._plan
    tuning = pb.planned(tuning)
    assert plan.static.tuning == tuning and plan.tuning_code == tuning.encode()
    arch = device_limits(plan.device)[0]
    pol = pb.policy(tuning)
    key = DecodeKey.of(DTYPE_CODES[pb.dtype], pb.d, causal, pol, arch, tuning)
    if plan.launch is not None:
        assert plan.launch.key == key, (plan.launch.key.name, key.name)
        check_decode_cluster(plan, key, tuning, pol)


def compare(pb: Problem, results, ref, tol) -> None:
    for label, out in results:
        err = rel_err(out, ref)
        assert err <= tol, f"{label}: rel err {err:.3e}"
        for b, s in enumerate(pb.request_slices()):
            e = rel_err(out[s], ref[s])
            assert e <= tol, f"{label}, request {b} (len {pb.seq_lens_list[b]}, q {pb.q_lens[b]}): rel err {e:.3e}"


def check(pb: Problem, tuning, mask="dense", window=-1, out_dtype=None, bmm1_scale=None, bmm2_scale=1.0, tol=None):
    """Run into NaN-poisoned outs (the wrapper planned with `tuning`; under the default tuning the
    standalone function too); compare with the float64 reference, whole and per request.
    Returns ([(label, out)], ref)."""
    odt = out_dtype or pb.dtype
    w = pb.plan(tuning, mask, window, out_dtype)
    out = torch.full(pb.q.shape, NAN, dtype=odt, device=DEVICE)
    assert w.run(pb.q, pb.cache, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=out) is out
    results = [("wrapper", out)]
    if tuning == STATIC:
        one = torch.full(pb.q.shape, NAN, dtype=odt, device=DEVICE)
        res = pb.call(mask_type=mask, window_left=window, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, out=one,
                      out_dtype=out_dtype)
        assert res is one
        results.append(("standalone", one))
    sync()
    launch = w._plan.launch
    if tuning == STATIC and launch is not None and launch.policy.splits > 1:
        # the standalone's policy and launch shape are the wrapper's
        check_decode_workspace(pb.workspace, merged_in_cluster(launch))
    ref = pb.ref(mask, window, bmm1_scale, bmm2_scale)
    compare(pb, results, ref, tol or TOLERANCE[pb.dtype])
    return results, ref


# ----------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------


def grid_cell(qmode, mask, window, d, group):
    """The rotated axes of one grid test: page size, form, dtype, page-ID kind, length set, SQ."""
    cell = QMODES.index(qmode) * 4 + MASKS.index((mask, window))
    j = DIMS.index(d) * 4 + GROUPS.index(group)  # 0..11 inside the cell
    return dict(ps=PAGE_SIZES[(j + cell) % 4], form=FORMS[(j + j // 4) % 2], dtype=(BF16, FP16)[(j + cell) % 2],
                kind=("perm", "repeated")[(j // 2 + cell) % 2], lengths=("long", "short")[(j + j // 4 + cell) % 2],
                sq=2 + (j + cell) % 3)


def test_grid_rotation_covers_every_axis():
    """Inside every (Q mode, mask) cell every page size, form, dtype, kind and length set appears."""
    for qmode in QMODES:
        for mask, window in MASKS:
            cells = [grid_cell(qmode, mask, window, d, g) for d in DIMS for g in GROUPS]
            for key, values in (("ps", PAGE_SIZES), ("form", FORMS), ("dtype", [BF16, FP16]),
                                ("kind", ["perm", "repeated"]), ("lengths", ["long", "short"])):
                assert {c[key] for c in cells} == set(values), (qmode, mask, window, key)


@pytest.mark.parametrize("group", GROUPS, ids=[f"gqa{g}" for g in GROUPS])
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("mask,window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("qmode", QMODES)
def test_decode_grid(split_merge, qmode, mask, window, d, group):
    c = grid_cell(qmode, mask, window, d, group)
    hkv = 1 if group == 32 else 2
    lens = list(LONG if c["lengths"] == "long" else SHORT)
    if qmode == "fixed" and mask == "causal":
        lens[0] = c["sq"]  # causal: every request's query count <= its length
    q_lens = Q_LENS[c["lengths"]]
    max_len = 2600 if c["lengths"] == "long" else 127
    pb = Problem(lens, group * hkv, hkv, d, c["ps"], c["dtype"], stable_seed(qmode, mask, window, d, group),
                 qmode=qmode, sq=c["sq"], q_lens=q_lens, max_seq_len_q=max(q_lens) + (d == 128), form=c["form"],
                 kind=c["kind"], max_seq_len=max_len)
    pol = pb.policy()
    assert (pol.splits > 1) == (c["lengths"] == "long"), pol
    check(pb, split_merge, mask, window)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_both_cache_forms_every_page_size(split_merge, ps, form):
    """Every page size with both cache forms (GQA 8, D 128, packed causal + window, split-KV)."""
    pb = Problem(LONG, 16, 2, 128, ps, BF16, stable_seed("forms", ps, form), qmode="packed", q_lens=Q_LENS["long"],
                 form=form, kind="repeated" if ps == 64 else "perm")
    assert pb.policy().splits > 1
    check(pb, split_merge, "causal", 300)


# ----------------------------------------------------------------------------
# Split-KV and single-split policies
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [True, False], ids=["split_kv", "one_split"])
@pytest.mark.parametrize("mask,window", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("qmode", QMODES)
def test_split_policies(split_merge, qmode, mask, window, split):
    if split:  # few requests, long lengths
        lens, max_len = [20000, 1, 7777, 4096], 20000
    else:  # many requests (enough CTAs for the SMs), short lengths
        lens, max_len = [1 + (37 * i) % 250 for i in range(96)], 256
    B = len(lens)
    q_lens = [1 + i % 4 for i in range(B)]
    if mask == "causal":
        lens = [max(sk, ql, 4) for sk, ql in zip(lens, q_lens)]
    pb = Problem(lens, 32, 8, 128, 64, BF16, stable_seed("split", qmode, mask, window, split), qmode=qmode, sq=4,
                 q_lens=q_lens, max_seq_len_q=4, max_seq_len=max_len, kind="perm")
    pol = pb.policy()
    if split:
        assert pol.splits > 1, pol
    else:
        assert pol.splits == 1, pol
    check(pb, split_merge, mask, window)


# ----------------------------------------------------------------------------
# Batch sizes, the 131072-token request
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 2, 64, 512])
@pytest.mark.parametrize("qmode", ["single", "packed"])
def test_batch_sizes(split_merge, B, qmode):
    g = torch.Generator().manual_seed(B)
    lens = torch.randint(1, 700, (B,), generator=g).tolist()
    lens[0] = 1
    if B > 1:
        lens[-1] = 699
    q_lens = torch.randint(1, 4, (B,), generator=g).tolist()
    pb = Problem(lens, 16, 2, 128, 16, BF16, stable_seed("batch", B, qmode), qmode=qmode, q_lens=q_lens,
                 max_seq_len_q=3, max_seq_len=700, kind="repeated" if B == 64 else "perm")
    check(pb, split_merge, "dense")
    # causal: every request's query count <= its length
    lens_c = [max(sk, ql) for sk, ql in zip(lens, q_lens)] if qmode == "packed" else lens
    pb = Problem(lens_c, 16, 2, 128, 16, BF16, stable_seed("batch", B, qmode, "causal"), qmode=qmode, q_lens=q_lens,
                 max_seq_len_q=3, max_seq_len=700)
    check(pb, split_merge, "causal", 64)


def test_one_request_of_131072_tokens(split_merge):
    """D 128, GQA 4 (Hq 4, Hkv 1), page 64, bf16: one 131072-token request beside a 1-token one."""
    lens = [LONGEST, 1]
    pb = Problem(lens, 4, 1, 128, 64, BF16, stable_seed("131072"), qmode="single", slack=0)
    assert pb.policy().splits > 1
    check(pb, split_merge, "dense")
    check(pb, split_merge, "causal", 5000)
    del pb
    pk = Problem(lens[::-1], 4, 1, 128, 64, BF16, stable_seed("131072", "packed"), qmode="packed", q_lens=[1, 4],
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
    pb = Problem(lens, 8, 2, 128, 32, dtype, stable_seed("odt", str(dtype), lengths, str(out_dtype)), qmode="packed",
                 q_lens=Q_LENS[lengths], max_seq_len=2600 if lengths == "long" else 127)
    tol = max(TOLERANCE[dtype], TOLERANCE[BF16] if out_dtype == BF16 else TOLERANCE[FP16])
    for bmm1, bmm2 in [(0.05, 1.7), (None, 0.5), (0.3, 1.0)]:
        results, _ = check(pb, split_merge, "causal", -1, out_dtype=out_dtype, bmm1_scale=bmm1, bmm2_scale=bmm2,
                           tol=tol)
        assert all(out.dtype == out_dtype for _, out in results)
    # the functional forms (no out): the wrapper's run, and (default tuning) the standalone
    res = [("wrapper functional", pb.plan(split_merge, "causal", out_dtype=out_dtype).run(pb.q, pb.cache))]
    if split_merge == STATIC:
        res.append(("standalone functional", pb.call(mask_type="causal", out_dtype=out_dtype)))
    sync()
    for label, out in res:
        assert out.dtype == out_dtype and out.shape == pb.q.shape, label
    compare(pb, res, pb.ref("causal"), tol)


def test_strided_query(split_merge):
    """Query heads sliced out of a fused projection (head stride > D)."""
    pb = Problem(LONG, 8, 2, 128, 16, BF16, stable_seed("strided"), poison=False)
    fused = torch.zeros(pb.B, 12, 128, dtype=BF16, device=DEVICE)
    fused[:, 2:10] = pb.q
    q = fused[:, 2:10]
    assert not q.is_contiguous()
    w = pb.plan(split_merge, "causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device=DEVICE)
    assert w.run(q, pb.cache, out=out) is out
    results = [("wrapper", out)]
    if split_merge == STATIC:
        one = torch.full(pb.q.shape, NAN, dtype=BF16, device=DEVICE)
        prims_ts_batch_decode_with_kv_cache(q, pb.cache, pb.workspace, pb.indptr, pb.indices, pb.seq_lens,
                                            pb.max_seq_len, mask_type="causal", out=one)
        results.append(("standalone", one))
    sync()
    compare(pb, results, pb.ref("causal"), TOLERANCE[BF16])


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", 37)], ids=["dense", "causal_w37"])
def test_plan_balances_uneven_lengths(mask, window):
    """A plan of the default Tuning() reads its lengths: one request of 8192 keys beside seven of
    64 launches balanced split-KV over the resident slots (its key and workspace), eight of 8192
    the static split; both match the reference (the one-shot, planned alike, too)."""
    for lens, balanced in (([8192] + [64] * 7, True), ([8192] * 8, False)):
        pb = Problem(lens, 8, 2, 128, 32, BF16, stable_seed("by-lengths", mask, balanced), qmode="single")
        assert bool(pb.planned(Tuning()).balanced_split) == balanced
        results, ref = check(pb, Tuning(), mask, window)
        plan = pb.plan(Tuning(), mask, window)._plan
        assert bool(plan.static.tuning.balanced_split) == balanced
        if plan.launch is not None:
            assert plan.launch.key.balanced == balanced and (plan.launch.policy.balanced > 0) == balanced
        with chosen_splits() as got:
            one = batch_decode_with_paged_kv_cache(pb.q, pb.cache, pb.wr_indptr, pb.wr_indices, pb.last,
                                                   mask_type=mask, window_left=window)
        assert [bool(t.balanced_split) for t in got] == [balanced]  # the one-shot's plan chose alike
        sync()
        compare(pb, [("one-shot", one)], ref, TOLERANCE[BF16])


@pytest.mark.parametrize("form", FORMS)
def test_runs_after_the_first_take_new_addresses_scales_and_strides(form):
    """A plan's later runs whose operands are laid out as its last checked run's (the fast path,
    ``cuda.keys.Accepted``): new q, cache and out tensors and new scales give the reference; a
    query of other strides is checked and relaunched, and the contiguous one after it is right
    again; an out overlapping q, or a misaligned one, is still refused."""
    pb = Problem(LONG, 8, 2, 128, 16, BF16, stable_seed("again", form), form=form)
    w = pb.plan(STATIC, "causal")
    for scales in ((None, 1.0), (0.05, 1.0), (0.11, 0.7)):
        pb.q = torch.randn_like(pb.q)
        if form == "combined":
            pb.cache = pb.cache.clone()
            pb.k, pb.v = pb.cache[:, 0], pb.cache[:, 1]
        else:
            pb.k, pb.v = pb.k.clone(), pb.v.clone()
            pb.cache = (pb.k, pb.v)
        out = torch.full(pb.q.shape, NAN, dtype=BF16, device=DEVICE)
        assert w.run(pb.q, pb.cache, bmm1_scale=scales[0], bmm2_scale=scales[1], out=out) is out
        sync()
        compare(pb, [(f"run, scales {scales}", out)], pb.ref("causal", -1, *scales), TOLERANCE[BF16])
    fused = torch.zeros(pb.B, 12, 128, dtype=BF16, device=DEVICE)
    for label, q in (("strided q", fused[:, 2:10]), ("contiguous q", pb.q)):
        q.copy_(torch.randn_like(pb.q))
        pb.q = q
        out = w.run(q, pb.cache)
        sync()
        compare(pb, [(label, out)], pb.ref("causal"), TOLERANCE[BF16])
    with pytest.raises(ValueError, match="out must not overlap q"):
        w.run(pb.q, pb.cache, out=pb.q)
    spare = torch.empty(pb.q.numel() + 8, dtype=BF16, device=DEVICE)
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(pb.q, pb.cache, out=spare[1:1 + pb.q.numel()].view(pb.q.shape))


def test_launch_from_a_thread_without_a_current_context():
    """A planned run from a fresh thread (no CUDA context current there yet) launches in the
    plan's context, and leaves the thread as it found it."""
    import threading

    pb = Problem(LONG, 8, 2, 128, 16, BF16, stable_seed("thread"))
    w = pb.plan(STATIC, "causal")
    w.run(pb.q, pb.cache)
    results = {}

    def body():
        try:
            results["out"] = w.run(pb.q, pb.cache)
            torch.cuda.synchronize()
        except BaseException as e:  # re-raised on the test's thread
            results["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in results:
        raise results["error"]
    compare(pb, [("run on a new thread", results["out"])], pb.ref("causal"), TOLERANCE[BF16])


# ----------------------------------------------------------------------------
# Wrapper (bound page IDs) and one-shot
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mask,window", MASKS, ids=MASK_IDS)
def test_wrapper_and_oneshot(split_merge, mask, window, form):
    lens = [1, 33, 1000, 4097, 64]
    ps = 32
    pb = Problem(lens, 32, 8, 128, ps, FP16, stable_seed("wrapper", mask, window, form), form=form, slack=0)
    w = BatchDecodePagedTSWrapper(tuning=split_merge)
    # max_kv_len defaults to the longest request
    w.plan(pb.wr_indptr, pb.wr_indices, pb.last, 32, 8, 128, ps, mask_type=mask, window_left=window,
           q_data_type=FP16, o_data_type=FP32)
    check_plan(pb, w, split_merge, mask == "causal")
    ref = pb.ref(mask, window, 0.07, 1.3)
    out = torch.full(pb.q.shape, NAN, dtype=FP32, device=DEVICE)
    assert w.run(pb.q, pb.cache, bmm1_scale=0.07, bmm2_scale=1.3, out=out) is out
    sync()
    compare(pb, [("wrapper", out)], ref, TOLERANCE[FP16])
    res = w.run(pb.q, pb.cache, bmm1_scale=0.07, bmm2_scale=1.3)
    sync()
    assert res.dtype == FP32
    compare(pb, [("wrapper functional", res)], ref, TOLERANCE[FP16])
    # the one-shot: its own plan, the default tuning
    one = batch_decode_with_paged_kv_cache(pb.q, pb.cache, pb.wr_indptr, pb.wr_indices, pb.last, mask_type=mask,
                                           window_left=window, bmm1_scale=0.07, bmm2_scale=1.3, out_dtype=FP32)
    sync()
    compare(pb, [("one-shot", one)], ref, TOLERANCE[FP16])
    # paged_kv_indices stays bound: move every page elsewhere in the pool and remap the IDs in place
    perm = torch.randperm(pb.num_pages, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    if form == "combined":
        moved = torch.empty_like(pb.cache)
        moved[perm.long()] = pb.cache
        k2, v2, cache2 = moved[:, 0], moved[:, 1], moved
    else:
        k2, v2 = torch.empty_like(pb.k), torch.empty_like(pb.v)
        k2[perm.long()], v2[perm.long()] = pb.k, pb.v
        cache2 = (k2, v2)
    pb.wr_indices.copy_(perm[pb.wr_indices.long()].to(I32))
    out.fill_(NAN)
    assert w.run(pb.q, cache2, bmm1_scale=0.07, bmm2_scale=1.3, out=out) is out
    sync()
    ref2 = R.batch_decode(pb.q, k2, v2, pb.wr_indptr, pb.wr_indices, pb.seq_lens, mask_type=mask, window_left=window,
                          sm_scale=0.07, output_scale=1.3, compute_dtype=torch.float64)
    compare(pb, [("wrapper, remapped pages", out)], ref2, TOLERANCE[FP16])


# ----------------------------------------------------------------------------
# Host checks that only apply to device tensors
# ----------------------------------------------------------------------------


def _must_not_launch(*args, **kwargs):
    raise AssertionError("the decode kernel was launched although validation should have failed first")


@pytest.mark.parametrize("name", ["query", "kv_cache", "paged_kv_indptr", "paged_kv_indices", "seq_lens", "out",
                                  "cpu_workspace"])
def test_workspace_overlap_and_device_refused(name):
    """The standalone's workspace must not share memory with any other argument (seed 003), and
    lives on the device."""
    pb = Problem([20, 5], 8, 2, 128, 16, BF16, stable_seed("ws_overlap", name), slack=0, poison=False)
    assert pb.workspace.numel() <= 4096
    args = dict(query=pb.q, kv_cache=pb.cache, workspace_buffer=pb.workspace, paged_kv_indptr=pb.indptr,
                paged_kv_indices=pb.indices, seq_lens=pb.seq_lens, max_seq_len=pb.max_seq_len)
    kw = {}
    if name == "query":
        args["workspace_buffer"] = pb.q.view(-1).view(torch.uint8)
    elif name == "kv_cache":
        args["workspace_buffer"] = pb.cache.view(-1).view(torch.uint8)[:4096]
    elif name == "out":
        buf = torch.zeros(pb.workspace.numel() + pb.q.numel() * 2, dtype=torch.uint8, device=DEVICE)
        args["workspace_buffer"] = buf[:pb.workspace.numel()]
        kw["out"] = buf[pb.workspace.numel() - 16:][:pb.q.numel() * 2].view(BF16).view(pb.q.shape)
    elif name == "cpu_workspace":
        args["workspace_buffer"] = pb.workspace.to(HOST)
    else:
        buf = torch.zeros(8192, dtype=torch.uint8, device=DEVICE)
        meta = args[name]
        view = buf[:meta.numel() * 4].view(I32)
        view.copy_(meta)
        args[name] = view
        args["workspace_buffer"] = buf
    match = r"\bout\b|workspace_buffer" if name == "out" else "workspace_buffer"
    with mock.patch.object(PreparedDecode, "run", _must_not_launch), reference_must_not_run("batch_decode"):
        with pytest.raises(ValueError, match=match):
            prims_ts_batch_decode_with_kv_cache(*args.values(), **kw)
