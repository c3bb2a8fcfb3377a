"""Block-sparse attention over contiguous K/V: ``block_sparse_attention`` and
``BlockSparseTSWrapper`` (FlashInfer main's contiguous form of the paged API).

Q and the output ``[B, Sq, Hq, D]``, K/V ``[B, Skv, Hkv, D]``, the paged API's BSR rules. The
CPU tests check the reference against the paged reference over shuffled pages holding the
same rows (an independent path), the one-shot and the wrapper against the float64 reference,
``opcheck`` of both ops, and that every bad input is refused before anything runs (the CPU
"kernel" replaced by a function that fails the test). The ``cuda`` tests run the grid on the
GPU kernel (the paged kernel's core with the contiguous address policy) against float64:
q / kv block sizes incl. 8 and 128 x GQA 1..8 x empty rows x valid bits x causal x D 128/256
x lengths that are not block multiples; outputs NaN-poisoned first, NaN never passes.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import prims_ts
import prims_ts.meta.block_sparse  # noqa: F401  (registers the fakes)
from prims_ts import reference as R
from prims_ts.ops.block_sparse import BlockSparseTSWrapper, block_sparse_attention
from prims_ts.ops._validate import dtype_code
from prims_ts.testing import OPCHECK_TESTS, TOLERANCE, assert_opcheck_passed, reference_must_not_run, rel_err

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, U32 = torch.int32, torch.uint32
NAN = float("nan")
DEVICE = "cuda"  # of the cuda-marked tests; a dry run may set "cpu" and call them directly


def routes_of(B, hkv, sq, skv, q_block, kv_block, g, density=0.5, empty_every=4):
    """Random canonical rows (every `empty_every`-th row empty), encoded back to back:
    (block_indptr [B, Hkv, R + 1], block_indices) as int32 CPU tensors."""
    rows, nblk = -(-sq // q_block), -(-skv // kv_block)
    ptr, ids = torch.zeros(B, hkv, rows + 1, dtype=I32), []
    for b, h in itertools.product(range(B), range(hkv)):
        for r in range(rows):
            ptr[b, h, r] = len(ids)
            if (b + h + r) % empty_every != empty_every - 1:
                ids += (torch.rand(nblk, generator=g) < density).nonzero().flatten().tolist()
        ptr[b, h, rows] = len(ids)
    return ptr, torch.tensor(ids, dtype=I32)


class Prob:
    def __init__(self, B, sq, skv, hq, hkv, d, q_block, kv_block, dtype, device, seed, *, bits=None, density=0.5,
                 empty_every=4):
        g = torch.Generator().manual_seed(seed)
        self.B, self.sq, self.skv, self.hq, self.hkv, self.d = B, sq, skv, hq, hkv, d
        self.q_block, self.kv_block, self.dtype, self.device = q_block, kv_block, dtype, device
        self.q = torch.randn(B, sq, hq, d, generator=g).to(dtype).to(device)
        self.k = torch.randn(B, skv, hkv, d, generator=g).to(dtype).to(device)
        self.v = torch.randn(B, skv, hkv, d, generator=g).to(dtype).to(device)
        ptr, ids = routes_of(B, hkv, sq, skv, q_block, kv_block, g, density, empty_every)
        self.block_indptr, self.block_indices = ptr.to(device), ids.to(device)
        self.bits = None
        if bits is not None:
            words = torch.randint(-2**31, 2**31, (B, -(-skv // 32)), generator=g, dtype=torch.int64).to(I32) | 1
            self.bits = (words.view(U32) if bits == "uint32" else words).to(device)

    @property
    def blocks(self) -> int:
        return -(-self.skv // self.kv_block)

    def ref(self, mask="dense", sm_scale=None):
        return R.block_sparse_attention_contiguous(self.q, self.k, self.v, self.block_indptr, self.block_indices,
                                                   self.q_block, self.kv_block, kv_valid_bits=self.bits,
                                                   mask_type=mask, sm_scale=sm_scale, compute_dtype=torch.float64)

    def plan(self, mask="dense", out_dtype=None, tuning=None) -> BlockSparseTSWrapper:
        w = BlockSparseTSWrapper(tuning=tuning)
        w.plan(self.B, self.sq, self.skv, self.hq, self.hkv, self.d, self.q_block, self.kv_block, device=self.device,
               max_blocks_per_row=self.blocks, use_kv_valid_bits=self.bits is not None, mask_type=mask,
               q_data_type=self.dtype, o_data_type=out_dtype)
        return w

    def run(self, w, **kw):
        return w.run(self.q, self.k, self.v, self.block_indptr, self.block_indices, kv_valid_bits=self.bits, **kw)

    def call(self, **kw):
        return block_sparse_attention(self.q, self.k, self.v, self.block_indptr, self.block_indices, self.q_block,
                                      self.kv_block, kv_valid_bits=self.bits, **kw)


def check(pb: Prob, mask="dense", sm_scale=None, out_dtype=None):
    odt = out_dtype or pb.dtype
    w = pb.plan(mask, out_dtype)
    out = torch.full(pb.q.shape, NAN, dtype=odt, device=pb.device)
    assert pb.run(w, sm_scale=sm_scale, out=out) is out
    one = torch.full(pb.q.shape, NAN, dtype=odt, device=pb.device)
    assert pb.call(mask_type=mask, sm_scale=sm_scale, out=one) is one
    ref = pb.ref(mask, sm_scale)
    tol = max(TOLERANCE[pb.dtype], TOLERANCE[odt])
    for label, x in (("wrapper", out), ("one-shot", one)):
        err = rel_err(x, ref)
        assert err <= tol, f"{label}: rel err {err:.3e}"
        for b in range(pb.B):
            assert rel_err(x[b], ref[b]) <= tol, (label, b)
    return out, ref


# ----------------------------------------------------------------------------
# CPU: the reference, the entry points, opcheck
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [None, "uint32"])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_reference_equals_the_paged_form_over_shuffled_pages(mask, bits):
    pb = Prob(3, 21, 45, 8, 2, 128, 4, 8, FP32, "cpu", 1, bits=bits)
    ps = 16
    per = -(-pb.skv // ps)
    perm = torch.randperm(pb.B * per + 3, generator=torch.Generator().manual_seed(2))
    pools = [torch.full((pb.B * per + 3, pb.hkv, ps, pb.d), NAN) for _ in range(2)]
    for src, pool in zip((pb.k, pb.v), pools):
        for b in range(pb.B):
            rows = torch.zeros(per * ps, pb.hkv, pb.d)
            rows[:pb.skv] = src[b]
            pool[perm[b * per:(b + 1) * per]] = rows.view(per, ps, pb.hkv, pb.d).transpose(1, 2)
    indptr = torch.arange(pb.B + 1, dtype=I32) * per
    paged = R.block_sparse_attention(pb.q, pools[0], pools[1], indptr, perm[:pb.B * per].to(I32), pb.block_indptr,
                                     pb.block_indices, pb.q_block, pb.kv_block, torch.full((pb.B,), pb.skv, dtype=I32),
                                     kv_valid_bits=pb.bits, mask_type=mask, compute_dtype=torch.float64)
    torch.testing.assert_close(pb.ref(mask), paged, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bits", [None, "int32"])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_entry_points_on_cpu(mask, bits, dtype):
    pb = Prob(2, 19, 70, 8, 4, 128, 4, 16, dtype, "cpu", 3, bits=bits)
    check(pb, mask)
    check(pb, mask, sm_scale=0.05, out_dtype=FP32)


def test_functional_run_and_exports():
    pb = Prob(1, 8, 40, 4, 4, 256, 8, 32, BF16, "cpu", 4)
    res = pb.run(pb.plan())
    assert res.dtype == BF16 and res.shape == pb.q.shape
    assert rel_err(res, pb.ref()) <= TOLERANCE[BF16]
    assert prims_ts.block_sparse_attention is block_sparse_attention
    assert prims_ts.BlockSparseTSWrapper is BlockSparseTSWrapper
    assert {"block_sparse_attention", "BlockSparseTSWrapper"} <= set(prims_ts.__all__)


def _op_sample(mask, out_dtype, bits, device="cpu"):
    pb = Prob(2, 9, 37, 4, 2, 128, 4, 8, BF16, device, 5, bits=bits)
    return pb, (pb.q, pb.k, pb.v, pb.block_indptr, pb.block_indices, pb.bits, pb.q_block, pb.kv_block, mask, 0.1)


@pytest.mark.parametrize("bits", [None, "uint32"])
@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_opcheck(mask, bits):
    pb, args = _op_sample(mask, BF16, bits)
    assert_opcheck_passed(torch.library.opcheck(torch.ops.prims_ts.block_sparse_attention_contiguous.default,
                                                args + (dtype_code(FP32), ""), test_utils=OPCHECK_TESTS))
    out = torch.empty(pb.q.shape, dtype=BF16)
    assert_opcheck_passed(torch.library.opcheck(torch.ops.prims_ts.block_sparse_attention_contiguous_out.default,
                                                args[:3] + (out,) + args[3:] + ("",), test_utils=OPCHECK_TESTS))


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 9, 4, 128, dtype=BF16)
        k = torch.empty(2, 37, 2, 128, dtype=BF16)
        out = torch.ops.prims_ts.block_sparse_attention_contiguous(
            q, k, k, torch.empty(2, 2, 4, dtype=I32), torch.empty(11, dtype=I32), None, 4, 8, "dense", 0.1,
            dtype_code(FP32), "")
        assert out.shape == q.shape and out.dtype == FP32


# ----------------------------------------------------------------------------
# CPU: bad input is refused before anything runs
# ----------------------------------------------------------------------------

REF = "block_sparse_attention_contiguous"


def _base():
    return Prob(2, 9, 37, 4, 2, 128, 4, 8, BF16, "cpu", 6, bits="uint32")


ONESHOT_ERRORS = [
    (ValueError, r"q_block_size: .* divisible by 8", lambda a, kw: kw.update(q_block_size=3)),
    (ValueError, r"kv_block_size: must be 8, 16, 32", lambda a, kw: kw.update(kv_block_size=48)),
    (ValueError, r"q must be rank 4", lambda a, kw: a.update(q=a["q"][0])),
    (ValueError, r"v: shape .* must equal k's", lambda a, kw: a.update(v=a["v"][:, :-1])),
    (ValueError, r"k: batch", lambda a, kw: a.update(k=a["k"][:1], v=a["v"][:1])),
    (ValueError, r"dtype", lambda a, kw: a.update(k=a["k"].half(), v=a["v"].half())),
    (ValueError, r"q: dtype float32 is not supported", lambda a, kw: a.update(q=a["q"].float())),
    (ValueError, r"head dim|head_dim|q: D", lambda a, kw: a.update(q=a["q"][..., :64], k=a["k"][..., :64],
                                                                   v=a["v"][..., :64])),
    (ValueError, r"mask_type", lambda a, kw: kw.update(mask_type="sliding")),
    (ValueError, r"block_indptr: expected \[B, Hkv", lambda a, kw: a.update(block_indptr=a["block_indptr"][:, :1].contiguous())),
    (ValueError, r"block_indptr must be rank 3", lambda a, kw: a.update(block_indptr=a["block_indptr"].flatten())),
    (ValueError, r"block_indptr: .*int32", lambda a, kw: a.update(block_indptr=a["block_indptr"].long())),
    (ValueError, r"block_indices", lambda a, kw: a.update(block_indices=a["block_indices"].long())),
    (ValueError, r"kv_valid_bits: expected \[B, ceil", lambda a, kw: kw.update(kv_valid_bits=kw["kv_valid_bits"][:, :1].contiguous())),
    (ValueError, r"kv_valid_bits: dtype", lambda a, kw: kw.update(kv_valid_bits=kw["kv_valid_bits"].long())),
    (ValueError, r"out: expected shape", lambda a, kw: kw.update(out=torch.empty(2, 9, 4, 64, dtype=BF16))),
    (ValueError, r"out must not overlap q", lambda a, kw: kw.update(out=a["q"])),
    (TypeError, r"q: expected a torch.Tensor", lambda a, kw: a.update(q=1.0)),
]


def _values(mutate):
    """A one-shot's arguments with `mutate(ptr, ids)` applied (in place) to copies of the routes."""
    def make(a, kw):
        ptr, ids = a["block_indptr"].clone(), a["block_indices"].clone()
        mutate(ptr, ids)  # in place
        a.update(block_indptr=ptr, block_indices=ids)
    return make


def _first_full_row(ptr):
    flat = ptr[..., 1:] - ptr[..., :-1]
    b, h, r = (flat >= 2).nonzero()[0].tolist()
    return int(ptr[b, h, r])


VALUE_ERRORS = [
    (r"block_indptr: entry .* is outside", _values(lambda p, i: p.view(-1)[-1].fill_(i.numel() + 5))),
    (r"block_indptr: row .* ends before it starts", _values(lambda p, i: p[-1, -1, 1].fill_(int(p[-1, -1, 0]) - 1))),
    (r"block_indices: .*strictly increasing|repeat", _values(lambda p, i: i.__setitem__(
        _first_full_row(p) + 1, int(i[_first_full_row(p)])))),
    (r"block_indices: .*strictly increasing", _values(lambda p, i: i.__setitem__(
        slice(_first_full_row(p), _first_full_row(p) + 2), i[_first_full_row(p):_first_full_row(p) + 2].flip(0)))),
    (r"block_indices: .*(outside|before|start)", _values(lambda p, i: i.__setitem__(_first_full_row(p) + 1, 999))),
    (r"block_indices: .*(outside|negative|>= 0|start)", _values(lambda p, i: i.__setitem__(_first_full_row(p), -1))),
]


def _oneshot_args(pb):
    a = dict(q=pb.q, k=pb.k, v=pb.v, block_indptr=pb.block_indptr, block_indices=pb.block_indices)
    kw = dict(q_block_size=pb.q_block, kv_block_size=pb.kv_block, kv_valid_bits=pb.bits)
    return a, kw


def _call_oneshot(a, kw):
    kw = dict(kw)
    qb, kvb = kw.pop("q_block_size"), kw.pop("kv_block_size")
    return block_sparse_attention(a["q"], a["k"], a["v"], a["block_indptr"], a["block_indices"], qb, kvb, **kw)


def test_base_inputs_are_valid():
    pb = _base()
    a, kw = _oneshot_args(pb)
    assert rel_err(_call_oneshot(a, kw), pb.ref()) <= TOLERANCE[BF16]


@pytest.mark.parametrize("exc,match,mutate", ONESHOT_ERRORS, ids=[m for _, m, _ in ONESHOT_ERRORS])
def test_oneshot_errors(exc, match, mutate):
    a, kw = _oneshot_args(_base())
    mutate(a, kw)
    with reference_must_not_run(REF), pytest.raises(exc, match=match):
        _call_oneshot(a, kw)


@pytest.mark.parametrize("match,mutate", VALUE_ERRORS, ids=[m for m, _ in VALUE_ERRORS])
def test_oneshot_route_value_errors(match, mutate):
    a, kw = _oneshot_args(_base())
    mutate(a, kw)
    with reference_must_not_run(REF), pytest.raises(ValueError, match=match):
        _call_oneshot(a, kw)


def test_oneshot_causal_needs_sq_at_most_skv():
    pb = Prob(1, 40, 30, 4, 2, 128, 4, 8, BF16, "cpu", 7)
    with reference_must_not_run(REF), pytest.raises(ValueError, match="Sq <= Skv"):
        pb.call(mask_type="causal")


PLAN_ERRORS = [
    (ValueError, r"batch_size", dict(batch_size=0)),
    (ValueError, r"seq_len_q", dict(seq_len_q=0)),
    (ValueError, r"seq_len_kv", dict(seq_len_kv=0)),
    (ValueError, r"num_qo_heads|divisible", dict(num_qo_heads=3)),
    (ValueError, r"head_dim", dict(head_dim=96)),
    (ValueError, r"q_block_size", dict(q_block_size=1)),
    (ValueError, r"kv_block_size", dict(kv_block_size=100)),
    (ValueError, r"max_blocks_per_row: .* cannot exceed", dict(max_blocks_per_row=6)),
    (ValueError, r"max_blocks_per_row: must be non-negative", dict(max_blocks_per_row=-1)),
    (TypeError, r"max_blocks_per_row: expected a Python integer", dict(max_blocks_per_row=2.0)),
    (TypeError, r"use_kv_valid_bits: expected a bool", dict(use_kv_valid_bits=1)),
    (ValueError, r"mask_type", dict(mask_type="window")),
    (ValueError, r"q_data_type|dtype", dict(q_data_type=FP32)),
    (ValueError, r"seq_len_q: causal", dict(mask_type="causal", seq_len_q=40)),
    (ValueError, r"device", dict(device="meta")),
    (TypeError, r"device", dict(device=1.5)),
]


def _plan_kw(pb, **mods):
    kw = dict(batch_size=pb.B, seq_len_q=pb.sq, seq_len_kv=pb.skv, num_qo_heads=pb.hq, num_kv_heads=pb.hkv,
              head_dim=pb.d, q_block_size=pb.q_block, kv_block_size=pb.kv_block, device="cpu",
              max_blocks_per_row=pb.blocks, use_kv_valid_bits=pb.bits is not None, q_data_type=pb.dtype)
    kw.update(mods)
    return kw


@pytest.mark.parametrize("exc,match,mods", PLAN_ERRORS, ids=[m for _, m, _ in PLAN_ERRORS])
def test_plan_errors(exc, match, mods):
    pb = _base()
    w = BlockSparseTSWrapper()
    with pytest.raises(exc, match=match):
        w.plan(**_plan_kw(pb, **mods))
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        pb.run(w)


RUN_ERRORS = [
    (ValueError, r"q: expected the planned", lambda pb: dict(q=pb.q[:, :-1])),
    (ValueError, r"k: expected the planned", lambda pb: dict(k=pb.k[:, :-1], v=pb.v[:, :-1])),
    (ValueError, r"v: shape", lambda pb: dict(v=pb.v[:, :-1])),
    (ValueError, r"q: dtype float16 differs from the planned", lambda pb: dict(q=pb.q.half(), k=pb.k.half(),
                                                                              v=pb.v.half())),
    (ValueError, r"block_indptr: expected", lambda pb: dict(block_indptr=pb.block_indptr[:1])),
    (ValueError, r"kv_valid_bits: kv_valid_bits is required", lambda pb: dict(kv_valid_bits=None)),
    (ValueError, r"out: expected dtype", lambda pb: dict(out=torch.empty(pb.q.shape, dtype=FP16))),
    (ValueError, r"out must not overlap k", lambda pb: dict(out=pb.k.view(-1)[:pb.q.numel()].view(pb.q.shape))),
    (ValueError, r"sm_scale", lambda pb: dict(sm_scale=-1.0)),
    (ValueError, r"the last dimension must be contiguous", lambda pb: dict(q=pb.q.transpose(2, 3).contiguous()
                                                                             .transpose(2, 3))),
]


@pytest.mark.parametrize("exc,match,mods", RUN_ERRORS, ids=[m for _, m, _ in RUN_ERRORS])
def test_run_errors(exc, match, mods):
    pb = _base()
    w = pb.plan()
    a = dict(q=pb.q, k=pb.k, v=pb.v, block_indptr=pb.block_indptr, block_indices=pb.block_indices,
             kv_valid_bits=pb.bits)
    a.update(mods(pb))
    with reference_must_not_run(REF), pytest.raises(exc, match=match):
        w.run(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("block_indptr"), a.pop("block_indices"), **a)


def test_run_trusts_route_values():
    """A run reads no route on the host: a block ID past Skv reaches the op (the CPU reference
    sees no key in it) instead of a host check."""
    pb = _base()
    w = pb.plan()
    bad = pb.block_indices.clone()
    bad[0] = 10**6
    assert torch.isfinite(w.run(pb.q, pb.k, pb.v, pb.block_indptr, bad, kv_valid_bits=pb.bits)).all()


# ----------------------------------------------------------------------------
# GPU: the kernel against float64
# ----------------------------------------------------------------------------

GRID = [  # (q_block, kv_block, group, d, mask, bits, empty_every, skv)
    (8, 8, 1, 128, "dense", None, 4, 333),
    (4, 16, 2, 128, "causal", "uint32", 3, 517),
    (2, 32, 4, 128, "dense", "int32", 5, 1000),
    (1, 64, 8, 128, "causal", None, 4, 1333),
    (128, 128, 1, 128, "causal", "uint32", 3, 2100),
    (64, 128, 2, 256, "dense", None, 4, 777),
    (16, 8, 8, 256, "causal", "int32", 2, 300),
    (32, 64, 4, 256, "causal", None, 4, 1029),
    (128, 64, 8, 128, "dense", "uint32", 3, 4097),
    (8, 256, 1, 128, "causal", None, 4, 1500),
]


@pytest.mark.cuda
@pytest.mark.parametrize("q_block,kv_block,group,d,mask,bits,empty_every,skv", GRID,
                         ids=[f"q{g[0]}-kv{g[1]}-gqa{g[2]}-d{g[3]}-{g[4]}-{g[5] or 'nobits'}" for g in GRID])
def test_gpu_grid(q_block, kv_block, group, d, mask, bits, empty_every, skv):
    hkv = 2
    sq = min(skv, 3 * q_block + 5 if q_block < 64 else 300)
    pb = Prob(2, sq, skv, hkv * group, hkv, d, q_block, kv_block, BF16, DEVICE, q_block * 7 + kv_block, bits=bits,
              empty_every=empty_every)
    out, ref = check(pb, mask)
    # a row that sees nothing is exactly zero
    empty = (pb.block_indptr[..., 1:] == pb.block_indptr[..., :-1]).cpu()
    b, h, r = empty.nonzero()[0].tolist()
    rows = out[b, r * q_block:(r + 1) * q_block, h * group:(h + 1) * group]
    assert torch.equal(rows, torch.zeros_like(rows))


@pytest.mark.cuda
def test_gpu_fp16_out_dtypes_and_scale():
    pb = Prob(3, 100, 1000, 16, 4, 128, 32, 64, FP16, DEVICE, 11, bits="uint32")
    for odt in (FP16, FP32):
        check(pb, "causal", sm_scale=0.06, out_dtype=odt)


@pytest.mark.cuda
def test_gpu_graph_replay_with_changed_routes():
    """A captured run, replayed after new routes are written into the captured tensors in place
    (another density, within the plan's capacity), gives the new reference."""
    pb = Prob(2, 200, 1500, 16, 4, 128, 64, 64, BF16, "cuda", 12, density=0.9, empty_every=5)
    cap = pb.B * pb.hkv * -(-pb.sq // pb.q_block) * pb.blocks  # every block of every row
    w = pb.plan("causal")
    out = torch.full(pb.q.shape, NAN, dtype=BF16, device="cuda")
    ids = torch.full((cap,), -1, dtype=I32, device="cuda")
    ids[:pb.block_indices.numel()] = pb.block_indices
    pb.block_indices = ids

    def launch():
        pb.run(w, out=out)

    launch()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for density, seed in ((0.9, 12), (0.3, 13), (0.6, 14)):
        ptr, new = routes_of(pb.B, pb.hkv, pb.sq, pb.skv, pb.q_block, pb.kv_block,
                             torch.Generator().manual_seed(seed), density, 5)
        assert new.numel() <= cap
        pb.block_indptr.copy_(ptr.cuda())
        ids.fill_(-1)
        ids[:new.numel()] = new.cuda()
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, pb.ref("causal")) <= TOLERANCE[BF16], density
