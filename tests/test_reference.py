"""The reference (prims_ts.reference) against direct math, and the public CPU path against it.

* ``naive_prefill`` below is an independent oracle: a per-(request, row, head)
  float64 loop that lists the visible keys from the SPEC's mask rules and does the
  softmax by hand. ``prims_ts.reference.batch_prefill(..., compute_dtype=float64)``
  must equal it to float64 round-off.
* The public ``batch_prefill`` and ``BatchPrefillTSWrapper`` (``plan(q, k, v, ...)``, which
  binds the offsets and variable-window bounds, then ``run(q, k, v, out=...)``) on CPU tensors must
  match the float64 reference within the project's tolerance
  (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16), write every element of
  a NaN-poisoned ``out`` and return ``out`` itself.
"""
from __future__ import annotations

import math
import zlib
from typing import List, Optional

import pytest
import torch

from prims_ts import BatchPrefillTSWrapper, batch_prefill
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, rel_err

F64 = torch.float64
I32 = torch.int32
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def random_bounds(b, sq, sk, g):
    a = torch.randint(0, sk, (b, sq), generator=g, dtype=I32)
    c = torch.randint(0, sk, (b, sq), generator=g, dtype=I32)
    return torch.minimum(a, c), torch.maximum(a, c)


# ----------------------------------------------------------------------------
# Independent oracle
# ----------------------------------------------------------------------------


def _visible(i: int, j: int, sq: int, sk: int, mask: str, window: int, starts, ends) -> bool:
    if mask == "dense":
        return True
    if mask == "causal":
        diag = sk - sq + i  # bottom-right aligned
        if j > diag:
            return False
        return window < 0 or j >= diag - window
    if mask == "variable_window":
        return int(starts[i]) <= j <= int(ends[i])
    raise AssertionError(mask)


def _naive_request(q, k, v, mask, window, starts, ends, scale, output_scale) -> torch.Tensor:
    """q [sq, hq, d], k/v [sk, hkv, d] -> float64 [sq, hq, d], one scalar softmax at a time."""
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    group = hq // hkv
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    out = torch.empty(sq, hq, v.shape[-1], dtype=F64)
    for i in range(sq):
        keys = [j for j in range(sk) if _visible(i, j, sq, sk, mask, window, starts, ends)]
        for h in range(hq):
            kh = h // group
            if not keys:
                out[i, h] = 0.0
                continue
            logits = [scale * float(torch.dot(q[i, h], k[j, kh])) for j in keys]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            total = math.fsum(w)
            acc = torch.zeros(v.shape[-1], dtype=F64)
            for wj, j in zip(w, keys):
                acc += wj * v[j, kh]
            out[i, h] = acc / total * output_scale
    return out


def naive_prefill(q, k, v, *, qo: Optional[List[int]] = None, kvo: Optional[List[int]] = None, mask="dense",
                  window=-1, starts=None, ends=None, sm_scale=None, output_scale=1.0) -> torch.Tensor:
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if qo is None:
        return torch.stack([
            _naive_request(q[b], k[b], v[b], mask, window,
                           None if starts is None else starts[b], None if ends is None else ends[b],
                           scale, output_scale)
            for b in range(q.shape[0])])
    parts = [_naive_request(q[qo[b]:qo[b + 1]], k[kvo[b]:kvo[b + 1]], v[kvo[b]:kvo[b + 1]], mask, window, None,
                            None, scale, output_scale) for b in range(len(qo) - 1)]
    return torch.cat(parts)


def ref64(q, k, v, **kw) -> torch.Tensor:
    return R.batch_prefill(q, k, v, compute_dtype=F64, **kw)


# ----------------------------------------------------------------------------
# Reference vs naive math
# ----------------------------------------------------------------------------

# (mask, window, sq, sk, hq, hkv, d)
FIXED_GRID = [
    ("dense", -1, 5, 7, 2, 2, 128),
    ("dense", -1, 5, 7, 4, 2, 128),
    ("dense", -1, 5, 7, 4, 1, 128),
    ("dense", -1, 7, 3, 4, 2, 128),  # dense allows Sq > Sk
    ("dense", -1, 1, 1, 2, 1, 256),
    ("causal", -1, 3, 7, 4, 2, 128),  # Sq < Sk: bottom-right aligned
    ("causal", -1, 5, 5, 4, 4, 128),  # Sq == Sk
    ("causal", -1, 5, 5, 4, 1, 256),
    ("causal", -1, 1, 6, 2, 2, 128),  # decode-like row sees every key
    ("causal", 0, 4, 7, 4, 2, 128),  # window 0: exactly the diagonal key
    ("causal", 0, 5, 5, 2, 2, 128),
    ("causal", 3, 4, 9, 4, 2, 128),
    ("causal", 3, 6, 6, 4, 1, 128),
    ("causal", 100, 4, 6, 2, 1, 128),  # window wider than the sequence
    ("variable_window", -1, 5, 7, 4, 2, 128),
    ("variable_window", -1, 6, 4, 4, 1, 128),  # variable window allows Sq > Sk
]


@pytest.mark.parametrize("mask,window,sq,sk,hq,hkv,d", FIXED_GRID,
                         ids=[f"{m}{w if w >= 0 else ''}-{sq}x{sk}-h{hq}/{hkv}-d{d}"
                              for m, w, sq, sk, hq, hkv, d in FIXED_GRID])
def test_reference_fixed_matches_naive(mask, window, sq, sk, hq, hkv, d):
    g = gen(zlib.crc32(repr((mask, window, sq, sk, hq, hkv, d)).encode()))
    B = 2
    q, k, v = randn((B, sq, hq, d), F64, g), randn((B, sk, hkv, d), F64, g), randn((B, sk, hkv, d), F64, g)
    starts = ends = None
    if mask == "variable_window":
        starts, ends = random_bounds(B, sq, sk, g)
    got = ref64(q, k, v, mask_type=mask, window_left=window, window_starts=starts, window_ends=ends)
    want = naive_prefill(q, k, v, mask=mask, window=window, starts=starts, ends=ends)
    assert got.dtype == F64 and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sm_scale,output_scale", [(0.05, 1.0), (1.0, 0.25), (0.3, 3.0)])
def test_reference_scales_match_naive(sm_scale, output_scale):
    g = gen(11)
    q, k, v = randn((2, 4, 4, 128), F64, g), randn((2, 6, 2, 128), F64, g), randn((2, 6, 2, 128), F64, g)
    got = ref64(q, k, v, mask_type="causal", sm_scale=sm_scale, output_scale=output_scale)
    want = naive_prefill(q, k, v, mask="causal", sm_scale=sm_scale, output_scale=output_scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_reference_half_inputs_upcast():
    """Half inputs are read exactly (upcast) before float64 math."""
    g = gen(12)
    q, k, v = randn((1, 3, 2, 128), BF16, g), randn((1, 5, 1, 128), BF16, g), randn((1, 5, 1, 128), BF16, g)
    got = ref64(q, k, v, mask_type="causal")
    want = naive_prefill(q, k, v, mask="causal")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


PACKED_GRID = [
    # (mask, window, q lens, kv lens, hq, hkv)
    ("dense", -1, [3, 1, 4], [5, 2, 4], 4, 2),
    ("dense", -1, [4, 2], [1, 3], 2, 1),  # dense: Sq > Sk allowed
    ("causal", -1, [3, 1, 4], [5, 2, 4], 4, 2),
    ("causal", -1, [2, 5], [2, 5], 4, 4),
    ("causal", 0, [3, 1, 4], [5, 2, 4], 4, 1),
    ("causal", 3, [3, 6, 4], [7, 6, 9], 4, 2),
]


@pytest.mark.parametrize("mask,window,qlens,kvlens,hq,hkv", PACKED_GRID,
                         ids=[f"{m}{w if w >= 0 else ''}-{'_'.join(map(str, ql))}-h{hq}/{hkv}"
                              for m, w, ql, kl, hq, hkv in PACKED_GRID])
def test_reference_packed_equals_per_request_fixed(mask, window, qlens, kvlens, hq, hkv):
    g = gen(sum(qlens) * 100 + sum(kvlens) + hq)
    d = 128
    qo = [0] + list(torch.tensor(qlens).cumsum(0).tolist())
    kvo = [0] + list(torch.tensor(kvlens).cumsum(0).tolist())
    q, k, v = randn((qo[-1], hq, d), F64, g), randn((kvo[-1], hkv, d), F64, g), randn((kvo[-1], hkv, d), F64, g)
    got = ref64(q, k, v, qo_indptr=torch.tensor(qo, dtype=I32), kv_indptr=torch.tensor(kvo, dtype=I32),
                mask_type=mask, window_left=window)
    assert got.shape == q.shape
    for b in range(len(qlens)):
        one = ref64(q[None, qo[b]:qo[b + 1]], k[None, kvo[b]:kvo[b + 1]], v[None, kvo[b]:kvo[b + 1]],
                    mask_type=mask, window_left=window)[0]
        torch.testing.assert_close(got[qo[b]:qo[b + 1]], one, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, naive_prefill(q, k, v, qo=qo, kvo=kvo, mask=mask, window=window),
                               rtol=1e-10, atol=1e-12)


def test_reference_row_without_keys_is_zero_not_nan():
    """Rows that see no key write zeros (reference does not validate, so we can build such rows)."""
    g = gen(13)
    # causal with Sq > Sk: the first Sq - Sk rows see nothing
    q, k, v = randn((2, 6, 2, 128), F64, g), randn((2, 3, 1, 128), F64, g), randn((2, 3, 1, 128), F64, g)
    for dt in (F64, FP32):
        out = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=dt)
        assert not torch.isnan(out).any()
        assert (out[:, :3] == 0).all()
        assert (out[:, 3:].abs().sum(dim=-1) > 0).all()
    torch.testing.assert_close(ref64(q, k, v, mask_type="causal"), naive_prefill(q, k, v, mask="causal"),
                               rtol=1e-10, atol=1e-12)
    # variable window with an empty row (start > end)
    starts = torch.tensor([[0, 2, 1], [1, 0, 0]], dtype=I32)
    ends = torch.tensor([[2, 1, 1], [0, 0, 2]], dtype=I32)
    q2 = q[:, :3]
    out = ref64(q2, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends)
    assert not torch.isnan(out).any()
    assert (out[0, 1] == 0).all() and (out[1, 0] == 0).all()
    torch.testing.assert_close(out, naive_prefill(q2, k, v, mask="variable_window", starts=starts, ends=ends),
                               rtol=1e-10, atol=1e-12)
    # attend() with an all-False visibility matrix
    vis = torch.zeros(3, 3, dtype=torch.bool)
    o = R.attend(q2[0], k[0], v[0], vis, 0.1, 1.0, F64)
    assert not torch.isnan(o).any() and (o == 0).all()


def test_reference_large_logits_are_stable():
    """Softmax is max-subtracted: huge scores neither overflow nor give NaN."""
    g = gen(14)
    q, k, v = randn((1, 4, 2, 128), F64, g) * 100, randn((1, 4, 1, 128), F64, g) * 100, randn((1, 4, 1, 128), F64, g)
    for dt in (F64, FP32):
        out = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=dt)
        assert torch.isfinite(out).all()
    torch.testing.assert_close(ref64(q, k, v, mask_type="causal"), naive_prefill(q, k, v, mask="causal"),
                               rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 2)])
def test_visible_keys_matches_rules(mask, window):
    for sq, sk in [(1, 1), (3, 7), (5, 5), (6, 2)]:
        vis = R.visible_keys(sq, sk, mask, window)
        want = torch.tensor([[_visible(i, j, sq, sk, mask, window, None, None) for j in range(sk)]
                             for i in range(sq)])
        assert torch.equal(vis, want), (sq, sk)


# ----------------------------------------------------------------------------
# Public batch_prefill on CPU vs the float64 reference
# ----------------------------------------------------------------------------

OUT_DTYPES = [None, FP32, BF16, FP16]
CONFIGS = [
    # (storage, mask, window, hq, hkv, d)
    ("fixed", "dense", -1, 4, 2, 128),
    ("fixed", "causal", -1, 4, 1, 128),
    ("fixed", "causal", 3, 4, 2, 256),
    ("fixed", "variable_window", -1, 2, 2, 128),
    ("packed", "dense", -1, 4, 4, 256),
    ("packed", "causal", -1, 4, 2, 128),
    ("packed", "causal", 0, 4, 1, 128),
]


def _tol(in_dtype, out_dtype):
    return TOLERANCE[BF16] if BF16 in (in_dtype, out_dtype) else TOLERANCE[FP16]


def _problem(storage, mask, hq, hkv, d, dtype, g):
    """Inputs and the metadata kwargs of one small problem."""
    if storage == "fixed":
        B, sq, sk = 2, 5, 9
        q, k, v = randn((B, sq, hq, d), dtype, g), randn((B, sk, hkv, d), dtype, g), randn((B, sk, hkv, d), dtype, g)
        meta = {}
        if mask == "variable_window":
            s, e = random_bounds(B, sq, sk, g)
            meta = dict(variable_window_token_starts=s, variable_window_token_ends=e)
        return q, k, v, meta
    qo, kvo = [0, 3, 4, 9], [0, 7, 8, 14]  # q lens 3, 1, 5 <= kv lens 7, 1, 6
    q, k, v = randn((qo[-1], hq, d), dtype, g), randn((kvo[-1], hkv, d), dtype, g), randn((kvo[-1], hkv, d), dtype, g)
    return q, k, v, dict(qo_indptr=torch.tensor(qo, dtype=I32), kv_indptr=torch.tensor(kvo, dtype=I32))


def _ref_kwargs(meta):
    kw = dict(meta)
    if "variable_window_token_starts" in kw:
        kw["window_starts"] = kw.pop("variable_window_token_starts")
        kw["window_ends"] = kw.pop("variable_window_token_ends")
    return kw


@pytest.mark.parametrize("in_dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=["out_default", "out_fp32", "out_bf16", "out_fp16"])
@pytest.mark.parametrize("storage,mask,window,hq,hkv,d", CONFIGS,
                         ids=[f"{s}-{m}{w if w >= 0 else ''}-h{hq}/{hkv}-d{d}" for s, m, w, hq, hkv, d in CONFIGS])
def test_public_cpu_matches_reference(storage, mask, window, hq, hkv, d, out_dtype, in_dtype):
    g = gen(zlib.crc32(repr((storage, mask, window, hq, hkv, d, str(out_dtype), str(in_dtype))).encode()))
    q, k, v, meta = _problem(storage, mask, hq, hkv, d, in_dtype, g)
    q_before = q.clone()
    ref = ref64(q, k, v, mask_type=mask, window_left=window, **_ref_kwargs(meta))
    expect_dtype = out_dtype or in_dtype
    tol = _tol(in_dtype, expect_dtype)

    res = batch_prefill(q, k, v, mask_type=mask, window_left=window, out_dtype=out_dtype, **meta)
    assert res.dtype == expect_dtype and res.shape == q.shape and res.device == q.device
    assert rel_err(res, ref) <= tol

    out = torch.full(q.shape, float("nan"), dtype=expect_dtype)
    got = batch_prefill(q, k, v, mask_type=mask, window_left=window, out_dtype=out_dtype, out=out, **meta)
    assert got is out
    assert not torch.isnan(out).any(), "out has unwritten (NaN-poisoned) elements"
    assert rel_err(out, ref) <= tol
    assert torch.equal(q, q_before), "inputs must not be modified"


@pytest.mark.parametrize("in_dtype", [FP16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("storage", ["fixed", "packed"])
def test_public_cpu_scales(storage, in_dtype):
    g = gen(21 if storage == "fixed" else 22)
    q, k, v, meta = _problem(storage, "causal", 4, 2, 128, in_dtype, g)
    for sm_scale, output_scale in [(0.02, 1.0), (0.2, 0.5), (None, 4.0)]:
        ref = ref64(q, k, v, mask_type="causal", sm_scale=sm_scale, output_scale=output_scale, **meta)
        out = torch.full(q.shape, float("nan"), dtype=FP32)
        got = batch_prefill(q, k, v, mask_type="causal", sm_scale=sm_scale, output_scale=output_scale, out=out,
                            **meta)
        assert got is out
        assert rel_err(out, ref) <= TOLERANCE[in_dtype]
    # sm_scale's default is 1/sqrt(D)
    a = batch_prefill(q, k, v, mask_type="causal", out_dtype=FP32, **meta)
    b = batch_prefill(q, k, v, mask_type="causal", sm_scale=1.0 / math.sqrt(128), out_dtype=FP32, **meta)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # output_scale is a plain multiplier
    c = batch_prefill(q, k, v, mask_type="causal", output_scale=2.0, out_dtype=FP32, **meta)
    torch.testing.assert_close(c, 2 * a, rtol=1e-6, atol=1e-6)


def test_public_cpu_out_dtype_from_out():
    """No out_dtype: out's dtype decides."""
    g = gen(23)
    q, k, v, _ = _problem("fixed", "causal", 2, 1, 128, FP16, g)
    ref = ref64(q, k, v, mask_type="causal")
    for dt in (FP32, BF16, FP16):
        out = torch.full(q.shape, float("nan"), dtype=dt)
        assert batch_prefill(q, k, v, mask_type="causal", out=out) is out
        assert rel_err(out, ref) <= _tol(FP16, dt)


def test_public_cpu_strided_inputs():
    """Views with a contiguous inner dimension (e.g. slices of a fused QKV buffer) are read correctly."""
    g = gen(24)
    B, S, H, d = 2, 6, 2, 128
    qkv = randn((B, S, 3 * H, d), BF16, g)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:2 * H], qkv[:, :, 2 * H:]
    assert not q.is_contiguous()
    ref = ref64(q.contiguous(), k.contiguous(), v.contiguous(), mask_type="causal")
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    batch_prefill(q, k, v, mask_type="causal", out=out)
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    qp = randn((9, 2 * H, d), BF16, g)[:, :H]  # packed, row stride 2*H*d
    kp, vp = randn((12, H, d), BF16, g), randn((12, H, d), BF16, g)
    meta = dict(qo_indptr=torch.tensor([0, 4, 9], dtype=I32), kv_indptr=torch.tensor([0, 5, 12], dtype=I32))
    ref = ref64(qp.contiguous(), kp, vp, mask_type="causal", **meta)
    assert rel_err(batch_prefill(qp, kp, vp, mask_type="causal", **meta), ref) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# BatchPrefillTSWrapper on CPU: plan(q, k, v, ...) over the actual tensors, run(q, k, v, out=...)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 2), ("variable_window", -1)])
@pytest.mark.parametrize("in_dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_wrapper_fixed(mask, window, in_dtype):
    g = gen(zlib.crc32(repr((mask, window, str(in_dtype))).encode()))
    B, sq, sk, hq, hkv, d = 2, 4, 7, 4, 2, 128

    def inputs():
        return randn((B, sq, hq, d), in_dtype, g), randn((B, sk, hkv, d), in_dtype, g), \
            randn((B, sk, hkv, d), in_dtype, g)

    q, k, v = inputs()
    s = e = None
    kw = {}
    if mask == "variable_window":  # the bounds are plan arguments, bound like the offsets
        s, e = random_bounds(B, sq, sk, g)
        kw = dict(variable_window_token_starts=s, variable_window_token_ends=e)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, mask_type=mask, window_left=window, sm_scale=0.07, output_scale=1.5, out_dtype=FP32, **kw)
    out = torch.full((B, sq, hq, d), float("nan"), dtype=FP32)
    for it in range(3):  # a plan serves many runs with new values
        if it:
            q, k, v = inputs()
        if it == 2 and s is not None:  # new window bounds written in place into the planned tensors
            ref_old = ref64(q, k, v, mask_type=mask, window_starts=s.clone(), window_ends=e.clone(), sm_scale=0.07,
                            output_scale=1.5)
            ns, ne = random_bounds(B, sq, sk, g)
            s.copy_(ns)
            e.copy_(ne)
        rkw = dict(window_starts=s.clone(), window_ends=e.clone()) if s is not None else {}
        ref = ref64(q, k, v, mask_type=mask, window_left=window, sm_scale=0.07, output_scale=1.5, **rkw)
        if it == 2 and s is not None:
            assert rel_err(ref_old, ref) > 0.1, "the new bounds must change the answer for this test to bite"
        out.fill_(float("nan"))
        assert w.run(q, k, v, out=out) is out
        assert rel_err(out, ref) <= TOLERANCE[in_dtype]
        res = w.run(q, k, v)
        assert res.dtype == FP32
        torch.testing.assert_close(res, out, rtol=0, atol=0)
        # the one-shot is this plan + run
        torch.testing.assert_close(batch_prefill(q, k, v, mask_type=mask, window_left=window, sm_scale=0.07,
                                                 output_scale=1.5, out_dtype=FP32, **kw), out, rtol=0, atol=0)


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 1)])
@pytest.mark.parametrize("in_dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_wrapper_packed(mask, window, in_dtype):
    g = gen(zlib.crc32(repr((mask, window, str(in_dtype), "p")).encode()))
    hq, hkv, d = 4, 1, 128
    qo = torch.tensor([0, 2, 7, 8], dtype=I32)
    kvo = torch.tensor([0, 3, 9, 13], dtype=I32)
    q, k, v = randn((8, hq, d), in_dtype, g), randn((13, hkv, d), in_dtype, g), randn((13, hkv, d), in_dtype, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
    ref = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
    out = torch.full(q.shape, float("nan"), dtype=in_dtype)
    assert w.run(q, k, v, out=out) is out
    assert rel_err(out, ref) <= TOLERANCE[in_dtype]
    res = w.run(q, k, v)
    assert res.dtype == in_dtype
    torch.testing.assert_close(res, out, rtol=0, atol=0)
    # same answer as the one-shot function
    torch.testing.assert_close(batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask,
                                             window_left=window), out, rtol=0, atol=0)
    # new values in the planned q, k, v shapes
    q2, k2, v2 = (randn(t.shape, in_dtype, g) for t in (q, k, v))
    out.fill_(float("nan"))
    w.run(q2, k2, v2, out=out)
    assert rel_err(out, ref64(q2, k2, v2, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)) \
        <= TOLERANCE[in_dtype]


# (mask, window, planned qo/kv, rewritten qo/kv): same totals, each q length within the planned longest,
# and Sq <= Sk per request for causal masks.
REWRITES = [
    ("causal", -1, ([0, 3, 5], [0, 4, 9]), ([0, 3, 5], [0, 6, 9])),  # kv offsets only
    ("causal", -1, ([0, 3, 5], [0, 4, 9]), ([0, 2, 5], [0, 6, 9])),  # q lens (3, 2) -> (2, 3) <= 3
    ("causal", 1, ([0, 4, 5], [0, 4, 9]), ([0, 1, 5], [0, 3, 9])),  # q lens (4, 1) -> (1, 4) <= 4
    ("dense", -1, ([0, 1, 4, 6], [0, 2, 4, 9]), ([0, 3, 4, 6], [0, 7, 8, 9])),
]


@pytest.mark.parametrize("mask,window,planned,rewritten", REWRITES, ids=["kv_only", "q_and_kv", "window", "dense"])
def test_wrapper_packed_run_after_inplace_indptr_rewrite(mask, window, planned, rewritten):
    """plan binds qo_indptr and kv_indptr: run reads their values live."""
    g = gen(zlib.crc32(repr((mask, window, str(rewritten))).encode()))
    hq, hkv, d = 4, 2, 128
    qo = torch.tensor(planned[0], dtype=I32)
    kvo = torch.tensor(planned[1], dtype=I32)
    tq, tk = planned[0][-1], planned[1][-1]
    q, k, v = randn((tq, hq, d), BF16, g), randn((tk, hkv, d), BF16, g), randn((tk, hkv, d), BF16, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    w.run(q, k, v, out=out)
    assert rel_err(out, ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)) \
        <= TOLERANCE[BF16]

    # the caller rewrites the planned tensors' values in place (same totals, within the planned longest)
    assert rewritten[0][-1] == tq and rewritten[1][-1] == tk
    longest = max(b - a for a, b in zip(planned[0], planned[0][1:]))
    assert max(b - a for a, b in zip(rewritten[0], rewritten[0][1:])) <= longest
    qo.copy_(torch.tensor(rewritten[0], dtype=I32))
    kvo.copy_(torch.tensor(rewritten[1], dtype=I32))
    new_qo, new_kvo = qo.clone(), kvo.clone()
    ref_new = ref64(q, k, v, qo_indptr=new_qo, kv_indptr=new_kvo, mask_type=mask, window_left=window)
    ref_old = ref64(q, k, v, qo_indptr=torch.tensor(planned[0], dtype=I32),
                    kv_indptr=torch.tensor(planned[1], dtype=I32), mask_type=mask, window_left=window)
    assert rel_err(ref_old.to(BF16), ref_new) > 0.1, "the rewrite must change the answer for this test to bite"
    out.fill_(float("nan"))
    assert w.run(q, k, v, out=out) is out
    assert rel_err(out, ref_new) <= TOLERANCE[BF16]
    assert rel_err(w.run(q, k, v), ref_new) <= TOLERANCE[BF16]


def test_wrapper_replan():
    """One wrapper, planned again for other shapes, storage kinds and masks: each run follows its latest plan."""
    g = gen(25)
    fixed = [randn((2, 5, 4, 128), FP16, g), randn((2, 9, 2, 128), FP16, g), randn((2, 9, 2, 128), FP16, g)]
    packed = [randn((9, 8, 256), BF16, g), randn((14, 8, 256), BF16, g), randn((14, 8, 256), BF16, g)]
    meta = dict(qo_indptr=torch.tensor([0, 3, 4, 9], dtype=I32), kv_indptr=torch.tensor([0, 7, 8, 14], dtype=I32))
    w = BatchPrefillTSWrapper()
    for (q, k, v), kw, mask in ((fixed, {}, "causal"), (packed, meta, "dense"), (fixed, {}, "dense"),
                                (packed, meta, "causal")):
        w.plan(q, k, v, mask_type=mask, **kw)
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        assert w.run(q, k, v, out=out) is out
        assert rel_err(out, ref64(q, k, v, mask_type=mask, **kw)) <= TOLERANCE[q.dtype]
