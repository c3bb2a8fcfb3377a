"""torch.compile / dynamic shapes / CUDA graphs / torch.export / AOTInductor on CUDA.

The same checks as test_compile_cpu.py, on the GPU kernels, plus CUDA-graph
capture and replay of BatchPrefillTSWrapper.run with changed metadata values:
the wrapper binds qo_indptr / kv_indptr (and a variable window's bound tensors,
given to plan), so replays may redistribute them in place within the planned
totals and the planned longest query count. Every result is compared with eager
and with the float64 reference (||out - ref|| / ||ref|| <= 2e-2 bf16, 5e-3 fp16),
after poisoning out with NaN.

Every helper reads the module's DEVICE when it is called (and the graph helpers take
it), so the whole file can be dry-run on the CPU by setting ``DEVICE = "cpu"`` (the
CUDA-graph helpers then run the captured call eagerly).
"""
from __future__ import annotations

import pytest
import torch

import prims_ts  # noqa: F401
from prims_ts import BatchPrefillTSWrapper, batch_prefill
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, rel_err
from aoti_child import run_aoti_in_child
from cuda_graphs import assert_no_allocation_no_sync, synchronize, warm_and_capture

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")


def gen(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(shape, dtype, g):
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=FP32).to(dtype)


def ip(values):
    return torch.tensor(values, dtype=I32, device=DEVICE)


def fixed_inputs(B, sq, sk, hq, hkv, d, dtype, g):
    return randn((B, sq, hq, d), dtype, g), randn((B, sk, hkv, d), dtype, g), randn((B, sk, hkv, d), dtype, g)


def packed_inputs(qo, kvo, hq, hkv, d, dtype, g):
    return randn((qo[-1], hq, d), dtype, g), randn((kvo[-1], hkv, d), dtype, g), randn((kvo[-1], hkv, d), dtype, g)


def bounds(B, sq, sk, g):
    a = torch.randint(0, sk, (B, sq), generator=g, dtype=I32, device=DEVICE)
    b = torch.randint(0, sk, (B, sq), generator=g, dtype=I32, device=DEVICE)
    return torch.minimum(a, b), torch.maximum(a, b)


def ref64(q, k, v, **kw):
    return R.batch_prefill(q, k, v, compute_dtype=torch.float64, **kw)


def close(a, b):
    """Compiled vs eager: the same kernel, so equal up to fused surrounding arithmetic."""
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask,window,d", [("dense", -1, 128), ("causal", 37, 128), ("causal", -1, 256),
                                           ("variable_window", -1, 128)])
def test_compile_fixed_matches_eager(mask, window, d):
    g = gen(1)
    B, sq, sk = 2, 130, 200
    q, k, v = fixed_inputs(B, sq, sk, 8, 2, d, BF16, g)
    starts, ends = bounds(B, sq, sk, g) if mask == "variable_window" else (None, None)

    def f(q, k, v, starts, ends):
        o = batch_prefill(q, k, v, mask_type=mask, window_left=window, variable_window_token_starts=starts,
                          variable_window_token_ends=ends, sm_scale=0.06, output_scale=0.5, out_dtype=FP32)
        return o * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True)
    got = cf(q, k, v, starts, ends)
    close(got, f(q, k, v, starts, ends))
    ref = ref64(q, k, v, mask_type=mask, window_left=window, window_starts=starts, window_ends=ends, sm_scale=0.06,
                output_scale=0.5)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]


def test_compile_out_variant_writes_out():
    g = gen(2)
    q, k, v = fixed_inputs(2, 64, 96, 8, 1, 128, FP16, g)

    def f(q, k, v, out):
        r = batch_prefill(q, k, v, mask_type="causal", out=out)
        return r.float().sum(), r

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(q.shape, NAN, dtype=FP16, device=DEVICE)
    s, r = cf(q, k, v, out)
    assert rel_err(out, ref64(q, k, v, mask_type="causal")) <= TOLERANCE[FP16]
    assert r.data_ptr() == out.data_ptr() or torch.equal(r, out)


@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 50)])
def test_compile_packed_oneshot_matches_eager(mask, window):
    """Traced one-shot packed call (no host reads of offsets, implicit tile order) == eager."""
    g = gen(3)
    qo, kvo = [0, 100, 101, 350], [0, 130, 140, 400]
    q, k, v = packed_inputs(qo, kvo, 8, 2, 128, BF16, g)

    def f(q, k, v, qo_indptr, kv_indptr):
        return batch_prefill(q, k, v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type=mask, window_left=window)

    cf = torch.compile(f, fullgraph=True)
    got = cf(q, k, v, ip(qo), ip(kvo))
    close(got, f(q, k, v, ip(qo), ip(kvo)))
    assert rel_err(got, ref64(q, k, v, qo_indptr=ip(qo), kv_indptr=ip(kvo), mask_type=mask,
                              window_left=window)) <= TOLERANCE[BF16]
    qo2, kvo2 = [0, 1, 200, 350], [0, 10, 260, 400]  # new offsets, same totals
    got2 = cf(q, k, v, ip(qo2), ip(kvo2))
    assert rel_err(got2, ref64(q, k, v, qo_indptr=ip(qo2), kv_indptr=ip(kvo2), mask_type=mask,
                               window_left=window)) <= TOLERANCE[BF16]


def test_compile_wrapper_run_packed():
    """Compiled run of a wrapper planned on packed q/k/v: the offsets are bound, so new values written in
    place (same totals, each query count within the planned longest, causal Sq <= Sk) are honoured."""
    g = gen(4)
    qo, kvo = ip([0, 100, 250]), ip([0, 300, 500])
    q, k, v = packed_inputs([0, 250], [0, 500], 8, 2, 128, BF16, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")  # longest query count: 150
    crun = torch.compile(lambda q, k, v, out: w.run(q, k, v, out=out), fullgraph=True)
    out = torch.full(q.shape, NAN, dtype=BF16, device=DEVICE)
    crun(q, k, v, out)
    ref = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    close(out, w.run(q, k, v))
    qo.copy_(ip([0, 150, 250]))
    kvo.copy_(ip([0, 320, 500]))
    ref2 = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    assert rel_err(ref.float(), ref2) > 0.1  # the new offsets matter
    out.fill_(NAN)
    crun(q, k, v, out)
    assert rel_err(out, ref2) <= TOLERANCE[BF16]


def test_compile_wrapper_run_fixed_variable_window():
    """Compiled run of a fixed variable-window plan: the bounds given to plan are bound, new values
    written in place are honoured (no recompile, no re-plan)."""
    g = gen(13)
    B, sq, sk = 2, 70, 150
    q, k, v = fixed_inputs(B, sq, sk, 8, 4, 128, FP16, g)
    starts, ends = bounds(B, sq, sk, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, mask_type="variable_window", variable_window_token_starts=starts,
           variable_window_token_ends=ends, sm_scale=0.07, out_dtype=FP32)
    crun = torch.compile(lambda q, k, v: w.run(q, k, v), fullgraph=True)
    ref = ref64(q, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends, sm_scale=0.07)
    got = crun(q, k, v)
    assert got.dtype == FP32
    assert rel_err(got, ref) <= TOLERANCE[FP16]
    s2, e2 = bounds(B, sq, sk, g)
    starts.copy_(s2)
    ends.copy_(e2)
    ref2 = ref64(q, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends, sm_scale=0.07)
    assert rel_err(ref.float(), ref2) > 0.1
    assert rel_err(crun(q, k, v), ref2) <= TOLERANCE[FP16]


# ----------------------------------------------------------------------------
# dynamic=True
# ----------------------------------------------------------------------------


def test_compile_dynamic_fixed():
    def f(q, k, v):
        return batch_prefill(q, k, v, mask_type="causal", window_left=40, sm_scale=0.08, output_scale=1.0,
                             out_dtype=FP32)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    g = gen(5)
    for sq, sk in [(77, 91), (129, 300), (200, 200), (3, 257)]:
        q, k, v = fixed_inputs(2, sq, sk, 8, 2, 128, BF16, g)
        got = cf(q, k, v)
        close(got, f(q, k, v))
        assert rel_err(got, ref64(q, k, v, mask_type="causal", window_left=40, sm_scale=0.08)) <= TOLERANCE[BF16]


def test_compile_dynamic_packed_oneshot():
    def f(q, k, v, qo_indptr, kv_indptr):
        return batch_prefill(q, k, v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type="causal",
                             output_scale=1.0)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    g = gen(6)
    for qo, kvo in [([0, 30, 95], [0, 40, 130]), ([0, 2, 200, 329], [0, 9, 300, 500]), ([0, 257], [0, 257])]:
        q, k, v = packed_inputs(qo, kvo, 8, 2, 128, BF16, g)
        got = cf(q, k, v, ip(qo), ip(kvo))
        close(got, f(q, k, v, ip(qo), ip(kvo)))
        assert rel_err(got, ref64(q, k, v, qo_indptr=ip(qo), kv_indptr=ip(kvo), mask_type="causal")) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mask,window", [("causal", -1), ("causal", 64), ("dense", -1)])
def test_cuda_graph_wrapper_packed_replay_with_new_offsets(mask, window):
    """plan(q, k, v, qo_indptr, kv_indptr) outside capture, capture run(out=); replays after the bound
    offsets are redistributed in place (same totals, query counts within the planned longest, 160)."""
    g = gen(7)
    hq, hkv, d = 8, 2, 128
    planned_qo, planned_kvo = [0, 90, 250], [0, 91, 500]  # query counts 90, 160; causal Sq <= Sk
    qo, kvo = ip(planned_qo), ip(planned_kvo)
    q, k, v = packed_inputs(planned_qo, planned_kvo, hq, hkv, d, BF16, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
    longest = 160
    out = torch.full(q.shape, NAN, dtype=BF16, device=DEVICE)

    graph = warm_and_capture(lambda: w.run(q, k, v, out=out), DEVICE)
    assert_no_allocation_no_sync(lambda: w.run(q, k, v, out=out), DEVICE)
    assert rel_err(out, ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)) \
        <= TOLERANCE[BF16]

    # replay with the planned offsets
    out.fill_(NAN)
    graph.replay()
    synchronize(DEVICE)
    first = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
    assert rel_err(out, first) <= TOLERANCE[BF16]

    # new offset values in place (same totals; query counts <= 160; causal Sq <= Sk), then new data too
    for new_qo, new_kvo, new_data in [([0, 100, 250], [0, 300, 500], False), ([0, 150, 250], [0, 320, 500], True)]:
        lens_q = [b - a for a, b in zip(new_qo, new_qo[1:])]
        lens_k = [b - a for a, b in zip(new_kvo, new_kvo[1:])]
        assert max(lens_q) <= longest and new_qo[-1] == planned_qo[-1] and new_kvo[-1] == planned_kvo[-1]
        assert mask != "causal" or all(a <= b for a, b in zip(lens_q, lens_k))
        qo.copy_(ip(new_qo))
        kvo.copy_(ip(new_kvo))
        if new_data:
            q.copy_(randn(q.shape, BF16, g))
            v.copy_(randn(v.shape, BF16, g))
        out.fill_(NAN)
        graph.replay()
        synchronize(DEVICE)
        ref = ref64(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window)
        assert rel_err(first.float(), ref) > 0.1, "the new offsets must change the answer"
        assert rel_err(out, ref) <= TOLERANCE[BF16], (new_qo, new_kvo)
        for a, b in zip(new_qo, new_qo[1:]):  # per request: a short request must not hide behind a long one
            assert rel_err(out[a:b], ref[a:b]) <= TOLERANCE[BF16], (new_qo, a, b)


def test_cuda_graph_wrapper_fixed_variable_window_replay():
    """Variable-window bounds are given to plan and bound: replays read new bounds written in place."""
    g = gen(8)
    B, sq, sk, hq, hkv, d = 2, 140, 260, 8, 8, 128
    q, k, v = fixed_inputs(B, sq, sk, hq, hkv, d, FP16, g)
    starts, ends = bounds(B, sq, sk, g)
    w = BatchPrefillTSWrapper()
    w.plan(q, k, v, mask_type="variable_window", variable_window_token_starts=starts,
           variable_window_token_ends=ends, out_dtype=FP32)
    out = torch.full(q.shape, NAN, dtype=FP32, device=DEVICE)
    graph = warm_and_capture(lambda: w.run(q, k, v, out=out), DEVICE)
    assert_no_allocation_no_sync(lambda: w.run(q, k, v, out=out), DEVICE)
    first = ref64(q, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends)
    assert rel_err(out, first) <= TOLERANCE[FP16]
    for _ in range(2):
        s2, e2 = bounds(B, sq, sk, g)
        starts.copy_(s2)
        ends.copy_(e2)
        k.copy_(randn(k.shape, FP16, g))
        out.fill_(NAN)
        graph.replay()
        synchronize(DEVICE)
        ref = ref64(q, k, v, mask_type="variable_window", window_starts=starts, window_ends=ends)
        assert rel_err(first.float(), ref) > 0.1
        assert rel_err(out, ref) <= TOLERANCE[FP16]


# ----------------------------------------------------------------------------
# torch.export and AOTInductor
# ----------------------------------------------------------------------------


class Prefill(torch.nn.Module):
    """batch_prefill's op in every storage x mask: fixed causal + sliding window (fp32, scaled), packed
    causal, fixed dense (defaults), packed causal + sliding window (fp16 out) and packed dense; the
    packed offsets are graph inputs."""

    def forward(self, q, k, v, qp, kp, vp, qo_indptr, kv_indptr):
        a = batch_prefill(q, k, v, mask_type="causal", window_left=33, sm_scale=0.09, output_scale=0.5,
                          out_dtype=FP32)
        b = batch_prefill(qp, kp, vp, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type="causal")
        c = batch_prefill(q, k, v)  # dense, the default scale, q's dtype
        d = batch_prefill(qp, kp, vp, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type="causal", window_left=40,
                          sm_scale=0.1, out_dtype=FP16)
        e = batch_prefill(qp, kp, vp, qo_indptr=qo_indptr, kv_indptr=kv_indptr)  # packed dense
        return a * 2.0, b, c, d, e


def _module_inputs(sq, sk, qo, kvo, seed):
    g = gen(seed)
    q, k, v = fixed_inputs(2, sq, sk, 8, 2, 128, BF16, g)
    qp, kp, vp = packed_inputs(qo, kvo, 8, 1, 128, BF16, g)
    return q, k, v, qp, kp, vp, ip(qo), ip(kvo)


def _check_module_outputs(outs, args):
    q, k, v, qp, kp, vp, qo, kvo = args
    a, b, c, d, e = outs
    assert (a.dtype, b.dtype, c.dtype, d.dtype, e.dtype) == (FP32, BF16, BF16, FP16, BF16)
    assert all(x.device.type == DEVICE for x in outs)
    assert rel_err(c, ref64(q, k, v)) <= TOLERANCE[BF16]
    assert rel_err(a / 2.0, ref64(q, k, v, mask_type="causal", window_left=33, sm_scale=0.09, output_scale=0.5)) \
        <= TOLERANCE[BF16]
    assert rel_err(b, ref64(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")) <= TOLERANCE[BF16]
    assert rel_err(d, ref64(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", window_left=40,
                            sm_scale=0.1)) <= TOLERANCE[BF16]
    assert rel_err(e, ref64(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo)) <= TOLERANCE[BF16]
    for x, y in zip(outs, Prefill()(*args)):
        close(x, y)


EXAMPLE = (77, 150, [0, 60, 190], [0, 100, 300])
OTHER_VALUES = (77, 150, [0, 1, 190], [0, 40, 300])
OTHER_SHAPES = (130, 131, [0, 5, 133, 400], [0, 7, 200, 520])


def _dynamic_shapes():
    Dim = torch.export.Dim
    sq, sk = Dim("sq", min=2, max=4096), Dim("sk", min=2, max=4096)
    tq, tk, b1 = Dim("tq", min=2, max=65536), Dim("tk", min=2, max=65536), Dim("b1", min=2, max=256)
    return ({1: sq}, {1: sk}, {1: sk}, {0: tq}, {0: tk}, {0: tk}, {0: b1}, {0: b1})


def test_export_dynamic_shapes():
    args = _module_inputs(*EXAMPLE, seed=9)
    ep = torch.export.export(Prefill(), args, dynamic_shapes=_dynamic_shapes())
    for spec in (EXAMPLE, OTHER_VALUES, OTHER_SHAPES):
        a = _module_inputs(*spec, seed=10)
        _check_module_outputs(ep.module()(*a), a)


def _aoti_body(package_path: str, device: str) -> None:
    """Export (dynamic shapes) -> aoti_compile_and_package -> aoti_load_package -> run == eager + reference
    (on the example, on new offset values of the same shapes, and on other shapes), in the child process
    that aoti_child starts for `device`."""
    global DEVICE
    DEVICE = device
    args = _module_inputs(*EXAMPLE, seed=11)
    ep = torch.export.export(Prefill(), args, dynamic_shapes=_dynamic_shapes())
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for spec in (EXAMPLE, OTHER_VALUES, OTHER_SHAPES):
        a = _module_inputs(*spec, seed=12)
        outs = compiled(*a)
        assert isinstance(outs, (list, tuple)) and len(outs) == 5
        _check_module_outputs(outs, a)


def test_aoti_package_load_run(tmp_path):
    run_aoti_in_child(__file__, DEVICE, tmp_path)
