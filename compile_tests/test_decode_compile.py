"""torch.compile / torch.export / AOTInductor / CUDA graphs over the paged decode API.

CPU tests run everywhere (the ops run the pure-PyTorch reference there); tests
marked ``cuda`` run the same checks on the GPU kernels, plus CUDA-graph capture of
the standalone ``prims_ts_batch_decode_with_kv_cache(out=, workspace)``, replayed after
the caller rewrites ``seq_lens``, page IDs, CSR offsets and ``qo_indptr`` in place within
the seed 003 contract, and of ``BatchDecodePagedTSWrapper.run(out=)``, replayed after the
caller remaps page IDs in place (``paged_kv_indices`` and ``qo_indptr`` are bound; the
lengths are fixed at plan: a ``paged_kv_last_page_len`` change takes a new plan); a warmed
call with ``out=`` neither allocates nor synchronises; and the workspace contract (two
launches of one key with different data, no re-zeroing). The graph tests also run on the
CPU (``cuda_graphs`` replays eagerly there). AOTInductor packages two standalone calls
(one package) and a planned wrapper's run (another). Every result is compared with the
float64 reference (``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16) after poisoning
``out`` with NaN; NaN never passes.
"""
from __future__ import annotations


import pytest
import torch
from torch._dynamo.utils import counters

import prims_ts  # noqa: F401
from prims_ts import (
    BatchDecodePagedTSWrapper,
    get_prims_ts_batch_decode_workspace_size,
    prims_ts_batch_decode_with_kv_cache,
)
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, check_decode_workspace, cumsum0, on_sm90_gpu, rel_err
from aoti_child import run_aoti_in_child
from cuda_graphs import assert_no_allocation_no_sync, check_standalone_replays, synchronize, warm_and_capture
from compile_helpers import BF16, DEVICES, FP16, FP32, I32, NAN, close, gen, ip, randn


class Prob:
    """Decode problem on `device`: q (single [B,Hq,D], fixed [B,SQ,Hq,D] or packed [T,Hq,D]), a combined
    cache [P, 2, Hkv, ps, D] (``self.cache``; ``self.k``/``self.v`` are its halves), CSR pages with
    non-identity IDs and `slack` spare entries per request, seq_lens, and a zeroed workspace."""

    def __init__(self, qmode, seq_lens, hq, hkv, d, ps, dtype, device, seed, *, sq=3, q_lens=None, max_seq_len=None,
                 max_seq_len_q=None, slack=1, extra_pages=3):
        g = gen(device, seed)
        cpu_g = torch.Generator().manual_seed(seed)
        B = len(seq_lens)
        self.qmode, self.device, self.dtype, self.ps = qmode, device, dtype, ps
        self.hq, self.hkv, self.d = hq, hkv, d
        n_live = [(sk + ps - 1) // ps for sk in seq_lens]
        P = sum(n_live) + extra_pages
        perm = torch.randperm(P, generator=cpu_g).tolist()
        indices, at = [], 0
        for n in n_live:
            indices += perm[at:at + n] + [perm[(at + n + i) % P] for i in range(slack)]
            at += n
        self.num_pages, self.slack = P, slack
        self.indptr = ip(cumsum0([n + slack for n in n_live]), device)
        self.indices = ip(indices, device)
        self.seq_lens = ip(seq_lens, device)
        self.cache = randn((P, 2, hkv, ps, d), dtype, g, device)
        self.k, self.v = self.cache[:, 0], self.cache[:, 1]
        self.qo_indptr, self.seq_len_q = None, 1
        if qmode == "single":
            self.q, self.max_seq_len_q = randn((B, hq, d), dtype, g, device), 1
        elif qmode == "fixed":
            self.q, self.seq_len_q, self.max_seq_len_q = randn((B, sq, hq, d), dtype, g, device), sq, sq
        else:
            self.q = randn((sum(q_lens), hq, d), dtype, g, device)
            self.qo_indptr = ip(cumsum0(q_lens), device)
            self.max_seq_len_q = max_seq_len_q or max(q_lens)
        self.batch = B
        self.max_seq_len = max_seq_len or max(seq_lens)
        n = get_prims_ts_batch_decode_workspace_size(B, hq, hkv, d, ps, self.max_seq_len, **self.kw(), q_dtype=dtype,
                                                     device=device)
        self.ws = torch.zeros(n, dtype=torch.uint8, device=device)

    def kw(self):
        """The query-mode arguments of the standalone call, the workspace size and the wrapper's plan."""
        kw = {}
        if self.qmode == "fixed":
            kw["seq_len_q"] = self.seq_len_q
        elif self.qmode == "packed":
            kw.update(qo_indptr=self.qo_indptr, max_seq_len_q=self.max_seq_len_q)
        return kw

    def last_page_len(self):
        """paged_kv_last_page_len of the live lengths (a wrapper's plan: needs slack=0, whole CSR rows live)."""
        assert self.slack == 0
        return ip([sk - ((sk + self.ps - 1) // self.ps - 1) * self.ps for sk in self.seq_lens.tolist()], self.device)

    def rows(self, b):
        """Request b's rows of the query and the output."""
        if self.qmode == "packed":
            offs = self.qo_indptr.tolist()
            return slice(offs[b], offs[b + 1])
        return slice(b, b + 1)

    def call(self, **kw):
        return prims_ts_batch_decode_with_kv_cache(self.q, self.cache, self.ws, self.indptr, self.indices,
                                                   self.seq_lens, self.max_seq_len, **self.kw(), **kw)

    def ref(self, mask_type="dense", window_left=-1, bmm1_scale=None, bmm2_scale=1.0):
        return R.batch_decode(self.q, self.k, self.v, self.indptr, self.indices, self.seq_lens,
                              qo_indptr=self.qo_indptr, mask_type=mask_type, window_left=window_left,
                              sm_scale=bmm1_scale, output_scale=bmm2_scale, compute_dtype=torch.float64)

    def policy(self):
        """The split-KV policy the library sizes this problem's launch with (the CPU: the nominal H200)."""
        from prims_ts.cuda.decode import decode_policy
        from prims_ts.cuda.keys import device_limits

        _, sms, smem = device_limits(self.device)
        return decode_policy(self.batch, self.hkv, self.hq // self.hkv, self.max_seq_len_q, self.d,
                             self.max_seq_len, sms, smem)

    def rewrite_metadata(self, new_lens, g, new_q_lens=None):
        """In place, within the contract: new live lengths (<= max_seq_len), new CSR offsets (same total,
        each request owning at least the pages its length needs), random page IDs in [0, P) (repeats
        allowed) and, for packed queries, new offsets (same total, deltas <= max_seq_len_q)."""
        N, B = self.indices.numel(), self.batch
        need = [(sk + self.ps - 1) // self.ps for sk in new_lens]
        assert sum(need) <= N and max(new_lens) <= self.max_seq_len
        own = list(need)
        for i in range(N - sum(need)):
            own[int(torch.randint(0, B, (1,), generator=g))] += 1
        self.seq_lens.copy_(ip(new_lens, self.device))
        self.indptr.copy_(ip(cumsum0(own), self.device))
        self.remap_page_ids(g)
        if new_q_lens is not None:
            assert self.qmode == "packed" and sum(new_q_lens) == self.q.shape[0]
            assert max(new_q_lens) <= self.max_seq_len_q and min(new_q_lens) >= 1
            self.qo_indptr.copy_(ip(cumsum0(new_q_lens), self.device))

    def remap_page_ids(self, g):
        """Random page IDs in [0, P) (repeats allowed) for every CSR entry, in place."""
        N = self.indices.numel()
        self.indices.copy_(torch.randint(0, self.num_pages, (N,), generator=g, dtype=I32).to(self.device))


QMODES = ["single", "fixed", "packed"]
# per device: seq_lens, page size, static max_seq_len (CUDA: large enough for split-KV)
SIZES = {"cpu": ([20, 3, 33], 16, 48), "cuda": ([300, 7, 1333], 32, 4096)}
Q_LENS = [2, 1, 3]


def make(qmode, device, seed, dtype=BF16, hq=8, hkv=2, d=128):
    lens, ps, max_len = SIZES[device]
    return Prob(qmode, lens, hq, hkv, d, ps, dtype, device, seed, sq=3, q_lens=Q_LENS, max_seq_len=max_len,
                max_seq_len_q=4)


# ----------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask,window", [("dense", -1), ("causal", -1), ("causal", 5)])
@pytest.mark.parametrize("qmode", QMODES)
def test_compile_standalone_matches_eager(device, qmode, mask, window):
    """Traced standalone call; new metadata values with the same shapes need no recompile and are honoured."""
    pb = make(qmode, device, seed=1)
    kw = pb.kw()
    max_len = pb.max_seq_len

    def f(q, cache, ws, indptr, indices, seq_lens, qo):
        extra = dict(kw, qo_indptr=qo) if qo is not None else kw
        o = prims_ts_batch_decode_with_kv_cache(q, cache, ws, indptr, indices, seq_lens, max_len, mask_type=mask,
                                                window_left=window, bmm1_scale=0.08, bmm2_scale=0.5,
                                                out_dtype=FP32, **extra)
        return o * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True)
    args = (pb.q, pb.cache, pb.ws, pb.indptr, pb.indices, pb.seq_lens, pb.qo_indptr)
    got = cf(*args)
    close(got, f(*args))
    ref = pb.ref(mask, window, 0.08, 0.5)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]

    # new values, same shapes: lengths, CSR offsets, page IDs (and packed offsets)
    g = torch.Generator().manual_seed(7)
    lens = SIZES[device][0]
    new_lens = [lens[2] - 5, lens[0] + 1, max(3, lens[1])]
    pb.rewrite_metadata(new_lens, g, [3, 2, 1] if qmode == "packed" else None)
    got2 = cf(*args)
    ref2 = pb.ref(mask, window, 0.08, 0.5)
    assert rel_err(ref.float(), ref2) > 0.1
    assert rel_err((got2 - 1.0) / 2.0, ref2) <= TOLERANCE[BF16]
    if device == "cpu":
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qmode", QMODES)
def test_compile_standalone_out_tuple_cache(device, qmode):
    pb = make(qmode, device, seed=2, dtype=FP16, hq=8, hkv=1, d=256)
    kw = pb.kw()
    max_len = pb.max_seq_len

    def f(q, k, v, ws, indptr, indices, seq_lens, out):
        r = prims_ts_batch_decode_with_kv_cache(q, (k, v), ws, indptr, indices, seq_lens, max_len,
                                                mask_type="causal", out=out, **kw)
        return r.float().sum(), r

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(pb.q.shape, NAN, dtype=FP32, device=device)
    s, r = cf(pb.q, pb.k, pb.v, pb.ws, pb.indptr, pb.indices, pb.seq_lens, out)
    assert rel_err(out, pb.ref("causal")) <= TOLERANCE[FP16]
    torch.testing.assert_close(r, out, rtol=0, atol=0)
    torch.testing.assert_close(s.double(), out.double().sum(), rtol=1e-3, atol=0.1)


def _new_last_pages(pb):
    """Other last-page lengths: 1 key where a request has several pages (its new length then still holds
    every query of a causal request: at least one full page), a full page where it has one (longer)."""
    ps = pb.ps
    n = [(sk + ps - 1) // ps for sk in pb.seq_lens.tolist()]
    last = pb.last_page_len().tolist()
    new_last = [1 if nb > 1 else ps for nb in n]
    assert new_last != last and min(last) < ps  # a one-page request grows
    return new_last, [(nb - 1) * ps + lp for nb, lp in zip(n, new_last)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qmode", QMODES)
def test_compile_wrapper_run(device, qmode):
    """Compiled run (functional and out=) of a planned wrapper: page IDs remapped in place are honoured
    (paged_kv_indices is bound); the lengths are fixed at plan: last_page_len rewritten in place changes
    nothing, and a new plan over it is honoured by the same compiled functions."""
    lens, ps, _ = SIZES[device]
    pb = Prob(qmode, lens, 8, 2, 128, ps, BF16, device, seed=3, sq=3, q_lens=Q_LENS, slack=0)
    last = pb.last_page_len()
    w = BatchDecodePagedTSWrapper()
    w.plan(pb.indptr, pb.indices, last, 8, 2, 128, ps, **pb.kw(), mask_type="causal", q_data_type=BF16,
           o_data_type=FP32)
    crun = torch.compile(lambda q, c: w.run(q, c, bmm1_scale=0.07, bmm2_scale=0.5), fullgraph=True)
    crun_out = torch.compile(lambda q, c, out: w.run(q, c, bmm1_scale=0.07, bmm2_scale=0.5, out=out),
                             fullgraph=True)
    close(crun(pb.q, pb.cache), w.run(pb.q, pb.cache, bmm1_scale=0.07, bmm2_scale=0.5))
    out = torch.full(pb.q.shape, NAN, dtype=FP32, device=device)
    crun_out(pb.q, pb.cache, out)
    ref = pb.ref("causal", -1, 0.07, 0.5)
    assert rel_err(out, ref) <= TOLERANCE[BF16]

    # 1. page IDs remapped in place (reversed): read live
    pb.indices.copy_(pb.indices.flip(0))
    ref1 = pb.ref("causal", -1, 0.07, 0.5)
    assert rel_err(ref.float(), ref1) > 0.1
    out.fill_(NAN)
    crun_out(pb.q, pb.cache, out)
    assert rel_err(out, ref1) <= TOLERANCE[BF16]

    # 2. shorter last pages written in place: the planned lengths rule
    new_last, new_lens = _new_last_pages(pb)
    last.copy_(ip(new_last, device))
    out.fill_(NAN)
    crun_out(pb.q, pb.cache, out)
    assert rel_err(out, ref1) <= TOLERANCE[BF16]
    assert rel_err(crun(pb.q, pb.cache), ref1) <= TOLERANCE[BF16]

    # 3. a new plan over them: followed
    w.plan(pb.indptr, pb.indices, last, 8, 2, 128, ps, **pb.kw(), mask_type="causal", q_data_type=BF16,
           o_data_type=FP32)
    pb.seq_lens.copy_(ip(new_lens, device))
    ref3 = pb.ref("causal", -1, 0.07, 0.5)
    assert rel_err(ref1[pb.rows(1)].float(), ref3[pb.rows(1)]) > 0.1  # the one-page request grew
    out.fill_(NAN)
    crun_out(pb.q, pb.cache, out)
    assert rel_err(out, ref3) <= TOLERANCE[BF16]
    assert rel_err(crun(pb.q, pb.cache), ref3) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# torch.export and AOTInductor
# ----------------------------------------------------------------------------

EXPORT_LENS = {"cpu": ([20, 3, 33], [9, 17, 40]), "cuda": ([300, 7, 1333], [1000, 70, 20])}
EXPORT_PS = {"cpu": 16, "cuda": 32}
EXPORT_MAX = {"cpu": 64, "cuda": 4096}
WRAPPER_SCALES = dict(bmm1_scale=0.07, bmm2_scale=2.0)
WRAPPER_MASK = dict(mask_type="causal", window_left=9)


class Decode(torch.nn.Module):
    """Two standalone calls over one (K, V) tuple: packed causal + window to fp32 (scaled) and single-token
    dense with defaults; every tensor, the two workspaces included, is a graph input."""

    def __init__(self, max_seq_len):
        super().__init__()
        self.max_seq_len = max_seq_len

    def forward(self, q_packed, q_single, k, v, ws_a, ws_b, indptr, indices, seq_lens, qo_indptr):
        a = prims_ts_batch_decode_with_kv_cache(q_packed, (k, v), ws_a, indptr, indices, seq_lens, self.max_seq_len,
                                                qo_indptr=qo_indptr, max_seq_len_q=4, mask_type="causal",
                                                window_left=6, bmm1_scale=0.09, bmm2_scale=0.5, out_dtype=FP32)
        b = prims_ts_batch_decode_with_kv_cache(q_single, (k, v), ws_b, indptr, indices, seq_lens, self.max_seq_len)
        return a * 2.0, b


class DecodeWrapper(torch.nn.Module):
    """A planned wrapper's run (fixed SQ=2, causal + window, fp32 out, scaled) over a combined cache: its
    metadata and workspace are the plan's (graph constants), its query and cache are graph inputs."""

    def __init__(self, wrapper):
        super().__init__()
        self.w = wrapper

    def forward(self, q, cache):
        return self.w.run(q, cache, **WRAPPER_SCALES) * 1.0


def _module_inputs(device, which, seed):
    """Same shapes for every `which` (same page counts and CSR size); other values."""
    lens = EXPORT_LENS[device][which]
    base_lens = EXPORT_LENS[device][0]
    ps, max_len = EXPORT_PS[device], EXPORT_MAX[device]
    pb = Prob("packed", base_lens, 8, 2, 128, ps, BF16, device, seed, q_lens=Q_LENS, max_seq_len=max_len,
              max_seq_len_q=4)
    if which:
        pb.rewrite_metadata(lens, torch.Generator().manual_seed(seed), [1, 3, 2])
    single = Prob("single", base_lens, 8, 2, 128, ps, BF16, device, seed + 1, max_seq_len=max_len)
    args = (pb.q, single.q, pb.k, pb.v, pb.ws, single.ws, pb.indptr, pb.indices, pb.seq_lens, pb.qo_indptr)
    return args, pb, single


def _check_module_outputs(outs, device, args, pb, single):
    a, b = outs
    assert a.dtype == FP32 and b.dtype == BF16 and a.device == pb.q.device
    assert rel_err(a / 2.0, pb.ref("causal", 6, 0.09, 0.5)) <= TOLERANCE[BF16]
    ref_b = R.batch_decode(single.q, pb.k, pb.v, pb.indptr, pb.indices, pb.seq_lens, compute_dtype=torch.float64)
    assert rel_err(b, ref_b) <= TOLERANCE[BF16]
    for x, y in zip(outs, Decode(EXPORT_MAX[device])(*args)):
        close(x, y)


def _wrapper_problem(device):
    """The wrapper's problem: the same metadata on every call (a fixed seed: page IDs, CSR, lengths)."""
    return Prob("fixed", EXPORT_LENS[device][1], 8, 2, 128, EXPORT_PS[device], BF16, device, seed=40, sq=2,
                max_seq_len=EXPORT_MAX[device], slack=0)


def _wrapper_module(device):
    """DecodeWrapper over a wrapper planned on _wrapper_problem's metadata (max_kv_len: the static bound,
    split-KV on CUDA)."""
    wp = _wrapper_problem(device)
    w = BatchDecodePagedTSWrapper()
    w.plan(wp.indptr, wp.indices, wp.last_page_len(), wp.hq, wp.hkv, wp.d, wp.ps, seq_len_q=2, q_data_type=BF16,
           o_data_type=FP32, max_kv_len=EXPORT_MAX[device], **WRAPPER_MASK)
    return DecodeWrapper(w)


def _wrapper_inputs(device, seed):
    """The wrapper problem with new q / cache data (its metadata: the plan's, the same every time)."""
    wp = _wrapper_problem(device)
    g = gen(device, seed)
    wp.q.copy_(randn(wp.q.shape, BF16, g, device))
    wp.cache.copy_(randn(wp.cache.shape, BF16, g, device))
    return (wp.q, wp.cache), wp


def _check_wrapper_output(out, module, args, wp):
    assert out.dtype == FP32 and out.device == wp.q.device and out.shape == wp.q.shape
    ref = wp.ref(WRAPPER_MASK["mask_type"], WRAPPER_MASK["window_left"], *WRAPPER_SCALES.values())
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    close(out, module(*args))


def _decode_calls(ep):
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    # the op, called directly or through auto_functionalized (it mutates the workspace)
    return sum("prims_ts.batch_decode" in f"{n.target} {n.args}" for n in calls), [str(n.target) for n in calls]


@pytest.mark.parametrize("device", DEVICES)
def test_export_static(device):
    args, pb, single = _module_inputs(device, 0, seed=9)
    ep = torch.export.export(Decode(EXPORT_MAX[device]), args)
    n, targets = _decode_calls(ep)
    assert n == 2, targets
    _check_module_outputs(ep.module()(*args), device, args, pb, single)
    args2, pb2, single2 = _module_inputs(device, 1, seed=10)  # same shapes, new values
    assert all(x.shape == y.shape for x, y in zip(args, args2))
    _check_module_outputs(ep.module()(*args2), device, args2, pb2, single2)


@pytest.mark.parametrize("device", DEVICES)
def test_export_wrapper_run(device):
    """A planned wrapper's run exported: the plan's metadata are constants; new q / cache data are honoured."""
    module = _wrapper_module(device)
    args, wp = _wrapper_inputs(device, seed=30)
    ep = torch.export.export(module, args)
    n, targets = _decode_calls(ep)
    assert n == 1, targets
    _check_wrapper_output(ep.module()(*args), module, args, wp)
    args2, wp2 = _wrapper_inputs(device, seed=31)
    assert rel_err(wp.ref().float(), wp2.ref()) > 0.1
    _check_wrapper_output(ep.module()(*args2), module, args2, wp2)


def _aoti_body(package_path: str, device: str) -> None:
    """Export -> aoti_compile_and_package -> aoti_load_package -> run == eager + reference, two packages:
    the standalone calls (two metadata value sets), then a planned wrapper's run (its metadata are the
    plan's constants: two sets of new q / cache data)."""
    args, _, _ = _module_inputs(device, 0, seed=17)
    ep = torch.export.export(Decode(EXPORT_MAX[device]), args)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for which in (0, 1):
        a, pb, single = _module_inputs(device, which, seed=18 + which)
        outs = compiled(*a)
        assert isinstance(outs, (list, tuple)) and len(outs) == 2
        _check_module_outputs(outs, device, a, pb, single)

    module = _wrapper_module(device)
    ep = torch.export.export(module, _wrapper_inputs(device, seed=32)[0])
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path.replace(".pt2", "_wrapper.pt2"))
    compiled = torch._inductor.aoti_load_package(path)
    for seed in (33, 34):
        a, wp = _wrapper_inputs(device, seed)
        outs = compiled(*a)
        out = outs[0] if isinstance(outs, (list, tuple)) else outs
        _check_wrapper_output(out, module, a, wp)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_load_run(device, tmp_path):
    run_aoti_in_child(__file__, device, tmp_path)


# ----------------------------------------------------------------------------
# CUDA graphs, no allocation / no sync, workspace reuse (also run on the CPU, eagerly)
# ----------------------------------------------------------------------------

GRAPH_CASES = [("single", "dense", -1), ("single", "causal", 50), ("fixed", "causal", -1), ("fixed", "dense", -1),
               ("packed", "causal", -1), ("packed", "causal", 0), ("packed", "dense", -1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_len", [127, 1024, 8192], ids=["one_split", "cluster", "split_kv"])
@pytest.mark.parametrize("qmode,mask,window", GRAPH_CASES,
                         ids=[f"{q}-{m}{w if w >= 0 else ''}" for q, m, w in GRAPH_CASES])
def test_cuda_graph_standalone_replay(device, qmode, mask, window, max_len):
    """Capture the standalone call, replay it over lengths, page IDs, packed offsets and cache
    data rewritten in place: one split, 8 splits (on sm_90a one thread block cluster a row tile,
    merged on chip: the workspace stays untouched) and, over 2 K/V heads, 16 splits (the ticket
    merge)."""
    lens = [100, 7, 120, 64] if max_len == 127 else [300, 7, 555, 64]
    ps = 16 if max_len == 127 else 64
    slack = {127: 6, 1024: 20, 8192: 64}[max_len]  # room for longer requests after the CSR rewrite
    hkv = 2 if max_len == 8192 else 4
    pb = Prob(qmode, lens, 16, hkv, 128, ps, BF16, device, seed=len(qmode) + max_len + window, sq=4,
              q_lens=[3, 1, 4, 2], max_seq_len=max_len, max_seq_len_q=4, slack=slack)
    pol = pb.policy()
    assert (pol.splits > 1) == (max_len > 127) and (pol.splits <= 8) == (max_len <= 1024), pol
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device=device)
    # new lengths (each >= the request's query count, as causal masks require), new packed offsets
    steps = {127: [([4, 127, 5, 100], [4, 3, 2, 1]), ([127, 4, 16, 126], [1, 4, 4, 1])],
             1024: [([1024, 4, 5, 700], [4, 3, 2, 1]), ([64, 1000, 4, 1023], [1, 4, 4, 1])],
             8192: [([8192, 4, 5, 3000], [4, 3, 2, 1]), ([64, 8000, 4, 8191], [1, 4, 4, 1])]}[max_len]
    check_standalone_replays(lambda: pb.call(mask_type=mask, window_left=window, out=out), out, pb, pb.cache,
                             randn(pb.cache.shape, BF16, gen(device, 5), device), steps, qmode == "packed",
                             lambda: pb.ref(mask, window), TOLERANCE[BF16], device, seed=max_len)
    if max_len == 1024 and on_sm90_gpu(device):  # every launch merged in its cluster
        check_decode_workspace(pb.ws, True)


WRAPPER_GRAPH_MASKS = [("dense", -1), ("causal", -1), ("causal", 31)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask,window", WRAPPER_GRAPH_MASKS)
@pytest.mark.parametrize("qmode", QMODES)
def test_cuda_graph_wrapper_replay(device, qmode, mask, window):
    """plan outside capture, capture run(out=); replays read remapped page IDs (and, packed, redistributed
    query offsets) written in place with new data; the lengths are fixed at plan (a last_page_len change
    in place changes nothing; a new plan and graph follow it)."""
    ps = 32
    lens = [1000, 33, 4, 4000]
    pb = Prob(qmode, lens, 32, 8, 128, ps, FP16, device, seed=11 + window, sq=2, q_lens=[2, 1, 4, 3],
              max_seq_len_q=4, slack=0, extra_pages=20)
    last = pb.last_page_len()

    def plan(wrapper):
        wrapper.plan(pb.indptr, pb.indices, last, 32, 8, 128, ps, **pb.kw(), mask_type=mask, window_left=window,
                     q_data_type=FP16, max_kv_len=4096)

    w = BatchDecodePagedTSWrapper()
    plan(w)
    out = torch.full(pb.q.shape, NAN, dtype=FP16, device=device)
    scales = dict(bmm1_scale=0.1, bmm2_scale=1.5)

    def reference():
        return pb.ref(mask, window, scales["bmm1_scale"], scales["bmm2_scale"])

    def replay(graph):
        out.fill_(NAN)
        graph.replay()
        synchronize(device)

    def check(what, ref):
        assert rel_err(out, ref) <= TOLERANCE[FP16], what
        for b in range(pb.batch):  # per request: a short request must not hide behind a long one
            assert rel_err(out[pb.rows(b)], ref[pb.rows(b)]) <= TOLERANCE[FP16], (what, b)

    graph = warm_and_capture(lambda: w.run(pb.q, pb.cache, out=out, **scales), device)
    assert_no_allocation_no_sync(lambda: w.run(pb.q, pb.cache, out=out, **scales), device)
    first = reference()
    check("warm", first)
    replay(graph)
    check("replay", first)

    # 1. page IDs remapped in place (random, repeats allowed), then new cache data too
    g = torch.Generator().manual_seed(12)
    for step in range(2):
        pb.remap_page_ids(g)
        if step:
            pb.cache.copy_(randn(pb.cache.shape, FP16, gen(device, 13), device))
        replay(graph)
        ref = reference()
        assert rel_err(first.float(), ref) > 0.1
        check(("pages", step), ref)

    # 2. packed: the bound query offsets redistributed in place (same total, counts <= max_seq_len_q = 4)
    if qmode == "packed":
        pb.qo_indptr.copy_(ip(cumsum0([4, 3, 2, 1]), device))
        before = ref
        replay(graph)
        ref = reference()
        assert rel_err(before.float(), ref) > 0.1
        check("query offsets", ref)

    # 3. other last-page lengths written in place: the planned lengths rule
    new_last = [ps, 30, 4, 3]
    n_pages = [(sk + ps - 1) // ps for sk in lens]
    new_lens = [(n - 1) * ps + lp for n, lp in zip(n_pages, new_last)]
    assert new_lens[1] != lens[1] and max(new_lens) <= 4096
    last.copy_(ip(new_last, device))
    replay(graph)
    check("last pages, old plan", ref)

    # 4. a new plan over them, a new graph: the new lengths
    w2 = BatchDecodePagedTSWrapper()
    plan(w2)
    pb.seq_lens.copy_(ip(new_lens, device))  # for the reference; the wrapper derives its own
    graph2 = warm_and_capture(lambda: w2.run(pb.q, pb.cache, out=out, **scales), device)
    replay(graph2)
    ref2 = reference()
    assert rel_err(ref[pb.rows(1)].float(), ref2[pb.rows(1)]) > 0.1  # request 1: 33 -> 62 keys
    check("last pages, new plan", ref2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qmode", QMODES)
def test_cuda_workspace_reused_without_rezeroing(device, qmode):
    """Seed 003: zeroed before first use, left reusable for the next launch of the same key. Two back-to-back
    launches of one split-KV key with different data (no sync, no re-zeroing in between) are both correct,
    and a third launch repeating the first gives the first result bit for bit."""
    a = Prob(qmode, [5000, 17, 2049], 8, 2, 128, 64, BF16, device, seed=21, sq=2, q_lens=[2, 1, 2],
             max_seq_len=8192, max_seq_len_q=2)
    b = Prob(qmode, [100, 8000, 2], 8, 2, 128, 64, BF16, device, seed=22, sq=2, q_lens=[1, 2, 2],
             max_seq_len=8192, max_seq_len_q=2)
    assert a.policy().splits > 1
    assert a.ws.numel() == b.ws.numel()
    b.ws = a.ws  # one workspace for the key
    outs = [torch.full(a.q.shape, NAN, dtype=BF16, device=device) for _ in range(3)]
    synchronize(device)
    a.call(out=outs[0])
    b.call(out=outs[1])
    a.call(out=outs[2])
    synchronize(device)
    assert rel_err(outs[0], a.ref()) <= TOLERANCE[BF16]
    assert rel_err(outs[1], b.ref()) <= TOLERANCE[BF16]
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)
    # another key (causal + window: empty splits for short requests): re-zeroed first, as the seed requires
    a.ws.zero_()
    for pb, o in ((a, outs[0]), (b, outs[1])):
        o.fill_(NAN)
        pb.call(mask_type="causal", window_left=100, out=o)
    synchronize(device)
    assert rel_err(outs[0], a.ref("causal", 100)) <= TOLERANCE[BF16]
    assert rel_err(outs[1], b.ref("causal", 100)) <= TOLERANCE[BF16]
