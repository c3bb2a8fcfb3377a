"""torch.library.opcheck on the paged block-sparse ops (CPU; the same on CUDA where a GPU is present).

opcheck runs, for each sample:
  test_schema                - the schema's mutation/aliasing annotations match what the op does;
  test_autograd_registration - an autograd kernel is registered where inputs may require grad;
  test_faketensor            - the fake (meta/block_sparse.py) agrees with the real kernel;
  test_aot_dispatch_dynamic  - the op traces through AOTAutograd with dynamic shapes and gives the
                               same result as eager.

The op signatures (``prims_ts/ops/block_sparse.py``):
  block_sparse_attention(q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens,
                         valid_bits, q_block_size, kv_block_size, mask_type, sm_scale, out_dtype: int,
                         tuning: str = "") -> Tensor
  block_sparse_attention_out(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices,
                             seq_lens, valid_bits, q_block_size, kv_block_size, mask_type, sm_scale,
                             tuning: str = "") -> ()
``out_dtype`` is the output dtype's int code (``prims_ts.ops._validate.dtype_code``: 0 fp16, 1 bf16,
2 fp32); ``tuning`` an encoded ``prims_ts.Tuning`` ("" the default). Samples run without the
tuning argument (its default), with "" and with a non-default encoded Tuning.
Samples: 3 requests over a 9-page pool with repeated, non-identity page IDs and a spare CSR entry;
routes at absolute offsets with a garbage entry between segments; K/V as two separate pools or as
the two (strided) halves of one combined cache; valid bits absent, uint32 or int32.
"""
from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import prims_ts
from prims_ts.ops._validate import dtype_code
import prims_ts.ops.block_sparse  # noqa: F401  (defines the ops)
import prims_ts.meta.block_sparse  # noqa: F401  (registers their fakes)
from prims_ts.testing import OPCHECK_TESTS, TOLERANCE, assert_opcheck_passed, rel_err

R = prims_ts.reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
D = 128
PS = 16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _randn(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _routes(lens, sq, hkv, q_block, kv_block, seed):
    """block_indptr [B, Hkv, R + 1] and block_indices: random strictly increasing rows (some empty), the
    (b, h) segments back to back with one garbage entry (-1) between segments."""
    g = torch.Generator().manual_seed(seed)
    n_rows = -(-sq // q_block)
    ptr, flat = [], []
    for sk in lens:
        nblk = -(-sk // kv_block)
        per_head = []
        for _ in range(hkv):
            offs = [len(flat)]
            for _ in range(n_rows):
                flat += (torch.rand(nblk, generator=g) < 0.6).nonzero().flatten().tolist()
                offs.append(len(flat))
            per_head.append(offs)
            flat.append(-1)
        ptr.append(per_head)
    return torch.tensor(ptr, dtype=I32), torch.tensor(flat, dtype=I32)


def sample(mask, dtype, bits, combined, kv_block=8, seed=0, device="cpu"):
    """3 requests (kv lens 20, 5, 33) over a 9-page pool with non-identity and repeated page IDs (page 2 is
    used by all three), one spare CSR entry after request 1; Sq 5, Hq 4 / Hkv 2, q_block 4."""
    lens = [20, 5, 33]
    indptr, indices = [0, 2, 4, 7], [7, 2, 2, -1, 5, 8, 2]
    sq, hq, hkv, P, q_block = 5, 4, 2, 9, 4
    if combined:
        kv = _randn((P, 2, hkv, PS, D), dtype, seed + 1, device)
        k, v = kv[:, 0], kv[:, 1]
    else:
        k, v = _randn((P, hkv, PS, D), dtype, seed + 1, device), _randn((P, hkv, PS, D), dtype, seed + 2, device)
    q = _randn((3, sq, hq, D), dtype, seed, device)
    bip, bi = _routes(lens, sq, hkv, q_block, kv_block, seed + 3)
    valid = None
    if bits is not None:
        words = torch.randint(-2**31, 2**31, (3, 2), generator=torch.Generator().manual_seed(seed + 4),
                              dtype=torch.int64).to(I32)
        valid = (words.view(torch.uint32) if bits == "uint32" else words).to(device)
    meta = tuple(torch.tensor(x, dtype=I32, device=device) for x in (indptr, indices)) + (
        bip.to(device), bi.to(device), torch.tensor(lens, dtype=I32, device=device), valid)
    scalars = (q_block, kv_block, mask, 0.09)
    return q, k, v, meta, scalars


def _reference(q, k, v, meta, scalars):
    q_block, kv_block, mask, sm_scale = scalars
    return R.block_sparse_attention(q, k, v, meta[0], meta[1], meta[2], meta[3], q_block, kv_block, meta[4],
                                    kv_valid_bits=meta[5], mask_type=mask, sm_scale=sm_scale,
                                    compute_dtype=torch.float64)


# the trailing tuning argument: left out (its default), "" and a non-default Tuning (the CPU kernel ignores it;
# on CUDA it selects another kernel variant of the same op)
NO_TUNING = ()
TUNINGS = [NO_TUNING, ("",), (prims_ts.Tuning(loop=0, persistent=True).encode(),)]

CASES = [("dense", BF16, BF16, None, False, 8), ("causal", FP16, FP32, "uint32", True, 16),
         ("causal", BF16, BF16, "int32", False, 32), ("dense", FP16, FP32, "uint32", True, 64),
         ("causal", BF16, FP16, None, True, 128), ("dense", BF16, FP32, "int32", False, 8)]
IDS = [f"{m}-kv{kvb}-{b or 'nobits'}-{'combined' if c else 'pools'}" for m, _, _, b, c, kvb in CASES]
CASE_TUNING = [TUNINGS[i % 3] for i in range(len(CASES))]  # every case one of the three forms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask,dtype,out_dtype,bits,combined,kv_block,tuning",
                         [c + (t,) for c, t in zip(CASES, CASE_TUNING)], ids=IDS)
def test_opcheck_block_sparse_attention(mask, dtype, out_dtype, bits, combined, kv_block, tuning, device):
    q, k, v, meta, scalars = sample(mask, dtype, bits, combined, kv_block, device=device)
    args = (q, k, v, *meta, *scalars, dtype_code(out_dtype), *tuning)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.block_sparse_attention.default, args, test_utils=OPCHECK_TESTS))
    res = torch.ops.prims_ts.block_sparse_attention(*args)
    assert res.dtype == out_dtype and res.shape == q.shape and res.device == q.device
    assert rel_err(res, _reference(q, k, v, meta, scalars)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask,dtype,out_dtype,bits,combined,kv_block,tuning",
                         [c + (t,) for c, t in zip(CASES, CASE_TUNING[1:] + CASE_TUNING[:1])], ids=IDS)
def test_opcheck_block_sparse_attention_out(mask, dtype, out_dtype, bits, combined, kv_block, tuning, device):
    q, k, v, meta, scalars = sample(mask, dtype, bits, combined, kv_block, seed=10, device=device)
    out = torch.full(q.shape, float("nan"), dtype=out_dtype, device=device)
    args = (q, k, v, out, *meta, *scalars, *tuning)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.block_sparse_attention_out.default, args,
                                  test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    assert torch.ops.prims_ts.block_sparse_attention_out(*args) is None
    assert rel_err(out, _reference(q, k, v, meta, scalars)) <= TOLERANCE[dtype]


def test_opcheck_with_requires_grad_inputs():
    """Inference ops without a backward formula: with inputs that require grad there must be an autograd
    kernel (custom_op's raises on backward), not a silent detach."""
    q, k, v, meta, scalars = sample("causal", FP32, "uint32", False, seed=30)
    q, k, v = (t.to(BF16).requires_grad_() for t in (q, k, v))
    args = (q, k, v, *meta, *scalars, dtype_code(BF16))
    names = ("test_schema", "test_autograd_registration", "test_faketensor")
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.block_sparse_attention.default, args, test_utils=names), names)
    res = torch.ops.prims_ts.block_sparse_attention(*args)
    assert res.requires_grad
    with pytest.raises(RuntimeError, match="autograd|backward"):
        res.float().sum().backward()


def test_fake_tensor_shapes():
    """The fakes give q's shape and the requested dtype, and never read data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for bits in (None, "uint32", "int32"):
        q, k, v, meta, scalars = sample("causal", BF16, bits, True)
        mq, mk, mv = (t.to("meta") for t in (q, k, v))
        mmeta = tuple(t.to("meta") if t is not None else None for t in meta)
        res = torch.ops.prims_ts.block_sparse_attention(mq, mk, mv, *mmeta, *scalars, dtype_code(FP32))
        assert res.device.type == "meta" and res.shape == q.shape and res.dtype == FP32
        with FakeTensorMode() as mode:
            fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
            fmeta = tuple(mode.from_tensor(t) if t is not None else None for t in meta)
            res = torch.ops.prims_ts.block_sparse_attention(fq, fk, fv, *fmeta, *scalars, dtype_code(FP16))
            assert res.shape == q.shape and res.dtype == FP16
            fout = torch.empty(q.shape, dtype=FP32)
            assert torch.ops.prims_ts.block_sparse_attention_out(fq, fk, fv, fout, *fmeta, *scalars) is None


@pytest.mark.parametrize("device", DEVICES)
def test_tuning_argument(device):
    """A non-default encoded Tuning is an ordinary op argument: opcheck passes with it (functional and out=),
    and it never changes the result's shape, dtype or accuracy; the functional op's output dtype follows the
    int code (each of the three)."""
    tuning = prims_ts.Tuning(loop=0, persistent=True).encode()
    assert tuning  # non-empty: not the default
    q, k, v, meta, scalars = sample("causal", BF16, "uint32", True, 16, seed=40, device=device)
    want = _reference(q, k, v, meta, scalars)
    for odt in (FP16, BF16, FP32):
        args = (q, k, v, *meta, *scalars, dtype_code(odt), tuning)
        assert_opcheck_passed(opcheck(torch.ops.prims_ts.block_sparse_attention.default, args,
                                      test_utils=OPCHECK_TESTS))
        res = torch.ops.prims_ts.block_sparse_attention(*args)
        assert res.dtype == odt and res.shape == q.shape
        assert rel_err(res, want) <= TOLERANCE[BF16]
    out = torch.full(q.shape, float("nan"), dtype=FP32, device=device)
    args = (q, k, v, out, *meta, *scalars, tuning)
    assert_opcheck_passed(opcheck(torch.ops.prims_ts.block_sparse_attention_out.default, args,
                                  test_utils=OPCHECK_TESTS))
    out.fill_(float("nan"))
    torch.ops.prims_ts.block_sparse_attention_out(*args)
    assert rel_err(out, want) <= TOLERANCE[BF16]


@pytest.mark.parametrize("code", [-1, 3, 7])
def test_out_dtype_code_out_of_range(code):
    """The functional op and its fake refuse an output dtype code outside 0..2, naming out_dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, meta, scalars = sample("dense", BF16, None, False)
    with pytest.raises(ValueError, match="out_dtype"):
        torch.ops.prims_ts.block_sparse_attention(q, k, v, *meta, *scalars, code)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fmeta = tuple(mode.from_tensor(t) if t is not None else None for t in meta)
        with pytest.raises(ValueError, match="out_dtype"):
            torch.ops.prims_ts.block_sparse_attention(fq, fk, fv, *fmeta, *scalars, code)
