"""torch.compile / torch.export / AOTInductor / CUDA graphs over the paged prefill API.

CPU tests run everywhere (the ops run the pure-PyTorch reference there); tests
marked ``cuda`` run the same checks on the GPU kernels, plus CUDA-graph capture of
``BatchPrefillPagedTSWrapper.run(out=)`` (planned over FlashInfer's CSR page metadata)
and replay after the caller redistributes ``qo_indptr`` in place within the planned
total and longest query count (``qo_indptr`` stays bound) with new data. The plan
SNAPSHOTS the pages and lengths: a replay after the caller remaps its pages still
reads the planned page IDs, and a remap (or new lengths) takes a new plan, whose
graph gives the remapped problem's answer. The graph tests also run on the CPU
(``cuda_graphs`` replays eagerly there). Every result is compared with the float64
reference (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16) after poisoning
``out`` with NaN; NaN never passes.
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
from cuda_graphs import assert_no_allocation_no_sync, synchronize, warm_and_capture
from compile_helpers import BF16, DEVICES, FP16, FP32, I32, NAN, close, gen, ip, randn


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


def csr(bt, sl, ps):
    """FlashInfer's CSR page metadata of a block table's used prefixes (new tensors on bt's device):
    paged_kv_indptr, paged_kv_indices (request b's ceil(sl[b] / ps) pages) and paged_kv_last_page_len."""
    lens, table = sl.tolist(), bt.cpu()
    n = [(sk + ps - 1) // ps for sk in lens]
    indices = torch.cat([table[b, :nb] for b, nb in enumerate(n)]).to(I32)
    assert bool((indices >= 0).all())
    last = [sk - (nb - 1) * ps for sk, nb in zip(lens, n)]
    return ip(cumsum0(n), bt.device), indices.to(bt.device), ip(last, bt.device)


def csr_table(indptr, indices, last, ps):
    """The (block table [B, max pages], seq_lens) of CSR page metadata: the reference's form."""
    ptr, ids, lasts = indptr.tolist(), indices.tolist(), last.tolist()
    n = [b - a for a, b in zip(ptr, ptr[1:])]
    table = torch.zeros((len(n), max(n)), dtype=I32)
    for b, nb in enumerate(n):
        table[b, :nb] = torch.tensor(ids[ptr[b]:ptr[b + 1]], dtype=I32)
    lens = [(nb - 1) * ps + lp for nb, lp in zip(n, lasts)]
    return table.to(indptr.device), ip(lens, indptr.device)


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


# a redistribution of SIZES' query counts: same total, each count within the planned longest and its K/V length
NEW_Q = {"cpu": [9, 1, 3], "cuda": [120, 1, 230]}


@pytest.mark.parametrize("device", DEVICES)
def test_compile_wrapper_run(device):
    """Compiled run (functional and out=) of a wrapper planned over CSR pages. The plan snapshots the
    pages: the caller's CSR rewritten in place changes nothing; qo_indptr is bound: offsets redistributed
    in place are honoured; a new plan over the rewritten CSR is honoured by the same compiled function."""
    q_lens, kv_lens, ps = SIZES[device]
    q, k, v, qo, bt, sl = problem(q_lens, kv_lens, 4, 2, 128, ps, BF16, device, seed=7)
    indptr, indices, last = csr(bt, sl, ps)
    w = BatchPrefillPagedTSWrapper()
    w.plan(q, k, v, qo, indptr, indices, last, page_size=ps, mask_type="causal", out_dtype=FP32)
    crun = torch.compile(lambda q, k, v: w.run(q, k, v), fullgraph=True)
    crun_out = torch.compile(lambda q, k, v, out: w.run(q, k, v, out=out), fullgraph=True)
    ref = ref64(q, k, v, qo, bt, sl, mask_type="causal")
    close(crun(q, k, v), w.run(q, k, v))
    out = torch.full(q.shape, NAN, dtype=FP32, device=device)
    crun_out(q, k, v, out)
    assert rel_err(out, ref) <= TOLERANCE[BF16]

    # 1. the caller's CSR rewritten in place (pages reversed, every last page 1 key): the plan's snapshot rules
    indices.copy_(indices.flip(0))
    last.fill_(1)
    bt2, sl2 = csr_table(indptr, indices, last, ps)
    assert rel_err(ref.float(), ref64(q, k, v, qo, bt2, sl2, mask_type="causal")) > 0.1
    out.fill_(NAN)
    crun_out(q, k, v, out)
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    assert rel_err(crun(q, k, v), ref) <= TOLERANCE[BF16]

    # 2. qo_indptr redistributed in place (same total, counts <= the planned longest, causal Sq <= Sk)
    new_q = NEW_Q[device]
    assert sum(new_q) == sum(q_lens) and max(new_q) <= max(q_lens) and new_q != q_lens
    assert all(a <= b for a, b in zip(new_q, kv_lens))
    qo.copy_(ip(cumsum0(new_q), device))
    ref_new = ref64(q, k, v, qo, bt, sl, mask_type="causal")
    assert rel_err(ref.float(), ref_new) > 0.1
    assert rel_err(crun(q, k, v), ref_new) <= TOLERANCE[BF16]
    out.fill_(NAN)
    crun_out(q, k, v, out)
    assert rel_err(out, ref_new) <= TOLERANCE[BF16]

    # 3. a new plan over the rewritten CSR (and the new offsets): the compiled run follows it
    assert all(a <= b for a, b in zip(new_q, sl2.tolist()))
    w.plan(q, k, v, qo, indptr, indices, last, page_size=ps, mask_type="causal", out_dtype=FP32)
    ref3 = ref64(q, k, v, qo, bt2, sl2, mask_type="causal")
    assert rel_err(ref_new.float(), ref3) > 0.1
    out.fill_(NAN)
    crun_out(q, k, v, out)
    assert rel_err(out, ref3) <= TOLERANCE[BF16]
    assert rel_err(crun(q, k, v), ref3) <= TOLERANCE[BF16]


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
    w.plan(q, k, v, qo, *csr(bt, sl, 16), page_size=16, mask_type="causal", out_dtype=FP32)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ps", [16, 64, 128])
@pytest.mark.parametrize("mask,window", [("causal", -1), ("causal", 100), ("dense", -1)])
def test_cuda_graph_wrapper_replay(device, ps, mask, window):
    """plan over CSR pages outside capture, capture run(out=); replay with the planned metadata, after
    qo_indptr is redistributed in place with new data, and after the caller remaps its pages (the
    plan's snapshot: the old graph reads the planned page IDs); a remap and a different logical problem
    (repeated page IDs, new K/V lengths and Q offsets) each take a new plan and graph."""
    q_lens, kv_lens = [100, 1, 300, 37], [130, 9, 1100, 37]
    hq, hkv, d = 8, 2, 128
    q, k, v, qo, bt, sl = problem(q_lens, kv_lens, hq, hkv, d, ps, BF16, device, seed=ps + len(mask) + window)
    indptr, indices, last = csr(bt, sl, ps)
    w = BatchPrefillPagedTSWrapper()
    w.plan(q, k, v, qo, indptr, indices, last, page_size=ps, mask_type=mask, window_left=window)
    longest = max(q_lens)  # the planned longest query count
    out = torch.full(q.shape, NAN, dtype=BF16, device=device)

    def reference(table=None, lens=None):
        return ref64(q, k, v, qo, bt if table is None else table, sl if lens is None else lens, mask_type=mask,
                     window_left=window)

    def replay(graph):
        out.fill_(NAN)
        graph.replay()
        synchronize(device)

    def check(what, ref):
        assert rel_err(out, ref) <= TOLERANCE[BF16], what
        offs = qo.tolist()
        for a, b in zip(offs, offs[1:]):  # per request: a short request must not hide behind a long one
            assert rel_err(out[a:b], ref[a:b]) <= TOLERANCE[BF16], (what, a, b)

    graph = warm_and_capture(lambda: w.run(q, k, v, out=out), device)
    assert_no_allocation_no_sync(lambda: w.run(q, k, v, out=out), device)
    check("warm", reference())

    # 1. replay with the planned metadata
    replay(graph)
    first = reference()
    check("replay", first)

    # 2. qo_indptr redistributed in place (same total, counts <= the planned longest, causal Sq <= Sk), new q
    for new_q in ([130, 8, 263, 37], [125, 5, 299, 9]):
        assert sum(new_q) == sum(q_lens) and max(new_q) <= longest and all(a <= b for a, b in zip(new_q, kv_lens))
        qo.copy_(ip(cumsum0(new_q), device))
        q.copy_(randn(q.shape, BF16, gen(device, sum(new_q[:2])), device))
        replay(graph)
        ref = reference()
        assert rel_err(first.float(), ref) > 0.1
        check(("offsets", new_q), ref)
    before, ref_before = out.clone(), reference()  # the answer of the current logical problem

    # 3. pages moved to new physical slots, the caller's table and CSR rewritten to follow: the captured
    #    plan keeps its snapshot of the old page IDs, so the old graph reads the old IDs in the moved pools
    g = torch.Generator().manual_seed(ps)
    old_bt = bt.clone()
    _remap_pages_in_place(k, v, bt, sl, ps, g)
    indices.copy_(csr(bt, sl, ps)[1])
    torch.testing.assert_close(reference(), ref_before)  # the same logical problem
    stale = reference(old_bt)
    assert rel_err(before.float(), stale) > 0.1
    replay(graph)
    check("snapshot", stale)

    # 4. a new plan over the remapped CSR, a new graph: the logical answer again
    w2 = BatchPrefillPagedTSWrapper()
    w2.plan(q, k, v, qo, indptr, indices, last, page_size=ps, mask_type=mask, window_left=window)
    graph2 = warm_and_capture(lambda: w2.run(q, k, v, out=out), device)
    replay(graph2)
    check("remap, new plan", reference())
    close(out, before)

    # 5. a different logical problem: other pages (repeated IDs), K/V lengths and Q offsets: a new plan each
    P = k.shape[0]
    for new_q, new_kv in [([300, 37, 1, 100], [1100, 40, 1, 100]), ([2, 320, 100, 16], [2, 640, 120, 16])]:
        assert sum(new_q) == sum(q_lens) and all(a <= b for a, b in zip(new_q, new_kv))
        n = [(sk + ps - 1) // ps for sk in new_kv]
        ip3 = ip(cumsum0(n), device)
        ids3 = torch.randint(0, max(2, P // 3), (sum(n),), generator=g, dtype=I32).to(device)  # repeated IDs
        last3 = ip([sk - (nb - 1) * ps for sk, nb in zip(new_kv, n)], device)
        qo.copy_(ip(cumsum0(new_q), device))
        q.copy_(randn(q.shape, BF16, gen(device, sum(new_kv)), device))
        w3 = BatchPrefillPagedTSWrapper()
        w3.plan(q, k, v, qo, ip3, ids3, last3, page_size=ps, mask_type=mask, window_left=window)
        graph3 = warm_and_capture(lambda: w3.run(q, k, v, out=out), device)
        replay(graph3)
        bt3, sl3 = csr_table(ip3, ids3, last3, ps)
        assert sl3.tolist() == new_kv
        check(("new problem", new_q, new_kv), reference(bt3, sl3))
