"""torch.library.opcheck on the prims_ts prefill ops with CPU tensors.

opcheck runs, for each sample:
  test_schema                - the schema's mutation/aliasing annotations match what the op does;
  test_autograd_registration - an autograd kernel is registered where inputs may require grad;
  test_faketensor            - the fake (meta/prefill.py) agrees with the real kernel on shape/dtype/...;
  test_aot_dispatch_dynamic  - the op traces through AOTAutograd with dynamic shapes and gives the
                               same result as eager.
All four apply to both ops, so every test below runs the full default set
(``test_utils`` is spelled out so that a later narrowing has to be explicit).

The op signatures (``prims_ts/ops/prefill.py``):
  batch_prefill(q, k, v, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type,
                window_left, sm_scale, output_scale, max_q_len, out_dtype, tuning="") -> Tensor
  batch_prefill_out(q, k, v, out, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type,
                    window_left, sm_scale, output_scale, max_q_len, tuning="") -> ()
``out_dtype`` is an int code (``prims_ts.ops._validate.dtype_code``); ``tuning`` an encoded
``prims_ts.Tuning`` (defaulted: samples below pass it left out, empty, and non-empty).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.library import opcheck

from prims_ts.ops._validate import dtype_code
import prims_ts  # noqa: F401  (registers the ops and their fakes)
from prims_ts import Tuning
from prims_ts import reference as R
from prims_ts.testing import OPCHECK_TESTS, assert_opcheck_passed

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
D = 128
OMIT = None  # tuning left out: the op's default ("")
LOOP1 = Tuning(loop=1).encode()
PERSISTENT = Tuning(persistent=True, persistent_ctas=3, copy_tpr=8).encode()
assert LOOP1 and PERSISTENT


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def fixed_sample(mask, window, dtype, out_dtype, seed=0):
    B, sq, sk, hq, hkv = 2, 5, 7, 4, 2
    q = _randn((B, sq, hq, D), dtype, seed)
    k = _randn((B, sk, hkv, D), dtype, seed + 1)
    v = _randn((B, sk, hkv, D), dtype, seed + 2)
    starts = ends = None
    if mask == "variable_window":
        g = torch.Generator().manual_seed(seed + 3)
        a = torch.randint(0, sk, (B, sq), generator=g, dtype=I32)
        b = torch.randint(0, sk, (B, sq), generator=g, dtype=I32)
        starts, ends = torch.minimum(a, b), torch.maximum(a, b)
    meta = dict(qo_indptr=None, kv_indptr=None, window_starts=starts, window_ends=ends, work=None)
    scalars = dict(mask_type=mask, window_left=window, sm_scale=1.0 / math.sqrt(D), output_scale=0.75,
                   max_q_len=sq)
    return q, k, v, meta, scalars


def packed_sample(mask, window, dtype, out_dtype, seed=0, with_work=False):
    qo, kvo = [0, 3, 4, 9], [0, 6, 7, 13]
    hq, hkv = 4, 1
    q = _randn((qo[-1], hq, D), dtype, seed)
    k = _randn((kvo[-1], hkv, D), dtype, seed + 1)
    v = _randn((kvo[-1], hkv, D), dtype, seed + 2)
    work = None
    if with_work:  # (request, q tile) items, as a wrapper's plan builds them
        work = torch.tensor([[2, 0], [0, 0], [1, 0]], dtype=I32)
    meta = dict(qo_indptr=torch.tensor(qo, dtype=I32), kv_indptr=torch.tensor(kvo, dtype=I32), window_starts=None,
                window_ends=None, work=work)
    scalars = dict(mask_type=mask, window_left=window, sm_scale=0.1, output_scale=1.0, max_q_len=5)
    return q, k, v, meta, scalars


def _tuning(tuning):
    return () if tuning is OMIT else (tuning,)


def functional_args(q, k, v, meta, scalars, out_dtype, tuning=OMIT):
    return (q, k, v, meta["qo_indptr"], meta["kv_indptr"], meta["window_starts"], meta["window_ends"], meta["work"],
            scalars["mask_type"], scalars["window_left"], scalars["sm_scale"], scalars["output_scale"],
            scalars["max_q_len"], dtype_code(out_dtype)) + _tuning(tuning)


def out_args(q, k, v, out, meta, scalars, tuning=OMIT):
    return (q, k, v, out, meta["qo_indptr"], meta["kv_indptr"], meta["window_starts"], meta["window_ends"],
            meta["work"], scalars["mask_type"], scalars["window_left"], scalars["sm_scale"],
            scalars["output_scale"], scalars["max_q_len"]) + _tuning(tuning)


def _reference(q, k, v, meta, scalars):
    return R.batch_prefill(q, k, v, qo_indptr=meta["qo_indptr"], kv_indptr=meta["kv_indptr"],
                           mask_type=scalars["mask_type"], window_left=scalars["window_left"],
                           window_starts=meta["window_starts"], window_ends=meta["window_ends"],
                           sm_scale=scalars["sm_scale"], output_scale=scalars["output_scale"],
                           compute_dtype=torch.float64)


# the last field: the tuning argument (OMIT: left out)
FIXED = [("dense", -1, BF16, BF16, OMIT), ("causal", -1, FP16, FP32, LOOP1), ("causal", 2, BF16, FP16, ""),
         ("variable_window", -1, FP16, FP16, PERSISTENT)]
PACKED = [("dense", -1, BF16, FP32, False, OMIT), ("causal", -1, FP16, FP16, True, LOOP1),
          ("causal", 0, BF16, BF16, False, PERSISTENT)]
FIXED_IDS = [f"{m}{w if w >= 0 else ''}-tuning_{'omitted' if t is OMIT else t or 'empty'}" for m, w, _, _, t in FIXED]
PACKED_IDS = [f"{m}{w if w >= 0 else ''}{'-work' if ww else ''}-tuning_{'omitted' if t is OMIT else t or 'empty'}"
              for m, w, _, _, ww, t in PACKED]


@pytest.mark.parametrize("mask,window,dtype,out_dtype,tuning", FIXED, ids=FIXED_IDS)
def test_opcheck_batch_prefill_fixed(mask, window, dtype, out_dtype, tuning):
    q, k, v, meta, scalars = fixed_sample(mask, window, dtype, out_dtype)
    args = functional_args(q, k, v, meta, scalars, out_dtype, tuning)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_prefill(*args)
    assert res.dtype == out_dtype and res.shape == q.shape
    ref = _reference(q, k, v, meta, scalars)
    assert ((res.double() - ref).norm() / ref.norm()).item() <= 2e-2


@pytest.mark.parametrize("mask,window,dtype,out_dtype,with_work,tuning", PACKED, ids=PACKED_IDS)
def test_opcheck_batch_prefill_packed(mask, window, dtype, out_dtype, with_work, tuning):
    q, k, v, meta, scalars = packed_sample(mask, window, dtype, out_dtype, with_work=with_work)
    args = functional_args(q, k, v, meta, scalars, out_dtype, tuning)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.batch_prefill(*args)
    ref = _reference(q, k, v, meta, scalars)
    assert res.dtype == out_dtype and ((res.double() - ref).norm() / ref.norm()).item() <= 2e-2


@pytest.mark.parametrize("mask,window,dtype,out_dtype,tuning", FIXED, ids=FIXED_IDS)
def test_opcheck_batch_prefill_out_fixed(mask, window, dtype, out_dtype, tuning):
    q, k, v, meta, scalars = fixed_sample(mask, window, dtype, out_dtype, seed=10)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill_out.default,
                                  out_args(q, k, v, out, meta, scalars, tuning), test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.batch_prefill_out(*out_args(q, k, v, out, meta, scalars, tuning)) is None
    ref = _reference(q, k, v, meta, scalars)
    assert not torch.isnan(out).any()
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 2e-2


@pytest.mark.parametrize("mask,window,dtype,out_dtype,with_work,tuning", PACKED, ids=PACKED_IDS)
def test_opcheck_batch_prefill_out_packed(mask, window, dtype, out_dtype, with_work, tuning):
    q, k, v, meta, scalars = packed_sample(mask, window, dtype, out_dtype, seed=20, with_work=with_work)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill_out.default,
                                  out_args(q, k, v, out, meta, scalars, tuning), test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    torch.ops.prims_ts.batch_prefill_out(*out_args(q, k, v, out, meta, scalars, tuning))
    ref = _reference(q, k, v, meta, scalars)
    assert not torch.isnan(out).any()
    assert ((out.double() - ref).norm() / ref.norm()).item() <= 2e-2


def test_opcheck_with_requires_grad_inputs():
    """test_autograd_registration is meaningful only when an input requires grad: the op must then
    have an autograd kernel (custom_op registers one that raises on backward), not silently detach.

    test_aot_dispatch_dynamic is left out here on purpose: with inputs that require grad it also
    traces and runs the *backward*, and these ops are inference kernels with no backward formula
    (the SPEC asks for none). That the backward fails loudly is checked below instead.
    """
    q, k, v, meta, scalars = fixed_sample("causal", -1, FP32, FP32, seed=30)
    q, k, v = (t.to(BF16).requires_grad_() for t in (q, k, v))
    args = functional_args(q, k, v, meta, scalars, BF16, LOOP1)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.batch_prefill.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor")),
                  ("test_schema", "test_autograd_registration", "test_faketensor"))
    res = torch.ops.prims_ts.batch_prefill(*args)
    assert res.requires_grad
    with pytest.raises(RuntimeError, match="autograd|backward"):
        res.float().sum().backward()


def test_fake_tensor_shapes():
    """The fakes give q's shape, the requested dtype, and never read data (meta tensors have none)."""
    q, k, v, meta, scalars = packed_sample("causal", -1, BF16, FP32)
    to_meta = {key: (t.to("meta") if isinstance(t, torch.Tensor) else t) for key, t in meta.items()}
    res = torch.ops.prims_ts.batch_prefill(*functional_args(q.to("meta"), k.to("meta"), v.to("meta"), to_meta,
                                                            scalars, FP32))
    assert res.device.type == "meta" and res.shape == q.shape and res.dtype == FP32
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fmeta = {key: (mode.from_tensor(t) if isinstance(t, torch.Tensor) else t) for key, t in meta.items()}
        res = torch.ops.prims_ts.batch_prefill(*functional_args(fq, fk, fv, fmeta, scalars, FP16, LOOP1))
        assert res.shape == q.shape and res.dtype == FP16
        fout = torch.empty(q.shape, dtype=FP32)
        assert torch.ops.prims_ts.batch_prefill_out(*out_args(fq, fk, fv, fout, fmeta, scalars, LOOP1)) is None


def test_out_dtype_code_error_names_the_argument():
    """The functional ops take the output dtype as an int code (dtype_code); an unknown code, in eager or
    from a compiled package's proxy call, is a ValueError naming out_dtype, real or fake tensors alike."""
    q, k, v, meta, scalars = fixed_sample("dense", -1, BF16, BF16)
    args = functional_args(q, k, v, meta, scalars, BF16)[:-1]
    for bad in (3, -1):
        for tuning in (_tuning(OMIT), (LOOP1,)):
            with pytest.raises(ValueError, match="out_dtype"):
                torch.ops.prims_ts.batch_prefill(*args, bad, *tuning)
            with pytest.raises(ValueError, match="out_dtype"):
                torch.ops.prims_ts.batch_prefill(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args),
                                                 bad, *tuning)


def test_tuning_argument_is_in_the_schemas():
    """Both ops end with ``tuning: str = ""`` and accept it by name; on CPU the result does not depend on it
    (the tuning chooses CUDA kernel variants)."""
    for op in (torch.ops.prims_ts.batch_prefill.default, torch.ops.prims_ts.batch_prefill_out.default):
        last = op._schema.arguments[-1]
        assert last.name == "tuning" and str(last.type) == "str" and last.default_value == ""
    q, k, v, meta, scalars = packed_sample("causal", 1, BF16, FP32, seed=40)
    args = functional_args(q, k, v, meta, scalars, FP32)
    plain = torch.ops.prims_ts.batch_prefill(*args)
    tuned = torch.ops.prims_ts.batch_prefill(*args, tuning=PERSISTENT)
    assert not torch.isnan(plain).any()
    torch.testing.assert_close(tuned, plain, rtol=0, atol=0)
    out = torch.full(q.shape, float("nan"), dtype=FP32)
    torch.ops.prims_ts.batch_prefill_out(*out_args(q, k, v, out, meta, scalars), tuning=LOOP1)
    torch.testing.assert_close(out, plain, rtol=0, atol=0)


def test_plain_eager_sees_modes_tracers_and_subclasses():
    """The direct-launch rule (``_dispatch.plain_eager``): a torch-function mode, a dispatch
    mode (a user's or an infra mode such as FakeTensorMode) or a subclass ``out`` each send the
    call through the op, where they see it; a plain call skips the dispatcher."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from prims_ts.ops import _dispatch

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class SeenFn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    assert _dispatch.plain_eager()
    assert _dispatch.plain_eager(torch.empty(2))
    assert not _dispatch.plain_eager(torch.empty(2).as_subclass(Sub))
    assert not _dispatch.plain_eager(traced=True)
    with Seen():
        assert not _dispatch.plain_eager()
    with SeenFn():
        assert not _dispatch.plain_eager()
    with FakeTensorMode():
        assert not _dispatch.plain_eager()
    assert _dispatch.plain_eager()
