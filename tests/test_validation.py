"""Every bad input of batch_prefill / BatchPrefillTSWrapper is refused on the host.

The wrapper has FlashInfer main's signatures: ``plan(q, k, v, *, qo_indptr, kv_indptr,
mask_type, window_left, sm_scale, output_scale, out_dtype, variable_window_token_starts,
variable_window_token_ends)`` takes the one-shot's arguments (so every refused one-shot call
is refused by plan + run too), and ``run(q, k, v, *, out)`` checks its tensors against the plan.

Contract (SPEC, "Errors"): anything outside the contract raises ``ValueError``
(``TypeError`` for a wrong Python type) whose message names the argument, before
any kernel runs. On CPU the "kernel" is ``prims_ts.reference.batch_prefill``;
every error case below runs with it replaced by a function that fails the test
if it is ever reached, so an error raised *after* the launch does not count.

Devices: this file runs on a CPU-only machine, so "another device" is 'meta'.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import BatchPrefillTSWrapper, Tuning, batch_prefill
from prims_ts.ops._validate import dtype_code
from prims_ts.testing import recording_no_host_reads, reference_must_not_run

BF16 = torch.bfloat16
I32 = torch.int32
D = 128
B, SQ, SK, HQ, HKV = 2, 4, 6, 4, 2
QO, KV = [0, 3, 5], [0, 4, 9]  # packed: q lens (3, 2), kv lens (4, 5); totals 5 and 9


def _rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def fixed(sq=SQ, sk=SK, hq=HQ, hkv=HKV, d=D, dtype=BF16):
    return _rand(B, sq, hq, d, dtype=dtype, seed=1), _rand(B, sk, hkv, d, dtype=dtype, seed=2), \
        _rand(B, sk, hkv, d, dtype=dtype, seed=3)


def packed(tq=QO[-1], tk=KV[-1], hq=HQ, hkv=HKV, d=D, dtype=BF16):
    return _rand(tq, hq, d, dtype=dtype, seed=4), _rand(tk, hkv, d, dtype=dtype, seed=5), \
        _rand(tk, hkv, d, dtype=dtype, seed=6)


def ip(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


def bounds(b=B, sq=SQ, sk=SK):
    starts = torch.zeros(b, sq, dtype=I32)
    ends = torch.full((b, sq), sk - 1, dtype=I32)
    return starts, ends


def expect(exc, match, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``match`` and never reaches the kernel."""
    with reference_must_not_run("batch_prefill"):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


# ----------------------------------------------------------------------------
# Sanity: the base inputs of every case below are valid.
# ----------------------------------------------------------------------------


def test_base_inputs_are_valid():
    q, k, v = fixed()
    assert batch_prefill(q, k, v, mask_type="causal").shape == q.shape
    s, e = bounds()
    assert batch_prefill(q, k, v, mask_type="variable_window", variable_window_token_starts=s,
                         variable_window_token_ends=e).shape == q.shape
    qp, kp, vp = packed()
    out = torch.empty(qp.shape, dtype=torch.float32)
    assert batch_prefill(qp, kp, vp, qo_indptr=ip(QO), kv_indptr=ip(KV), mask_type="causal", window_left=1,
                         out=out) is out
    # out.dtype decides the output dtype when out_dtype is not given
    batch_prefill(q, k, v, out=torch.empty(q.shape, dtype=torch.float16))


# ----------------------------------------------------------------------------
# One-shot batch_prefill, fixed storage
# ----------------------------------------------------------------------------


def _f(**mods):
    """Fixed-storage case: start from valid inputs, apply modifications."""
    q, k, v = fixed()
    args = dict(q=q, k=k, v=v)
    kwargs = {}
    for key, val in mods.items():
        if key in args:
            args[key] = val
        else:
            kwargs[key] = val
    return (args["q"], args["k"], args["v"]), kwargs


def _noncontig_inner(t):
    """Same shape as t, last dimension with stride 2."""
    base = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    view = base[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


_q, _k, _v = fixed()
_s, _e = bounds()

FIXED_CASES = [
    # devices
    ("k_meta", ValueError, r"\bk\b", lambda: _f(k=_k.to("meta"))),
    ("v_meta", ValueError, r"\bv\b", lambda: _f(v=_v.to("meta"))),
    ("q_meta", ValueError, r"\bq\b", lambda: _f(q=_q.to("meta"))),
    # dtypes
    ("k_fp16_q_bf16", ValueError, r"\bk\b", lambda: _f(k=_k.half())),
    ("v_fp16_q_bf16", ValueError, r"\bv\b", lambda: _f(v=_v.half())),
    ("q_float32", ValueError, r"\bq\b", lambda: _f(q=_q.float(), k=_k.float(), v=_v.float())),
    ("q_float64", ValueError, r"\bq\b", lambda: _f(q=_q.double(), k=_k.double(), v=_v.double())),
    ("k_int8", ValueError, r"\bk\b", lambda: _f(k=_k.to(torch.int8))),
    # head dims
    ("head_dim_64", ValueError, r"\bq\b", lambda: _f(q=_q[..., :64], k=_k[..., :64], v=_v[..., :64])),
    ("k_head_dim_differs", ValueError, r"\bk\b", lambda: _f(k=fixed(d=256)[1], v=fixed(d=256)[2])),
    # strides
    ("q_inner_noncontig", ValueError, r"\bq\b", lambda: _f(q=_noncontig_inner(_q))),
    ("k_inner_noncontig", ValueError, r"\bk\b", lambda: _f(k=_noncontig_inner(_k))),
    ("v_inner_noncontig", ValueError, r"\bv\b", lambda: _f(v=_noncontig_inner(_v))),
    # ranks and shapes
    ("q_3d_fixed", ValueError, r"\bq\b", lambda: _f(q=_q[0])),
    ("k_3d_fixed", ValueError, r"\bk\b", lambda: _f(k=_k[0], v=_v[0])),
    ("q_5d", ValueError, r"\bq\b", lambda: _f(q=_q[None])),
    ("v_shape_differs", ValueError, r"\bv\b", lambda: _f(v=_v[:, :SK - 1])),
    ("batch_differs", ValueError, r"\bk\b", lambda: _f(k=_k[:1], v=_v[:1])),
    ("hq_not_multiple_of_hkv", ValueError, r"\bk\b|heads",
     lambda: _f(q=fixed(hq=3)[0], k=fixed(hkv=2)[1], v=fixed(hkv=2)[2])),
    ("hkv_greater_than_hq", ValueError, r"\bk\b|heads",
     lambda: _f(q=fixed(hq=2)[0], k=fixed(hkv=4)[1], v=fixed(hkv=4)[2])),
    # Python types
    ("q_not_tensor", TypeError, r"\bq\b", lambda: _f(q=_q.tolist())),
    ("k_none", TypeError, r"\bk\b", lambda: _f(k=None)),
    # indptr: only one of the two
    ("only_qo_indptr", ValueError, r"kv_indptr", lambda: _f(qo_indptr=ip([0, 4, 8]))),
    ("only_kv_indptr", ValueError, r"qo_indptr", lambda: _f(kv_indptr=ip([0, 6, 12]))),
    # no keys (packed storage refuses empty requests too)
    ("fixed_sk_0", ValueError, r"\bk\b", lambda: _f(k=fixed(sk=0)[1], v=fixed(sk=0)[2])),
    # causal needs Sq <= Sk
    ("causal_sq_gt_sk", ValueError, r"\bq\b|Sq",
     lambda: _f(q=fixed(sq=SK + 1)[0], mask_type="causal")),
    ("causal_window_sq_gt_sk", ValueError, r"\bq\b|Sq",
     lambda: _f(q=fixed(sq=SK + 1)[0], mask_type="causal", window_left=2)),
    # window_left
    ("window_minus_2", ValueError, "window_left", lambda: _f(mask_type="causal", window_left=-2)),
    ("window_minus_100", ValueError, "window_left", lambda: _f(mask_type="causal", window_left=-100)),
    ("window_without_causal", ValueError, "window_left", lambda: _f(mask_type="dense", window_left=0)),
    ("window_3_without_causal", ValueError, "window_left", lambda: _f(window_left=3)),
    ("window_float", TypeError, "window_left", lambda: _f(mask_type="causal", window_left=2.0)),
    ("window_str", TypeError, "window_left", lambda: _f(mask_type="causal", window_left="2")),
    # mask_type
    ("mask_unknown", ValueError, "mask_type", lambda: _f(mask_type="sliding")),
    ("mask_upper", ValueError, "mask_type", lambda: _f(mask_type="CAUSAL")),
    ("mask_none", TypeError, "mask_type", lambda: _f(mask_type=None)),
    ("mask_int", TypeError, "mask_type", lambda: _f(mask_type=1)),
    # variable window
    ("vw_missing_both", ValueError, "variable_window_token_starts", lambda: _f(mask_type="variable_window")),
    ("vw_missing_starts", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_ends=_e)),
    ("vw_missing_ends", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s)),
    ("vw_starts_wrong_shape", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s[:, :SQ - 1],
                variable_window_token_ends=_e[:, :SQ - 1])),
    ("vw_ends_wrong_shape", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s,
                variable_window_token_ends=_e[:1])),
    ("vw_starts_1d", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.flatten(),
                variable_window_token_ends=_e.flatten())),
    ("vw_starts_int64", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.long(),
                variable_window_token_ends=_e)),
    ("vw_ends_int64", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s,
                variable_window_token_ends=_e.long())),
    ("vw_start_gt_end", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=torch.full((B, SQ), 3, dtype=I32),
                variable_window_token_ends=torch.full((B, SQ), 2, dtype=I32))),
    ("vw_one_start_gt_end", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window",
                variable_window_token_starts=torch.tensor([[0, 1, 2, 3], [0, 5, 1, 1]], dtype=I32),
                variable_window_token_ends=torch.tensor([[0, 1, 2, 3], [0, 4, 1, 1]], dtype=I32))),
    ("vw_end_eq_sk", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s,
                variable_window_token_ends=torch.full((B, SQ), SK, dtype=I32))),
    ("vw_start_negative", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=torch.full((B, SQ), -1, dtype=I32),
                variable_window_token_ends=_e)),
    ("vw_with_window", ValueError, "window_left",
     lambda: _f(mask_type="variable_window", window_left=2, variable_window_token_starts=_s,
                variable_window_token_ends=_e)),
    ("vw_bounds_meta", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.to("meta"),
                variable_window_token_ends=_e.to("meta"))),
    ("vw_ends_meta", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s,
                variable_window_token_ends=_e.to("meta"))),
    ("vw_bounds_with_dense", ValueError, "variable_window_token",
     lambda: _f(mask_type="dense", variable_window_token_starts=_s, variable_window_token_ends=_e)),
    ("vw_bounds_with_causal", ValueError, "variable_window_token",
     lambda: _f(mask_type="causal", variable_window_token_starts=_s, variable_window_token_ends=_e)),
    # scales
    *[(f"sm_scale_{name}", ValueError, "sm_scale", (lambda val=val: _f(sm_scale=val)))
      for name, val in [("nan", math.nan), ("inf", math.inf), ("neg_inf", -math.inf), ("zero", 0.0),
                        ("minus_one", -1.0), ("int_zero", 0)]],
    *[(f"output_scale_{name}", ValueError, "output_scale", (lambda val=val: _f(output_scale=val)))
      for name, val in [("nan", math.nan), ("inf", math.inf), ("neg_inf", -math.inf), ("zero", 0.0),
                        ("minus_one", -1.0), ("int_zero", 0)]],
    ("sm_scale_str", TypeError, "sm_scale", lambda: _f(sm_scale="0.1")),
    ("sm_scale_tensor", TypeError, "sm_scale", lambda: _f(sm_scale=[0.1])),
    ("output_scale_str", TypeError, "output_scale", lambda: _f(output_scale="1.0")),
    ("output_scale_none", TypeError, "output_scale", lambda: _f(output_scale=None)),
    # out_dtype
    ("out_dtype_float64", ValueError, "out_dtype", lambda: _f(out_dtype=torch.float64)),
    ("out_dtype_int32", ValueError, "out_dtype", lambda: _f(out_dtype=torch.int32)),
    ("out_dtype_str", TypeError, "out_dtype", lambda: _f(out_dtype="float32")),
    # out
    ("out_wrong_shape", ValueError, r"\bout\b", lambda: _f(out=torch.empty(B, SQ, HQ, D + 1, dtype=BF16))),
    ("out_wrong_batch", ValueError, r"\bout\b", lambda: _f(out=torch.empty(B + 1, SQ, HQ, D, dtype=BF16))),
    ("out_packed_shape", ValueError, r"\bout\b", lambda: _f(out=torch.empty(B * SQ, HQ, D, dtype=BF16))),
    ("out_dtype_disagrees", ValueError, r"\bout\b",
     lambda: _f(out=torch.empty(B, SQ, HQ, D, dtype=torch.float32), out_dtype=BF16)),
    # an out of an unsupported dtype is refused, and the message names out
    ("out_float64", ValueError, r"\bout", lambda: _f(out=torch.empty(B, SQ, HQ, D, dtype=torch.float64))),
    ("out_int32", ValueError, r"\bout", lambda: _f(out=torch.empty(B, SQ, HQ, D, dtype=torch.int32))),
    ("out_meta", ValueError, r"\bout\b", lambda: _f(out=torch.empty(B, SQ, HQ, D, dtype=BF16, device="meta"))),
    ("out_noncontig", ValueError, r"\bout\b",
     lambda: _f(out=torch.empty(B, SQ, D, HQ, dtype=BF16).transpose(2, 3))),
    ("out_noncontig_inner", ValueError, r"\bout\b", lambda: _f(out=_noncontig_inner(torch.empty_like(_q)))),
    ("out_is_q", ValueError, r"\bout must not overlap q\b", lambda: _f(q=_q, out=_q)),
    ("out_list", TypeError, r"\bout\b", lambda: _f(out=torch.empty_like(_q).tolist())),
]


def _overlap_k():
    """out is a view of k's storage (k is a prefix of a buffer, out starts inside it)."""
    q, k, v = fixed()
    buf = torch.empty(k.numel() + q.numel(), dtype=BF16)
    kk = buf[:k.numel()].view(k.shape)
    kk.copy_(k)
    out = buf[k.numel() - 8 * D:k.numel() - 8 * D + q.numel()].view(q.shape)  # shares k's last 8 rows
    return (q, kk, v), dict(out=out)


def _overlap_v_exact():
    q, k, v = fixed(sk=SQ, hkv=HQ)  # v has out's shape: out = v itself
    return (q, k, v), dict(out=v)


def _overlap_q_tail():
    """out overlaps only the last element of q."""
    q, k, v = fixed()
    buf = torch.empty(2 * q.numel(), dtype=BF16)
    qq = buf[:q.numel()].view(q.shape)
    qq.copy_(q)
    out = buf[q.numel() - 8:2 * q.numel() - 8].view(q.shape)
    return (qq, k, v), dict(out=out)


def _overlap_bounds():
    """out shares bytes with variable_window_token_starts (one byte buffer, two views)."""
    q, k, v = fixed()
    nbytes = q.numel() * 2
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    out = buf.view(BF16).view(q.shape)
    starts = buf[:B * SQ * 4].view(I32).view(B, SQ)
    starts.zero_()
    _, ends = bounds()
    return (q, k, v), dict(out=out, mask_type="variable_window", variable_window_token_starts=starts,
                           variable_window_token_ends=ends)


FIXED_CASES += [
    ("out_overlaps_k", ValueError, r"\bout must not overlap k\b", _overlap_k),
    ("out_is_v", ValueError, r"\bout must not overlap v\b", _overlap_v_exact),
    ("out_overlaps_q_tail", ValueError, r"\bout must not overlap q\b", _overlap_q_tail),
    ("out_overlaps_window_bounds", ValueError, r"\bout must not overlap variable_window_token_starts\b",
     _overlap_bounds),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in FIXED_CASES], ids=[c[0] for c in FIXED_CASES])
def test_fixed_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, batch_prefill, *args, **kwargs)


# ----------------------------------------------------------------------------
# One-shot batch_prefill, packed-ragged storage
# ----------------------------------------------------------------------------


def _p(qo=QO, kv=KV, **mods):
    q, k, v = packed(tq=qo[-1] if isinstance(qo, list) else QO[-1], tk=kv[-1] if isinstance(kv, list) else KV[-1])
    args = dict(q=q, k=k, v=v)
    kwargs = dict(qo_indptr=ip(qo) if isinstance(qo, list) else qo, kv_indptr=ip(kv) if isinstance(kv, list) else kv)
    for key, val in mods.items():
        (args if key in args else kwargs)[key] = val
    return (args["q"], args["k"], args["v"]), kwargs


_qp, _kp, _vp = packed()


def _packed_out_overlaps_indptr():
    q, k, v = packed()
    buf = torch.zeros(q.numel() * 4, dtype=torch.uint8)
    out = buf.view(torch.float32).view(q.shape)
    qo = buf[:12].view(I32)
    qo.copy_(ip(QO))
    return (q, k, v), dict(qo_indptr=qo, kv_indptr=ip(KV), out_dtype=torch.float32, out=out)


PACKED_CASES = [
    # devices
    ("k_meta", ValueError, r"\bk\b", lambda: _p(k=_kp.to("meta"))),
    ("qo_indptr_meta", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip(QO).to("meta"))),
    ("kv_indptr_meta", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip(KV).to("meta"))),
    ("out_meta", ValueError, r"\bout\b", lambda: _p(out=torch.empty(_qp.shape, dtype=BF16, device="meta"))),
    # dtypes, dims
    ("v_fp16", ValueError, r"\bv\b", lambda: _p(v=_vp.half())),
    ("q_float32", ValueError, r"\bq\b", lambda: _p(q=_qp.float(), k=_kp.float(), v=_vp.float())),
    ("head_dim_64", ValueError, r"\bq\b", lambda: _p(q=_qp[..., :64], k=_kp[..., :64], v=_vp[..., :64])),
    ("q_inner_noncontig", ValueError, r"\bq\b", lambda: _p(q=_noncontig_inner(_qp))),
    ("hq_not_multiple", ValueError, r"\bk\b|heads",
     lambda: _p(q=packed(hq=3)[0])),
    # rank
    ("q_4d_packed", ValueError, r"\bq\b", lambda: _p(q=_qp[None])),
    ("k_4d_packed", ValueError, r"\bk\b", lambda: _p(k=_kp[None], v=_vp[None])),
    # indptr dtype / shape
    ("qo_int64", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip(QO, torch.int64))),
    ("kv_int64", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip(KV, torch.int64))),
    ("qo_float", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip(QO, torch.float32))),
    ("qo_2d", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([QO]))),
    ("kv_2d", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([KV]))),
    ("qo_noncontig", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([0, 7, 3, 7, 5])[::2])),
    ("lengths_differ", ValueError, "kv_indptr", lambda: _p(kv=[0, 2, 4, 9])),
    ("qo_single_entry", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([0]), kv_indptr=ip([0]))),
    # indptr values
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([1, 3, 5]))),
    ("kv_not_start_0", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([2, 4, 9]))),
    ("qo_not_strict", ValueError, "qo_indptr", lambda: _p(qo=[0, 3, 3, 5], kv=[0, 4, 6, 9])),
    ("kv_not_strict", ValueError, "kv_indptr", lambda: _p(qo=[0, 3, 4, 5], kv=[0, 4, 4, 9])),
    ("qo_decreasing", ValueError, "qo_indptr", lambda: _p(qo=[0, 4, 3, 5], kv=[0, 4, 6, 9])),
    ("qo_not_end_at_q", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([0, 3, 4]))),
    ("qo_past_end", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([0, 3, 6]))),
    ("kv_not_end_at_k", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([0, 4, 8]))),
    ("kv_past_end", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([0, 4, 10]))),
    # causal Sq > Sk in one request
    ("causal_sq_gt_sk", ValueError, "qo_indptr", lambda: _p(qo=[0, 5, 6], kv=[0, 4, 9], mask_type="causal")),
    ("causal_window_sq_gt_sk", ValueError, "qo_indptr",
     lambda: _p(qo=[0, 2, 8], kv=[0, 4, 9], mask_type="causal", window_left=1)),
    # masks
    ("vw_packed", ValueError, "mask_type", lambda: _p(mask_type="variable_window")),
    ("vw_packed_with_bounds", ValueError, "mask_type|variable_window",
     lambda: _p(mask_type="variable_window", variable_window_token_starts=torch.zeros(1, 5, dtype=I32),
                variable_window_token_ends=torch.zeros(1, 5, dtype=I32))),
    ("bounds_with_packed_dense", ValueError, "variable_window_token",
     lambda: _p(variable_window_token_starts=torch.zeros(1, 5, dtype=I32),
                variable_window_token_ends=torch.zeros(1, 5, dtype=I32))),
    ("window_without_causal", ValueError, "window_left", lambda: _p(window_left=1)),
    ("window_minus_2", ValueError, "window_left", lambda: _p(mask_type="causal", window_left=-2)),
    ("mask_unknown", ValueError, "mask_type", lambda: _p(mask_type="causal_lower")),
    ("sm_scale_nan", ValueError, "sm_scale", lambda: _p(sm_scale=math.nan)),
    ("output_scale_zero", ValueError, "output_scale", lambda: _p(output_scale=0.0)),
    # out
    ("out_fixed_shape", ValueError, r"\bout\b", lambda: _p(out=torch.empty(1, 5, HQ, D, dtype=BF16))),
    ("out_is_q", ValueError, r"\bout must not overlap q\b", lambda: _p(q=_qp, out=_qp)),
    ("out_overlaps_qo_indptr", ValueError, r"\bout must not overlap qo_indptr\b", _packed_out_overlaps_indptr),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in PACKED_CASES], ids=[c[0] for c in PACKED_CASES])
def test_packed_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, batch_prefill, *args, **kwargs)


@pytest.mark.parametrize("which", ["qo_indptr", "kv_indptr", "variable_window_token_starts",
                                   "variable_window_token_ends"])
def test_metadata_not_a_tensor_is_type_error(which):
    if which.endswith("indptr"):
        q, k, v = packed()
        kwargs = dict(qo_indptr=ip(QO), kv_indptr=ip(KV))
    else:
        q, k, v = fixed()
        kwargs = dict(mask_type="variable_window", variable_window_token_starts=_s.clone(),
                      variable_window_token_ends=_e.clone())
    kwargs[which] = kwargs[which].tolist()
    expect(TypeError, which, batch_prefill, q, k, v, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32], ids=["float64", "int32"])
def test_out_of_unsupported_dtype_names_out(dtype):
    q, k, v = fixed()
    expect(ValueError, r"\bout\b", batch_prefill, q, k, v, out=torch.empty(q.shape, dtype=dtype))


def test_error_leaves_out_untouched():
    """A refused call writes nothing: the poisoned out is still all NaN."""
    q, k, v = packed()
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    expect(ValueError, "kv_indptr", batch_prefill, q, k, v, qo_indptr=ip(QO), kv_indptr=ip([0, 4, 8]), out=out)
    assert torch.isnan(out).all()
    qf, kf, vf = fixed(sq=SK + 2)
    out = torch.full(qf.shape, float("nan"), dtype=BF16)
    expect(ValueError, r"\bq\b|Sq", batch_prefill, qf, kf, vf, mask_type="causal", out=out)
    assert torch.isnan(out).all()


def test_metadata_not_modified_by_validation():
    q, k, v = packed()
    qo, kv = ip(QO), ip(KV)
    batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kv, mask_type="causal")
    assert qo.tolist() == QO and kv.tolist() == KV


# ----------------------------------------------------------------------------
# BatchPrefillTSWrapper: plan(q, k, v, ...) then run(q, k, v, out=...)
# ----------------------------------------------------------------------------


def _plan_run(q, k, v, *, out=None, **kw):
    """The wrapper form of a one-shot call: plan over these tensors, run them into ``out``."""
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, **kw)
    return w.run(q, k, v, out=out)


ONESHOT_CASES = [("fixed-" + c[0], *c[1:]) for c in FIXED_CASES] + [("packed-" + c[0], *c[1:]) for c in PACKED_CASES]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in ONESHOT_CASES], ids=[c[0] for c in ONESHOT_CASES])
def test_wrapper_refuses_every_oneshot_case(exc, match, make):
    """plan takes the one-shot's arguments (out goes to run): every refused one-shot call is refused."""
    args, kwargs = make()
    expect(exc, match, _plan_run, *args, **kwargs)


def test_wrapper_base_inputs_are_valid():
    q, k, v = fixed()
    assert _plan_run(q, k, v, mask_type="causal").shape == q.shape
    s, e = bounds()
    assert _plan_run(q, k, v, mask_type="variable_window", variable_window_token_starts=s,
                     variable_window_token_ends=e).shape == q.shape
    qp, kp, vp = packed()
    out = torch.empty(qp.shape, dtype=torch.float32)
    assert _plan_run(qp, kp, vp, qo_indptr=ip(QO), kv_indptr=ip(KV), mask_type="causal", window_left=1,
                     out_dtype=torch.float32, out=out) is out


# ----------------------------------------------------------------------------
# BatchPrefillTSWrapper.plan: refused by plan itself (the old plan's cases, in the new signature)
# ----------------------------------------------------------------------------

PLAN_CASES = [
    # packed offsets
    ("only_qo_indptr", ValueError, "kv_indptr", lambda: _p(kv_indptr=None)),
    ("only_kv_indptr", ValueError, "qo_indptr", lambda: _p(qo_indptr=None)),
    ("qo_int64", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip(QO, torch.int64))),
    ("kv_int64", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip(KV, torch.int64))),
    ("qo_2d", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([QO]))),
    ("kv_2d", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([KV]))),
    ("qo_list", TypeError, "qo_indptr", lambda: _p(qo_indptr=list(QO))),
    ("kv_list", TypeError, "kv_indptr", lambda: _p(kv_indptr=list(KV))),
    ("lengths_differ", ValueError, "kv_indptr", lambda: _p(kv=[0, 2, 4, 9])),
    ("qo_single_entry", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([0]), kv_indptr=ip([0]))),
    ("kv_meta", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip(KV).to("meta"))),
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([1, 3, 5]))),
    ("kv_not_start_0", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([1, 4, 9]))),
    ("qo_not_strict", ValueError, "qo_indptr", lambda: _p(qo=[0, 3, 3, 5], kv=[0, 4, 6, 9])),
    ("kv_decreasing", ValueError, "kv_indptr", lambda: _p(qo=[0, 3, 4, 5], kv=[0, 4, 3, 9])),
    # the totals are q's and k's now (the old plan took them from the offsets' last entries)
    ("qo_not_end_at_q", ValueError, "qo_indptr", lambda: _p(qo_indptr=ip([0, 3, 4]))),
    ("kv_not_end_at_k", ValueError, "kv_indptr", lambda: _p(kv_indptr=ip([0, 4, 10]))),
    ("causal_packed_sq_gt_sk", ValueError, "qo_indptr", lambda: _p(qo=[0, 5, 6], kv=[0, 4, 9], mask_type="causal")),
    # fixed shapes come from q, k, v (were batch_size / q_len / kv_len and the head counts)
    ("causal_fixed_sq_gt_sk", ValueError, r"\bq\b", lambda: _f(q=fixed(sq=SK + 1)[0], mask_type="causal")),
    ("q_none", TypeError, r"\bq\b", lambda: _f(q=None)),
    ("k_none", TypeError, r"\bk\b", lambda: _f(k=None)),
    ("v_none", TypeError, r"\bv\b", lambda: _f(v=None)),
    ("q_list", TypeError, r"\bq\b", lambda: _f(q=_q.tolist())),
    ("k_fixed_sk_0", ValueError, r"\bk\b", lambda: _f(k=fixed(sk=0)[1], v=fixed(sk=0)[2])),
    ("q_no_heads", ValueError, r"\bq\b", lambda: _f(q=fixed(hq=0)[0])),
    ("heads_not_multiple", ValueError, r"\bq\b|\bk\b",
     lambda: _f(q=fixed(hq=3)[0], k=fixed(hkv=2)[1], v=fixed(hkv=2)[2])),
    ("head_dim_64", ValueError, r"\bq\b", lambda: _f(q=_q[..., :64], k=_k[..., :64], v=_v[..., :64])),
    ("k_head_dim_differs", ValueError, r"\bk\b", lambda: _f(k=fixed(d=256)[1], v=fixed(d=256)[2])),
    ("q_float32", ValueError, r"\bq\b", lambda: _f(q=_q.float(), k=_k.float(), v=_v.float())),
    ("k_dtype_differs", ValueError, r"\bk\b", lambda: _f(k=_k.half())),
    ("q_inner_noncontig", ValueError, r"\bq\b", lambda: _f(q=_noncontig_inner(_q))),
    ("q_meta", ValueError, r"\bq\b|\bk\b", lambda: _f(q=_q.to("meta"))),
    # masks, scales, output dtype
    ("mask_unknown", ValueError, "mask_type", lambda: _f(mask_type="full")),
    ("window_minus_2", ValueError, "window_left", lambda: _f(mask_type="causal", window_left=-2)),
    ("window_without_causal", ValueError, "window_left", lambda: _f(window_left=4)),
    ("vw_packed", ValueError, "mask_type", lambda: _p(mask_type="variable_window")),
    ("vw_with_window", ValueError, "window_left",
     lambda: _f(mask_type="variable_window", window_left=1, variable_window_token_starts=_s.clone(),
                variable_window_token_ends=_e.clone())),
    ("sm_scale_inf", ValueError, "sm_scale", lambda: _f(sm_scale=math.inf)),
    ("sm_scale_neg", ValueError, "sm_scale", lambda: _f(sm_scale=-1.0)),
    ("sm_scale_str", TypeError, "sm_scale", lambda: _f(sm_scale="x")),
    ("output_scale_nan", ValueError, "output_scale", lambda: _f(output_scale=math.nan)),
    ("output_scale_zero", ValueError, "output_scale", lambda: _f(output_scale=0.0)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda: _f(out_dtype=torch.float64)),
    ("out_dtype_str", TypeError, "out_dtype", lambda: _f(out_dtype="float32")),
    # variable-window bounds are plan arguments now (they were run's)
    ("vw_missing_both", ValueError, "variable_window_token_starts", lambda: _f(mask_type="variable_window")),
    ("vw_missing_ends", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.clone())),
    ("vw_starts_wrong_shape", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s[:, :2].clone(),
                variable_window_token_ends=_e[:, :2].clone())),
    ("vw_ends_int64", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.clone(),
                variable_window_token_ends=_e.long())),
    ("vw_bounds_meta", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.to("meta"),
                variable_window_token_ends=_e.to("meta"))),
    ("vw_start_gt_end", ValueError, "variable_window_token_starts",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=torch.full((B, SQ), 3, dtype=I32),
                variable_window_token_ends=torch.full((B, SQ), 2, dtype=I32))),
    ("vw_end_eq_sk", ValueError, "variable_window_token_ends",
     lambda: _f(mask_type="variable_window", variable_window_token_starts=_s.clone(),
                variable_window_token_ends=torch.full((B, SQ), SK, dtype=I32))),
    ("vw_bounds_with_causal", ValueError, "variable_window_token",
     lambda: _f(mask_type="causal", variable_window_token_starts=_s.clone(), variable_window_token_ends=_e.clone())),
    ("vw_bounds_with_packed", ValueError, "variable_window_token",
     lambda: _p(variable_window_token_starts=torch.zeros(1, 5, dtype=I32),
                variable_window_token_ends=torch.zeros(1, 5, dtype=I32))),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_wrapper_plan_errors(exc, match, make):
    args, kwargs = make()
    w = BatchPrefillTSWrapper()
    expect(exc, match, w.plan, *args, **kwargs)
    # a refused plan leaves no plan behind
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        w.run(*fixed())


# ----------------------------------------------------------------------------
# BatchPrefillTSWrapper.run: tensors against the plan, out
# ----------------------------------------------------------------------------


def _wrapper(kind, **kw):
    w = BatchPrefillTSWrapper()
    if kind == "packed":
        w.plan(*packed(), qo_indptr=ip(QO), kv_indptr=ip(KV), **kw)
    else:
        w.plan(*fixed(), **kw)
    return w


def test_wrapper_run_before_plan():
    for w, (q, k, v) in ((BatchPrefillTSWrapper(), fixed()), (BatchPrefillTSWrapper(), packed())):
        with reference_must_not_run("batch_prefill"):
            with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
                w.run(q, k, v)


def _r(kind, **mods):
    q, k, v = packed() if kind == "packed" else fixed()
    args = dict(q=q, k=k, v=v)
    kwargs = {}
    for key, val in mods.items():
        (args if key in args else kwargs)[key] = val
    return (args["q"], args["k"], args["v"]), kwargs


def _misaligned(t):
    """Same shape and values as t, starting 2 bytes past a 16-byte boundary."""
    view = torch.zeros(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)
    view.copy_(t)
    return view


def _overlap_kv_indptr():
    """out (fp32) shares bytes with the planned kv_indptr: plan binds the caller's tensor."""
    q, k, v = packed()
    buf = torch.zeros(q.numel() * 4, dtype=torch.uint8)
    out = buf.view(torch.float32).view(q.shape)
    kv = buf[:12].view(I32)
    kv.copy_(ip(KV))
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, qo_indptr=ip(QO), kv_indptr=kv, out_dtype=torch.float32)
    return w, (q, k, v), out


RUN_CASES = [
    # shapes differ from the plan
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=fixed(sq=SQ - 1)[0])),
    ("fixed", {}, ValueError, r"\bk\b", lambda: _r("fixed", k=fixed(sk=SK + 1)[1], v=fixed(sk=SK + 1)[2])),
    ("fixed", {}, ValueError, r"\bv\b", lambda: _r("fixed", v=fixed(sk=SK + 1)[2])),
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=torch.cat([_q, _q])[:B + 1])),
    ("fixed", {}, ValueError, r"\bq\b|heads", lambda: _r("fixed", q=fixed(hq=2 * HQ)[0])),
    ("fixed", {}, ValueError, r"\bq\b|\bk\b", lambda: _r("fixed", k=fixed(hkv=1)[1], v=fixed(hkv=1)[2])),
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=fixed(d=256)[0], k=fixed(d=256)[1],
                                                       v=fixed(d=256)[2])),
    ("packed", {}, ValueError, r"\bq\b", lambda: _r("packed", q=packed(tq=6)[0])),
    ("packed", {}, ValueError, r"\bk\b", lambda: _r("packed", k=packed(tk=8)[1], v=packed(tk=8)[2])),
    # storage kind differs from the plan
    ("packed", {}, ValueError, r"\bq\b", lambda: _r("packed", q=_q, k=_k, v=_v)),
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=_qp, k=_kp, v=_vp)),
    # dtypes
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=_q.half(), k=_k.half(), v=_v.half())),
    ("fixed", {}, ValueError, r"\bk\b", lambda: _r("fixed", k=_k.half())),
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=_q.float(), k=_k.float(), v=_v.float())),
    # strides and alignment (same shape, dtype and device as planned)
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=_noncontig_inner(_q))),
    ("fixed", {}, ValueError, r"\bk\b", lambda: _r("fixed", k=_noncontig_inner(_k))),
    ("packed", {}, ValueError, r"\bv\b", lambda: _r("packed", v=_noncontig_inner(_vp))),
    ("fixed", {}, ValueError, r"\bq\b", lambda: _r("fixed", q=_misaligned(_q))),
    # devices
    ("fixed", {}, ValueError, r"\bk\b", lambda: _r("fixed", k=_k.to("meta"))),
    ("packed", {}, ValueError, r"\bv\b", lambda: _r("packed", v=_vp.to("meta"))),
    ("packed", {}, ValueError, r"\bq\b", lambda: _r("packed", q=_qp.to("meta"), k=_kp.to("meta"), v=_vp.to("meta"))),
    # Python types
    ("fixed", {}, TypeError, r"\bq\b", lambda: _r("fixed", q=_q.tolist())),
    ("packed", {}, TypeError, r"\bk\b", lambda: _r("packed", k=None)),
    # out
    ("fixed", {}, ValueError, r"\bout\b", lambda: _r("fixed", out=torch.empty(B, SQ, HQ, D + 1, dtype=BF16))),
    ("fixed", {}, ValueError, r"\bout\b", lambda: _r("fixed", out=torch.empty(B, SQ, HQ, D, dtype=torch.float32))),
    ("fixed", dict(out_dtype=torch.float32), ValueError, r"\bout\b",
     lambda: _r("fixed", out=torch.empty(B, SQ, HQ, D, dtype=BF16))),
    ("fixed", {}, ValueError, r"\bout\b",
     lambda: _r("fixed", out=torch.empty(B, SQ, HQ, D, dtype=BF16, device="meta"))),
    ("fixed", {}, ValueError, r"\bout\b",
     lambda: _r("fixed", out=torch.empty(B, SQ, D, HQ, dtype=BF16).transpose(2, 3))),
    ("fixed", {}, ValueError, r"\bout\b", lambda: _r("fixed", out=_misaligned(torch.empty_like(_q)))),
    ("fixed", {}, ValueError, r"\bout must not overlap q\b", lambda: _r("fixed", q=_q, out=_q)),
    ("fixed", {}, ValueError, r"\bout must not overlap k\b", lambda: _overlap_k()),
    ("fixed", {}, ValueError, r"\bout must not overlap q\b", lambda: _overlap_q_tail()),
    ("packed", {}, ValueError, r"\bout must not overlap q\b", lambda: _r("packed", q=_qp, out=_qp)),
    ("fixed", {}, TypeError, r"\bout\b", lambda: _r("fixed", out=0)),
]


@pytest.mark.parametrize("kind,plan_kw,exc,match,make", RUN_CASES,
                         ids=[f"{c[0]}-{i}-{c[3].replace(chr(92) + 'b', '').split('|')[0].replace(' ', '_')}"
                              for i, c in enumerate(RUN_CASES)])
def test_wrapper_run_errors(kind, plan_kw, exc, match, make):
    w = _wrapper(kind, **plan_kw)
    args, kwargs = make()
    expect(exc, match, w.run, *args, **kwargs)


@pytest.mark.parametrize("what", ["qo_indptr", "kv_indptr", "variable_window_token_starts"])
def test_wrapper_run_out_overlapping_planned_metadata(what):
    """The plan binds the caller's offsets and window bounds (run reads them): out must not overlap them."""
    if what == "qo_indptr":
        q, k, v = packed()
        buf = torch.zeros(q.numel() * 2, dtype=torch.uint8)
        out = buf.view(BF16).view(q.shape)
        qo = buf[:12].view(I32)
        qo.copy_(ip(QO))
        w = BatchPrefillTSWrapper()
        w.plan(q, k, v, qo_indptr=qo, kv_indptr=ip(KV))
    elif what == "kv_indptr":
        w, (q, k, v), out = _overlap_kv_indptr()
    else:
        (q, k, v), kw = _overlap_bounds()
        out = kw.pop("out")
        w = BatchPrefillTSWrapper()
        w.plan(q, k, v, **kw)
    expect(ValueError, rf"\bout must not overlap {what}\b", w.run, q, k, v, out=out)


def test_wrapper_old_forms_are_gone():
    """FlashInfer main's signatures: no device constructor argument, no shape-only or offsets-only plan,
    no window bounds at run (they are plan arguments)."""
    q, k, v = fixed()
    with reference_must_not_run("batch_prefill"):
        with pytest.raises(TypeError):
            BatchPrefillTSWrapper("cpu")
        with pytest.raises(TypeError):
            BatchPrefillTSWrapper().plan(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, batch_size=B, q_len=SQ,
                                         kv_len=SK)
        with pytest.raises(TypeError):
            BatchPrefillTSWrapper().plan(ip(QO), ip(KV), num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D)
        s, e = bounds()
        w = _wrapper("fixed", mask_type="variable_window", variable_window_token_starts=s,
                     variable_window_token_ends=e)
        with pytest.raises(TypeError):
            w.run(q, k, v, variable_window_token_starts=s, variable_window_token_ends=e)


@pytest.mark.parametrize("tuning", ["loop=1", 1, {"loop": 1}], ids=["str", "int", "dict"])
def test_wrapper_tuning_must_be_a_tuning(tuning):
    """tuning= takes a prims_ts.Tuning (None: the default); anything else is a TypeError naming tuning,
    raised by the constructor, plan or run, before any launch."""
    q, k, v = fixed()
    with reference_must_not_run("batch_prefill"):
        with pytest.raises(TypeError, match=r"\btuning\b"):
            w = BatchPrefillTSWrapper(tuning=tuning)
            w.plan(q, k, v)
            w.run(q, k, v)


@pytest.mark.parametrize("kind", ["fixed", "packed", "variable_window"])
def test_wrapper_run_reads_nothing_on_the_host(kind):
    """run passes the plan's bound metadata (the caller's tensors) and tuning to the op, reading no
    tensor value on the host."""
    tuning = Tuning(loop=1)
    w = BatchPrefillTSWrapper(tuning=tuning)
    if kind == "packed":
        q, k, v = packed()
        qo, kv = ip(QO), ip(KV)
        w.plan(q, k, v, qo_indptr=qo, kv_indptr=kv, mask_type="causal")
        bound = (qo, kv, None, None)
    else:
        q, k, v = fixed()
        s, e = bounds() if kind == "variable_window" else (None, None)
        w.plan(q, k, v, mask_type="variable_window" if s is not None else "dense", variable_window_token_starts=s,
               variable_window_token_ends=e)
        bound = (None, None, s, e)
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    with recording_no_host_reads("batch_prefill", "batch_prefill") as rec:
        assert w.run(q, k, v, out=out) is out
        res = w.run(q, k, v)
    assert [c[0] for c in rec.calls] == ["batch_prefill_out", "batch_prefill"]
    (_, out_args), (_, fn_args) = rec.calls
    assert out_args[3] is out
    for got, want in ((out_args[:3], (q, k, v)), (fn_args[:3], (q, k, v)), (out_args[4:8], bound),
                      (fn_args[3:7], bound)):
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), got
    assert out_args[-1] == fn_args[-1] == tuning.encode() != ""
    assert fn_args[-2] == dtype_code(BF16) and res.dtype == BF16


def test_wrapper_failed_plan_keeps_previous_plan_usable():
    """A refused re-plan must not leave a half-written plan behind that run would then use."""
    w = _wrapper("fixed")
    q, k, v = fixed()
    ref = w.run(q, k, v)
    expect(ValueError, r"\bq\b", w.plan, q[..., :64], k[..., :64], v[..., :64])
    expect(ValueError, "qo_indptr", w.plan, *packed(), qo_indptr=ip([0, 3, 4]), kv_indptr=ip(KV))
    torch.testing.assert_close(w.run(q, k, v), ref, rtol=0, atol=0)
    expect(ValueError, r"\bq\b", w.run, *packed())  # still the fixed plan
