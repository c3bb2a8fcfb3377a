"""torch.library.opcheck on the MLA decode ops with CPU tensors.

opcheck runs, for each sample:
  test_schema                - the schema's mutation/aliasing annotations match what the op does;
  test_autograd_registration - an autograd kernel is registered where inputs may require grad;
  test_faketensor            - the fake (meta/mla.py) agrees with the real kernel;
  test_aot_dispatch_dynamic  - the op traces through AOTAutograd with dynamic shapes and gives the
                               same result as eager.

The op signatures (``prims_ts/ops/mla.py``):
  batch_mla_decode(query, kv_cache, workspace, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len,
                   mask_type, sm_scale, output_scale, out_dtype: int, tuning: str = "") -> Tensor
  batch_mla_decode_out(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q,
                       max_seq_len, mask_type, sm_scale, output_scale, tuning: str = "") -> ()
``out_dtype`` is an output dtype code (``prims_ts.ops._validate.dtype_code``); ``tuning`` an encoded
``prims_ts.Tuning`` (defaulted: calls without it are checked too).
``kv_cache`` is the 3-D ``[P, page_size, 576]`` pool (the public functions view a 4-D cache as one).
Samples: fixed [B, SQ, H, 576] (SQ 1 and 3) and packed [T, H, 576] queries, a padded (row-strided)
block table with repeated page IDs and garbage past the live pages.
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from prims_ts.ops._validate import dtype_code
import prims_ts  # noqa: F401  (registers the ops and their fakes)
from prims_ts import Tuning, get_prims_ts_batch_decode_mla_workspace_size
from prims_ts import reference as R
from prims_ts.testing import OPCHECK_TESTS, assert_opcheck_passed, rel_err

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
DQK, DV = 576, 512
PS = 16


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def sample(qmode, mask, dtype, seed=0, h=8, max_seq_len=64):
    """3 requests (kv lens 20, 3, 33) over a 9-page pool: page 2 is used by all three; the table is a
    row-strided view and holds garbage past each request's live pages."""
    lens = [20, 3, 33]
    wide = torch.tensor([[7, 2, -1, 0, 0], [2, 99, -5, 0, 0], [5, 8, 2, 0, 0]], dtype=I32)
    table = wide[:, :3]
    cache = _randn((9, PS, DQK), dtype, seed + 1)
    qo = None
    if qmode == "single":
        q, msq = _randn((3, 1, h, DQK), dtype, seed), 1
    elif qmode == "fixed":
        q, msq = _randn((3, 3, h, DQK), dtype, seed), 3
    else:
        q, msq = _randn((6, h, DQK), dtype, seed), 4  # q lens 2, 1, 3 under a bound of 4
        qo = torch.tensor([0, 2, 3, 6], dtype=I32)
    ws = torch.zeros(get_prims_ts_batch_decode_mla_workspace_size(3, h, DV, DQK - DV, PS, max_seq_len, seq_len_q=msq,
                                                                  device="cpu"), dtype=torch.uint8)
    meta = (table, torch.tensor(lens, dtype=I32), qo)
    scalars = (msq, max_seq_len, mask, 0.04, 0.75)
    return q, cache, ws, meta, scalars


def _reference(q, cache, meta, scalars):
    _, _, mask, sm_scale, output_scale = scalars
    return R.batch_mla_decode(q, cache, meta[0], meta[1], qo_indptr=meta[2], mask_type=mask, sm_scale=sm_scale,
                              output_scale=output_scale, compute_dtype=torch.float64)


CASES = [("single", "causal", BF16, BF16), ("single", "dense", FP16, FP32), ("fixed", "causal", FP16, FP16),
         ("fixed", "dense", BF16, FP32), ("packed", "causal", BF16, BF16), ("packed", "dense", FP16, BF16)]
IDS = [f"{qm}-{m}-{str(dt)[6:]}-to-{str(o)[6:]}" for qm, m, dt, o in CASES]


def _out_shape(q):
    return tuple(q.shape[:-1]) + (DV,)


@pytest.mark.parametrize("qmode,mask,dtype,out_dtype", CASES, ids=IDS)
def test_opcheck_batch_mla_decode(qmode, mask, dtype, out_dtype):
    q, cache, ws, meta, scalars = sample(qmode, mask, dtype)
    args = (q, cache, ws, *meta, *scalars, dtype_code(out_dtype))
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_mla_decode.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_mla_decode(*args)
    assert res.dtype == out_dtype and res.shape == _out_shape(q)
    assert rel_err(res, _reference(q, cache, meta, scalars)) <= 2e-2


@pytest.mark.parametrize("qmode,mask,dtype,out_dtype", CASES, ids=IDS)
def test_opcheck_batch_mla_decode_out(qmode, mask, dtype, out_dtype):
    q, cache, ws, meta, scalars = sample(qmode, mask, dtype, seed=10)
    out = torch.full(_out_shape(q), float("nan"), dtype=out_dtype)
    args = (q, cache, ws, out, *meta, *scalars)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_mla_decode_out.default, args, test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.batch_mla_decode_out(*args) is None
    assert rel_err(out, _reference(q, cache, meta, scalars)) <= 2e-2


def test_opcheck_split_kv_key():
    """A static max_seq_len large enough for a split-KV policy (a bigger workspace); same result."""
    q, cache, ws, meta, scalars = sample("packed", "causal", BF16, seed=20, max_seq_len=8192)
    assert ws.numel() > 256
    args = (q, cache, ws, *meta, *scalars, dtype_code(BF16))
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_mla_decode.default, args, test_utils=OPCHECK_TESTS))
    assert rel_err(torch.ops.prims_ts.batch_mla_decode(*args), _reference(q, cache, meta, scalars)) <= 2e-2


def test_opcheck_with_requires_grad_inputs():
    """Inference ops without a backward formula: with inputs that require grad there must be an autograd
    kernel (custom_op's raises on backward), not a silent detach."""
    q, cache, ws, meta, scalars = sample("single", "causal", FP32, seed=30)
    q, cache = (t.to(BF16).requires_grad_() for t in (q, cache))
    args = (q, cache, ws, *meta, *scalars, dtype_code(BF16))
    names = ("test_schema", "test_autograd_registration", "test_faketensor")
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_mla_decode.default, args, test_utils=names), names)
    res = torch.ops.prims_ts.batch_mla_decode(*args)
    assert res.requires_grad
    with pytest.raises(RuntimeError, match="autograd|backward"):
        res.float().sum().backward()


def test_fake_tensor_shapes():
    """The fakes give [..., 512] and the requested dtype, and never read data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for qmode in ("single", "fixed", "packed"):
        q, cache, ws, meta, scalars = sample(qmode, "causal", BF16)
        mq, mc, mws = (t.to("meta") for t in (q, cache, ws))
        mmeta = tuple(t.to("meta") if t is not None else None for t in meta)
        res = torch.ops.prims_ts.batch_mla_decode(mq, mc, mws, *mmeta, *scalars, dtype_code(FP32))
        assert res.device.type == "meta" and res.shape == _out_shape(q) and res.dtype == FP32
        with FakeTensorMode() as mode:
            fq, fc, fws = (mode.from_tensor(t) for t in (q, cache, ws))
            fmeta = tuple(mode.from_tensor(t) if t is not None else None for t in meta)
            res = torch.ops.prims_ts.batch_mla_decode(fq, fc, fws, *fmeta, *scalars, dtype_code(FP16))
            assert res.shape == _out_shape(q) and res.dtype == FP16
            res = torch.ops.prims_ts.batch_mla_decode(fq, fc, fws, *fmeta, *scalars, dtype_code(BF16), TICKET)
            assert res.shape == _out_shape(q) and res.dtype == BF16
            fout = torch.empty(_out_shape(q), dtype=FP32)
            assert torch.ops.prims_ts.batch_mla_decode_out(fq, fc, fws, fout, *fmeta, *scalars) is None
            assert torch.ops.prims_ts.batch_mla_decode_out(fq, fc, fws, fout, *fmeta, *scalars, TICKET) is None


TICKET = Tuning(cluster_merge=False, mla_swapped=not Tuning().mla_swapped).encode()  # a non-default tuning string


@pytest.mark.parametrize("qmode,mask", [("single", "causal"), ("fixed", "dense"), ("packed", "causal")])
def test_opcheck_with_tuning_string(qmode, mask):
    """The trailing ``tuning`` argument (an encoded Tuning) passes opcheck on both ops and leaves the
    CPU result unchanged (on CPU every tuning runs the reference)."""
    assert TICKET and Tuning.decode(TICKET) != Tuning()
    q, cache, ws, meta, scalars = sample(qmode, mask, FP16, seed=40, h=16, max_seq_len=4096)
    want = _reference(q, cache, meta, scalars)
    args = (q, cache, ws, *meta, *scalars, dtype_code(FP32), TICKET)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_mla_decode.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_mla_decode(*args)
    assert res.dtype == FP32 and rel_err(res, want) <= 5e-3
    default = torch.ops.prims_ts.batch_mla_decode(*args[:-1])  # tuning left at its default ""
    torch.testing.assert_close(res, default, rtol=0, atol=0)
    out = torch.full(_out_shape(q), float("nan"), dtype=BF16)
    args = (q, cache, ws, out, *meta, *scalars, TICKET)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_mla_decode_out.default, args, test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.batch_mla_decode_out(*args) is None
    assert rel_err(out, want) <= 2e-2
