"""torch.library.opcheck on the paged decode ops with CPU tensors.

opcheck runs, for each sample:
  test_schema                - the schema's mutation/aliasing annotations match what the op does;
  test_autograd_registration - an autograd kernel is registered where inputs may require grad;
  test_faketensor            - the fake (meta/decode.py) agrees with the real kernel;
  test_aot_dispatch_dynamic  - the op traces through AOTAutograd with dynamic shapes and gives the
                               same result as eager.

The op signatures (``prims_ts/ops/decode.py``):
  batch_decode(query, k_cache, v_cache, workspace, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
               max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale, out_dtype: int,
               tuning: str = "") -> Tensor
  batch_decode_out(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr,
                   seq_len_q, max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale,
                   tuning: str = "") -> ()
``out_dtype`` is an output dtype code (``prims_ts.ops._validate.dtype_code``); ``tuning`` an encoded
``prims_ts.Tuning`` (defaulted: calls without it are checked too).
Samples: fixed [B, Hq, D], fixed [B, SQ, Hq, D] (SQ > 1) and packed [T, Hq, D] queries; K/V as two
separate pools or as the two (strided) halves of one combined cache.
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from prims_ts.ops._validate import dtype_code
import prims_ts  # noqa: F401  (registers the ops and their fakes)
from prims_ts import Tuning, get_prims_ts_batch_decode_workspace_size
from prims_ts import reference as R
from prims_ts.testing import OPCHECK_TESTS, assert_opcheck_passed, rel_err

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
D = 128
PS = 16


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def sample(qmode, mask, window, dtype, seed=0, combined=False, max_seq_len=64):
    """3 requests (kv lens 20, 3, 33) over a 9-page pool with non-identity and repeated page IDs
    (page 2 is used by all three), one spare CSR entry after request 1."""
    lens = [20, 3, 33]
    indptr, indices = [0, 2, 4, 7], [7, 2, 2, -1, 5, 8, 2]
    hq, hkv, P = 4, 2, 9
    if combined:
        kv = _randn((P, 2, hkv, PS, D), dtype, seed + 1)
        k, v = kv[:, 0], kv[:, 1]
    else:
        k, v = _randn((P, hkv, PS, D), dtype, seed + 1), _randn((P, hkv, PS, D), dtype, seed + 2)
    qo = None
    if qmode == "single":
        q, sq, msq = _randn((3, hq, D), dtype, seed), 1, 1
    elif qmode == "fixed":
        q, sq, msq = _randn((3, 3, hq, D), dtype, seed), 3, 3
    else:
        q, sq, msq = _randn((6, hq, D), dtype, seed), 1, 4  # q lens 2, 1, 3 under a bound of 4
        qo = torch.tensor([0, 2, 3, 6], dtype=I32)
    qkw = dict(qo_indptr=qo, max_seq_len_q=msq) if qo is not None else dict(seq_len_q=sq)
    ws = torch.zeros(get_prims_ts_batch_decode_workspace_size(3, hq, hkv, D, PS, max_seq_len, **qkw, device="cpu"),
                     dtype=torch.uint8)
    meta = (torch.tensor(indptr, dtype=I32), torch.tensor(indices, dtype=I32), torch.tensor(lens, dtype=I32), qo)
    scalars = (sq, msq, max_seq_len, mask, window, 0.09, 0.75)
    return q, k, v, ws, meta, scalars


def _reference(q, k, v, meta, scalars):
    _, _, _, mask, window, sm_scale, output_scale = scalars
    return R.batch_decode(q, k, v, meta[0], meta[1], meta[2], qo_indptr=meta[3], mask_type=mask, window_left=window,
                          sm_scale=sm_scale, output_scale=output_scale, compute_dtype=torch.float64)


CASES = [("single", "dense", -1, BF16, BF16, False), ("single", "causal", 1, FP16, FP32, True),
         ("fixed", "causal", -1, FP16, FP16, False), ("fixed", "dense", -1, BF16, FP32, True),
         ("packed", "causal", 2, BF16, BF16, True), ("packed", "dense", -1, FP16, FP32, False)]
IDS = [f"{qm}-{m}{w if w >= 0 else ''}-{'combined' if c else 'pools'}" for qm, m, w, _, _, c in CASES]


@pytest.mark.parametrize("qmode,mask,window,dtype,out_dtype,combined", CASES, ids=IDS)
def test_opcheck_batch_decode(qmode, mask, window, dtype, out_dtype, combined):
    q, k, v, ws, meta, scalars = sample(qmode, mask, window, dtype, combined=combined)
    args = (q, k, v, ws, *meta, *scalars, dtype_code(out_dtype))
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_decode.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_decode(*args)
    assert res.dtype == out_dtype and res.shape == q.shape
    assert rel_err(res, _reference(q, k, v, meta, scalars)) <= 2e-2


@pytest.mark.parametrize("qmode,mask,window,dtype,out_dtype,combined", CASES, ids=IDS)
def test_opcheck_batch_decode_out(qmode, mask, window, dtype, out_dtype, combined):
    q, k, v, ws, meta, scalars = sample(qmode, mask, window, dtype, seed=10, combined=combined)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    args = (q, k, v, ws, out, *meta, *scalars)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_decode_out.default, args, test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.batch_decode_out(*args) is None
    assert rel_err(out, _reference(q, k, v, meta, scalars)) <= 2e-2


def test_opcheck_split_kv_key():
    """A static max_seq_len large enough for a split-KV policy (a bigger workspace); same result."""
    q, k, v, ws, meta, scalars = sample("packed", "causal", -1, BF16, seed=20, max_seq_len=8192)
    assert ws.numel() > 256
    args = (q, k, v, ws, *meta, *scalars, dtype_code(BF16))
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_decode.default, args, test_utils=OPCHECK_TESTS))
    assert rel_err(torch.ops.prims_ts.batch_decode(*args), _reference(q, k, v, meta, scalars)) <= 2e-2


def test_opcheck_with_requires_grad_inputs():
    """Inference ops without a backward formula: with inputs that require grad there must be an autograd
    kernel (custom_op's raises on backward), not a silent detach."""
    q, k, v, ws, meta, scalars = sample("single", "causal", -1, FP32, seed=30)
    q, k, v = (t.to(BF16).requires_grad_() for t in (q, k, v))
    args = (q, k, v, ws, *meta, *scalars, dtype_code(BF16))
    names = ("test_schema", "test_autograd_registration", "test_faketensor")
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_decode.default, args, test_utils=names), names)
    res = torch.ops.prims_ts.batch_decode(*args)
    assert res.requires_grad
    with pytest.raises(RuntimeError, match="autograd|backward"):
        res.float().sum().backward()


def test_fake_tensor_shapes():
    """The fakes give the query's shape and the requested dtype, and never read data."""
    for qmode in ("single", "fixed", "packed"):
        q, k, v, ws, meta, scalars = sample(qmode, "causal", 3, BF16)
        mq, mk, mv, mws = (t.to("meta") for t in (q, k, v, ws))
        mmeta = tuple(t.to("meta") if t is not None else None for t in meta)
        res = torch.ops.prims_ts.batch_decode(mq, mk, mv, mws, *mmeta, *scalars, dtype_code(FP32))
        assert res.device.type == "meta" and res.shape == q.shape and res.dtype == FP32
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode() as mode:
            fq, fk, fv, fws = (mode.from_tensor(t) for t in (q, k, v, ws))
            fmeta = tuple(mode.from_tensor(t) if t is not None else None for t in meta)
            res = torch.ops.prims_ts.batch_decode(fq, fk, fv, fws, *fmeta, *scalars, dtype_code(FP16))
            assert res.shape == q.shape and res.dtype == FP16
            res = torch.ops.prims_ts.batch_decode(fq, fk, fv, fws, *fmeta, *scalars, dtype_code(BF16), TICKET)
            assert res.shape == q.shape and res.dtype == BF16
            fout = torch.empty(q.shape, dtype=FP32)
            assert torch.ops.prims_ts.batch_decode_out(fq, fk, fv, fws, fout, *fmeta, *scalars) is None
            assert torch.ops.prims_ts.batch_decode_out(fq, fk, fv, fws, fout, *fmeta, *scalars, TICKET) is None


TICKET = Tuning(cluster_merge=False).encode()  # a non-default tuning string: the ops carry it unchanged


@pytest.mark.parametrize("qmode,mask,window", [("single", "causal", 2), ("fixed", "dense", -1),
                                               ("packed", "causal", -1)])
def test_opcheck_with_tuning_string(qmode, mask, window):
    """The trailing ``tuning`` argument (an encoded Tuning) passes opcheck on both ops and leaves the
    CPU result unchanged (on CPU every tuning runs the reference)."""
    assert TICKET and Tuning.decode(TICKET) == Tuning(cluster_merge=False)
    q, k, v, ws, meta, scalars = sample(qmode, mask, window, FP16, seed=40, combined=qmode == "fixed",
                                        max_seq_len=4096)
    want = _reference(q, k, v, meta, scalars)
    args = (q, k, v, ws, *meta, *scalars, dtype_code(FP32), TICKET)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_decode.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_decode(*args)
    assert res.dtype == FP32 and rel_err(res, want) <= 5e-3
    default = torch.ops.prims_ts.batch_decode(*args[:-1])  # tuning left at its default ""
    torch.testing.assert_close(res, default, rtol=0, atol=0)
    out = torch.full(q.shape, float("nan"), dtype=BF16)
    args = (q, k, v, ws, out, *meta, *scalars, TICKET)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_decode_out.default, args, test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.batch_decode_out(*args) is None
    assert rel_err(out, want) <= 2e-2
