"""torch.compile / torch.export / AOTInductor / CUDA graphs over the MLA decode API.

CPU tests run everywhere (the ops run the pure-PyTorch reference there); tests marked
``cuda`` run the same checks on the GPU kernels, plus CUDA-graph capture of the standalone
``prims_ts_batch_decode_with_kv_cache_mla(out=, workspace)`` and of
``BatchMLADecodePagedTSWrapper.run(out=, validate=False)``, replayed after the caller rewrites
``seq_lens``, page IDs and ``qo_indptr`` in place within the plan's bounds (the wrapper binds
``block_tables``, ``seq_lens`` and ``qo_indptr`` at plan and reads them live); a warmed call with
``out=`` neither allocates nor synchronises; and the workspace contract (two launches of one key
with different data, no re-zeroing). The graph tests also run on the CPU (``cuda_graphs``
replays eagerly there). Every result is compared with the float64 reference
(``||out - ref|| / ||ref||`` <= 2e-2 bf16, 5e-3 fp16) after poisoning ``out`` with NaN; NaN never
passes.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import prims_ts  # noqa: F401
from prims_ts import (
    BatchMLADecodePagedTSWrapper,
    get_prims_ts_batch_decode_mla_workspace_size,
    prims_ts_batch_decode_with_kv_cache_mla,
)
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, check_decode_workspace, cumsum0, on_sm90_gpu, rel_err
from aoti_child import run_aoti_in_child
from cuda_graphs import assert_no_allocation_no_sync, check_standalone_replays, synchronize, warm_and_capture
from compile_helpers import BF16, DEVICES, FP16, FP32, I32, NAN, close, gen, ip, randn

DQK, DV = 576, 512
SCALE = 1.0 / math.sqrt(DQK)
RANKS = (512, 64)  # kv_lora_rank, qk_rope_head_dim


def ws_for(device, batch, h, ps, max_seq_len, max_seq_len_q=1, dtype=BF16):
    n = get_prims_ts_batch_decode_mla_workspace_size(batch, h, *RANKS, ps, max_seq_len, max_seq_len_q=max_seq_len_q,
                                                     q_dtype=dtype, device=device)
    return torch.zeros(n, dtype=torch.uint8, device=device)


class Prob:
    """MLA problem on `device`: q (fixed [B, SQ, H, 576] or packed [T, H, 576]), a latent cache
    [P, ps, 576] (``self.pool``; ``self.cache`` is it or its [P, 1, ps, 576] view), a padded
    block table with `slack` spare columns of valid page IDs (room for longer requests after a
    rewrite), seq_lens, and a zeroed workspace."""

    def __init__(self, qmode, seq_lens, h, ps, dtype, device, seed, *, sq=3, q_lens=None, max_seq_len=None,
                 max_seq_len_q=None, slack=1, extra_pages=3, rank=3):
        g = gen(device, seed)
        cpu_g = torch.Generator().manual_seed(seed)
        B = len(seq_lens)
        self.qmode, self.device, self.dtype, self.ps, self.h, self.batch = qmode, device, dtype, ps, h, B
        self.cols = max((sk + ps - 1) // ps for sk in seq_lens) + slack
        P = B * self.cols + extra_pages
        self.num_pages = P
        perm = torch.randperm(P, generator=cpu_g)[:B * self.cols].to(I32).view(B, self.cols)
        wide = torch.full((B, self.cols + 2), -1, dtype=I32)
        wide[:, :self.cols] = perm
        self.block_tables = wide.to(device)[:, :self.cols]
        self.seq_lens = ip(seq_lens, device)
        self.pool = randn((P, ps, DQK), dtype, g, device)
        self.cache = self.pool.unsqueeze(1) if rank == 4 else self.pool
        self.qo_indptr = None
        if qmode == "fixed":
            self.q, self.max_seq_len_q = randn((B, sq, h, DQK), dtype, g, device), sq
        else:
            self.q = randn((sum(q_lens), h, DQK), dtype, g, device)
            self.qo_indptr = ip(cumsum0(q_lens), device)
            self.max_seq_len_q = max_seq_len_q or max(q_lens)
        self.max_seq_len = max_seq_len or max(seq_lens)
        self.ws = ws_for(device, B, h, ps, self.max_seq_len, self.max_seq_len_q, dtype)

    @property
    def out_shape(self):
        return tuple(self.q.shape[:-1]) + (DV,)

    def kw(self):
        return dict(qo_indptr=self.qo_indptr, max_seq_len_q=self.max_seq_len_q) if self.qmode == "packed" else {}

    def call(self, **kw):
        return prims_ts_batch_decode_with_kv_cache_mla(self.q, self.cache, self.ws, *RANKS, self.block_tables,
                                                       self.seq_lens, self.max_seq_len, **self.kw(), **kw)

    def ref(self, mask_type="causal", bmm1_scale=1.0, bmm2_scale=1.0):
        return R.batch_mla_decode(self.q, self.cache, self.block_tables, self.seq_lens, qo_indptr=self.qo_indptr,
                                  mask_type=mask_type, sm_scale=bmm1_scale, output_scale=bmm2_scale,
                                  compute_dtype=torch.float64)

    def rows(self, b):
        """Request b's rows of the query and the output."""
        if self.qmode == "packed":
            offs = self.qo_indptr.tolist()
            return slice(offs[b], offs[b + 1])
        return slice(b, b + 1)

    def policy(self):
        """The split-KV policy the library sizes this problem's launch with (the CPU: the nominal H200)."""
        from prims_ts.cuda.decode import MLA_DIM_QK, decode_policy
        from prims_ts.cuda.keys import device_limits

        _, sms, smem = device_limits(self.device)
        return decode_policy(self.batch, 1, self.h, self.max_seq_len_q, MLA_DIM_QK, self.max_seq_len, sms, smem)

    def rewrite_metadata(self, new_lens, g, new_q_lens=None):
        """In place, within the contract: new live lengths (<= max_seq_len and the table's rows), random
        page IDs in [0, P) (repeats allowed) and, for packed queries, new offsets (same total, deltas
        <= max_seq_len_q)."""
        assert max(new_lens) <= min(self.max_seq_len, self.cols * self.ps)
        self.seq_lens.copy_(ip(new_lens, self.device))
        self.block_tables.copy_(torch.randint(0, self.num_pages, tuple(self.block_tables.shape), generator=g,
                                              dtype=I32).to(self.device))
        if new_q_lens is not None:
            assert self.qmode == "packed" and sum(new_q_lens) == self.q.shape[0]
            assert max(new_q_lens) <= self.max_seq_len_q and min(new_q_lens) >= 1
            self.qo_indptr.copy_(ip(cumsum0(new_q_lens), self.device))


QMODES = ["fixed", "packed"]
# per device: seq_lens, page size, static max_seq_len (CUDA: large enough for split-KV)
SIZES = {"cpu": ([20, 3, 33], 16, 48), "cuda": ([300, 7, 1333], 32, 4096)}
Q_LENS = [2, 1, 3]


def make(qmode, device, seed, dtype=BF16, h=8, rank=3):
    lens, ps, max_len = SIZES[device]
    return Prob(qmode, lens, h, ps, dtype, device, seed, sq=3, q_lens=Q_LENS, max_seq_len=max_len,
                max_seq_len_q=4, rank=rank, slack=2)


# ----------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("qmode", QMODES)
def test_compile_standalone_matches_eager(device, qmode, mask):
    """Traced standalone call; new metadata values with the same shapes need no recompile and are honoured."""
    pb = make(qmode, device, seed=1)
    kw = pb.kw()
    max_len = pb.max_seq_len

    def f(q, cache, ws, block_tables, seq_lens, qo):
        extra = dict(kw, qo_indptr=qo) if qo is not None else kw
        o = prims_ts_batch_decode_with_kv_cache_mla(q, cache, ws, *RANKS, block_tables, seq_lens, max_len,
                                                    mask_type=mask, bmm1_scale=0.05, bmm2_scale=0.5, out_dtype=FP32,
                                                    **extra)
        return o * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True)
    args = (pb.q, pb.cache, pb.ws, pb.block_tables, pb.seq_lens, pb.qo_indptr)
    got = cf(*args)
    close(got, f(*args))
    ref = pb.ref(mask, 0.05, 0.5)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]

    # new values, same shapes: lengths, page IDs (and packed offsets)
    g = torch.Generator().manual_seed(7)
    lens = SIZES[device][0]
    new_lens = [lens[2] - 5, lens[0] + 1, max(3, lens[1])]
    pb.rewrite_metadata(new_lens, g, [3, 2, 1] if qmode == "packed" else None)
    got2 = cf(*args)
    ref2 = pb.ref(mask, 0.05, 0.5)
    assert rel_err(ref.float(), ref2) > 0.1
    assert rel_err((got2 - 1.0) / 2.0, ref2) <= TOLERANCE[BF16]
    if device == "cpu":
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qmode", QMODES)
def test_compile_standalone_out_4d_cache(device, qmode):
    pb = make(qmode, device, seed=2, dtype=FP16, h=16, rank=4)
    kw = pb.kw()
    max_len = pb.max_seq_len

    def f(q, cache, ws, block_tables, seq_lens, out):
        r = prims_ts_batch_decode_with_kv_cache_mla(q, cache, ws, *RANKS, block_tables, seq_lens, max_len,
                                                    bmm1_scale=SCALE, out=out, out_dtype=FP32, **kw)
        return r.float().sum(), r

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(pb.out_shape, NAN, dtype=FP32, device=device)
    s, r = cf(pb.q, pb.cache, pb.ws, pb.block_tables, pb.seq_lens, out)
    assert rel_err(out, pb.ref("causal", SCALE)) <= TOLERANCE[FP16]
    torch.testing.assert_close(r, out, rtol=0, atol=0)
    torch.testing.assert_close(s.double(), out.double().sum(), rtol=1e-3, atol=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("qmode", QMODES)
def test_compile_wrapper_run(device, qmode, validate):
    """Compiled run of a planned wrapper (validate=True cannot read values while traced: they are
    trusted there); the bound block_tables, seq_lens and qo_indptr rewritten in place are honoured."""
    pb = make(qmode, device, seed=3)
    max_kv = min(pb.max_seq_len, pb.cols * pb.ps)  # the table's columns must cover max_kv_len
    w = BatchMLADecodePagedTSWrapper()
    w.plan(pb.block_tables, pb.seq_lens, pb.h, *RANKS, pb.ps, qo_indptr=pb.qo_indptr, max_seq_len_q=pb.max_seq_len_q,
           max_kv_len=max_kv, q_data_type=BF16, o_data_type=FP32)
    crun = torch.compile(lambda q, c: w.run(q, c, bmm1_scale=SCALE, validate=validate), fullgraph=True)
    crun_out = torch.compile(lambda q, c, out: w.run(q, c, bmm1_scale=SCALE, out=out, validate=validate),
                             fullgraph=True)
    close(crun(pb.q, pb.cache), w.run(pb.q, pb.cache, bmm1_scale=SCALE, validate=validate))
    out = torch.full(pb.out_shape, NAN, dtype=FP32, device=device)
    crun_out(pb.q, pb.cache, out)
    ref = pb.ref("causal", SCALE)
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    new_lens = [5, 40, 3]
    assert max(new_lens) <= max_kv
    pb.rewrite_metadata(new_lens, torch.Generator().manual_seed(8), [1, 3, 2] if qmode == "packed" else None)
    ref2 = pb.ref("causal", SCALE)
    assert rel_err(ref.float(), ref2) > 0.1
    out.fill_(NAN)
    crun_out(pb.q, pb.cache, out)
    assert rel_err(out, ref2) <= TOLERANCE[BF16]
    assert rel_err(crun(pb.q, pb.cache), ref2) <= TOLERANCE[BF16]
    assert rel_err(w.run(pb.q, pb.cache, bmm1_scale=SCALE, validate=validate), ref2) <= TOLERANCE[BF16]


# ----------------------------------------------------------------------------
# torch.export and AOTInductor
# ----------------------------------------------------------------------------

EXPORT_LENS = {"cpu": ([20, 3, 33], [9, 17, 40]), "cuda": ([300, 7, 1333], [1000, 70, 20])}
EXPORT_PS = {"cpu": 16, "cuda": 32}
EXPORT_MAX = {"cpu": 64, "cuda": 4096}


class MLADecode(torch.nn.Module):
    """Two standalone calls over one latent cache: packed causal to fp32 (scaled) and a fixed SQ=3
    dense call with defaults; every tensor, the two workspaces included, is a graph input."""

    def __init__(self, max_seq_len):
        super().__init__()
        self.max_seq_len = max_seq_len

    def forward(self, q_packed, q_fixed, cache, ws_a, ws_b, block_tables, seq_lens, qo_indptr):
        a = prims_ts_batch_decode_with_kv_cache_mla(q_packed, cache, ws_a, *RANKS, block_tables, seq_lens,
                                                    self.max_seq_len, qo_indptr=qo_indptr, max_seq_len_q=4,
                                                    bmm1_scale=0.05, bmm2_scale=0.5, out_dtype=FP32)
        b = prims_ts_batch_decode_with_kv_cache_mla(q_fixed, cache, ws_b, *RANKS, block_tables, seq_lens,
                                                    self.max_seq_len, mask_type="dense")
        return a * 2.0, b


def _module_inputs(device, which, seed):
    """Same shapes for every `which` (same table and pool sizes); other values."""
    lens = EXPORT_LENS[device][which]
    base_lens = EXPORT_LENS[device][0]
    ps, max_len = EXPORT_PS[device], EXPORT_MAX[device]
    pb = Prob("packed", base_lens, 16, ps, BF16, device, seed, q_lens=Q_LENS, max_seq_len=max_len, max_seq_len_q=4,
              slack=2)
    if which:
        pb.rewrite_metadata(lens, torch.Generator().manual_seed(seed), [1, 3, 2])
    fixed = Prob("fixed", base_lens, 16, ps, BF16, device, seed + 1, sq=3, max_seq_len=max_len)
    args = (pb.q, fixed.q, pb.pool, pb.ws, fixed.ws, pb.block_tables, pb.seq_lens, pb.qo_indptr)
    return args, pb, fixed


def _check_module_outputs(outs, device, args, pb, fixed):
    a, b = outs
    assert a.dtype == FP32 and b.dtype == BF16 and a.device == pb.q.device
    assert rel_err(a / 2.0, pb.ref("causal", 0.05, 0.5)) <= TOLERANCE[BF16]
    ref_b = R.batch_mla_decode(fixed.q, pb.pool, pb.block_tables, pb.seq_lens, mask_type="dense",
                               compute_dtype=torch.float64)
    assert rel_err(b, ref_b) <= TOLERANCE[BF16]
    for x, y in zip(outs, MLADecode(EXPORT_MAX[device])(*args)):
        close(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_export_static(device):
    args, pb, fixed = _module_inputs(device, 0, seed=9)
    ep = torch.export.export(MLADecode(EXPORT_MAX[device]), args)
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    # the op, called directly or through auto_functionalized (it mutates the workspace)
    assert sum("prims_ts.batch_mla_decode" in f"{n.target} {n.args}" for n in calls) == 2, \
        [str(n.target) for n in calls]
    _check_module_outputs(ep.module()(*args), device, args, pb, fixed)
    args2, pb2, fixed2 = _module_inputs(device, 1, seed=10)  # same shapes, new values
    assert all(x.shape == y.shape for x, y in zip(args, args2))
    _check_module_outputs(ep.module()(*args2), device, args2, pb2, fixed2)


def _aoti_body(package_path: str, device: str) -> None:
    """Export -> aoti_compile_and_package -> aoti_load_package -> run == eager + reference (two value sets)."""
    args, _, _ = _module_inputs(device, 0, seed=17)
    ep = torch.export.export(MLADecode(EXPORT_MAX[device]), args)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for which in (0, 1):
        a, pb, fixed = _module_inputs(device, which, seed=18 + which)
        outs = compiled(*a)
        assert isinstance(outs, (list, tuple)) and len(outs) == 2
        _check_module_outputs(outs, device, a, pb, fixed)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_load_run(device, tmp_path):
    run_aoti_in_child(__file__, device, tmp_path)


# ----------------------------------------------------------------------------
# CUDA graphs, no allocation / no sync, workspace reuse
# ----------------------------------------------------------------------------

GRAPH_CASES = [("fixed", "causal"), ("fixed", "dense"), ("packed", "causal"), ("packed", "dense")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_len", [127, 1024, 8192], ids=["one_split", "cluster", "split_kv"])
@pytest.mark.parametrize("qmode,mask", GRAPH_CASES, ids=[f"{q}-{m}" for q, m in GRAPH_CASES])
def test_cuda_graph_standalone_replay(device, qmode, mask, max_len):
    """Capture the standalone call, replay it over lengths, page IDs, packed offsets and latent
    data rewritten in place: one split (H 16, SQ 4: rows of 64), 8 splits of rows of 16 (H 8,
    SQ 2; on sm_90a the swapped tile's splits as one thread block cluster, merged on chip: the
    workspace stays untouched) and 32+ splits (the ticket merge)."""
    lens = [100, 7, 120, 64] if max_len == 127 else [300, 7, 555, 64]
    ps = 16 if max_len == 127 else 64
    slack = {127: 4, 1024: 20, 8192: 120}[max_len]  # room for longer requests after the rewrite
    h, sq, q_lens = (8, 2, [2, 1, 2, 1]) if max_len == 1024 else (16, 4, [3, 1, 4, 2])
    pb = Prob(qmode, lens, h, ps, BF16, device, seed=len(qmode) + max_len, sq=sq, q_lens=q_lens,
              max_seq_len=max_len, max_seq_len_q=sq, slack=slack, rank=3 + (mask == "dense"))
    pol = pb.policy()
    assert (pol.splits > 1) == (max_len > 127) and (pol.splits <= 8) == (max_len <= 1024), pol
    out = torch.full(pb.out_shape, NAN, dtype=BF16, device=device)
    # new lengths (each >= the request's query count, as causal masks require), new packed offsets
    steps = {127: [([4, 127, 5, 100], [4, 3, 2, 1]), ([127, 4, 16, 126], [1, 4, 4, 1])],
             1024: [([1024, 4, 5, 700], [2, 2, 1, 1]), ([64, 1000, 4, 1023], [1, 2, 1, 2])],
             8192: [([8192, 4, 5, 3000], [4, 3, 2, 1]), ([64, 8000, 4, 8191], [1, 4, 4, 1])]}[max_len]
    check_standalone_replays(lambda: pb.call(mask_type=mask, bmm1_scale=SCALE, out=out), out, pb, pb.pool,
                             randn(pb.pool.shape, BF16, gen(device, 5), device), steps, qmode == "packed",
                             lambda: pb.ref(mask, SCALE), TOLERANCE[BF16], device, seed=max_len)
    if max_len == 1024 and on_sm90_gpu(device):  # every launch merged in its cluster
        check_decode_workspace(pb.ws, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qmode,mask", GRAPH_CASES, ids=[f"{q}-{m}" for q, m in GRAPH_CASES])
def test_cuda_graph_wrapper_replay(device, qmode, mask):
    """plan outside capture (it binds block_tables, seq_lens, qo_indptr); capture run(validate=False);
    replay after in-place rewrites of the bound metadata within the planned bounds."""
    lens = [1000, 33, 4, 4000]
    pb = Prob(qmode, lens, 64, 32, FP16, device, seed=11 + len(mask), sq=2, q_lens=[2, 1, 3, 4], slack=8,
              extra_pages=20, max_seq_len=4096)
    assert pb.cols * pb.ps >= 4096  # the table covers max_kv_len
    w = BatchMLADecodePagedTSWrapper()
    w.plan(pb.block_tables, pb.seq_lens, 64, *RANKS, 32, qo_indptr=pb.qo_indptr,
           max_seq_len_q=4 if qmode == "packed" else 2, max_kv_len=4096, mask_type=mask, q_data_type=FP16,
           o_data_type=FP16)
    out = torch.full(pb.out_shape, NAN, dtype=FP16, device=device)
    scales = dict(bmm1_scale=SCALE, bmm2_scale=1.5)

    def launch():
        w.run(pb.q, pb.cache, out=out, validate=False, **scales)

    def check(what):
        ref = pb.ref(mask, *scales.values())
        assert rel_err(out, ref) <= TOLERANCE[FP16], what
        for b in range(pb.batch):  # per request: a short request must not hide behind a long one
            assert rel_err(out[pb.rows(b)], ref[pb.rows(b)]) <= TOLERANCE[FP16], (what, b)
        return ref

    graph = warm_and_capture(launch, device)
    assert_no_allocation_no_sync(launch, device)
    first = check("warm")
    g = torch.Generator().manual_seed(12)
    for new_lens, new_q in (([4096, 4, 2049, 33], [4, 3, 2, 1]), ([5, 3001, 64, 4095], [1, 2, 3, 4])):
        pb.rewrite_metadata(new_lens, g, new_q if qmode == "packed" else None)
        out.fill_(NAN)
        graph.replay()
        synchronize(device)
        assert rel_err(first.float(), check(new_lens)) > 0.1
    # the validated path (not captured) on the same live values
    res = w.run(pb.q, pb.cache, validate=True, **scales)
    assert rel_err(res, pb.ref(mask, *scales.values())) <= TOLERANCE[FP16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qmode", QMODES)
def test_cuda_workspace_reused_without_rezeroing(device, qmode):
    """Zeroed before first use, left reusable for the next launch of the same key: two back-to-back
    launches of one split-KV key with different data (no sync, no re-zeroing in between) are both
    correct, and a third launch repeating the first gives the first result bit for bit."""
    a = Prob(qmode, [5000, 17, 2049], 16, 64, BF16, device, seed=21, sq=2, q_lens=[2, 1, 2], max_seq_len=8192,
             max_seq_len_q=2)
    b = Prob(qmode, [100, 8000, 2], 16, 64, BF16, device, seed=22, sq=2, q_lens=[1, 2, 2], max_seq_len=8192,
             max_seq_len_q=2)
    assert a.policy().splits > 1
    assert a.ws.numel() == b.ws.numel()
    b.ws = a.ws  # one workspace for the key
    outs = [torch.full(a.out_shape, NAN, dtype=BF16, device=device) for _ in range(3)]
    synchronize(device)
    a.call(bmm1_scale=SCALE, out=outs[0])
    b.call(bmm1_scale=SCALE, out=outs[1])
    a.call(bmm1_scale=SCALE, out=outs[2])
    synchronize(device)
    assert rel_err(outs[0], a.ref("causal", SCALE)) <= TOLERANCE[BF16]
    assert rel_err(outs[1], b.ref("causal", SCALE)) <= TOLERANCE[BF16]
    torch.testing.assert_close(outs[2], outs[0], rtol=0, atol=0)
    # another key (dense): re-zeroed first
    a.ws.zero_()
    for pb, o in ((a, outs[0]), (b, outs[1])):
        o.fill_(NAN)
        pb.call(mask_type="dense", bmm1_scale=SCALE, out=o)
    synchronize(device)
    assert rel_err(outs[0], a.ref("dense", SCALE)) <= TOLERANCE[BF16]
    assert rel_err(outs[1], b.ref("dense", SCALE)) <= TOLERANCE[BF16]
