"""torch.compile / torch.export / AOTInductor / CUDA graphs over the paged prefill API.

CPU tests run everywhere (the ops run the pure-PyTorch reference there); tests
marked ``cuda`` run the same checks on the GPU kernels, plus CUDA-graph capture of
``BatchPrefillPagedTSWrapper.run(out=)`` and replay after the caller remaps pages
(pool contents moved and block-table values rewritten in place), changes K/V
lengths and Q offsets within the planned bounds. Every result is compared with
the float64 reference (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16) after
poisoning ``out`` with NaN; NaN never passes.
"""
from __future__ import annotations


import pytest
import torch
from torch._dynamo.utils import counters

import prims_ts  # noqa: F401
from prims_ts import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, cumsum0, rel_err
from aoti_child import run_aoti_in_child
from cuda_graphs import assert_no_allocation_no_sync, warm_and_capture

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
CUDA = "cuda"  # the device of the CUDA-graph tests


def gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype, g, device):
    return torch.randn(*shape, generator=g, device=device, dtype=FP32).to(dtype)


def ip(values, device):
    return torch.tensor(values, dtype=I32, device=device)


def close(a, b):
    """Compiled vs eager: the same kernel, so equal up to fused surrounding arithmetic."""
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)


def problem(q_lens, kv_lens, hq, hkv, d, ps, dtype, device, seed, extra_pages=4, pad_cols=2, view=True):
    """q, pools, qo_indptr, block tables with non-identity pages (by default a padded, row-strided view
    of a wider table: unused entries hold -1), seq_lens."""
    g = gen(device, seed)
    cpu_g = torch.Generator().manual_seed(seed)
    n_pages = [(sk + ps - 1) // ps for sk in kv_lens]
    P = sum(n_pages) + extra_pages
    perm = torch.randperm(P, generator=cpu_g).tolist()
    C = max(n_pages) + pad_cols
    big = torch.full((len(kv_lens), C + 3), -1, dtype=I32)
    at = 0
    for b, n in enumerate(n_pages):
        big[b, :n] = torch.tensor(perm[at:at + n], dtype=I32)
        at += n
    table = big.to(device)[:, :C] if view else big[:, :C].contiguous().to(device)
    q = randn((sum(q_lens), hq, d), dtype, g, device)
    k = randn((P, hkv, ps, d), dtype, g, device)
    v = randn((P, hkv, ps, d), dtype, g, device)
    return q, k, v, ip(cumsum0(q_lens), device), table, ip(kv_lens, device)


def ref64(q, k, v, qo, bt, sl, **kw):
    return R.batch_prefill_paged(q, k, v, qo, bt, sl, compute_dtype=torch.float64, **kw)


# ----------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------

SIZES = {"cpu": ([3, 1, 9], [20, 1, 33], 16), "cuda": ([100, 1, 250], [130, 7, 400], 32)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 5)])
def test_compile_oneshot_matches_eager(device, mask, window):
    """Traced one-shot call: no host reads of metadata values; new values with the same shapes need
    no recompile and are honoured."""
    q_lens, kv_lens, ps = SIZES[device]
    q, k, v, qo, bt, sl = problem(q_lens, kv_lens, 4, 2, 128, ps, BF16, device, seed=1)

    def f(q, k, v, qo, bt, sl):
        o = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, mask_type=mask, window_left=window,
                                              sm_scale=0.08, output_scale=0.5, out_dtype=FP32)
        return o * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True)
    got = cf(q, k, v, qo, bt, sl)
    close(got, f(q, k, v, qo, bt, sl))
    ref = ref64(q, k, v, qo, bt, sl, mask_type=mask, window_left=window, sm_scale=0.08, output_scale=0.5)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]

    # new values, same shapes: other Q offsets and lengths (Sq <= Sk), pages reversed
    new_q = [q_lens[2], q_lens[1], q_lens[0]]
    # request 0 reads old row 2, request 2 old row 0: each length within the pages that row holds
    new_kv = [min(kv_lens[2], max(new_q[0], kv_lens[0] + 3)), kv_lens[1], max(new_q[2], kv_lens[0] - 7)]
    assert new_kv[0] <= kv_lens[2] and new_kv[2] <= kv_lens[0]
    assert all(a <= b for a, b in zip(new_q, new_kv))
    qo2, sl2 = ip(cumsum0(new_q), device), ip(new_kv, device)
    bt2 = torch.empty_strided(tuple(bt.shape), bt.stride(), dtype=I32, device=device)  # same padded strides
    bt2.copy_(torch.flip(bt, dims=[0]))
    got2 = cf(q, k, v, qo2, bt2, sl2)
    ref2 = ref64(q, k, v, qo2, bt2, sl2, mask_type=mask, window_left=window, sm_scale=0.08, output_scale=0.5)
    assert rel_err((got2 - 1.0) / 2.0, ref2) <= TOLERANCE[BF16]
    if device == "cpu":
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_compile_oneshot_out_writes_out(device):
    q_lens, kv_lens, ps = SIZES[device]
    q, k, v, qo, bt, sl = problem(q_lens, kv_lens, 8, 1, 256, ps, FP16, device, seed=2)

    def f(q, k, v, qo, bt, sl, out):
        r = batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=ps, mask_type="causal", out=out)
        return r.float().sum(), r

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(q.shape, NAN, dtype=FP32, device=device)
    s, r = cf(q, k, v, qo, bt, sl, out)
    assert rel_err(out, ref64(q, k, v, qo, bt, sl, mask_type="causal")) <= TOLERANCE[FP16]
    torch.testing.assert_close(r, out, rtol=0, atol=0)
    torch.testing.assert_close(s.double(), out.double().sum(), rtol=1e-3, atol=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_oneshot_dynamic(device):
    def f(q, k, v, qo, bt, sl):
        return batch_prefill_with_paged_kv_cache(q, k, v, qo, bt, sl, page_size=16, mask_type="causal",
                                                 output_scale=1.0)

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    specs = [([3, 5], [9, 30]), ([2, 6, 7], [3, 40, 7]), ([11, 4, 5, 6], [50, 4, 20, 6])]
    if device == "cuda":
        specs = [([30, 50], [90, 300]), ([2, 60, 77], [3, 400, 77]), ([110, 4, 5, 129], [500, 4, 20, 129])]
    for i, (q_lens, kv_lens) in enumerate(specs):
        q, k, v, qo, bt, sl = problem(q_lens, kv_lens, 4, 2, 128, 16, BF16, device, seed=3 + i)
        got = cf(q, k, v, qo, bt, sl)
        close(got, f(q, k, v, qo, bt, sl))
        assert rel_err(got, ref64(q, k, v, qo, bt, sl, mask_type="causal")) <= TOLERANCE[BF16]


@pytest.mark.parametrize("device", DEVICES)
def test_compile_wrapper_run(device):
    """Compiled run (functional and out=) of a planned wrapper; the planned metadata tensors are then
    rewritten in place within the planned bounds and the compiled run honours the new values."""
    q_lens, kv_lens, ps = SIZES[device]
    q, k, v, qo, bt, sl = problem(q_lens, kv_lens, 4, 2, 128, ps, BF16, device, seed=7)
    max_q = max(q_lens)
    w = BatchPrefillPagedTSWrapper()
    w.plan(qo, bt, sl, num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=ps, mask_type="causal",
           max_q_len=max_q, q_data_type=BF16, out_dtype=FP32)
    crun = torch.compile(lambda q, k, v: w.run(q, k, v), fullgraph=True)
    crun_out = torch.compile(lambda q, k, v, out: w.run(q, k, v, out=out), fullgraph=True)
    ref = ref64(q, k, v, qo, bt, sl, mask_type="causal")
    close(crun(q, k, v), w.run(q, k, v))
    out = torch.full(q.shape, NAN, dtype=FP32, device=device)
    crun_out(q, k, v, out)
    assert rel_err(out, ref) <= TOLERANCE[BF16]

    # in place: pages of requests 0 and 2 swapped in the table, new offsets (same total, <= max_q), lengths
    new_q = [q_lens[2], q_lens[1], q_lens[0]]
    assert max(new_q) <= max_q
    C = bt.shape[1]
    new_kv = [min(C * ps, kv_lens[2]), kv_lens[1], max(new_q[2], kv_lens[0])]
    rows = bt.clone()
    bt[0].copy_(rows[2])
    bt[2].copy_(rows[0])
    qo.copy_(ip(cumsum0(new_q), device))
    sl.copy_(ip(new_kv, device))
    ref_new = ref64(q, k, v, qo, bt, sl, mask_type="causal")
    assert rel_err(ref.float(), ref_new) > 0.1
    assert rel_err(crun(q, k, v), ref_new) <= TOLERANCE[BF16]
    out.fill_(NAN)
    crun_out(q, k, v, out)
    assert rel_err(out, ref_new) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# torch.export and AOTInductor
# ----------------------------------------------------------------------------


class PagedPrefill(torch.nn.Module):
    """Two paged calls: causal+window to fp32 (scaled) and dense with defaults; metadata are graph inputs."""

    def forward(self, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv):
        a = batch_prefill_with_paged_kv_cache(q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv,
                                              page_size=16, mask_type="causal", window_left=6, sm_scale=0.09,
                                              output_scale=0.5, out_dtype=FP32)
        b = batch_prefill_with_paged_kv_cache(q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv,
                                              page_size=16)
        return a * 2.0, b


EXPORT_SPECS = {
    # the first two have the same shapes (same page counts), the third other shapes
    "cpu": [([3, 5], [9, 30]), ([5, 3], [31, 8]), ([2, 6, 7], [3, 40, 7])],
    "cuda": [([70, 150], [90, 300]), ([150, 70], [290, 95]), ([2, 60, 177], [3, 400, 190])],
}


def _module_inputs(spec, device, seed, view=True):
    """view=False for dynamic shapes: a padded view's row stride is a static number that the
    row-stride >= C check would turn into an upper bound on C."""
    q_lens, kv_lens = spec
    return problem(q_lens, kv_lens, 4, 1, 128, 16, BF16, device, seed=seed, extra_pages=4, pad_cols=0, view=view)


def _check_module_outputs(outs, args):
    q, k, v, qo, bt, sl = args
    a, b = outs
    assert a.dtype == FP32 and b.dtype == BF16 and a.device == q.device
    assert rel_err(a / 2.0, ref64(q, k, v, qo, bt, sl, mask_type="causal", window_left=6, sm_scale=0.09,
                                  output_scale=0.5)) <= TOLERANCE[BF16]
    assert rel_err(b, ref64(q, k, v, qo, bt, sl)) <= TOLERANCE[BF16]
    for x, y in zip(outs, PagedPrefill()(*args)):
        close(x, y)


def _dynamic_shapes():
    Dim = torch.export.Dim
    tq, b, c, p = Dim("tq", min=2, max=65536), Dim("b", min=2, max=256), Dim("c", min=2, max=4096), \
        Dim("p", min=2, max=1 << 20)
    return ({0: tq}, {0: p}, {0: p}, {0: b + 1}, {0: b, 1: c}, {0: b})


@pytest.mark.parametrize("device", DEVICES)
def test_export_static(device):
    specs = EXPORT_SPECS[device]
    args = _module_inputs(specs[0], device, seed=9)
    ep = torch.export.export(PagedPrefill(), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.prims_ts.batch_prefill_paged.default in targets
    _check_module_outputs(ep.module()(*args), args)
    args2 = _module_inputs(specs[1], device, seed=10)  # same shapes, new values (offsets, lengths, pages)
    assert all(x.shape == y.shape for x, y in zip(args, args2))
    _check_module_outputs(ep.module()(*args2), args2)


@pytest.mark.parametrize("device", DEVICES)
def test_export_dynamic_shapes(device):
    specs = EXPORT_SPECS[device]
    ep = torch.export.export(PagedPrefill(), _module_inputs(specs[0], device, seed=11, view=False),
                             dynamic_shapes=_dynamic_shapes())
    for i, spec in enumerate(specs):
        a = _module_inputs(spec, device, seed=12 + i, view=False)
        _check_module_outputs(ep.module()(*a), a)


class WrapperModule(torch.nn.Module):
    """Calls a planned wrapper's run (its op: batch_prefill_paged_out) on caller-provided out."""

    def __init__(self, wrapper):
        super().__init__()
        self.w = wrapper

    def forward(self, q, k_cache, v_cache, out):
        self.w.run(q, k_cache, v_cache, out=out)
        return out * 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_export_wrapper_run(device):
    spec = EXPORT_SPECS[device][0]
    q, k, v, qo, bt, sl = _module_inputs(spec, device, seed=15)
    w = BatchPrefillPagedTSWrapper()
    w.plan(qo, bt, sl, num_qo_heads=4, num_kv_heads=1, head_dim=128, page_size=16, mask_type="causal",
           q_data_type=BF16, out_dtype=FP32)
    out = torch.full(q.shape, NAN, dtype=FP32, device=device)
    ep = torch.export.export(WrapperModule(w), (q, k, v, out))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert any("batch_prefill_paged" in str(t) for t in targets), targets
    ref = ref64(q, k, v, qo, bt, sl, mask_type="causal")
    res = ep.module()(q, k, v, out)
    assert rel_err(res, ref) <= TOLERANCE[BF16]
    # new q / pool data, same planned metadata
    g = gen(device, 16)
    q2 = randn(q.shape, BF16, g, device)
    v2 = randn(v.shape, BF16, g, device)
    out.fill_(NAN)
    res2 = ep.module()(q2, k, v2, out)
    assert rel_err(res2, ref64(q2, k, v2, qo, bt, sl, mask_type="causal")) <= TOLERANCE[BF16]


def _aoti_body(package_path: str, device: str) -> None:
    """Export (dynamic shapes) -> aoti_compile_and_package -> aoti_load_package -> run == eager + reference."""
    specs = EXPORT_SPECS[device]
    ep = torch.export.export(PagedPrefill(), _module_inputs(specs[0], device, seed=17, view=False),
                             dynamic_shapes=_dynamic_shapes())
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for i, spec in enumerate(specs):
        a = _module_inputs(spec, device, seed=18 + i, view=False)
        outs = compiled(*a)
        assert isinstance(outs, (list, tuple)) and len(outs) == 2
        _check_module_outputs(outs, a)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_load_run(device, tmp_path):
    run_aoti_in_child(__file__, device, tmp_path)


# ----------------------------------------------------------------------------
# CUDA graphs
# ----------------------------------------------------------------------------


def _remap_pages_in_place(k, v, bt, sl, ps, g):
    """Move every page of both pools to a new physical slot and rewrite the used table prefixes."""
    P = k.shape[0]
    new_of_old = torch.randperm(P, generator=g, device="cpu").to(k.device)
    for cache in (k, v):
        moved = torch.empty_like(cache)
        moved[new_of_old] = cache
        cache.copy_(moved)
    for b, sk in enumerate(sl.tolist()):
        n = (sk + ps - 1) // ps
        bt[b, :n] = new_of_old[bt[b, :n].long()].to(I32)


@pytest.mark.cuda
@pytest.mark.parametrize("ps", [16, 64, 128])
@pytest.mark.parametrize("mask,window", [("causal", -1), ("causal", 100), ("dense", -1)])
def test_cuda_graph_wrapper_replay_after_remap(ps, mask, window):
    device = CUDA
    q_lens, kv_lens = [100, 1, 300, 37], [130, 9, 1100, 37]
    hq, hkv, d = 8, 2, 128
    q, k, v, qo, bt, sl = problem(q_lens, kv_lens, hq, hkv, d, ps, BF16, device, seed=ps + len(mask) + window)
    max_q = 320
    w = BatchPrefillPagedTSWrapper()
    w.plan(qo, bt, sl, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps, mask_type=mask,
           window_left=window, max_q_len=max_q, q_data_type=BF16)
    out = torch.full(q.shape, NAN, dtype=BF16, device=device)

    def reference():
        return ref64(q, k, v, qo, bt, sl, mask_type=mask, window_left=window)

    graph = warm_and_capture(lambda: w.run(q, k, v, out=out))
    assert_no_allocation_no_sync(lambda: w.run(q, k, v, out=out))
    assert rel_err(out, reference()) <= TOLERANCE[BF16]

    # 1. replay with the planned metadata
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    before = out.clone()
    assert rel_err(out, reference()) <= TOLERANCE[BF16]

    # 2. pages moved to new physical slots (pool contents and table values rewritten in place)
    g = torch.Generator().manual_seed(ps)
    _remap_pages_in_place(k, v, bt, sl, ps, g)
    out.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference()) <= TOLERANCE[BF16]
    close(out, before)

    # 3. a different logical problem: other pages (repeated IDs), Q offsets and K/V lengths within bounds
    C, P = bt.shape[1], k.shape[0]
    for new_q, new_kv in [([300, 37, 1, 100], [1100, 40, 1, 100]), ([2, 320, 100, 16], [2, 640, 120, 16])]:
        assert max(new_q) <= max_q and sum(new_q) == sum(q_lens) and max(new_kv) <= C * ps
        qo.copy_(ip(cumsum0(new_q), device))
        sl.copy_(ip(new_kv, device))
        bt.copy_(torch.randint(0, P, tuple(bt.shape), generator=g, dtype=I32).to(device))
        q.copy_(randn(q.shape, BF16, gen(device, sum(new_kv)), device))
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, reference()) <= TOLERANCE[BF16], (new_q, new_kv)
