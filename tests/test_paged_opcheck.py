"""torch.library.opcheck on the paged prefill ops with CPU tensors.

opcheck runs, for each sample:
  test_schema                - the schema's mutation/aliasing annotations match what the op does;
  test_autograd_registration - an autograd kernel is registered where inputs may require grad;
  test_faketensor            - the fake (meta/prefill_paged.py) agrees with the real kernel;
  test_aot_dispatch_dynamic  - the op traces through AOTAutograd with dynamic shapes and gives the
                               same result as eager.

The op signatures (``prims_ts/ops/prefill_paged.py``):
  batch_prefill_paged(q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, work, mask_type,
                      window_left, sm_scale, output_scale, max_q_len, out_dtype, tuning="") -> Tensor
  batch_prefill_paged_out(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work,
                          mask_type, window_left, sm_scale, output_scale, max_q_len, tuning="") -> ()
``out_dtype`` is an int code (``prims_ts.ops._validate.dtype_code``); ``tuning`` an encoded
``prims_ts.Tuning`` (defaulted: the samples below pass it left out, empty, and non-empty). The
wrappers' plans build these arguments (a CSR plan's own block table and lengths).
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

from prims_ts.ops._validate import dtype_code
import prims_ts  # noqa: F401  (registers the ops and their fakes)
from prims_ts import Tuning
from prims_ts import reference as R
from prims_ts.testing import OPCHECK_TESTS, assert_opcheck_passed, rel_err

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
D = 128
PS = 16
OMIT = None  # tuning left out: the op's default ("")
LOOP1 = Tuning(loop=1).encode()
PERSISTENT = Tuning(persistent=True, persistent_ctas=3).encode()
assert LOOP1 and PERSISTENT


def _tuning(tuning):
    return () if tuning is OMIT else (tuning,)


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def sample(mask, window, dtype, seed=0, padded=False, with_work=False):
    """3 requests (q lens 3, 1, 5; kv lens 20, 1, 33) over a 9-page pool, non-identity and repeated IDs."""
    qo, lens = [0, 3, 4, 9], [20, 1, 33]
    hq, hkv, P = 4, 2, 9
    q = _randn((qo[-1], hq, D), dtype, seed)
    k = _randn((P, hkv, PS, D), dtype, seed + 1)
    v = _randn((P, hkv, PS, D), dtype, seed + 2)
    rows = [[7, 2, 0], [2, 0, 0], [5, 8, 2]]  # page 2 used by all three requests
    if padded:
        big = torch.full((3, 7), -1, dtype=I32)
        big[:, :3] = torch.tensor(rows, dtype=I32)
        big[1, 1:] = 2**31 - 1  # padding past request 1's single page
        table = big[:, :3]
    else:
        table = torch.tensor(rows, dtype=I32)
    work = torch.tensor([[2, 0], [0, 0], [1, 0]], dtype=I32) if with_work else None
    meta = (torch.tensor(qo, dtype=I32), table, torch.tensor(lens, dtype=I32), work)
    scalars = (mask, window, 0.09, 0.75, 5)
    return q, k, v, meta, scalars


def _reference(q, k, v, meta, scalars):
    mask, window, sm_scale, output_scale, _ = scalars
    return R.batch_prefill_paged(q, k, v, meta[0], meta[1], meta[2], mask_type=mask, window_left=window,
                                 sm_scale=sm_scale, output_scale=output_scale, compute_dtype=torch.float64)


# the last field: the tuning argument (OMIT: left out)
CASES = [("dense", -1, BF16, BF16, False, False, OMIT), ("causal", -1, FP16, FP32, True, False, LOOP1),
         ("causal", 2, BF16, FP16, False, True, ""), ("causal", 0, FP16, FP16, True, True, PERSISTENT)]
IDS = [f"{m}{w if w >= 0 else ''}-{'padded' if p else 'dense_table'}{'-work' if ww else ''}"
       f"-tuning_{'omitted' if t is OMIT else t or 'empty'}" for m, w, _, _, p, ww, t in CASES]


@pytest.mark.parametrize("mask,window,dtype,out_dtype,padded,with_work,tuning", CASES, ids=IDS)
def test_opcheck_batch_prefill_paged(mask, window, dtype, out_dtype, padded, with_work, tuning):
    q, k, v, meta, scalars = sample(mask, window, dtype, padded=padded, with_work=with_work)
    args = (q, k, v, *meta, *scalars, dtype_code(out_dtype), *_tuning(tuning))
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill_paged.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_prefill_paged(*args)
    assert res.dtype == out_dtype and res.shape == q.shape
    assert rel_err(res, _reference(q, k, v, meta, scalars)) <= 2e-2


@pytest.mark.parametrize("mask,window,dtype,out_dtype,padded,with_work,tuning", CASES, ids=IDS)
def test_opcheck_batch_prefill_paged_out(mask, window, dtype, out_dtype, padded, with_work, tuning):
    q, k, v, meta, scalars = sample(mask, window, dtype, seed=10, padded=padded, with_work=with_work)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    args = (q, k, v, out, *meta, *scalars, *_tuning(tuning))
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill_paged_out.default, args, test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.batch_prefill_paged_out(*args) is None
    assert rel_err(out, _reference(q, k, v, meta, scalars)) <= 2e-2


def test_opcheck_with_requires_grad_inputs():
    """With inputs that require grad the op must have an autograd kernel (custom_op registers one that
    raises on backward), not silently detach. The ops are inference kernels with no backward formula,
    so test_aot_dispatch_dynamic (which would trace the backward) is left out; the backward must fail."""
    q, k, v, meta, scalars = sample("causal", -1, FP32, seed=30)
    q, k, v = (t.to(BF16).requires_grad_() for t in (q, k, v))
    args = (q, k, v, *meta, *scalars, dtype_code(BF16), LOOP1)
    names = ("test_schema", "test_autograd_registration", "test_faketensor")
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill_paged.default, args, test_utils=names), names)
    res = torch.ops.prims_ts.batch_prefill_paged(*args)
    assert res.requires_grad
    with pytest.raises(RuntimeError, match="autograd|backward"):
        res.float().sum().backward()


def test_fake_tensor_shapes():
    """The fakes give q's shape and the requested dtype, and never read data."""
    q, k, v, meta, scalars = sample("causal", 3, BF16)
    mq, mk, mv = (t.to("meta") for t in (q, k, v))
    mmeta = tuple(t.to("meta") if t is not None else None for t in meta)
    res = torch.ops.prims_ts.batch_prefill_paged(mq, mk, mv, *mmeta, *scalars, dtype_code(FP32))
    assert res.device.type == "meta" and res.shape == q.shape and res.dtype == FP32
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fmeta = tuple(mode.from_tensor(t) if t is not None else None for t in meta)
        res = torch.ops.prims_ts.batch_prefill_paged(fq, fk, fv, *fmeta, *scalars, dtype_code(FP16), LOOP1)
        assert res.shape == q.shape and res.dtype == FP16
        fout = torch.empty(q.shape, dtype=FP32)
        assert torch.ops.prims_ts.batch_prefill_paged_out(fq, fk, fv, fout, *fmeta, *scalars, LOOP1) is None


def test_tuning_argument_is_in_the_schemas():
    """Both ops end with ``tuning: str = ""`` and accept it by name; on CPU the result does not depend on it
    (the tuning chooses CUDA kernel variants)."""
    for op in (torch.ops.prims_ts.batch_prefill_paged.default, torch.ops.prims_ts.batch_prefill_paged_out.default):
        last = op._schema.arguments[-1]
        assert last.name == "tuning" and str(last.type) == "str" and last.default_value == ""
    q, k, v, meta, scalars = sample("causal", 1, BF16, seed=40, padded=True)
    plain = torch.ops.prims_ts.batch_prefill_paged(q, k, v, *meta, *scalars, dtype_code(FP32))
    assert not torch.isnan(plain).any()
    tuned = torch.ops.prims_ts.batch_prefill_paged(q, k, v, *meta, *scalars, dtype_code(FP32), tuning=PERSISTENT)
    torch.testing.assert_close(tuned, plain, rtol=0, atol=0)
    out = torch.full(q.shape, float("nan"), dtype=FP32)
    torch.ops.prims_ts.batch_prefill_paged_out(q, k, v, out, *meta, *scalars, tuning=LOOP1)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_opcheck_with_a_wrapper_plans_arguments():
    """The arguments a BatchPrefillPagedTSWrapper plan over CSR page metadata hands the op (its own block
    table and lengths, the bound qo_indptr, its tuning) pass opcheck and give the reference's answer."""
    from prims_ts import BatchPrefillPagedTSWrapper

    q, k, v, meta, _ = sample("causal", 2, FP16, seed=50)
    qo = meta[0]
    # sample()'s pages as CSR: request b's used pages and its last page's fill
    indptr = torch.tensor([0, 2, 3, 6], dtype=I32)
    indices = torch.tensor([7, 2, 2, 5, 8, 2], dtype=I32)
    last = torch.tensor([4, 1, 1], dtype=I32)
    w = BatchPrefillPagedTSWrapper(tuning=Tuning(loop=1))
    w.plan(q, k, v, qo, indptr, indices, last, page_size=PS, mask_type="causal", window_left=2, sm_scale=0.09,
           output_scale=0.75, out_dtype=FP32)
    plan = w._plan
    args = (q, k, v, *plan.op_args(), dtype_code(FP32), plan.tuning_code)
    assert args[3] is qo and plan.tuning_code == LOOP1
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill_paged.default, args, test_utils=OPCHECK_TESTS))
    ref = _reference(q, k, v, meta, ("causal", 2, 0.09, 0.75, 5))
    out = torch.full(q.shape, float("nan"), dtype=FP32)
    assert w.run(q, k, v, out=out) is out
    assert rel_err(out, ref) <= 5e-3
    assert rel_err(torch.ops.prims_ts.batch_prefill_paged(*args), ref) <= 5e-3
