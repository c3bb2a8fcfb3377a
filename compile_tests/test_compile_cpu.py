"""torch.compile / torch.export / AOTInductor over prims_ts.batch_prefill, on CPU tensors.

On CPU the ops run the pure-PyTorch reference, so eager and compiled results are
compared tightly; every result is also checked against the float64 reference.
Sizes are tiny: what is under test is tracing (fake tensors, the traced path that
skips host reads of metadata values, dynamic shapes), not the math.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

from aoti_child import run_aoti_in_child
from prims_ts import BatchPrefillTSWrapper, batch_prefill
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, rel_err

DEVICE = "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32


def gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(shape, dtype, g):
    return torch.randn(*shape, generator=g, device=DEVICE).to(dtype)


def ip(values):
    return torch.tensor(values, dtype=I32, device=DEVICE)


def fixed_inputs(B, sq, sk, hq, hkv, d, dtype, g):
    return randn((B, sq, hq, d), dtype, g), randn((B, sk, hkv, d), dtype, g), randn((B, sk, hkv, d), dtype, g)


def packed_inputs(qo, kvo, hq, hkv, d, dtype, g):
    return randn((qo[-1], hq, d), dtype, g), randn((kvo[-1], hkv, d), dtype, g), randn((kvo[-1], hkv, d), dtype, g)


def ref64(q, k, v, **kw):
    return R.batch_prefill(q, k, v, compute_dtype=torch.float64, **kw)


def bounds(B, sq, sk, g):
    a = torch.randint(0, sk, (B, sq), generator=g, dtype=I32, device=DEVICE)
    b = torch.randint(0, sk, (B, sq), generator=g, dtype=I32, device=DEVICE)
    return torch.minimum(a, b), torch.maximum(a, b)


# ----------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", 2), ("variable_window", -1)])
def test_compile_fixed_matches_eager(mask, window):
    g = gen(1)
    q, k, v = fixed_inputs(2, 5, 8, 4, 2, 128, BF16, g)
    starts, ends = bounds(2, 5, 8, g) if mask == "variable_window" else (None, None)

    def f(q, k, v, starts, ends):
        o = batch_prefill(q, k, v, mask_type=mask, window_left=window, variable_window_token_starts=starts,
                          variable_window_token_ends=ends, sm_scale=0.1, output_scale=0.5, out_dtype=FP32)
        return o * 2.0 + 1.0  # something for Inductor to fuse around the op

    cf = torch.compile(f, fullgraph=True)
    got, want = cf(q, k, v, starts, ends), f(q, k, v, starts, ends)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    ref = ref64(q, k, v, mask_type=mask, window_left=window, window_starts=starts, window_ends=ends, sm_scale=0.1,
                output_scale=0.5)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]
    # new values, same shapes: no recompile, right answer
    q2, k2, v2 = fixed_inputs(2, 5, 8, 4, 2, 128, BF16, g)
    torch.testing.assert_close(cf(q2, k2, v2, starts, ends), f(q2, k2, v2, starts, ends), rtol=1e-6, atol=1e-6)


def test_compile_fixed_default_arguments():
    """The plain call with every default (dense, sm_scale=1/sqrt(D), output_scale=1.0)."""
    g = gen(2)
    q, k, v = fixed_inputs(1, 4, 4, 2, 2, 256, FP16, g)
    cf = torch.compile(lambda q, k, v: batch_prefill(q, k, v), fullgraph=True)
    torch.testing.assert_close(cf(q, k, v), batch_prefill(q, k, v), rtol=0, atol=0)


def test_compile_out_variant_writes_out():
    """out= under compile: the mutation of a graph input must be visible to the caller."""
    g = gen(3)
    q, k, v = fixed_inputs(2, 4, 6, 4, 1, 128, BF16, g)

    def f(q, k, v, out):
        r = batch_prefill(q, k, v, mask_type="causal", out=out)
        return r.float().sum(), r

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(q.shape, float("nan"), dtype=FP32, device=DEVICE)
    s, r = cf(q, k, v, out)
    assert not torch.isnan(out).any(), "compiled out= call did not write out"
    assert rel_err(out, ref64(q, k, v, mask_type="causal")) <= TOLERANCE[BF16]
    torch.testing.assert_close(r, out, rtol=0, atol=0)
    torch.testing.assert_close(s, out.sum(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 1)])
def test_compile_packed_oneshot_matches_eager(mask, window):
    """One-shot packed call under tracing: the host reads of indptr values are skipped, the op reads
    the live offsets at run time, so new offset values (same shapes) need no recompile."""
    g = gen(4)
    qo, kvo = [0, 3, 5], [0, 4, 9]
    q, k, v = packed_inputs(qo, kvo, 4, 2, 128, BF16, g)

    def f(q, k, v, qo_indptr, kv_indptr):
        return batch_prefill(q, k, v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type=mask, window_left=window)

    cf = torch.compile(f, fullgraph=True)
    got = cf(q, k, v, ip(qo), ip(kvo))
    torch.testing.assert_close(got, f(q, k, v, ip(qo), ip(kvo)), rtol=0, atol=0)
    assert rel_err(got, ref64(q, k, v, qo_indptr=ip(qo), kv_indptr=ip(kvo), mask_type=mask, window_left=window)) \
        <= TOLERANCE[BF16]
    qo2, kvo2 = [0, 1, 5], [0, 2, 9]
    got2 = cf(q, k, v, ip(qo2), ip(kvo2))
    assert rel_err(got2, ref64(q, k, v, qo_indptr=ip(qo2), kv_indptr=ip(kvo2), mask_type=mask,
                               window_left=window)) <= TOLERANCE[BF16]
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_wrapper_run_packed():
    """plan(q, k, v, qo_indptr=, kv_indptr=) outside the graph binds the offsets; the compiled run reads
    them live, so in-place changes (same totals, no request longer than the planned longest) are seen."""
    g = gen(5)
    qo, kvo = ip([0, 3, 5]), ip([0, 4, 9])
    q, k, v = packed_inputs([0, 5], [0, 9], 4, 2, 128, BF16, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", out_dtype=FP32)

    crun = torch.compile(lambda q, k, v: w.run(q, k, v), fullgraph=True)
    crun_out = torch.compile(lambda q, k, v, out: w.run(q, k, v, out=out), fullgraph=True)
    ref = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    torch.testing.assert_close(crun(q, k, v), w.run(q, k, v), rtol=0, atol=0)
    out = torch.full(q.shape, float("nan"), dtype=FP32)
    crun_out(q, k, v, out)
    assert rel_err(out, ref) <= TOLERANCE[BF16]

    # the planned tensors' values change in place (same totals, q lens <= the planned longest 3, causal Sq <= Sk)
    qo.copy_(ip([0, 2, 5]))
    kvo.copy_(ip([0, 6, 9]))
    ref_new = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    assert rel_err(ref.float(), ref_new) > 0.1
    assert rel_err(crun(q, k, v), ref_new) <= TOLERANCE[BF16]
    out.fill_(float("nan"))
    crun_out(q, k, v, out)
    assert rel_err(out, ref_new) <= TOLERANCE[BF16]
    assert counters["stats"]["unique_graphs"] == 2  # one per compiled function: no recompile for new values


def test_compile_wrapper_run_fixed():
    g = gen(6)
    q, k, v = fixed_inputs(2, 3, 7, 2, 1, 128, FP16, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, mask_type="causal", window_left=2, sm_scale=0.2)
    crun = torch.compile(lambda q, k, v: w.run(q, k, v), fullgraph=True)
    got = crun(q, k, v)
    assert got.dtype == FP16
    torch.testing.assert_close(got, w.run(q, k, v), rtol=0, atol=0)
    assert rel_err(got, ref64(q, k, v, mask_type="causal", window_left=2, sm_scale=0.2)) <= TOLERANCE[FP16]
    # new q/k/v values of the planned shapes: the same graph, the right answer
    q2, k2, v2 = fixed_inputs(2, 3, 7, 2, 1, 128, FP16, g)
    assert rel_err(crun(q2, k2, v2), ref64(q2, k2, v2, mask_type="causal", window_left=2, sm_scale=0.2)) \
        <= TOLERANCE[FP16]
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_wrapper_run_variable_window():
    """Variable-window bounds are given to plan (run has no window arguments) and bound: the compiled run
    reads their values live, so bounds rewritten in place are seen without a recompile."""
    g = gen(16)
    q, k, v = fixed_inputs(2, 5, 8, 4, 2, 128, BF16, g)
    starts, ends = bounds(2, 5, 8, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, mask_type="variable_window", variable_window_token_starts=starts,
           variable_window_token_ends=ends, out_dtype=FP32)
    crun = torch.compile(lambda q, k, v, out: w.run(q, k, v, out=out), fullgraph=True)
    out = torch.full(q.shape, float("nan"), dtype=FP32)
    crun(q, k, v, out)
    ref = ref64(q, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends)
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    s2, e2 = bounds(2, 5, 8, g)
    starts.copy_(s2)
    ends.copy_(e2)
    ref_new = ref64(q, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends)
    assert rel_err(ref.float(), ref_new) > 0.1
    out.fill_(float("nan"))
    crun(q, k, v, out)
    assert rel_err(out, ref_new) <= TOLERANCE[BF16]
    assert counters["stats"]["unique_graphs"] == 1


# ----------------------------------------------------------------------------
# dynamic=True
# ----------------------------------------------------------------------------

# first sizes distinct from B, H, D (duck sizing would tie them); all >= 2 (torch specialises 0 and 1)
FIXED_SIZES = [(5, 7), (3, 9), (6, 6), (2, 11), (4, 4)]


def _run_dynamic_fixed(f):
    cf = torch.compile(f, fullgraph=True, dynamic=True)
    g = gen(7)
    for sq, sk in FIXED_SIZES:
        q, k, v = fixed_inputs(2, sq, sk, 4, 2, 128, BF16, g)
        got = cf(q, k, v)
        assert got.shape == q.shape
        torch.testing.assert_close(got, f(q, k, v), rtol=1e-6, atol=1e-6)
        assert rel_err(got, ref64(q, k, v, mask_type="causal", window_left=3, sm_scale=0.1)) <= TOLERANCE[BF16]
    assert counters["stats"]["unique_graphs"] == 1, "dynamic=True recompiled for new Sq/Sk"


def test_compile_dynamic_fixed():
    _run_dynamic_fixed(lambda q, k, v: batch_prefill(q, k, v, mask_type="causal", window_left=3, sm_scale=0.1,
                                                     output_scale=1.0, out_dtype=FP32))


def test_compile_dynamic_fixed_default_output_scale():
    _run_dynamic_fixed(lambda q, k, v: batch_prefill(q, k, v, mask_type="causal", window_left=3, sm_scale=0.1,
                                                     out_dtype=FP32))


def test_compile_dynamic_packed_oneshot():
    def f(q, k, v, qo_indptr, kv_indptr):
        return batch_prefill(q, k, v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type="causal",
                             output_scale=1.0)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    g = gen(8)
    for qo, kvo in [([0, 3, 5], [0, 4, 9]), ([0, 2, 6, 9], [0, 3, 8, 12]), ([0, 4, 8], [0, 4, 8])]:
        q, k, v = packed_inputs(qo, kvo, 4, 2, 128, BF16, g)
        got = cf(q, k, v, ip(qo), ip(kvo))
        torch.testing.assert_close(got, f(q, k, v, ip(qo), ip(kvo)), rtol=0, atol=0)
        assert rel_err(got, ref64(q, k, v, qo_indptr=ip(qo), kv_indptr=ip(kvo), mask_type="causal")) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# torch.export and AOTInductor
# ----------------------------------------------------------------------------


class Prefill(torch.nn.Module):
    """One fixed and one packed call; the packed offsets are graph inputs."""

    def forward(self, q, k, v, qp, kp, vp, qo_indptr, kv_indptr):
        a = batch_prefill(q, k, v, mask_type="causal", window_left=3, sm_scale=0.09, output_scale=0.5,
                          out_dtype=FP32)
        b = batch_prefill(qp, kp, vp, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type="causal")
        return a * 2.0, b


def _module_inputs(sq, sk, qo, kvo, seed):
    g = gen(seed)
    q, k, v = fixed_inputs(2, sq, sk, 4, 2, 128, BF16, g)
    qp, kp, vp = packed_inputs(qo, kvo, 4, 1, 128, BF16, g)
    return q, k, v, qp, kp, vp, ip(qo), ip(kvo)


def _check_module_outputs(outs, args):
    q, k, v, qp, kp, vp, qo, kvo = args
    a, b = outs
    assert a.dtype == FP32 and b.dtype == BF16
    assert rel_err(a / 2.0, ref64(q, k, v, mask_type="causal", window_left=3, sm_scale=0.09, output_scale=0.5)) \
        <= TOLERANCE[BF16]
    assert rel_err(b, ref64(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")) <= TOLERANCE[BF16]
    eager = Prefill()(*args)
    for x, y in zip(outs, eager):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)


EXAMPLE = (4, 6, [0, 3, 5], [0, 4, 9])
OTHER_VALUES = (4, 6, [0, 1, 5], [0, 2, 9])  # same shapes, new offsets
OTHER_SHAPES = (3, 9, [0, 2, 5, 8], [0, 3, 8, 12])


def _dynamic_shapes():
    Dim = torch.export.Dim
    sq, sk = Dim("sq", min=2, max=1024), Dim("sk", min=2, max=1024)
    tq, tk, b1 = Dim("tq", min=2, max=8192), Dim("tk", min=2, max=8192), Dim("b1", min=2, max=64)
    return ({1: sq}, {1: sk}, {1: sk}, {0: tq}, {0: tk}, {0: tk}, {0: b1}, {0: b1})


def test_export_static():
    args = _module_inputs(*EXAMPLE, seed=9)
    ep = torch.export.export(Prefill(), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.prims_ts.batch_prefill.default in targets
    _check_module_outputs(ep.module()(*args), args)
    args2 = _module_inputs(*OTHER_VALUES, seed=10)
    _check_module_outputs(ep.module()(*args2), args2)


def test_export_dynamic_shapes():
    args = _module_inputs(*EXAMPLE, seed=11)
    ep = torch.export.export(Prefill(), args, dynamic_shapes=_dynamic_shapes())
    for spec in (EXAMPLE, OTHER_VALUES, OTHER_SHAPES):
        a = _module_inputs(*spec, seed=12)
        _check_module_outputs(ep.module()(*a), a)


def _aoti_body(package_path: str, device: str) -> None:
    """Exported (dynamic shapes) -> aoti_compile_and_package -> aoti_load_package -> run == eager."""
    args = _module_inputs(*EXAMPLE, seed=13)
    ep = torch.export.export(Prefill(), args, dynamic_shapes=_dynamic_shapes())
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    assert os.path.exists(package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for spec in (EXAMPLE, OTHER_VALUES, OTHER_SHAPES):
        a = _module_inputs(*spec, seed=14)
        outs = compiled(*a)
        assert isinstance(outs, (list, tuple)) and len(outs) == 2
        _check_module_outputs(outs, a)


def test_aoti_package_load_run(tmp_path):
    run_aoti_in_child(__file__, DEVICE, tmp_path)
