"""torch.compile / torch.export / AOTInductor / CUDA graphs over block-sparse attention on
contiguous K/V (``BlockSparseTSWrapper``, ``block_sparse_attention``).

CPU tests run everywhere (the ops run the pure-PyTorch reference there); ``cuda`` ones run
the same checks on the GPU kernel. A compiled or exported run honours routes rewritten in
place without recompiling; the exported op runs on a second set of values of the same
shapes; an AOTInductor package does both after loading; a captured run replays with new
routes and takes no allocation or host sync; the one-shot reads routes on the host and
refuses to be traced. Every result is compared with the float64 reference after poisoning
``out`` with NaN; NaN never passes.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch._dynamo.utils import counters

import prims_ts
import prims_ts.meta.block_sparse  # noqa: F401  (registers the fakes)
from prims_ts.ops._validate import dtype_code
from prims_ts.ops.block_sparse import BlockSparseTSWrapper, block_sparse_attention
from prims_ts.testing import TOLERANCE, rel_err
from aoti_child import run_aoti_in_child
from cuda_graphs import assert_no_allocation_no_sync, synchronize, warm_and_capture
from compile_helpers import BF16, DEVICES, FP32, I32, NAN, close

R = prims_ts.reference
# per device: B, Sq, Skv, Hq, Hkv, D, q_block, kv_block
SIZES = {"cpu": (2, 10, 45, 8, 2, 128, 4, 8), "cuda": (2, 200, 1333, 16, 4, 128, 32, 64)}


class Prob:
    """q [B, Sq, Hq, D], K/V [B, Skv, Hkv, D], routes in a block_indices of fixed capacity (every
    block of every row fits; garbage past the rows), optional uint32 valid bits."""

    def __init__(self, device, seed, bits=False):
        B, sq, skv, hq, hkv, d, qb, kvb = SIZES[device]
        self.g = torch.Generator().manual_seed(seed)
        self.B, self.sq, self.skv, self.hq, self.hkv, self.d, self.q_block, self.kv_block = B, sq, skv, hq, hkv, d, qb, kvb
        self.device = device
        self.q = torch.randn(B, sq, hq, d, generator=self.g).to(BF16).to(device)
        self.k = torch.randn(B, skv, hkv, d, generator=self.g).to(BF16).to(device)
        self.v = torch.randn(B, skv, hkv, d, generator=self.g).to(BF16).to(device)
        self.rows, self.blocks = -(-sq // qb), -(-skv // kvb)
        self.capacity = B * hkv * self.rows * self.blocks + 3
        self.block_indptr = torch.zeros(B, hkv, self.rows + 1, dtype=I32, device=device)
        self.block_indices = torch.full((self.capacity,), -5, dtype=I32, device=device)
        self.rewrite_routes(0.5)
        self.bits = None
        if bits:
            words = torch.randint(-2**31, 2**31, (B, -(-skv // 32)), generator=self.g, dtype=torch.int64).to(I32)
            self.bits = (words | 1).view(torch.uint32).to(device)

    def rewrite_routes(self, density):
        """New canonical rows (every fifth empty), in place, within the capacity."""
        ptr, ids = torch.zeros(self.B, self.hkv, self.rows + 1, dtype=I32), []
        for b, h in itertools.product(range(self.B), range(self.hkv)):
            for r in range(self.rows):
                ptr[b, h, r] = len(ids)
                if (b + h + r) % 5 != 4:
                    ids += (torch.rand(self.blocks, generator=self.g) < density).nonzero().flatten().tolist()
            ptr[b, h, self.rows] = len(ids)
        self.block_indptr.copy_(ptr)
        self.block_indices.fill_(-5)
        self.block_indices[:len(ids)] = torch.tensor(ids, dtype=I32)

    def plan(self, mask="dense", out_dtype=None) -> BlockSparseTSWrapper:
        w = BlockSparseTSWrapper()
        w.plan(self.B, self.sq, self.skv, self.hq, self.hkv, self.d, self.q_block, self.kv_block, device=self.device,
               max_blocks_per_row=self.blocks, use_kv_valid_bits=self.bits is not None, mask_type=mask,
               q_data_type=BF16, o_data_type=out_dtype)
        return w

    def ref(self, mask="dense", sm_scale=None, bits=True):
        return R.block_sparse_attention_contiguous(self.q, self.k, self.v, self.block_indptr, self.block_indices,
                                                   self.q_block, self.kv_block,
                                                   kv_valid_bits=self.bits if bits else None, mask_type=mask,
                                                   sm_scale=sm_scale, compute_dtype=torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_compile_wrapper_run(device, mask):
    pb = Prob(device, 1 + len(mask), bits=True)
    w = pb.plan(mask)

    def f(q, k, v, bip, bi, vb):
        return w.run(q, k, v, bip, bi, kv_valid_bits=vb, sm_scale=0.08).float() * 2.0 + 1.0

    cf = torch.compile(f, fullgraph=True)
    args = (pb.q, pb.k, pb.v, pb.block_indptr, pb.block_indices, pb.bits)
    got = cf(*args)
    close(got, f(*args))
    ref = pb.ref(mask, 0.08)
    assert rel_err((got - 1.0) / 2.0, ref) <= TOLERANCE[BF16]
    pb.rewrite_routes(0.9)
    ref2 = pb.ref(mask, 0.08)
    assert rel_err(ref.float(), ref2) > 0.05
    assert rel_err((cf(*args) - 1.0) / 2.0, ref2) <= TOLERANCE[BF16]
    if device == "cpu":
        assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_oneshot_refuses_tracing(device):
    pb = Prob(device, 3)

    def f(q, k, v, bip, bi):
        return block_sparse_attention(q, k, v, bip, bi, pb.q_block, pb.kv_block)

    args = (pb.q, pb.k, pb.v, pb.block_indptr, pb.block_indices)
    assert rel_err(f(*args), pb.ref()) <= TOLERANCE[BF16]
    with pytest.raises(Exception, match="BlockSparseTSWrapper"):
        torch.compile(f, fullgraph=True)(*args)


class Module(torch.nn.Module):
    """Two op calls: causal with valid bits to fp32, dense without bits in q's dtype."""

    def __init__(self, q_block, kv_block):
        super().__init__()
        self.q_block, self.kv_block = q_block, kv_block

    def forward(self, q, k, v, bip, bi, vb):
        a = torch.ops.prims_ts.block_sparse_attention_contiguous(q, k, v, bip, bi, vb, self.q_block, self.kv_block,
                                                                 "causal", 0.09, dtype_code(FP32))
        b = torch.ops.prims_ts.block_sparse_attention_contiguous(q, k, v, bip, bi, None, self.q_block,
                                                                 self.kv_block, "dense", 0.1, dtype_code(BF16))
        return a * 2.0, b


def _inputs(device, seed):
    pb = Prob(device, seed, bits=True)
    return (pb.q, pb.k, pb.v, pb.block_indptr, pb.block_indices, pb.bits), pb


def _check(outs, pb, args):
    a, b = outs
    assert a.dtype == FP32 and b.dtype == BF16
    assert rel_err(a / 2.0, pb.ref("causal", 0.09)) <= TOLERANCE[BF16]
    assert rel_err(b, pb.ref("dense", 0.1, bits=False)) <= TOLERANCE[BF16]
    for x, y in zip(outs, Module(pb.q_block, pb.kv_block)(*args)):
        close(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_export_two_value_sets(device):
    args, pb = _inputs(device, 9)
    ep = torch.export.export(Module(pb.q_block, pb.kv_block), args)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.prims_ts.block_sparse_attention_contiguous.default) == 2, targets
    _check(ep.module()(*args), pb, args)
    args2, pb2 = _inputs(device, 10)
    _check(ep.module()(*args2), pb2, args2)


def _aoti_body(package_path: str, device: str) -> None:
    args, pb = _inputs(device, 17)
    ep = torch.export.export(Module(pb.q_block, pb.kv_block), args)
    path = torch._inductor.aoti_compile_and_package(ep, package_path=package_path)
    compiled = torch._inductor.aoti_load_package(path)
    for seed in (18, 19):
        a, p = _inputs(device, seed)
        _check(compiled(*a), p, a)


@pytest.mark.parametrize("device", DEVICES)
def test_aoti_package_load_run(device, tmp_path):
    run_aoti_in_child(__file__, device, tmp_path)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_replay_with_new_routes(device):
    pb = Prob(device, 21, bits=True)
    w = pb.plan("causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device=device)

    def launch():
        w.run(pb.q, pb.k, pb.v, pb.block_indptr, pb.block_indices, kv_valid_bits=pb.bits, sm_scale=0.07, out=out)

    graph = warm_and_capture(launch, device)
    assert_no_allocation_no_sync(launch, device)
    for density in (0.5, 0.2, 0.95):
        pb.rewrite_routes(density)
        out.fill_(NAN)
        graph.replay()
        synchronize(device)
        ref = pb.ref("causal", 0.07)
        assert rel_err(out, ref) <= TOLERANCE[BF16], density
        for b in range(pb.B):
            assert rel_err(out[b], ref[b]) <= TOLERANCE[BF16], (density, b)
