"""batch_prefill_with_paged_kv_cache on the GPU against the float64 reference (issue 3's correctness grid).

Grid: page size 16/32/64/128 x mask (dense, causal, causal + window 0 and 100) x D 128/256
x GQA 1/4/8 x bf16/fp16; each cell runs three block tables (non-identity permutation,
IDs repeated across and within requests, padded row-strided view with garbage past the
used prefix) over requests whose K/V lengths are not page multiples, one of them 1033
tokens long. Tolerance: ``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16 against
``prims_ts.reference.batch_prefill_paged(..., compute_dtype=torch.float64)``; ``out``
is NaN-poisoned first and NaN never passes. Every pool slot that no request uses holds
NaN, so a kernel that reads past a request's length (or an unused page) fails.
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
from prims_ts.testing import TOLERANCE, assign_pages, cumsum0, rel_err, stable_seed

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ring_variant")]  # every producer-ring variant

DEVICE = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
GARBAGE = (-1, 2**31 - 1, -2**31, 99999)
MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 100)]
KINDS = ("perm", "repeated", "padded")
# (q len, kv len) per request; kv lengths are not page multiples (except 1); dense adds Sq > Sk
REQUESTS = [(1, 1), (17, 17), (37, 100), (129, 129), (1000, 1033)]
DENSE_EXTRA = [(50, 20)]


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


# ----------------------------------------------------------------------------
# The grid
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS, ids=[f"{m}{w if w >= 0 else ''}" for m, w in MASKS])
@pytest.mark.parametrize("ps", [16, 32, 64, 128])
def test_paged_grid(ps, mask, window, d, group, dtype):
    hkv = 2
    hq = hkv * group
    requests = REQUESTS + (DENSE_EXTRA if mask == "dense" else [])
    for i, kind in enumerate(KINDS):
        seed = stable_seed(ps, mask, window, d, group, str(dtype), kind)
        q, k, v, qo, bt, sl = make_problem(requests, hq, hkv, d, ps, dtype, kind, seed)
        if kind == "padded":
            assert bt.stride(0) > bt.shape[1]
        out = torch.full_like(q, NAN)
        res = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, mask_type=mask,
                                                window_left=window, out=out)
        assert res is out
        torch.cuda.synchronize()
        ref = ref64(q, k, v, qo, bt, sl, mask_type=mask, window_left=window)
        err = rel_err(out, ref)
        assert err <= TOLERANCE[dtype], f"{kind} table: rel err {err:.3e}"
        # per request too: a small request must not hide behind the 1033-token one
        qo_l = qo.tolist()
        for b in range(len(requests)):
            s = slice(qo_l[b], qo_l[b + 1])
            e = rel_err(out[s], ref[s])
            assert e <= TOLERANCE[dtype], f"{kind} table, request {b} {requests[b]}: rel err {e:.3e}"


# ----------------------------------------------------------------------------
# Output dtypes, scales, strides, many requests
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [FP32, FP16, BF16])
@pytest.mark.parametrize("ps", [16, 128])
def test_out_dtype_and_scales(ps, out_dtype):
    q, k, v, qo, bt, sl = make_problem([(300, 333), (5, 700), (64, 64)], 8, 2, 128, ps, BF16, "padded", seed=3)
    for sm_scale, output_scale in [(0.05, 1.7), (None, 0.5)]:
        res = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, mask_type="causal",
                                                sm_scale=sm_scale, output_scale=output_scale, out_dtype=out_dtype)
        assert res.dtype == out_dtype and res.shape == q.shape
        ref = ref64(q, k, v, qo, bt, sl, mask_type="causal", sm_scale=sm_scale, output_scale=output_scale)
        assert rel_err(res, ref) <= 2e-2
    out = torch.full(q.shape, NAN, dtype=out_dtype, device=DEVICE)
    assert batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, out=out) is out
    assert rel_err(out, ref64(q, k, v, qo, bt, sl)) <= 2e-2


def test_strided_q_and_pools_from_combined_cache():
    """q sliced from a fused projection; K/V pools as the halves of one [P, 2, Hkv, ps, D] cache."""
    q0, k0, v0, qo, bt, sl = make_problem([(100, 257), (129, 129)], 4, 2, 128, 32, FP16, "perm", seed=4,
                                          poison=False)
    fused = torch.zeros(q0.shape[0], 8, 128, dtype=FP16, device=DEVICE)
    fused[:, 2:6] = q0
    q = fused[:, 2:6]
    combined = torch.stack([k0, v0], dim=1)
    k, v = combined[:, 0], combined[:, 1]
    assert not q.is_contiguous() and not k.is_contiguous()
    out = torch.full(q.shape, NAN, dtype=FP16, device=DEVICE)
    batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=32, mask_type="causal", out=out)
    assert rel_err(out, ref64(q0, k0, v0, qo, bt, sl, mask_type="causal")) <= TOLERANCE[FP16]


@pytest.mark.parametrize("ps", [16, 64])
def test_many_requests(ps):
    """40 requests of random lengths (heavy-first work list over many items)."""
    g = torch.Generator().manual_seed(ps)
    requests = []
    for _ in range(40):
        sk = int(torch.randint(1, 400, (1,), generator=g))
        sq = int(torch.randint(1, sk + 1, (1,), generator=g))
        requests.append((sq, sk))
    q, k, v, qo, bt, sl = make_problem(requests, 8, 1, 128, ps, BF16, "repeated", seed=ps + 1)
    for mask, window in (("causal", -1), ("causal", 31), ("dense", -1)):
        out = torch.full_like(q, NAN)
        batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, mask_type=mask, window_left=window,
                                          out=out)
        assert rel_err(out, ref64(q, k, v, qo, bt, sl, mask_type=mask, window_left=window)) <= TOLERANCE[BF16]


def test_large_scores_no_overflow():
    q, k, v, qo, bt, sl = make_problem([(200, 500)], 4, 4, 128, 64, BF16, "perm", seed=5, poison=False)
    q, k = q * 8, k * 8
    out = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=64)
    assert rel_err(out, ref64(q, k, v, qo, bt, sl)) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# Wrapper (graph capture and replay: compile_tests/test_paged_compile.py)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [128, 256])
def test_wrapper_run_and_rewrites(d, dtype):
    ps = 32
    q, k, v, qo, bt, sl = make_problem([(100, 130), (1, 9), (300, 1100)], 8, 2, d, ps, dtype, "padded", seed=6,
                                       poison=False)
    w = BatchPrefillPagedTSWrapper()
    w.plan(qo, bt, sl, num_qo_heads=8, num_kv_heads=2, head_dim=d, page_size=ps, mask_type="causal",
           max_q_len=320, q_data_type=dtype)
    out = torch.full_like(q, NAN)
    assert w.run(q, k, v, out=out) is out
    assert rel_err(out, ref64(q, k, v, qo, bt, sl, mask_type="causal")) <= TOLERANCE[dtype]
    res = w.run(q, k, v)
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    # rewrite page IDs, Q offsets and K/V lengths in place within the planned bounds
    C, P = bt.shape[1], k.shape[0]
    g = torch.Generator().manual_seed(7)
    bt.copy_(torch.randint(0, P, tuple(bt.shape), generator=g, dtype=I32).to(DEVICE))
    qo.copy_(torch.tensor([0, 320, 380, 401], dtype=I32))
    sl.copy_(torch.tensor([min(C * ps, 1000), 60, 21], dtype=I32))
    out.fill_(NAN)
    w.run(q, k, v, out=out)
    assert rel_err(out, ref64(q, k, v, qo, bt, sl, mask_type="causal")) <= TOLERANCE[dtype]


# ----------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["qo_indptr", "block_tables", "seq_lens_kv", "k_cache", "out"])
def test_cpu_tensor_with_cuda_call_is_refused(which):
    q, k, v, qo, bt, sl = make_problem([(5, 20), (3, 40)], 4, 2, 128, 16, BF16, "perm", seed=8)
    args = dict(q=q, k_cache=k, v_cache=v, qo_indptr=qo, block_tables=bt, seq_lens_kv=sl)
    kwargs = dict(page_size=16)
    if which == "out":
        kwargs["out"] = torch.empty(q.shape, dtype=BF16)
    elif which == "k_cache":
        args["k_cache"], args["v_cache"] = k.cpu(), v.cpu()
    else:
        args[which] = args[which].cpu()
    from prims_ts.cuda import kernels

    def must_not_launch(*a, **k):
        raise AssertionError("the CUDA kernel was launched although validation should have failed first")

    with mock.patch.object(kernels, "launch_prefill_paged", must_not_launch):
        with pytest.raises(ValueError, match=which):
            batch_prefill_with_paged_kv_cache(*args.values(), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    global DEVICE
    saved = DEVICE
    DEVICE = "cuda:1"
    try:
        q, k, v, qo, bt, sl = make_problem([(130, 140), (1, 300)], 8, 2, 128, 16, BF16, "padded", seed=9)
        assert q.device == torch.device("cuda:1")
        out = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, mask_type="causal")
        assert out.device == q.device
        assert rel_err(out, ref64(q, k, v, qo, bt, sl, mask_type="causal")) <= TOLERANCE[BF16]
        w = BatchPrefillPagedTSWrapper()
        w.plan(qo, bt, sl, num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, mask_type="causal")
        assert rel_err(w.run(q, k, v), ref64(q, k, v, qo, bt, sl, mask_type="causal")) <= TOLERANCE[BF16]
    finally:
        DEVICE = saved


def test_sm_scale_default_is_inverse_sqrt_d():
    q, k, v, qo, bt, sl = make_problem([(64, 100)], 4, 2, 256, 16, FP16, "perm", seed=10)
    a = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, out_dtype=FP32)
    b = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, sm_scale=1.0 / math.sqrt(256),
                                          out_dtype=FP32)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert prims_ts.batch_prefill_with_paged_kv_cache is batch_prefill_with_paged_kv_cache
