"""batch_prefill_with_paged_kv_cache and BatchPrefillPagedTSWrapper on the GPU against the
float64 reference (issue 3's correctness grid).

Grid: page size 16/32/64/128 x mask (dense, causal, causal + window 0 and 100) x D 128/256
x GQA 1/4/8 x bf16/fp16; each cell runs three block tables (non-identity permutation,
IDs repeated across and within requests, padded row-strided view with garbage past the
used prefix) over requests whose K/V lengths are not page multiples, one of them 1033
tokens long. Tolerance: ``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16 against
``prims_ts.reference.batch_prefill_paged(..., compute_dtype=torch.float64)``; ``out``
is NaN-poisoned first and NaN never passes. Every pool slot that no request uses holds
NaN, so a kernel that reads past a request's length (or an unused page) fails.

Every compute test takes ``ring_variant`` (conftest: a ``prims_ts.Tuning`` of the producer
ring) and runs a ``BatchPrefillPagedTSWrapper`` planned with it over FlashInfer's CSR page
metadata built from the grid's block table (the planned kernel key must be the one
``PrefillKey.choose(..., paged=True, tuning=...)`` builds); under the first variant
(``loop0``, the one every device runs) the one-shot (the default tuning) runs the same cells
over the block table itself (padded, row-strided views included).

``DEVICE`` (and ``HOST``, the other device of the device checks) are module globals: a dry run
may set them to "cpu" (and "meta") and call the test functions with a Tuning directly.
"""
from __future__ import annotations

import math
from typing import Sequence
from unittest import mock

import pytest
import torch

import prims_ts
from prims_ts import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache
from prims_ts import reference as R
from prims_ts.cuda.catalog import RING_VARIANTS
from prims_ts.cuda.keys import device_limits
from prims_ts.cuda.prefill import PreparedPrefill, PrefillKey
from prims_ts.testing import TOLERANCE, assign_pages, cumsum0, reference_must_not_run, rel_err, stable_seed

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
HOST = "cpu"  # the device of the one misplaced tensor in the device checks
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
GARBAGE = (-1, 2**31 - 1, -2**31, 99999)
MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 100)]
KINDS = ("perm", "repeated", "padded")
# (q len, kv len) per request; kv lengths are not page multiples (except 1); dense adds Sq > Sk
REQUESTS = [(1, 1), (17, 17), (37, 100), (129, 129), (1000, 1033)]
DENSE_EXTRA = [(50, 20)]
MANY_REQUESTS_MAX_LEN = 400
# the ring variant whose cells also run the one-shot (the default tuning): every device runs it
ONESHOT_TUNING = RING_VARIANTS["loop0"]


def sync():
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def tables(kind: str, kv_lens: Sequence[int], ps: int, g: torch.Generator, extra_pages: int = 5):
    """CPU block table ([B, C], possibly a padded view) and the pool size for one table kind."""
    n_pages = [(sk + ps - 1) // ps for sk in kv_lens]
    B = len(kv_lens)
    P, rows = assign_pages(n_pages, "repeated" if kind == "repeated" else "perm", extra_pages, g)
    if kind == "padded":
        C = max(n_pages) + 3
        big = torch.empty(B, C + 7, dtype=I32)
        for b in range(B):
            big[b] = torch.tensor([GARBAGE[(b + c) % len(GARBAGE)] for c in range(C + 7)], dtype=I32)
            big[b, :n_pages[b]] = torch.tensor(rows[b], dtype=I32)
        table = big[:, :C]
    else:
        C = max(n_pages)
        table = torch.zeros(B, C, dtype=I32)
        for b in range(B):
            table[b, :n_pages[b]] = torch.tensor(rows[b], dtype=I32)
    return table, P


def used_slots(table: torch.Tensor, kv_lens: Sequence[int], ps: int, P: int) -> torch.Tensor:
    used = torch.zeros(P, ps, dtype=torch.bool)
    for b, sk in enumerate(kv_lens):
        j = torch.arange(sk)
        used[table[b, j // ps].long(), j % ps] = True
    return used


def make_problem(requests, hq, hkv, d, ps, dtype, kind, seed, poison=True):
    """Tables are built on the host (CPU generator), data on the device (device generator: fast)."""
    g = torch.Generator().manual_seed(seed)
    dg = torch.Generator(device=DEVICE).manual_seed(seed)
    q_lens = [r[0] for r in requests]
    kv_lens = [r[1] for r in requests]
    table, P = tables(kind, kv_lens, ps, g)
    q = torch.randn(sum(q_lens), hq, d, generator=dg, device=DEVICE).to(dtype)
    k = torch.randn(P, hkv, ps, d, generator=dg, device=DEVICE).to(dtype)
    v = torch.randn(P, hkv, ps, d, generator=dg, device=DEVICE).to(dtype)
    if poison:
        unused = ~used_slots(table, kv_lens, ps, P)
        mask = unused.to(DEVICE)[:, None, :, None].expand_as(k)
        k.masked_fill_(mask, NAN)
        v.masked_fill_(mask, NAN)
    if kind == "padded":  # keep the row stride of the view on the device
        big = table.as_strided((table.shape[0], table.stride(0)), (table.stride(0), 1)).to(DEVICE)
        bt = big[:, :table.shape[1]]
    else:
        bt = table.to(DEVICE)
    qo = torch.tensor(cumsum0(q_lens), dtype=I32, device=DEVICE)
    sl = torch.tensor(kv_lens, dtype=I32, device=DEVICE)
    return q, k, v, qo, bt, sl


def ref64(q, k, v, qo, bt, sl, **kw):
    return R.batch_prefill_paged(q, k, v, qo, bt, sl, compute_dtype=torch.float64, **kw)


def csr(bt: torch.Tensor, sl: torch.Tensor, ps: int):
    """FlashInfer's CSR page metadata (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
    of a block table's used prefix, on the table's device: request b's pages are
    bt[b, :ceil(sl[b] / ps)], its last page holds sl[b] - (pages - 1) * ps keys."""
    table, lens = bt.cpu(), sl.cpu().tolist()
    n = [(s + ps - 1) // ps for s in lens]
    indices = torch.cat([table[b, :n[b]] for b in range(len(lens))]).to(I32)
    last = [s - (nb - 1) * ps for s, nb in zip(lens, n)]
    assert all(1 <= x <= ps for x in last)
    return (torch.tensor(cumsum0(n), dtype=I32, device=bt.device), indices.to(bt.device),
            torch.tensor(last, dtype=I32, device=bt.device))


def check_key(w, dtype, d, mask, tuning):
    """The plan keeps `tuning`, and (on CUDA) its prepared launch is the paged kernel that
    PrefillKey.choose builds for it; on sm_90a that key takes the tuning's ring choices."""
    plan = w._plan
    assert plan.static.tuning == tuning and plan.static.paged
    assert plan.tuning_code == tuning.encode()
    arch = device_limits(plan.device)[0]
    key = PrefillKey.choose(dtype, d, mask, arch, paged=True, tuning=tuning, page_size=plan.static.page_size)
    assert key.paged
    if arch == "sm_90a" and tuning.portable:
        assert key.arch == 80, key.name  # the portable engine on a Hopper GPU
    elif arch == "sm_90a":
        assert key.arch == 90 and key.loop == tuning.loop_for(d) and key.copy_tpr == tuning.copy_for(d), key.name
        assert key.persistent == tuning.persistent, key.name
        assert (key.vpage > 0) == (tuning.page_major_v and key.tma and plan.static.page_size < key.bn), key.name
        assert key.kil == (tuning.page_major_k and key.tma and plan.static.page_size < key.bn), key.name
    if plan.launch is not None:
        assert plan.launch.key == key, (plan.launch.key.name, key.name)


def plan_wrapper(tuning, q, k, v, qo, bt, sl, ps, **kw) -> BatchPrefillPagedTSWrapper:
    """A wrapper planned with `tuning` over the CSR form of (bt, sl); `kw`: plan's keywords."""
    w = BatchPrefillPagedTSWrapper(tuning=tuning)
    w.plan(q, k, v, qo, *csr(bt, sl, ps), page_size=ps, **kw)
    check_key(w, q.dtype, q.shape[-1], kw.get("mask_type", "dense"), tuning)
    return w


def run_entries(tuning, q, k, v, qo, bt, sl, ps, *, out_dtype=None, **kw):
    """[(label, out)]: the wrapper planned with `tuning` (run into a NaN-poisoned out) and,
    under ONESHOT_TUNING, the one-shot over the block table (the default tuning) the same way."""
    odt = out_dtype or q.dtype
    w = plan_wrapper(tuning, q, k, v, qo, bt, sl, ps, out_dtype=out_dtype, **kw)
    out = torch.full(q.shape, NAN, dtype=odt, device=q.device)
    assert w.run(q, k, v, out=out) is out
    results = [("wrapper", out)]
    if tuning == ONESHOT_TUNING:
        one = torch.full(q.shape, NAN, dtype=odt, device=q.device)
        res = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, out_dtype=out_dtype, out=one,
                                                **kw)
        assert res is one
        results.append(("one-shot", one))
    sync()
    return results


def assert_close_to(results, ref, tol, qo=None, requests=None, what=""):
    """Each result against the reference, whole and (with qo) per request: a small request must
    not hide behind the 1033-token one."""
    qo_l = qo.tolist() if qo is not None else None
    for label, out in results:
        err = rel_err(out, ref)
        assert err <= tol, f"{label} {what}: rel err {err:.3e}"
        if qo_l is None:
            continue
        for b in range(len(qo_l) - 1):
            s = slice(qo_l[b], qo_l[b + 1])
            e = rel_err(out[s], ref[s])
            assert e <= tol, f"{label} {what}, request {b} {requests[b] if requests else ''}: rel err {e:.3e}"


# ----------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS, ids=[f"{m}{w if w >= 0 else ''}" for m, w in MASKS])
@pytest.mark.parametrize("ps", [16, 32, 64, 128])
def test_paged_grid(ring_variant, ps, mask, window, d, group, dtype):
    hkv = 2
    hq = hkv * group
    requests = REQUESTS + (DENSE_EXTRA if mask == "dense" else [])
    for kind in KINDS:
        seed = stable_seed(ps, mask, window, d, group, str(dtype), kind)
        q, k, v, qo, bt, sl = make_problem(requests, hq, hkv, d, ps, dtype, kind, seed)
        if kind == "padded":
            assert bt.stride(0) > bt.shape[1]
        results = run_entries(ring_variant, q, k, v, qo, bt, sl, ps, mask_type=mask, window_left=window)
        ref = ref64(q, k, v, qo, bt, sl, mask_type=mask, window_left=window)
        assert_close_to(results, ref, TOLERANCE[dtype], qo, requests, f"{kind} table")


# ----------------------------------------------------------------------------
# Output dtypes, scales, strides, many requests
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("ps", [16, 128])
def test_out_dtype_and_scales(ring_variant, ps, out_dtype):
    q, k, v, qo, bt, sl = make_problem([(300, 333), (5, 700), (64, 64)], 8, 2, 128, ps, BF16, "padded", seed=3)
    for sm_scale, output_scale in [(0.05, 1.7), (None, 0.5)]:
        kw = dict(mask_type="causal", sm_scale=sm_scale, output_scale=output_scale)
        ref = ref64(q, k, v, qo, bt, sl, **kw)
        results = run_entries(ring_variant, q, k, v, qo, bt, sl, ps, out_dtype=out_dtype, **kw)
        assert all(out.dtype == out_dtype for _, out in results)
        assert_close_to(results, ref, 2e-2, qo)
        # the functional forms (no out)
        w = plan_wrapper(ring_variant, q, k, v, qo, bt, sl, ps, out_dtype=out_dtype, **kw)
        res = [("wrapper functional", w.run(q, k, v))]
        if ring_variant == ONESHOT_TUNING:
            res.append(("one-shot functional", batch_prefill_with_paged_kv_cache(
                q, k, v, qo, bt, sl, page_size=ps, out_dtype=out_dtype, **kw)))
        sync()
        assert all(out.dtype == out_dtype and out.shape == q.shape for _, out in res)
        assert_close_to(res, ref, 2e-2)
    # the output dtype from out alone (the one-shot), or from the plan (the wrapper)
    ref = ref64(q, k, v, qo, bt, sl)
    results = run_entries(ring_variant, q, k, v, qo, bt, sl, ps, out_dtype=out_dtype)
    if ring_variant == ONESHOT_TUNING:
        out = torch.full(q.shape, NAN, dtype=out_dtype, device=DEVICE)
        assert batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, out=out) is out
        results.append(("one-shot, dtype of out", out))
    sync()
    assert_close_to(results, ref, 2e-2)


def test_strided_q_and_pools_from_combined_cache(ring_variant):
    """q sliced from a fused projection; K/V pools as the halves of one [P, 2, Hkv, ps, D] cache."""
    q0, k0, v0, qo, bt, sl = make_problem([(100, 257), (129, 129)], 4, 2, 128, 32, FP16, "perm", seed=4,
                                          poison=False)
    fused = torch.zeros(q0.shape[0], 8, 128, dtype=FP16, device=DEVICE)
    fused[:, 2:6] = q0
    q = fused[:, 2:6]
    combined = torch.stack([k0, v0], dim=1)
    k, v = combined[:, 0], combined[:, 1]
    assert not q.is_contiguous() and not k.is_contiguous()
    results = run_entries(ring_variant, q, k, v, qo, bt, sl, 32, mask_type="causal")
    assert_close_to(results, ref64(q0, k0, v0, qo, bt, sl, mask_type="causal"), TOLERANCE[FP16], qo)


def test_runs_after_the_first_take_new_addresses_and_strides():
    """A plan's later runs whose operands are laid out as its last checked run's (the fast path,
    ``cuda.keys.Accepted``): new q, pools and out give the reference; a strided q with pools
    from a combined cache (other strides) is checked and relaunched, and contiguous tensors
    after it are right again; an out overlapping q, or a misaligned one, is still refused."""
    q, k, v, qo, bt, sl = make_problem([(100, 257), (129, 129)], 4, 2, 128, 32, FP16, "perm", seed=31,
                                       poison=False)
    w = plan_wrapper(ONESHOT_TUNING, q, k, v, qo, bt, sl, 32, mask_type="causal")
    fused = torch.zeros(q.shape[0], 8, 128, dtype=FP16, device=DEVICE)
    combined = torch.zeros((k.shape[0], 2) + tuple(k.shape[1:]), dtype=FP16, device=DEVICE)
    for label in ("contiguous", "new tensors", "strided", "contiguous again"):
        if label == "strided":
            fused[:, 2:6] = torch.randn_like(q)
            combined.copy_(torch.randn_like(combined))
            q, k, v = fused[:, 2:6], combined[:, 0], combined[:, 1]
        elif label != "contiguous":
            q, k, v = (torch.randn_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        out = torch.full(q.shape, NAN, dtype=FP16, device=DEVICE)
        assert w.run(q, k, v, out=out) is out
        sync()
        assert_close_to([(label, out)], ref64(q, k, v, qo, bt, sl, mask_type="causal"), TOLERANCE[FP16], qo)
    with pytest.raises(ValueError, match="out must not overlap q"):
        w.run(q, k, v, out=q)
    spare = torch.empty(q.numel() + 8, dtype=FP16, device=DEVICE)
    with pytest.raises(ValueError, match="16-byte aligned"):
        w.run(q, k, v, out=spare[1:1 + q.numel()].view(q.shape))


@pytest.mark.parametrize("ps", [16, 64])
def test_many_requests(ring_variant, ps):
    """40 requests of random lengths (heavy-first work list over many items)."""
    g = torch.Generator().manual_seed(ps)
    requests = []
    for _ in range(40):
        sk = int(torch.randint(1, MANY_REQUESTS_MAX_LEN, (1,), generator=g))
        sq = int(torch.randint(1, sk + 1, (1,), generator=g))
        requests.append((sq, sk))
    q, k, v, qo, bt, sl = make_problem(requests, 8, 1, 128, ps, BF16, "repeated", seed=ps + 1)
    for mask, window in (("causal", -1), ("causal", 31), ("dense", -1)):
        results = run_entries(ring_variant, q, k, v, qo, bt, sl, ps, mask_type=mask, window_left=window)
        ref = ref64(q, k, v, qo, bt, sl, mask_type=mask, window_left=window)
        assert_close_to(results, ref, TOLERANCE[BF16], qo, requests, f"{mask}{window}")


def test_large_scores_no_overflow(ring_variant):
    q, k, v, qo, bt, sl = make_problem([(200, 500)], 4, 4, 128, 64, BF16, "perm", seed=5, poison=False)
    q, k = q * 8, k * 8
    results = run_entries(ring_variant, q, k, v, qo, bt, sl, 64)
    assert_close_to(results, ref64(q, k, v, qo, bt, sl), TOLERANCE[BF16])


# ----------------------------------------------------------------------------
# Wrapper: snapshot page metadata, bound qo_indptr (graph capture and replay:
# compile_tests/test_paged_compile.py)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [128, 256])
def test_wrapper_run_and_rewrites(ring_variant, d, dtype):
    ps = 32
    q, k, v, qo, bt, sl = make_problem([(100, 130), (1, 9), (300, 1100)], 8, 2, d, ps, dtype, "padded", seed=6,
                                       poison=False)
    ip, ids, last = csr(bt, sl, ps)
    w = BatchPrefillPagedTSWrapper("HND", tuning=ring_variant)
    w.plan(q, k, v, qo, ip, ids, last, page_size=ps, mask_type="causal")
    check_key(w, dtype, d, "causal", ring_variant)
    out = torch.full_like(q, NAN)
    assert w.run(q, k, v, out=out) is out
    sync()
    ref = ref64(q, k, v, qo, bt, sl, mask_type="causal")
    assert_close_to([("planned", out)], ref, TOLERANCE[dtype], qo)
    res = w.run(q, k, v)
    sync()
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    # the plan snapshot the page metadata: rewriting the caller's tensors changes nothing
    P = k.shape[0]
    g = torch.Generator().manual_seed(7)
    ids.copy_(torch.randint(0, P, tuple(ids.shape), generator=g, dtype=I32).to(ids.device))
    last.fill_(1)
    ip.copy_(torch.arange(ip.shape[0], dtype=I32).to(ip.device))
    out.fill_(NAN)
    w.run(q, k, v, out=out)
    sync()
    torch.testing.assert_close(out, res, rtol=0, atol=0)
    # qo_indptr stays bound: queries move between requests in place (the planned total, each
    # count within the planned longest 300, causal Sq <= Sk against the planned lengths 130/9/1100)
    qo.copy_(torch.tensor([0, 130, 139, 401], dtype=I32))
    out.fill_(NAN)
    w.run(q, k, v, out=out)
    sync()
    assert_close_to([("moved queries", out)], ref64(q, k, v, qo, bt, sl, mask_type="causal"), TOLERANCE[dtype], qo)
    # new page metadata takes a new plan
    C = bt.shape[1]
    bt2 = torch.randint(0, P, (3, C), generator=g, dtype=I32).to(DEVICE)
    sl2 = torch.tensor([min(C * ps, 1000), 60, 300], dtype=I32, device=DEVICE)
    w.plan(q, k, v, qo, *csr(bt2, sl2, ps), page_size=ps, mask_type="causal")
    check_key(w, dtype, d, "causal", ring_variant)
    out.fill_(NAN)
    assert w.run(q, k, v, out=out) is out
    sync()
    assert_close_to([("replanned", out)], ref64(q, k, v, qo, bt2, sl2, mask_type="causal"), TOLERANCE[dtype], qo)


# ----------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------


def _must_not_launch(*a, **k):
    raise AssertionError("the CUDA kernel was launched although validation should have failed first")


ONESHOT_MISPLACED = ["qo_indptr", "block_tables", "seq_lens_kv", "k_cache", "out"]
WRAPPER_MISPLACED = ["qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len", "k_cache", "out"]


@pytest.mark.parametrize("entry,which", [("oneshot", n) for n in ONESHOT_MISPLACED]
                         + [("wrapper", n) for n in WRAPPER_MISPLACED])
def test_cpu_tensor_with_cuda_call_is_refused(entry, which):
    """One tensor on the host, the rest on the GPU: refused (naming it) before any launch."""
    q, k, v, qo, bt, sl = make_problem([(5, 20), (3, 40)], 4, 2, 128, 16, BF16, "perm", seed=8)
    out = None
    if entry == "oneshot":
        args = dict(q=q, k_cache=k, v_cache=v, qo_indptr=qo, block_tables=bt, seq_lens_kv=sl)
    else:
        ip, ids, last = csr(bt, sl, 16)
        args = dict(q=q, k_cache=k, v_cache=v, qo_indptr=qo, paged_kv_indptr=ip, paged_kv_indices=ids,
                    paged_kv_last_page_len=last)
    if which == "out":
        out = torch.empty(q.shape, dtype=BF16, device=HOST)
    elif which == "k_cache":
        args["k_cache"], args["v_cache"] = k.to(HOST), v.to(HOST)
    else:
        args[which] = args[which].to(HOST)
    with mock.patch.object(PreparedPrefill, "run", _must_not_launch), reference_must_not_run("batch_prefill_paged"):
        with pytest.raises(ValueError, match=which):
            if entry == "oneshot":
                batch_prefill_with_paged_kv_cache(*args.values(), page_size=16, out=out)
            else:
                w = BatchPrefillPagedTSWrapper()
                w.plan(*args.values(), page_size=16)
                w.run(q, k, v, out=out)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(ring_variant):
    global DEVICE
    saved = DEVICE
    DEVICE = "cuda:1"
    try:
        q, k, v, qo, bt, sl = make_problem([(130, 140), (1, 300)], 8, 2, 128, 16, BF16, "padded", seed=9)
        assert q.device == torch.device(DEVICE)
        ref = ref64(q, k, v, qo, bt, sl, mask_type="causal")
        out = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, mask_type="causal")
        assert out.device == q.device
        assert rel_err(out, ref) <= TOLERANCE[BF16]
        w = plan_wrapper(ring_variant, q, k, v, qo, bt, sl, 16, mask_type="causal")
        res = w.run(q, k, v)
        assert res.device == q.device
        assert rel_err(res, ref) <= TOLERANCE[BF16]
    finally:
        DEVICE = saved


def test_sm_scale_default_is_inverse_sqrt_d():
    q, k, v, qo, bt, sl = make_problem([(64, 100)], 4, 2, 256, 16, FP16, "perm", seed=10)
    a = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, out_dtype=FP32)
    b = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, sm_scale=1.0 / math.sqrt(256),
                                          out_dtype=FP32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    w = plan_wrapper(prims_ts.Tuning(), q, k, v, qo, bt, sl, 16, out_dtype=FP32)
    torch.testing.assert_close(w.run(q, k, v), a, rtol=0, atol=0)  # the same kernel and problem
    assert prims_ts.batch_prefill_with_paged_kv_cache is batch_prefill_with_paged_kv_cache


def test_tma_maps_follow_the_pool():
    """The shared prepared launch of a TMA paged key (an op call) re-encodes its maps when the
    pool's page count changes (no static key holds it): pages past the first pool's count
    read their data, not the old map's zero fill."""
    from prims_ts.ops import _validate as V

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("TMA pages: an sm_90a key")
    g = torch.Generator().manual_seed(23)
    ps, hkv, d, lens = 16, 2, 128, [100, 37]
    qo = torch.tensor([0, 30, 50], dtype=torch.int32, device=DEVICE)
    q = torch.randn(50, 8, d, generator=g).to(torch.bfloat16).to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    for pool in (20, 60):
        k = torch.randn(pool, hkv, ps, d, generator=g).to(torch.bfloat16).to(DEVICE)
        v = torch.randn_like(k)
        table = torch.arange(pool - 14, pool, dtype=torch.int32, device=DEVICE).view(2, 7)  # the pool's last pages
        out = torch.ops.prims_ts.batch_prefill_paged(q, k, v, qo, table, sl, None, "causal", -1, d ** -0.5, 1.0, 30,
                                                     V.dtype_code(torch.bfloat16), "")
        ref = R.batch_prefill_paged(q, k, v, qo, table, sl, mask_type="causal", compute_dtype=torch.float64)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], pool
