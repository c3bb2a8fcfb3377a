"""batch_prefill on the GPU against the float64 reference (the correctness grid)."""
import itertools
import zlib

import pytest
import torch

import prims_ts
from prims_ts import reference as R
from prims_ts.testing import TOLERANCE, rel_err

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("ring_variant")]  # every producer-ring variant

MASKS = [("dense", -1), ("causal", -1), ("causal", 0), ("causal", 100), ("variable_window", -1)]
FIXED_LENGTHS = [(1, 1), (7, 7), (127, 129), (129, 1000), (1000, 1033)]
PACKED_Q = [1, 7, 127, 129, 1000]
PACKED_KV = [1, 9, 127, 300, 1040]


def _gen(seed):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, g):
    return torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _windows(B, Sq, Sk, g):
    a = torch.randint(0, Sk, (B, Sq), generator=g, device="cuda", dtype=torch.int32)
    b = torch.randint(0, Sk, (B, Sq), generator=g, device="cuda", dtype=torch.int32)
    return torch.minimum(a, b), torch.maximum(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS, ids=[f"{m}{w}" for m, w in MASKS])
def test_fixed_grid(mask, window, d, group, dtype):
    g = _gen(zlib.crc32(repr((mask, window, d, group, str(dtype))).encode()))
    hkv = 2
    hq = hkv * group
    for sq, sk in FIXED_LENGTHS:
        if mask == "causal" and sq > sk:
            continue
        B = 2
        q = _randn((B, sq, hq, d), dtype, g)
        k = _randn((B, sk, hkv, d), dtype, g)
        v = _randn((B, sk, hkv, d), dtype, g)
        starts = ends = None
        if mask == "variable_window":
            starts, ends = _windows(B, sq, sk, g)
        out = torch.full_like(q, float("nan"))
        res = prims_ts.batch_prefill(q, k, v, mask_type=mask, window_left=window,
                                     variable_window_token_starts=starts, variable_window_token_ends=ends, out=out)
        assert res is out
        ref = R.batch_prefill(q, k, v, mask_type=mask, window_left=window, window_starts=starts, window_ends=ends,
                              compute_dtype=torch.float64)
        err = rel_err(out, ref)
        assert err <= TOLERANCE[dtype], f"Sq={sq} Sk={sk}: rel err {err:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("mask,window", MASKS[:4], ids=[f"{m}{w}" for m, w in MASKS[:4]])
def test_packed_grid(mask, window, d, group, dtype):
    g = _gen(zlib.crc32(repr(("packed", mask, window, d, group, str(dtype))).encode()))
    hkv = 2
    hq = hkv * group
    qo = torch.tensor([0] + list(itertools.accumulate(PACKED_Q)), dtype=torch.int32, device="cuda")
    kvo = torch.tensor([0] + list(itertools.accumulate(PACKED_KV)), dtype=torch.int32, device="cuda")
    q = _randn((int(qo[-1]), hq, d), dtype, g)
    k = _randn((int(kvo[-1]), hkv, d), dtype, g)
    v = _randn((int(kvo[-1]), hkv, d), dtype, g)
    out = torch.full_like(q, float("nan"))
    prims_ts.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window, out=out)
    ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type=mask, window_left=window,
                          compute_dtype=torch.float64)
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"rel err {err:.3e}"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_out_dtype_and_scales(out_dtype):
    g = _gen(7)
    q = _randn((2, 300, 8, 128), torch.bfloat16, g)
    k = _randn((2, 333, 4, 128), torch.bfloat16, g)
    v = _randn((2, 333, 4, 128), torch.bfloat16, g)
    out = prims_ts.batch_prefill(q, k, v, mask_type="causal", sm_scale=0.05, output_scale=1.7, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    ref = R.batch_prefill(q, k, v, mask_type="causal", sm_scale=0.05, output_scale=1.7, compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2


def test_strided_views():
    """q/k/v as views into a fused QKV projection (outer strides != contiguous)."""
    g = _gen(11)
    B, S, hq, hkv, d = 2, 257, 8, 2, 128
    qkv = _randn((B, S, hq + 2 * hkv, d), torch.bfloat16, g)
    q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
    out = prims_ts.batch_prefill(q, k, v, mask_type="causal")
    ref = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2


def test_large_scores_no_overflow():
    """Large logits must not overflow the online softmax."""
    g = _gen(3)
    q = _randn((1, 200, 4, 128), torch.bfloat16, g) * 8
    k = _randn((1, 500, 4, 128), torch.bfloat16, g) * 8
    v = _randn((1, 500, 4, 128), torch.bfloat16, g)
    out = prims_ts.batch_prefill(q, k, v)
    ref = R.batch_prefill(q, k, v, compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2


def test_wrapper_replay_changed_offsets():
    g = _gen(5)
    hq, hkv, d = 8, 2, 128
    q_lens, kv_lens = [100, 300, 37], [200, 300, 500]
    qo = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device="cuda")
    kvo = torch.tensor([0] + list(itertools.accumulate(kv_lens)), dtype=torch.int32, device="cuda")
    q = _randn((int(qo[-1]), hq, d), torch.bfloat16, g)
    k = _randn((int(kvo[-1]), hkv, d), torch.bfloat16, g)
    v = _randn((int(kvo[-1]), hkv, d), torch.bfloat16, g)
    w = prims_ts.BatchPrefillTSWrapper()
    w.plan(qo, kvo, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, mask_type="causal", max_q_len=300)
    out = torch.full_like(q, float("nan"))
    w.run(q, k, v, out=out)
    ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, k, v, out=out)
    # new offsets: same totals, every q length within max_q_len, Sq <= Sk
    new_q, new_kv = [200, 137, 100], [250, 350, 400]
    qo.copy_(torch.tensor([0] + list(itertools.accumulate(new_q)), dtype=torch.int32))
    kvo.copy_(torch.tensor([0] + list(itertools.accumulate(new_kv)), dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device():
    dev = torch.device("cuda:1")
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    q = torch.randn((2, 130, 8, 128), generator=g, device=dev).to(torch.bfloat16)
    k = torch.randn((2, 140, 2, 128), generator=g, device=dev).to(torch.bfloat16)
    v = torch.randn((2, 140, 2, 128), generator=g, device=dev).to(torch.bfloat16)
    out = prims_ts.batch_prefill(q, k, v, mask_type="causal")
    assert out.device == dev
    ref = R.batch_prefill(q, k, v, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(out, ref) <= 2e-2
    qo = torch.tensor([0, 100, 260], dtype=torch.int32, device=dev)
    kvo = torch.tensor([0, 120, 280], dtype=torch.int32, device=dev)
    qp, kp, vp = q.reshape(260, 8, 128), k.reshape(280, 2, 128), v.reshape(280, 2, 128)
    outp = prims_ts.batch_prefill(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    refp = R.batch_prefill(qp, kp, vp, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
    assert rel_err(outp, refp) <= 2e-2
