"""The launch fields a prepared decode-shaped launch (decode, MLA, block-sparse) writes: the
strides and addresses ``write_rows`` puts into the parameter struct for every pool layout,
and the argument names its errors carry. Runs on CPU tensors: the struct is plain ctypes."""

import pytest
import torch

from prims_ts.cuda.decode import DecodeParams, write_rows

BF16 = torch.bfloat16
ES = 2  # bf16 element size


def _fields(p, names):
    return tuple(getattr(p, n) for n in names)


KSTR = ("k_sp", "k_sh", "k_ss")
VSTR = ("v_sp", "v_sh", "v_ss")
QSTR = ("q_sb", "q_st", "q_sh")
OSTR = ("o_sb", "o_st", "o_sh")


def test_separate_pools_and_batched_query():
    q = torch.randn(3, 8, 64, dtype=BF16)
    k = torch.randn(5, 2, 16, 64, dtype=BF16)
    v = torch.randn(5, 2, 16, 64, dtype=BF16)
    o = torch.empty(3, 8, 64, dtype=BF16)
    p = DecodeParams()
    s = write_rows(p, None, q, k, v, o, False)
    assert s == (q.stride(), k.stride(), v.stride(), o.stride())
    assert _fields(p, QSTR) == (8 * 64, 0, 64)
    assert _fields(p, OSTR) == (8 * 64, 0, 64)
    assert _fields(p, KSTR) == (2 * 16 * 64, 16 * 64, 64)
    assert _fields(p, VSTR) == (2 * 16 * 64, 16 * 64, 64)
    assert (p.q, p.k, p.v, p.o) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())


def test_combined_cache_points_v_at_the_second_half():
    kv = torch.randn(4, 2, 2, 16, 128, dtype=BF16)
    q = torch.randn(2, 3, 4, 128, dtype=BF16)  # [B, SQ, Hq, D]
    o = torch.empty_like(q)
    p = DecodeParams()
    write_rows(p, None, q, kv, None, o, False)
    st = kv.stride()
    assert _fields(p, KSTR) == (st[0], st[2], st[3])
    assert _fields(p, VSTR) == (st[0], st[2], st[3])
    assert p.k == kv.data_ptr() and p.v == kv.data_ptr() + st[1] * ES
    assert p.v == kv[:, 1].data_ptr()
    assert _fields(p, QSTR) == q.stride()[:3]


@pytest.mark.parametrize("shape", [(6, 1, 32, 576), (6, 32, 576)])
def test_latent_pool_is_both_k_and_v(shape):
    pool = torch.randn(*shape, dtype=BF16)
    q = torch.randn(2, 16, 576, dtype=BF16)
    o = torch.empty(2, 16, 512, dtype=BF16)
    p = DecodeParams()
    write_rows(p, None, q, pool, None, o, False)
    st = pool.stride()
    want = (st[0], st[1], st[2]) if len(shape) == 4 else (st[0], 0, st[1])
    assert _fields(p, KSTR) == want and _fields(p, VSTR) == want
    assert p.k == p.v == pool.data_ptr()
    assert _fields(p, OSTR) == (16 * 512, 0, 512)


def test_packed_query_and_strided_views():
    big = torch.randn(10, 12, 64, dtype=BF16)
    q = big[:, 2:10]  # packed [T, Hq, D] with a head stride of 64 and token stride 768
    o = torch.empty(10, 8, 64, dtype=BF16)
    kpool = torch.randn(3, 2, 16, 2, 64, dtype=BF16)
    k, v = kpool[:, :, :, 0], kpool[:, :, :, 1]  # slot stride 128
    p = DecodeParams()
    write_rows(p, None, q, k, v, o, True)
    assert _fields(p, QSTR) == (0, 12 * 64, 64)
    assert _fields(p, OSTR) == (0, 8 * 64, 64)
    assert _fields(p, KSTR) == (2 * 16 * 2 * 64, 16 * 2 * 64, 128)
    assert p.v - p.k == 64 * ES


def test_addresses_follow_each_call_strides_only_on_change():
    q = torch.randn(2, 4, 64, dtype=BF16)
    o = torch.empty_like(q)
    kv = torch.randn(3, 2, 1, 16, 64, dtype=BF16)
    p = DecodeParams()
    s = write_rows(p, None, q, kv, None, o, False)
    p.k_sp = -1  # a stale field survives a call with the same strides ...
    q2, o2, kv2 = q.clone(), o.clone(), kv.clone()
    assert write_rows(p, s, q2, kv2, None, o2, False) == s
    assert p.k_sp == -1
    assert (p.q, p.k, p.o) == (q2.data_ptr(), kv2.data_ptr(), o2.data_ptr())
    write_rows(p, None, q2, kv2, None, o2, False)  # ... and is rewritten when they differ
    assert p.k_sp == kv.stride(0)


def test_errors_name_the_callers_arguments():
    q = torch.randn(2, 4, 64, dtype=BF16)
    o = torch.empty_like(q)
    kv = torch.randn(3, 2, 1, 16, 64, dtype=BF16)
    p = DecodeParams()
    with pytest.raises(ValueError, match="paged_kv_cache"):
        write_rows(p, None, q, kv[..., ::2], None, o, False, ("q", "paged_kv_cache"))
    with pytest.raises(ValueError, match="^q"):
        write_rows(p, None, q[..., 1:], kv[..., 1:], None, o, False, ("q", "paged_kv_cache"))
    k, v = kv[:, 0], kv[:, 1]
    with pytest.raises(ValueError, match="v_cache"):
        write_rows(p, None, q, k, v.transpose(-1, -2), o, False)
    flat = torch.randn(3 * 2 * 16 * 64 + 1, dtype=BF16)
    shifted = flat[1:].view(3, 2, 16, 64)
    with pytest.raises(ValueError, match="k_cache"):
        write_rows(p, None, q, shifted, v, o, False)
