"""torch.compile / torch.export / AOTInductor / CUDA graphs over the paged block-sparse API.

CPU tests run everywhere (the ops run the pure-PyTorch reference there); tests marked
``cuda`` run the same checks on the GPU kernel, plus CUDA-graph capture of
``BlockSparsePagedTSWrapper.run(..., out=...)`` replayed after the caller rewrites the run's
live metadata in place: the BSR routes (``block_indptr`` / ``block_indices``, within
``block_indices``' capacity), the page IDs and the valid bits. The plan copies
``paged_kv_indptr`` and ``seq_lens_kv``: new lengths take a new plan (and graph). A warmed
``run`` with ``out=`` neither allocates nor synchronises. The graph tests also run on the
CPU (``cuda_graphs`` replays eagerly there). The one-shot reads metadata on the host and
refuses to be traced. Every result is compared with the float64 reference (``||out - ref|| / ||ref||`` <=
2e-2 bf16, 5e-3 fp16) after poisoning ``out`` with NaN; NaN never passes.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from prims_ts.ops._validate import dtype_code
import prims_ts.ops.block_sparse  # noqa: F401  (defines the ops)
import prims_ts.meta.block_sparse  # noqa: F401  (registers their fakes)
from prims_ts.ops.block_sparse import BlockSparsePagedTSWrapper, block_sparse_attention_with_paged_kv_cache
from prims_ts.testing import TOLERANCE, cumsum0, rel_err
from aoti_child import run_aoti_in_child
from cuda_graphs import assert_no_allocation_no_sync, synchronize, warm_and_capture
from compile_helpers import BF16, DEVICES, FP16, FP32, I32, NAN, close, gen, ip, randn

R = prims_ts.reference
BLOCK_GARBAGE = (-7, 2**31 - 1, -2**31, 77777)


def random_routes(lens, sq, hkv, q_block, kv_block, g, density=0.5):
    """routes[b][h][r]: random strictly increasing blocks, the causal diagonal's blocks always in, every
    fourth row empty."""
    n_rows = -(-sq // q_block)
    routes = []
    for b, sk in enumerate(lens):
        nblk = -(-sk // kv_block)
        heads = []
        for h in range(hkv):
            rows = []
            for r in range(n_rows):
                sel = set((torch.rand(nblk, generator=g) < density).nonzero().flatten().tolist())
                t0, t1 = r * q_block, min(sq, (r + 1) * q_block)
                lo, hi = max(0, sk - sq + t0), min(sk - 1, max(0, sk - sq + t1 - 1))
                sel |= set(range(lo // kv_block, hi // kv_block + 1))
                rows.append([] if (b + h + r) % 4 == 3 else sorted(sel))
            heads.append(rows)
        routes.append(heads)
    return routes


def encode_routes(routes, capacity):
    """(block_indptr nested lists, flat block_indices padded with garbage to ``capacity``); the (b, h)
    segments in reverse order (absolute offsets), one garbage entry between segments."""
    B, H = len(routes), len(routes[0])
    ptr, flat = [[None] * H for _ in range(B)], []
    for b, h in reversed([(b, h) for b in range(B) for h in range(H)]):
        offs = [len(flat)]
        for row in routes[b][h]:
            flat += row
            offs.append(len(flat))
        ptr[b][h] = offs
        flat.append(BLOCK_GARBAGE[(b + h) % 4])
    assert len(flat) <= capacity
    return ptr, flat + [BLOCK_GARBAGE[i % 4] for i in range(capacity - len(flat))]


class Prob:
    """A block-sparse problem on `device`: q [B, Sq, Hq, D], a combined cache [P, 2, Hkv, ps, D]
    (``self.k``/``self.v`` its halves), CSR pages with non-identity IDs (each request owns enough entries
    for max_seq_len_kv, plus `slack`, so lengths may grow in place), BSR routes in a ``block_indices`` of
    fixed capacity (every block of every row fits), lengths and optional valid bits (uint32 or int32)."""

    def __init__(self, lens, sq, hq, hkv, d, ps, q_block, kv_block, dtype, device, seed, *, bits=None,
                 max_seq_len_kv=None, slack=1, extra_pages=3):
        g = gen(device, seed)
        self.cpu_g = torch.Generator().manual_seed(seed)
        B = len(lens)
        self.B, self.sq, self.hq, self.hkv, self.d, self.ps = B, sq, hq, hkv, d, ps
        self.q_block, self.kv_block, self.dtype, self.device = q_block, kv_block, dtype, device
        self.max_seq_len_kv = max_seq_len_kv or max(lens)
        max_pages = -(-self.max_seq_len_kv // ps)
        P = B * max_pages + extra_pages
        perm = torch.randperm(P, generator=self.cpu_g).tolist()
        indices = []
        for b in range(B):
            indices += perm[b * max_pages:(b + 1) * max_pages] + [perm[-1 - i] for i in range(slack)]
        self.num_pages = P
        self.indptr = ip(cumsum0([max_pages + slack] * B), device)
        self.indices = ip(indices, device)
        self.seq_lens = ip(lens, device)
        self.cache = randn((P, 2, hkv, ps, d), dtype, g, device)
        self.k, self.v = self.cache[:, 0], self.cache[:, 1]
        self.q = randn((B, sq, hq, d), dtype, g, device)
        n_rows = -(-sq // q_block)
        self.capacity = B * hkv * (n_rows * -(-self.max_seq_len_kv // kv_block) + 1) + 5
        ptr, flat = encode_routes(random_routes(lens, sq, hkv, q_block, kv_block, self.cpu_g), self.capacity)
        self.block_indptr, self.block_indices = ip(ptr, device), ip(flat, device)
        self.bits = None
        if bits is not None:
            words = torch.randint(-2**31, 2**31, (B, -(-self.max_seq_len_kv // 32)), generator=self.cpu_g,
                                  dtype=torch.int64).to(I32)
            words |= 1  # key 0 of every request valid
            self.bits = (words.view(torch.uint32) if bits == "uint32" else words).to(device)

    def metadata(self):
        """The ops' metadata arguments."""
        return (self.indptr, self.indices, self.block_indptr, self.block_indices, self.seq_lens)

    def run_metadata(self):
        """A wrapper run's live metadata arguments (the plan copied indptr and the lengths)."""
        return (self.indices, self.block_indptr, self.block_indices)

    def plan(self, mask="dense", out_dtype=None) -> BlockSparsePagedTSWrapper:
        """A wrapper planned on this problem's CSR offsets and lengths (seq_len_kv: max_seq_len_kv; the
        route capacity: every block of a row); out_dtype: the plan's o_data_type (default: q's)."""
        w = BlockSparsePagedTSWrapper()
        w.plan(self.indptr, self.sq, self.max_seq_len_kv, self.hq, self.hkv, self.d, self.q_block, self.kv_block,
               self.ps, max_blocks_per_row=-(-self.max_seq_len_kv // self.kv_block),
               use_kv_valid_bits=self.bits is not None, seq_lens_kv=self.seq_lens, mask_type=mask,
               q_data_type=self.dtype, o_data_type=out_dtype)
        return w

    def ref(self, mask="dense", sm_scale=None):
        return R.block_sparse_attention(self.q, self.k, self.v, self.indptr, self.indices, self.block_indptr,
                                        self.block_indices, self.q_block, self.kv_block, self.seq_lens,
                                        kv_valid_bits=self.bits, mask_type=mask, sm_scale=sm_scale,
                                        compute_dtype=torch.float64)

    def rewrite_routes(self, density=0.5, lens=None):
        """New routes, in place, within block_indices' capacity."""
        lens = lens or self.seq_lens.tolist()
        ptr, flat = encode_routes(random_routes(lens, self.sq, self.hkv, self.q_block, self.kv_block, self.cpu_g,
                                                density), self.capacity)
        self.block_indptr.copy_(ip(ptr, self.device))
        self.block_indices.copy_(ip(flat, self.device))

    def rewrite_pages(self):
        """Random page IDs in [0, P) (repeats allowed) for every CSR entry, in place."""
        self.indices.copy_(torch.randint(0, self.num_pages, tuple(self.indices.shape), generator=self.cpu_g,
                                         dtype=I32).to(self.device))

    def remap_pages(self):
        """Every page moved to a new physical slot; the IDs rewritten to follow: the same logical problem."""
        new_of_old = torch.randperm(self.num_pages, generator=self.cpu_g).to(self.device)
        moved = torch.empty_like(self.cache)
        moved[new_of_old] = self.cache
        self.cache.copy_(moved)
        live = (self.indices >= 0) & (self.indices < self.num_pages)
        self.indices.copy_(torch.where(live, new_of_old[self.indices.clamp(0, self.num_pages - 1).long()].to(I32),
                                       self.indices))

    def rewrite_lens(self, new_lens):
        """New lengths (<= max_seq_len_kv), in place, and routes for them."""
        assert all(1 <= n <= self.max_seq_len_kv for n in new_lens)
        self.seq_lens.copy_(ip(new_lens, self.device))
        self.rewrite_routes(lens=new_lens)


# per device: lens, Sq, Hq, Hkv, D, page size, q_block, kv_block
SIZES = {"cpu": ([20, 9, 33], 6, 8, 2, 128, 16, 4, 8),
         "cuda": ([300, 100, 1333], 100, 16, 4, 128, 32, 32, 64)}


def make(device, seed, bits=None, dtype=BF16, **kw):
    lens, sq, hq, hkv, d, ps, qb, kvb = SIZES[device]
    kw.setdefault("slack", 2)
    return Prob(lens, sq, hq, hkv, d, ps, qb, kvb, dtype, device, seed, bits=bits, **kw)


# ----------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [None, "uint32", "int32"])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_compile_wrapper_run_matches_eager(device, mask, bits):
    """Compiled run of a planned wrapper; routes, page IDs and valid bits rewritten in place are honoured
    without a recompile."""
    pb = make(device, seed=1 + len(mask), bits=bits)
    w = pb.plan(mask)

    def f(q, cache, indices, bip, bi, vb):
        o = w.run(q, cache, indices, bip, bi, kv_valid_bits=vb, sm_scale=0.08)
        return o.float() * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True)
    args = (pb.q, pb.cache) + pb.run_metadata() + (pb.bits,)
    got = cf(*args)
    close(got, f(*args))
    ref = pb.ref(mask, 0.08)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]

    pb.rewrite_routes(density=0.8)
    pb.rewrite_pages()
    if bits is not None:
        pb.bits.copy_(pb.bits.flip(0))
    got2 = cf(*args)
    ref2 = pb.ref(mask, 0.08)
    assert rel_err(ref.float(), ref2) > 0.1
    assert rel_err((got2 - 1.0) / 2.0, ref2) <= TOLERANCE[BF16]
    if device == "cpu":
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_compile_wrapper_run_out_tuple_cache(device):
    pb = make(device, seed=2, dtype=FP16, bits="uint32")
    w = pb.plan("causal", FP32)

    def f(q, k, v, indices, bip, bi, vb, out):
        r = w.run(q, (k, v), indices, bip, bi, kv_valid_bits=vb, out=out)
        return r.float().sum(), r

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(pb.q.shape, NAN, dtype=FP32, device=device)
    s, r = cf(pb.q, pb.k, pb.v, *pb.run_metadata(), pb.bits, out)
    assert rel_err(out, pb.ref("causal")) <= TOLERANCE[FP16]
    torch.testing.assert_close(r, out, rtol=0, atol=0)
    torch.testing.assert_close(s.double(), out.double().sum(), rtol=1e-3, atol=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_ops_directly(device):
    """Both ops called directly in a compiled function (functional + out=, the out op with its trailing
    tuning argument given), with surrounding arithmetic."""
    pb = make(device, seed=3, bits="int32")
    statics = (pb.q_block, pb.kv_block, "causal", 0.1)

    def f(q, k, v, indptr, indices, bip, bi, lens, vb, out):
        a = torch.ops.prims_ts.block_sparse_attention(q * 1.0, k, v, indptr, indices, bip, bi, lens, vb, *statics,
                                                      dtype_code(FP32))
        torch.ops.prims_ts.block_sparse_attention_out(q, k, v, out, indptr, indices, bip, bi, lens, vb, *statics, "")
        return a + 1.0, out * 2.0

    cf = torch.compile(f, fullgraph=True)
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device=device)
    a, b = cf(pb.q, pb.k, pb.v, *pb.metadata(), pb.bits, out)
    ref = pb.ref("causal", 0.1)
    assert rel_err(a - 1.0, ref) <= TOLERANCE[BF16]
    assert rel_err(out, ref) <= TOLERANCE[BF16]
    close(b, out.float() * 2.0)
    out2 = torch.full(pb.q.shape, NAN, dtype=BF16, device=device)
    ea, eb = f(pb.q, pb.k, pb.v, *pb.metadata(), pb.bits, out2)
    close(a, ea)
    close(b, eb)


@pytest.mark.parametrize("device", DEVICES)
def test_oneshot_refuses_tracing(device):
    """The one-shot reads metadata on the host: compiling or exporting it fails with a message naming the
    capturable alternative (never a silent graph over unvalidated metadata)."""
    pb = make(device, seed=4)
    qb, kvb, max_len = pb.q_block, pb.kv_block, pb.max_seq_len_kv

    def f(q, cache, indptr, indices, bip, bi, lens):
        return block_sparse_attention_with_paged_kv_cache(q, cache, indptr, indices, bip, bi, qb, kvb,
                                                          max_seq_len_kv=max_len, seq_lens_kv=lens)

    args = (pb.q, pb.cache) + pb.metadata()
    assert rel_err(f(*args), pb.ref()) <= TOLERANCE[BF16]  # eager: fine
    with pytest.raises(Exception, match="BlockSparsePagedTSWrapper"):
        torch.compile(f, fullgraph=True)(*args)

    class M(torch.nn.Module):
        def forward(self, *a):
            return f(*a)

    with pytest.raises(Exception, match="BlockSparsePagedTSWrapper"):
        torch.export.export(M(), args)


# ----------------------------------------------------------------------------
# torch.export and AOTInductor
# ----------------------------------------------------------------------------


class BlockSparse(torch.nn.Module):
    """Two op calls over one (K, V) tuple: causal with valid bits to fp32 (scaled), and dense with the default
    scale in q's dtype; every tensor is a graph input."""

    def __init__(self, q_block, kv_block, d):
        super().__init__()
        self.q_block, self.kv_block, self.scale = q_block, kv_block, d ** -0.5

    def forward(self, q, k, v, indptr, indices, bip, bi, lens, vb):
        a = torch.ops.prims_ts.block_sparse_attention(q, k, v, indptr, indices, bip, bi, lens, vb, self.q_block,
                                                      self.kv_block, "causal", 0.09, dtype_code(FP32))
        b = torch.ops.prims_ts.block_sparse_attention(q, k, v, indptr, indices, bip, bi, lens, None, self.q_block,
                                                      self.kv_block, "dense", self.scale, dtype_code(q.dtype))
        return a * 2.0, b


def _module_inputs(device, which, seed):
    """Same shapes for every `which`; other values (routes, page IDs, lengths, bits, data)."""
    pb = make(device, seed, bits="uint32")
    if which:
        lens = pb.seq_lens.tolist()
        pb.rewrite_lens([max(pb.sq, n - 7) for n in lens])
        pb.rewrite_pages()
    args = (pb.q, pb.k, pb.v) + pb.metadata() + (pb.bits,)
    return args, pb


def _check_module_outputs(outs, pb, args):
    a, b = outs
    assert a.dtype == FP32 and b.dtype == BF16 and a.device == pb.q.device
    assert rel_err(a / 2.0, pb.ref("causal", 0.09)) <= TOLERANCE[BF16]
    bits, pb.bits = pb.bits, None
    try:
        assert rel_err(b, pb.ref("dense")) <= TOLERANCE[BF16]
    finally:
        pb.bits = bits
    for x, y in zip(outs, BlockSparse(pb.q_block, pb.kv_block, pb.d)(*args)):
        close(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_export_static(device):
    args, pb = _module_inputs(device, 0, seed=9)
    ep = torch.export.export(BlockSparse(pb.q_block, pb.kv_block, pb.d), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.prims_ts.block_sparse_attention.default) == 2, targets
    _check_module_outputs(ep.module()(*args), pb, args)
    args2, pb2 = _module_inputs(device, 1, seed=10)  # same shapes, new values
    assert all(x.shape == y.shape for x, y in zip(args, args2))
    _check_module_outputs(ep.module()(*args2), pb2, args2)


class WrapperModule(torch.nn.Module):
    """Calls a planned wrapper's run (its op: block_sparse_attention_out) on caller-provided out."""

    def __init__(self, wrapper):
        super().__init__()
        self.w = wrapper

    def forward(self, q, cache, indices, bip, bi, vb, out):
        self.w.run(q, cache, indices, bip, bi, kv_valid_bits=vb, out=out)
        return out * 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_export_wrapper_run(device):
    pb = make(device, seed=15, bits="int32")
    w = pb.plan("causal", FP32)
    out = torch.full(pb.q.shape, NAN, dtype=FP32, device=device)
    args = (pb.q, pb.cache) + pb.run_metadata() + (pb.bits, out)
    ep = torch.export.export(WrapperModule(w), args)
    calls = [f"{n.target} {n.args}" for n in ep.graph.nodes if n.op == "call_function"]
    # the out op, called directly or through auto_functionalized (it mutates out)
    assert sum("prims_ts.block_sparse_attention_out" in c for c in calls) == 1, calls
    ref = pb.ref("causal")
    assert rel_err(ep.module()(*args), ref) <= TOLERANCE[BF16]
    # new routes and page IDs, in place
    pb.rewrite_routes(density=0.3)
    pb.rewrite_pages()
    ref2 = pb.ref("causal")
    assert rel_err(ref.float(), ref2) > 0.1
    out.fill_(NAN)
    assert rel_err(ep.module()(*args), ref2) <= TOLERANCE[BF16]


def _aoti_body(package_path: str, device: str) -> None:
    """Export -> aoti_compile_and_package -> aoti_load_package -> run == eager + reference (two value sets)."""
    args, pb = _module_inputs(device, 0, seed=17)
    ep = torch.export.export(BlockSparse(pb.q_block, pb.kv_block, pb.d), args)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for which in (0, 1):
        a, p = _module_inputs(device, which, seed=18 + which)
        outs = compiled(*a)
        assert isinstance(outs, (list, tuple)) and len(outs) == 2
        _check_module_outputs(outs, p, a)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_load_run(device, tmp_path):
    run_aoti_in_child(__file__, device, tmp_path)


# ----------------------------------------------------------------------------
# CUDA graphs, no allocation / no sync
# ----------------------------------------------------------------------------

GRAPH_CASES = [("dense", None, 64, 64), ("causal", None, 64, 128), ("causal", "uint32", 16, 8),
               ("dense", "int32", 32, 32), ("causal", "int32", 128, 64), ("dense", "uint32", 8, 16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask,bits,q_block,kv_block", GRAPH_CASES,
                         ids=[f"{m}-{b or 'nobits'}-q{qb}-kv{kvb}" for m, b, qb, kvb in GRAPH_CASES])
def test_cuda_graph_wrapper_replay(device, mask, bits, q_block, kv_block):
    lens, sq, ps = [700, 130, 1000, 257], 130, 64
    pb = Prob(lens, sq, 16, 4, 128, ps, q_block, kv_block, BF16, device, seed=q_block + kv_block + len(mask),
              bits=bits, max_seq_len_kv=1024, slack=3)
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device=device)
    state = {}

    def capture():
        """A plan over the current CSR offsets and lengths, its run captured."""
        w = pb.plan(mask)

        def launch():
            w.run(pb.q, pb.cache, *pb.run_metadata(), kv_valid_bits=pb.bits, sm_scale=0.07, out=out)

        state["graph"] = warm_and_capture(launch, device)
        state["w"] = w
        assert_no_allocation_no_sync(launch, device)

    def check(what):
        ref = pb.ref(mask, 0.07)
        assert rel_err(out, ref) <= TOLERANCE[BF16], what
        for b in range(pb.B):  # per request: a short request must not hide behind a long one
            assert rel_err(out[b], ref[b]) <= TOLERANCE[BF16], (what, b)
        return ref

    def replay():
        out.fill_(NAN)
        state["graph"].replay()
        synchronize(device)

    capture()
    check("warm")
    replay()
    prev = check("replay")
    before = out.clone()

    # 1. the pages moved to new physical slots, IDs rewritten to follow: the same answer
    pb.remap_pages()
    replay()
    check("remap")
    close(out, before)

    # 2. new routes (in place, within capacity), then new page IDs, new lengths (a new plan: the plan copied
    #    the old ones), bits and data; each step changes the answer
    def new_lengths():
        pb.rewrite_lens([1024, 1 if mask == "dense" else sq, 600, 700])
        capture()

    steps = [("routes", lambda: pb.rewrite_routes(density=0.2)), ("dense routes", lambda: pb.rewrite_routes(0.9)),
             ("pages", pb.rewrite_pages), ("lengths, new plan", new_lengths)]
    if bits is not None:
        # roll through an int32 view (CUDA has no uint32 roll)
        steps.append(("bits", lambda: pb.bits.view(torch.int32).copy_(pb.bits.view(torch.int32).roll(1, 0))))
    steps.append(("data", lambda: pb.q.copy_(randn(pb.q.shape, BF16, gen(device, 5), device))))
    for what, step in steps:
        step()
        replay()
        ref = check(what)
        # the step matters (per request: a one-key request's rows, its key 0 valid, may not change)
        assert max(rel_err(prev[b].float(), ref[b]) for b in range(pb.B)) > 0.1, what
        prev = ref
