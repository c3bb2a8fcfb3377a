"""Every bad input of the paged decode API is refused on the host, before any kernel runs.

Contract (SPEC "Errors", §3, seed 003 and issue 4 item 7): anything outside the
contract raises ``ValueError`` (``TypeError`` for a wrong Python type) whose message
names the argument. On CPU the "kernel" of ``prims_ts::batch_decode(_out)`` is
``prims_ts.reference.batch_decode``; every error case below runs with it replaced
by a function that fails the test if it is ever reached, so an error raised *after*
the launch does not count.

The standalone ``prims_ts_batch_decode_with_kv_cache`` trusts metadata *values*
(no device-to-host synchronisation); only shapes, dtypes, devices, the workspace
and scalars are checked — ``test_standalone_trusts_metadata_values`` checks that
invalid values reach the op untouched and unread. Its static checks are cached per
static key (shapes, dtypes, strides, devices and scalars); overlaps and the scales are
checked on every call (``test_standalone_static_key_cache_*``). Every test here starts
from an empty cache, so that each error case is refused by its own check.

``BatchDecodePagedTSWrapper.plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
num_qo_heads, num_kv_heads, head_dim, page_size, *, seq_len_q, qo_indptr, max_seq_len_q,
q_data_type, kv_data_type, o_data_type, mask_type, window_left, max_kv_len)`` reads and
validates the metadata values; ``run(q, paged_kv_cache, *, bmm1_scale, bmm2_scale, out)``
checks the query, the cache, the scales and ``out`` against the plan. The one-shot
``batch_decode_with_paged_kv_cache`` (the wrapper's plan + run) also checks every page ID
against the cache.

Devices: this file runs on a CPU-only machine, so "another device" is 'meta'.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import (
    BatchDecodePagedTSWrapper,
    batch_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_workspace_size,
    prims_ts_batch_decode_with_kv_cache,
)
import prims_ts
import prims_ts.ops._validate as V
import prims_ts.ops.decode as decode_ops
from prims_ts.ops._validate import dtype_code
from prims_ts.testing import huge_page_stride, recording_no_host_reads, reference_must_not_run

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, U8 = torch.int32, torch.uint8
NAN = float("nan")
D = 128
HQ, HKV = 4, 2
PS = 16
P = 8
B = 2
INDPTR = [0, 2, 3]  # request 0 owns 2 pages, request 1 one page
INDICES = [3, 1, 5]
LENS = [20, 5]
MAX_LEN = 32  # = 2 pages: the static bound
QO = [0, 3, 5]  # packed: q lens 3, 2 (<= LENS, so causal is valid too)
BOUND = 2_147_483_520

DROP = object()  # base(key=DROP): leave the keyword out (use the function's default)


def _rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def ip(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


def make_q(b=B, hq=HQ, d=D, dtype=BF16, sq=None):
    shape = (b, hq, d) if sq is None else (b, sq, hq, d)
    return _rand(*shape, dtype=dtype, seed=1)


def make_cache(p=P, hkv=HKV, ps=PS, d=D, dtype=BF16, two=2, seed=2):
    return _rand(p, two, hkv, ps, d, dtype=dtype, seed=seed)


def make_pool(p=P, hkv=HKV, ps=PS, d=D, dtype=BF16, seed=3):
    return _rand(p, hkv, ps, d, dtype=dtype, seed=seed)


def ws_bytes(batch=B, hq=HQ, hkv=HKV, d=D, max_seq_len=MAX_LEN, max_seq_len_q=1, page_size=PS):
    """The workspace size for a query bound of max_seq_len_q (asked in the fixed multi-token form:
    the size depends on the bound, not on how the queries are laid out)."""
    return get_prims_ts_batch_decode_workspace_size(batch, hq, hkv, d, page_size, max_seq_len,
                                                    seq_len_q=max_seq_len_q, device="cpu")


@pytest.fixture(autouse=True)
def fresh_static_checks(monkeypatch):
    """An empty standalone check cache for each test (see the module docstring)."""
    monkeypatch.setattr(decode_ops, "_CHECKED", V.memo())


def make_ws(nbytes=None, dtype=U8):
    n = ws_bytes() if nbytes is None else nbytes
    return torch.zeros(n, dtype=U8).view(dtype) if dtype != U8 else torch.zeros(n, dtype=U8)


def expect(exc, match, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``match`` and never reaches the kernel."""
    with reference_must_not_run("batch_decode"):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


_q = make_q()
_q4 = make_q(sq=3)
_qp = _rand(QO[-1], HQ, D, dtype=BF16, seed=4)
_kv = make_cache()
_k = make_pool(seed=5)
_v = make_pool(seed=6)

ARG_NAMES = ("query", "kv_cache", "workspace_buffer", "paged_kv_indptr", "paged_kv_indices", "seq_lens",
             "max_seq_len")
META = ("paged_kv_indptr", "paged_kv_indices", "seq_lens", "qo_indptr")


def base(**mods):
    """Valid standalone arguments with modifications applied: (args, kwargs)."""
    args = dict(query=_q, kv_cache=_kv, workspace_buffer=make_ws(), paged_kv_indptr=ip(INDPTR),
                paged_kv_indices=ip(INDICES), seq_lens=ip(LENS), max_seq_len=MAX_LEN)
    kwargs = {}
    for key, val in mods.items():
        if isinstance(val, list) and key in META:
            val = ip(val)
        (args if key in args else kwargs)[key] = val
    kwargs = {key: val for key, val in kwargs.items() if val is not DROP}
    return tuple(args.values()), kwargs


def packed(**mods):
    """Valid packed-Q arguments (q lens 3 and 2, max_seq_len_q 3) with modifications."""
    kw = dict(query=_qp, qo_indptr=ip(QO), max_seq_len_q=3,
              workspace_buffer=make_ws(ws_bytes(max_seq_len_q=3)))
    kw.update(mods)
    return base(**kw)


def fixed(sq=3, **mods):
    kw = dict(query=make_q(sq=sq), seq_len_q=sq, workspace_buffer=make_ws(ws_bytes(max_seq_len_q=sq)))
    kw.update(mods)
    return base(**kw)


def _noncontig_inner(t):
    """Same shape and values as t, last dimension with stride 2."""
    base_ = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    view = base_[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


def _out_sharing(name, values=None):
    """(metadata tensor holding the base values, out sharing bytes with it): out is 16-byte aligned
    (so that only the overlap is wrong); its last 4 bytes are the metadata's first."""
    if values is None:
        values = {"paged_kv_indptr": INDPTR, "paged_kv_indices": INDICES, "seq_lens": LENS, "qo_indptr": QO}[name]
    shape = _qp.shape if name == "qo_indptr" else _q.shape
    n = math.prod(shape) * 2
    buf = torch.zeros(n + 256, dtype=U8)
    out = buf[:n].view(BF16).view(shape)
    meta = buf[n - 4:n - 4 + len(values) * 4].view(I32)
    meta.copy_(ip(values))
    assert out.data_ptr() % 16 == 0
    return meta, out


def _out_overlaps(name):
    meta, out = _out_sharing(name)
    if name == "qo_indptr":
        return packed(qo_indptr=meta, out=out)
    return base(**{name: meta, "out": out})


def _out_in_workspace():
    n = ws_bytes()
    buf = torch.zeros(n + _q.numel() * 2, dtype=U8)
    ws = buf[:n]
    out = buf[n - 16:n - 16 + _q.numel() * 2].view(BF16).view(_q.shape)  # last 16 workspace bytes shared
    return base(workspace_buffer=ws, out=out)


def _ws_sharing(name):
    """A workspace buffer (big enough) whose bytes overlap the named input."""
    if name == "query":
        return base(workspace_buffer=_q.view(-1).view(U8))
    if name == "kv_cache":
        return base(workspace_buffer=_kv.view(-1).view(U8)[:4096])
    meta, _ = _out_sharing(name)
    buf = meta.untyped_storage()
    ws = torch.empty(0, dtype=U8).set_(buf, 0, (buf.nbytes(),))
    assert ws.numel() >= ws_bytes()
    return base(**{name: meta, "workspace_buffer": ws})


# ----------------------------------------------------------------------------
# Sanity: the base inputs (and some unusual but valid ones) are accepted.
# ----------------------------------------------------------------------------


def test_base_inputs_are_valid():
    args, kw = base()
    assert prims_ts_batch_decode_with_kv_cache(*args, **kw).shape == _q.shape
    args, kw = base(kv_cache=(_k, _v), mask_type="causal", window_left=0)
    out = torch.empty(_q.shape, dtype=FP32)
    assert prims_ts_batch_decode_with_kv_cache(*args, out=out, **kw) is out
    args, kw = packed(mask_type="causal")
    assert prims_ts_batch_decode_with_kv_cache(*args, **kw).shape == _qp.shape
    args, kw = fixed(sq=3, max_seq_len_q=3)  # an explicit max_seq_len_q equal to the fixed SQ
    assert prims_ts_batch_decode_with_kv_cache(*args, **kw).shape == (B, 3, HQ, D)
    # int8 workspace, a 2-D contiguous workspace, a larger one
    for ws in (make_ws(dtype=torch.int8), torch.zeros(2, ws_bytes(), dtype=U8), make_ws(10 * ws_bytes())):
        args, kw = base(workspace_buffer=ws)
        prims_ts_batch_decode_with_kv_cache(*args, **kw)
    # max_seq_len at the representable bound (with a workspace sized for it)
    args, kw = base(max_seq_len=BOUND, workspace_buffer=make_ws(ws_bytes(max_seq_len=BOUND)))
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    # out.dtype decides the output dtype when out_dtype is not given
    args, kw = base()
    assert prims_ts_batch_decode_with_kv_cache(*args, out=torch.empty(_q.shape, dtype=FP16), **kw).dtype == FP16


ONESHOT = []  # filled below: (id, exc, match, make)


def case(name, exc, match, make):
    ONESHOT.append((name, exc, match, make))


# --- mask, window, layout
case("window_without_causal", ValueError, "window_left", lambda: base(window_left=4))
case("window_zero_without_causal", ValueError, "window_left", lambda: base(window_left=0))
case("window_minus_2", ValueError, "window_left", lambda: base(mask_type="causal", window_left=-2))
case("window_minus_100", ValueError, "window_left", lambda: base(mask_type="causal", window_left=-100))
case("window_float", TypeError, "window_left", lambda: base(mask_type="causal", window_left=2.0))
case("mask_variable_window", ValueError, "mask_type", lambda: base(mask_type="variable_window"))
case("mask_unknown", ValueError, "mask_type", lambda: base(mask_type="full"))
case("mask_none", TypeError, "mask_type", lambda: base(mask_type=None))
case("kv_layout_NHD", ValueError, "kv_layout", lambda: base(kv_layout="NHD"))
case("kv_layout_lower", ValueError, "kv_layout", lambda: base(kv_layout="hnd"))
case("kv_layout_none", TypeError, "kv_layout", lambda: base(kv_layout=None))
# --- dtype mixes
case("query_fp16_cache_bf16", ValueError, "query|kv_cache", lambda: base(query=_q.half()))
case("query_bf16_cache_fp16", ValueError, "query|kv_cache", lambda: base(kv_cache=_kv.half()))
case("tuple_k_bf16_v_fp16", ValueError, "kv_cache", lambda: base(kv_cache=(_k, _v.half())))
case("tuple_k_fp16_v_bf16", ValueError, "kv_cache", lambda: base(query=_q.half(), kv_cache=(_k.half(), _v)))
case("all_float32", ValueError, "query|kv_cache", lambda: base(query=_q.float(), kv_cache=_kv.float()))
case("cache_int8", ValueError, "kv_cache", lambda: base(kv_cache=_kv.to(torch.int8)))
# --- Q mode: packed needs max_seq_len_q; seq_len_q must agree with the query's shape
case("packed_without_max_seq_len_q", ValueError, "max_seq_len_q", lambda: packed(max_seq_len_q=DROP))
case("packed_max_seq_len_q_none", ValueError, "max_seq_len_q", lambda: packed(max_seq_len_q=None))
case("packed_max_seq_len_q_zero", ValueError, "max_seq_len_q", lambda: packed(max_seq_len_q=0))
case("packed_max_seq_len_q_float", TypeError, "max_seq_len_q", lambda: packed(max_seq_len_q=3.0))
case("packed_seq_len_q_2", ValueError, "seq_len_q", lambda: packed(seq_len_q=2))
case("packed_query_rank4", ValueError, "query", lambda: packed(query=_qp.unsqueeze(0)))
case("packed_qo_int64", ValueError, "qo_indptr", lambda: packed(qo_indptr=ip(QO, torch.int64)))
case("packed_qo_rank2", ValueError, "qo_indptr", lambda: packed(qo_indptr=[QO]))
case("packed_qo_single_entry", ValueError, "qo_indptr", lambda: packed(qo_indptr=[0]))
case("packed_qo_vs_indptr_length", ValueError, "qo_indptr|paged_kv_indptr", lambda: packed(qo_indptr=[0, 1, 3, 5]))
case("packed_qo_meta", ValueError, "qo_indptr", lambda: packed(qo_indptr=ip(QO).to("meta")))
case("packed_qo_list", TypeError, "qo_indptr", lambda: packed(qo_indptr=tuple(QO)))
case("fixed3d_seq_len_q_2", ValueError, "seq_len_q|query", lambda: base(seq_len_q=2))
case("fixed4d_wrong_sq", ValueError, "seq_len_q|query", lambda: fixed(sq=3, query=make_q(sq=2)))
case("fixed4d_seq_len_q_default", ValueError, "seq_len_q|query", lambda: base(query=_q4))
case("fixed4d_sq1_seq_len_q_1", ValueError, "seq_len_q|query", lambda: base(query=make_q(sq=1)))
case("seq_len_q_zero", ValueError, "seq_len_q", lambda: base(seq_len_q=0))
case("seq_len_q_float", TypeError, "seq_len_q", lambda: fixed(sq=3, seq_len_q=3.0))
case("seq_len_q_none", TypeError, "seq_len_q", lambda: base(seq_len_q=None))
case("fixed3d_max_seq_len_q_2", ValueError, "max_seq_len_q", lambda: base(max_seq_len_q=2))
case("fixed4d_max_seq_len_q_4", ValueError, "max_seq_len_q", lambda: fixed(sq=3, max_seq_len_q=4))
case("fixed4d_max_seq_len_q_2", ValueError, "max_seq_len_q", lambda: fixed(sq=3, max_seq_len_q=2))
# --- workspace
case("ws_float32", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros((ws_bytes() + 3) // 4, dtype=FP32)))
case("ws_int32", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros((ws_bytes() + 3) // 4, dtype=I32)))
case("ws_bf16", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros(ws_bytes(), dtype=BF16)))
case("ws_noncontig", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros(2 * ws_bytes(), dtype=U8)[::2]))
case("ws_noncontig_2d", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros(ws_bytes(), 2, dtype=U8).t()))
case("ws_misaligned", ValueError, "workspace_buffer.*16-byte",
     lambda: base(workspace_buffer=torch.zeros(ws_bytes() + 64, dtype=U8)[8:]))  # partials are read in 16-byte vectors
case("ws_meta", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros(ws_bytes(), dtype=U8, device="meta")))
case("ws_one_byte_short", ValueError, "workspace_buffer", lambda: base(workspace_buffer=make_ws(ws_bytes() - 1)))
case("ws_empty", ValueError, "workspace_buffer", lambda: base(workspace_buffer=make_ws(0)))
case("ws_sized_for_smaller_max_seq_len", ValueError, "workspace_buffer",
     # a split-KV key: the size for max_seq_len 4096 exceeds the minimum; sized for 32 it is too small
     lambda: base(max_seq_len=4096, workspace_buffer=make_ws(ws_bytes())))
case("ws_split_key_one_byte_short", ValueError, "workspace_buffer",
     lambda: base(max_seq_len=4096, workspace_buffer=make_ws(ws_bytes(max_seq_len=4096) - 1)))
case("ws_sized_for_smaller_max_seq_len_q", ValueError, "workspace_buffer",
     lambda: packed(max_seq_len_q=3, max_seq_len=4096,
                    workspace_buffer=make_ws(ws_bytes(max_seq_len=4096, max_seq_len_q=1))))
case("ws_not_tensor", TypeError, "workspace_buffer", lambda: base(workspace_buffer=bytearray(4096)))
case("ws_none", TypeError, "workspace_buffer", lambda: base(workspace_buffer=None))
# --- max_seq_len
case("max_seq_len_0", ValueError, "max_seq_len", lambda: base(max_seq_len=0))
case("max_seq_len_negative", ValueError, "max_seq_len", lambda: base(max_seq_len=-1))
case("max_seq_len_bound_plus_1", ValueError, "max_seq_len", lambda: base(max_seq_len=BOUND + 1))
case("max_seq_len_2_31", ValueError, "max_seq_len", lambda: base(max_seq_len=2**31))
case("max_seq_len_2_40", ValueError, "max_seq_len", lambda: base(max_seq_len=2**40))
case("max_seq_len_float", TypeError, "max_seq_len", lambda: base(max_seq_len=32.0))
case("max_seq_len_str", TypeError, "max_seq_len", lambda: base(max_seq_len="32"))
case("max_seq_len_bool", TypeError, "max_seq_len", lambda: base(max_seq_len=True))
case("max_seq_len_none", TypeError, "max_seq_len", lambda: base(max_seq_len=None))
case("max_seq_len_tensor", TypeError, "max_seq_len", lambda: base(max_seq_len=torch.tensor(32)))
# --- out overlapping an input, a metadata tensor or the workspace
case("out_is_query", ValueError, r"\bout\b.*query", lambda: base(out=_q))
_q3 = make_q(b=B + 1)
case("out_in_query", ValueError, r"\bout\b.*query", lambda: base(query=_q3[:B], out=_q3[1:B + 1]))
case("out_in_combined_cache", ValueError, r"\bout\b.*kv_cache",
     lambda: base(out=_kv.view(-1)[: _q.numel()].view(_q.shape)))
case("out_tail_of_combined_cache", ValueError, r"\bout\b.*kv_cache",
     lambda: base(out=_kv.view(-1)[-_q.numel():].view(_q.shape)))
case("out_in_tuple_k", ValueError, r"\bout\b.*kv_cache",
     lambda: base(kv_cache=(_k, _v), out=_k.view(-1)[128:128 + _q.numel()].view(_q.shape)))
case("out_in_tuple_v", ValueError, r"\bout\b.*kv_cache",
     lambda: base(kv_cache=(_k, _v), out=_v.view(-1)[-_q.numel():].view(_q.shape)))
case("out_overlaps_paged_kv_indptr", ValueError, r"\bout\b.*paged_kv_indptr",
     lambda: _out_overlaps("paged_kv_indptr"))
case("out_overlaps_paged_kv_indices", ValueError, r"\bout\b.*paged_kv_indices",
     lambda: _out_overlaps("paged_kv_indices"))
case("out_overlaps_seq_lens", ValueError, r"\bout\b.*seq_lens", lambda: _out_overlaps("seq_lens"))
case("out_overlaps_qo_indptr", ValueError, r"\bout\b.*qo_indptr", lambda: _out_overlaps("qo_indptr"))
case("out_overlaps_workspace", ValueError, r"\bout\b|workspace_buffer", lambda: _out_in_workspace())
# --- out: shape, dtype, device, layout
case("out_wrong_shape", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, HQ, D + 128, dtype=BF16)))
case("out_fixed4d_for_3d_query", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, 1, HQ, D, dtype=BF16)))
case("out_dtype_disagrees", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=BF16),
                                                                   out_dtype=FP32))
case("out_float64", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=torch.float64)))
case("out_noncontig", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, D, HQ, dtype=BF16).transpose(1, 2)))
case("out_meta", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=BF16, device="meta")))
case("out_not_tensor", TypeError, r"\bout\b", lambda: base(out=0))
case("out_dtype_float64", ValueError, "out_dtype", lambda: base(out_dtype=torch.float64))
case("out_dtype_int32", ValueError, "out_dtype", lambda: base(out_dtype=I32))
case("out_dtype_str", TypeError, "out_dtype", lambda: base(out_dtype="float32"))
# --- cache forms, page size, head dim, heads
case("combined_dim1_3", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(two=3)))
case("combined_dim1_1", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(two=1)))
case("combined_rank4", ValueError, "kv_cache", lambda: base(kv_cache=_k))
case("combined_rank6", ValueError, "kv_cache", lambda: base(kv_cache=_kv.unsqueeze(0)))
case("tuple_of_3", ValueError, "kv_cache", lambda: base(kv_cache=(_k, _v, _v)))
case("tuple_of_1", ValueError, "kv_cache", lambda: base(kv_cache=(_k,)))
case("tuple_shapes_differ", ValueError, "kv_cache", lambda: base(kv_cache=(_k, _v[:P - 1])))
case("tuple_rank5", ValueError, "kv_cache", lambda: base(kv_cache=(_kv, _kv)))
case("tuple_of_lists", TypeError, "kv_cache", lambda: base(kv_cache=(_k.tolist(), _v)))
case("cache_not_tensor", TypeError, "kv_cache", lambda: base(kv_cache=None))
case("cache_inner_noncontig", ValueError, "kv_cache", lambda: base(kv_cache=_noncontig_inner(_kv)))
case("page_size_8", ValueError, "page size|kv_cache", lambda: base(kv_cache=make_cache(ps=8)))
case("page_size_8_tuple", ValueError, "page size|kv_cache",
     lambda: base(kv_cache=(make_pool(ps=8), make_pool(ps=8, seed=4))))
case("page_size_256", ValueError, "page size|kv_cache", lambda: base(kv_cache=make_cache(p=2, ps=256)))
case("page_size_48", ValueError, "page size|kv_cache", lambda: base(kv_cache=make_cache(ps=48)))
case("head_dim_96", ValueError, "query|head dim",
     lambda: base(query=make_q(d=96), kv_cache=make_cache(d=96)))
case("head_dim_32", ValueError, "query|head dim",
     lambda: base(query=make_q(d=32), kv_cache=make_cache(d=32)))
case("head_dim_512", ValueError, "query|head dim",
     lambda: base(query=make_q(d=512), kv_cache=make_cache(p=2, d=512)))
case("head_dim_query_vs_cache", ValueError, "kv_cache|query", lambda: base(kv_cache=make_cache(d=64)))
case("hq_not_multiple_of_hkv", ValueError, "query|kv_cache|heads", lambda: base(query=make_q(hq=3)))
case("hkv_gt_hq", ValueError, "query|kv_cache|heads", lambda: base(query=make_q(hq=1)))
case("hq_6_hkv_4", ValueError, "query|kv_cache|heads",
     lambda: base(query=make_q(hq=6), kv_cache=make_cache(hkv=4)))
# --- query: type, rank, layout
case("query_not_tensor", TypeError, "query", lambda: base(query=_q.tolist()))
case("query_rank2", ValueError, "query", lambda: base(query=_q[:, 0]))
case("query_rank5", ValueError, "query", lambda: base(query=_q4.unsqueeze(0), seq_len_q=3))
case("query_inner_noncontig", ValueError, "query", lambda: base(query=_noncontig_inner(_q)))
case("query_empty_batch", ValueError, "query", lambda: base(query=_q[:0], paged_kv_indptr=ip([0])))
case("query_misaligned", ValueError, "query",
     lambda: base(query=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape)))
case("query_batch_vs_indptr", ValueError, "paged_kv_indptr|query", lambda: base(query=make_q(b=3)))
# --- metadata dtypes and shapes
case("indptr_int64", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=ip(INDPTR, torch.int64)))
case("indptr_uint32", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=ip(INDPTR).view(torch.uint32)))
case("indptr_float", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=ip(INDPTR, FP32)))
case("indptr_length_B", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 3]))
case("indptr_length_B_plus_2", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 1, 2, 3]))
case("indptr_rank2", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[INDPTR]))
case("indptr_noncontig", ValueError, "paged_kv_indptr",
     lambda: base(paged_kv_indptr=ip([0, 9, 2, 9, 3, 9])[::2]))
case("indptr_list", TypeError, "paged_kv_indptr", lambda: base(paged_kv_indptr=tuple(INDPTR)))
case("indptr_meta", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=ip(INDPTR).to("meta")))
case("indices_int64", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=ip(INDICES, torch.int64)))
case("indices_rank2", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=[INDICES]))
case("indices_meta", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=ip(INDICES).to("meta")))
case("indices_tuple", TypeError, "paged_kv_indices", lambda: base(paged_kv_indices=tuple(INDICES)))
case("seq_lens_int64", ValueError, "seq_lens", lambda: base(seq_lens=ip(LENS, torch.int64)))
case("seq_lens_length_B_plus_1", ValueError, "seq_lens", lambda: base(seq_lens=LENS + [5]))
case("seq_lens_length_B_minus_1", ValueError, "seq_lens", lambda: base(seq_lens=LENS[:1]))
case("seq_lens_rank2", ValueError, "seq_lens", lambda: base(seq_lens=[LENS]))
case("seq_lens_noncontig", ValueError, "seq_lens", lambda: base(seq_lens=ip([20, 9, 5, 9])[::2]))
case("seq_lens_meta", ValueError, "seq_lens", lambda: base(seq_lens=ip(LENS).to("meta")))
case("query_meta", ValueError, "query|kv_cache", lambda: base(query=_q.to("meta")))
case("cache_meta", ValueError, "kv_cache", lambda: base(kv_cache=_kv.to("meta")))
case("combined_page_stride_beyond_int32", ValueError, "kv_cache: page stride",
     lambda: base(kv_cache=_kv.as_strided((1,) + tuple(_kv.shape[1:]), (2**31,) + _kv.stride()[1:])))
case("tuple_k_page_stride_beyond_int32", ValueError, r"kv_cache\[0\]: page stride",
     lambda: base(kv_cache=(huge_page_stride(_k), huge_page_stride(_v))))
# --- scales
case("bmm1_scale_zero", ValueError, "bmm1_scale", lambda: base(bmm1_scale=0.0))
case("bmm1_scale_nan", ValueError, "bmm1_scale", lambda: base(bmm1_scale=math.nan))
case("bmm1_scale_inf", ValueError, "bmm1_scale", lambda: base(bmm1_scale=math.inf))
case("bmm1_scale_negative", ValueError, "bmm1_scale", lambda: base(bmm1_scale=-0.1))
case("bmm1_scale_str", TypeError, "bmm1_scale", lambda: base(bmm1_scale="0.1"))
case("bmm1_scale_tensor", TypeError, "bmm1_scale", lambda: base(bmm1_scale=torch.tensor(0.1)))
case("bmm2_scale_negative", ValueError, "bmm2_scale", lambda: base(bmm2_scale=-1.0))
case("bmm2_scale_zero", ValueError, "bmm2_scale", lambda: base(bmm2_scale=0.0))
case("bmm2_scale_nan", ValueError, "bmm2_scale", lambda: base(bmm2_scale=math.nan))
case("bmm2_scale_inf", ValueError, "bmm2_scale", lambda: base(bmm2_scale=-math.inf))
case("bmm2_scale_none", TypeError, "bmm2_scale", lambda: base(bmm2_scale=None))
case("bmm2_scale_str", TypeError, "bmm2_scale", lambda: base(bmm2_scale="1"))


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in ONESHOT], ids=[c[0] for c in ONESHOT])
def test_standalone_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, prims_ts_batch_decode_with_kv_cache, *args, **kwargs)


# The workspace must not overlap the query, the cache or a metadata tensor (seed 003), on any device.
@pytest.mark.parametrize("name", ["query", "kv_cache", "paged_kv_indptr", "paged_kv_indices", "seq_lens"])
def test_standalone_workspace_overlapping_an_input(name):
    args, kwargs = _ws_sharing(name)
    expect(ValueError, f"workspace_buffer.*{name}", prims_ts_batch_decode_with_kv_cache, *args, **kwargs)


def test_error_leaves_out_and_workspace_untouched():
    """A refused call writes nothing: the poisoned out is still all NaN, the workspace unchanged."""
    for mods in (dict(window_left=3), dict(max_seq_len=0), dict(kv_layout="NHD"), dict(bmm1_scale=0.0),
                 dict(seq_lens=LENS + [1])):
        out = torch.full(_q.shape, float("nan"), dtype=BF16)
        ws = torch.full((ws_bytes(),), 0xA5, dtype=U8)
        args, kw = base(out=out, workspace_buffer=ws, **mods)
        expect((ValueError, TypeError), ".", prims_ts_batch_decode_with_kv_cache, *args, **kw)
        assert torch.isnan(out).all(), mods
        assert (ws == 0xA5).all(), mods


# ----------------------------------------------------------------------------
# The standalone trusts metadata values: it neither reads nor validates them
# ----------------------------------------------------------------------------


INVALID_VALUES = [
    # seq_lens of 0 and beyond max_seq_len, indptr not monotone / not starting at 0 / past indices.numel(),
    # page IDs outside the cache, negative page IDs
    dict(seq_lens=[0, 0], paged_kv_indptr=[5, 1, 99], paged_kv_indices=[-1, 10**6, P]),
    dict(seq_lens=[-7, MAX_LEN + 1000], paged_kv_indptr=[0, 0, 0], paged_kv_indices=[2**31 - 1, -2**31, 0]),
]


@pytest.mark.parametrize("mode", ["fixed1", "fixed3", "packed"])
@pytest.mark.parametrize("which", [0, 1])
def test_standalone_trusts_metadata_values(mode, which):
    """Invalid metadata values (the caller's obligations per seed 003) raise nothing on the host: they
    reach the op as the very same tensors, and no tensor value is read on the host on the way. The
    functional op gets the output dtype as its code and both ops the default tuning ("")."""
    mods = dict(INVALID_VALUES[which])
    if mode == "packed":
        mods["qo_indptr"] = [3, 1, 0]  # not starting at 0, decreasing, not ending at total_q
        args, kw = packed(mask_type="causal", **mods)
    elif mode == "fixed3":
        args, kw = fixed(sq=3, mask_type="causal", **mods)
    else:
        args, kw = base(mask_type="causal", window_left=1, **mods)
    out = torch.empty(args[0].shape, dtype=FP32)
    with recording_no_host_reads("batch_decode", "batch_decode") as rec:
        res = prims_ts_batch_decode_with_kv_cache(*args, **kw)
        res_out = prims_ts_batch_decode_with_kv_cache(*args, out=out, **kw)
        res16 = prims_ts_batch_decode_with_kv_cache(*args, out_dtype=FP16, **kw)
    assert res.shape == args[0].shape and res.dtype == args[0].dtype
    assert res_out is out
    assert res16.dtype == FP16
    assert [c[0] for c in rec.calls] == ["batch_decode", "batch_decode_out", "batch_decode"]
    for _, call in rec.calls:
        names = {id(call[i]) for i in range(len(call)) if isinstance(call[i], torch.Tensor)}
        for meta in (args[3], args[4], args[5]) + ((kw["qo_indptr"],) if "qo_indptr" in kw else ()):
            assert id(meta) in names, "a metadata tensor was copied or replaced before the op"
        assert call[-1] == "", "the standalone runs the default tuning"
    (_, functional), (_, with_out), (_, functional16) = rec.calls
    assert functional[-2] == dtype_code(args[0].dtype) and functional16[-2] == dtype_code(FP16)
    assert with_out[4] is out


def test_standalone_does_not_modify_metadata():
    args, kw = packed(mask_type="causal")
    before = [t.clone() for t in args[3:6]] + [kw["qo_indptr"].clone()]
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    for a, b in zip(before, list(args[3:6]) + [kw["qo_indptr"]]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------
# The standalone's static checks are cached per static key; per-call facts are not
# ----------------------------------------------------------------------------


@pytest.fixture
def counted_static_checks(monkeypatch):
    """Counts the standalone's static-check passes (the cache misses)."""
    calls = []
    real = decode_ops._standalone_checks

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(decode_ops, "_standalone_checks", counting)
    return calls


def test_standalone_static_key_cache_still_checks_per_call_inputs(counted_static_checks):
    """A second call with the same static key skips the static checks, yet every per-call input that
    is not part of the key is still refused: an out (of the cached layout) whose bytes are the query's,
    the cache's, a metadata tensor's or the workspace's, a workspace (of the cached size) inside the
    cache, and non-positive or non-finite scales. A refused call leaves the poisoned out untouched."""
    out = torch.full(_q.shape, NAN, dtype=BF16)
    args, kw = base(out=out)
    assert prims_ts_batch_decode_with_kv_cache(*args, **kw) is out
    assert not torch.isnan(out).any()
    assert len(counted_static_checks) == 1
    args, kw = base(out=out)  # new tensors, the same static facts
    assert prims_ts_batch_decode_with_kv_cache(*args, **kw) is out
    assert len(counted_static_checks) == 1  # the same static key: no second check pass
    in_ws = torch.zeros(ws_bytes() + _q.numel() * 2, dtype=U8)
    meta, out_in_meta = _out_sharing("paged_kv_indices")
    per_call = [
        (r"\bout\b.*query", base(out=_q)),
        (r"\bout\b.*kv_cache", base(out=_kv.view(-1)[:_q.numel()].view(_q.shape))),
        (r"\bout\b.*paged_kv_indices", base(paged_kv_indices=meta, out=out_in_meta)),
        (r"\bout\b|workspace_buffer",
         base(workspace_buffer=in_ws[:ws_bytes()], out=in_ws[ws_bytes() - 16:][:_q.numel() * 2].view(BF16)
              .view(_q.shape))),
        ("workspace_buffer.*kv_cache", base(workspace_buffer=_kv.view(-1).view(U8)[:ws_bytes()], out=out)),
        ("bmm1_scale", base(bmm1_scale=0.0, out=out)),
        ("bmm1_scale", base(bmm1_scale=-0.5, out=out)),
        ("bmm1_scale", base(bmm1_scale=math.nan, out=out)),
        ("bmm2_scale", base(bmm2_scale=math.inf, out=out)),
        ("bmm2_scale", base(bmm2_scale=0.0, out=out)),
    ]
    for match, (a, k) in per_call:
        out.fill_(NAN)
        assert V.meta(k["out"]) == V.meta(out)  # the cached static key
        expect(ValueError, match, prims_ts_batch_decode_with_kv_cache, *a, **k)
        assert torch.isnan(out).all(), match
    args, kw = base(bmm1_scale="0.1", out=out)
    expect(TypeError, "bmm1_scale", prims_ts_batch_decode_with_kv_cache, *args, **kw)
    assert len(counted_static_checks) == 1, "a per-call refusal re-ran the static checks"


def test_standalone_overlap_check_runs_once_per_operand_addresses(counted_static_checks, monkeypatch):
    """The overlap check of a call whose operands start where a passing call's did (same key, so
    same extents) is that call's; any moved operand is checked again, and refused if it overlaps."""
    seen = []
    real = V.disjoint
    monkeypatch.setattr(V, "disjoint", lambda *a: (seen.append(1), real(*a)))
    out = torch.empty(_q.shape, dtype=BF16)
    args, kw = base(out=out)
    for _ in range(3):
        prims_ts_batch_decode_with_kv_cache(*args, **kw)
    assert len(seen) == 1
    args2, kw2 = base(out=torch.empty(_q.shape, dtype=BF16))  # another out address
    prims_ts_batch_decode_with_kv_cache(*args2, **kw2)
    assert len(seen) == 2
    prims_ts_batch_decode_with_kv_cache(*args, **kw)  # the first addresses again: checked again
    assert len(seen) == 3
    a, k = base(out=_q)  # out on the query's bytes, right after a passing call
    expect(ValueError, r"\bout\b.*query", prims_ts_batch_decode_with_kv_cache, *a, **k)
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    assert len(seen) == 4 and len(counted_static_checks) == 1  # the passing addresses: not checked again


def test_standalone_indices_length_is_not_in_the_static_key(counted_static_checks, monkeypatch):
    """A serving loop slices ``paged_kv_indices`` to each step's page count: a call whose indices
    have another length keeps the static key (no second check pass), and its overlap check uses
    that call's length: the same start with a longer tensor reaching into the workspace (or an
    ``out`` inside the longer range) is refused."""
    store = torch.zeros(64 + ws_bytes(), dtype=U8)
    ws = store[64:]
    short = store[:4 * len(INDICES)].view(torch.int32)
    short.copy_(ip(INDICES))
    out = torch.empty(_q.shape, dtype=BF16)
    longer = torch.tensor(INDICES + [0] * 9, dtype=torch.int32)  # 12 entries: another length
    args, kw = base(paged_kv_indices=longer, out=out)
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    indptr, lens = ip(INDPTR), ip(LENS)
    args, kw = base(paged_kv_indices=short, workspace_buffer=ws, paged_kv_indptr=indptr, seq_lens=lens, out=out)
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    assert len(counted_static_checks) == 1
    # every operand where the last passing call had it, the indices longer: 80 bytes, into the workspace
    seen = []
    real = V.disjoint
    monkeypatch.setattr(V, "disjoint", lambda *a: (seen.append(a[3]), real(*a)))
    reaching = store[:4 * 20].view(torch.int32)
    args, kw = base(paged_kv_indices=reaching, workspace_buffer=ws, paged_kv_indptr=indptr, seq_lens=lens, out=out)
    expect(ValueError, "workspace_buffer.*paged_kv_indices", prims_ts_batch_decode_with_kv_cache, *args, **kw)
    assert len(seen) == 1 and 80 in seen[0]  # the standalone's own check, with this call's length
    assert len(counted_static_checks) == 1


def test_standalone_static_key_cache_rechecks_a_changed_static_fact(counted_static_checks):
    """Another dtype, shape or scalar is another static key: its static checks run (and refuse)."""
    args, kw = base()
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    assert len(counted_static_checks) == 1
    changed = [
        ("query|kv_cache", base(query=_q.half())),  # another query dtype, the cache's still bf16
        ("kv_cache|query", base(kv_cache=_kv.half())),  # another cache dtype
        ("out_dtype", base(out_dtype=torch.float64)),
        (r"\bout\b", base(out=torch.empty(_q.shape, dtype=torch.float64))),
        ("workspace_buffer", base(workspace_buffer=make_ws(ws_bytes() - 16))),  # another (too small) size
        ("workspace_buffer", base(max_seq_len=4096)),  # another bound: a split-KV key needs more workspace
        ("window_left", base(window_left=3)),
        ("paged_kv_indices", base(paged_kv_indices=ip(INDICES, torch.int64))),
    ]
    for i, (match, (a, k)) in enumerate(changed):
        expect(ValueError, match, prims_ts_batch_decode_with_kv_cache, *a, **k)
        assert len(counted_static_checks) == 2 + i, match
    # a valid new key (fp16 throughout) is checked once, then cached; the old key is still cached
    args16, kw16 = base(query=_q.half(), kv_cache=_kv.half())
    n = len(counted_static_checks)
    for _ in range(2):
        assert prims_ts_batch_decode_with_kv_cache(*args16, **kw16).dtype == FP16
    prims_ts_batch_decode_with_kv_cache(*args, **kw)
    assert len(counted_static_checks) == n + 1


# ----------------------------------------------------------------------------
# get_prims_ts_batch_decode_workspace_size(batch_size, num_qo_heads, num_kv_heads, head_dim, page_size,
#                                          max_seq_len, *, seq_len_q, qo_indptr, max_seq_len_q, ...)
# ----------------------------------------------------------------------------

WS_CASES = [
    ("batch_0", ValueError, "batch_size", dict(batch_size=0)),
    ("batch_float", TypeError, "batch_size", dict(batch_size=2.0)),
    ("hq_0", ValueError, "num_qo_heads", dict(num_qo_heads=0)),
    ("hkv_float", TypeError, "num_kv_heads", dict(num_kv_heads=2.0)),
    ("heads_not_multiple", ValueError, "num_qo_heads|num_kv_heads", dict(num_qo_heads=3)),
    ("head_dim_96", ValueError, "head_dim", dict(head_dim=96)),
    ("head_dim_str", TypeError, "head_dim", dict(head_dim="128")),
    ("page_size_8", ValueError, "page_size", dict(page_size=8)),
    ("page_size_48", ValueError, "page_size", dict(page_size=48)),
    ("page_size_str", TypeError, "page_size", dict(page_size="16")),
    # the old positional order (max_seq_len 5th) lands a length in page_size: refused, not misread
    ("old_positional_order", ValueError, "page_size", dict(page_size=MAX_LEN * 128)),
    ("max_seq_len_0", ValueError, "max_seq_len", dict(max_seq_len=0)),
    ("max_seq_len_past_bound", ValueError, "max_seq_len", dict(max_seq_len=BOUND + 1)),
    ("max_seq_len_float", TypeError, "max_seq_len", dict(max_seq_len=32.0)),
    ("max_seq_len_q_0", ValueError, "max_seq_len_q", dict(max_seq_len_q=0)),
    ("max_seq_len_q_vs_seq_len_q", ValueError, "max_seq_len_q", dict(seq_len_q=2, max_seq_len_q=3)),
    ("max_seq_len_q_without_qo", ValueError, "max_seq_len_q", dict(max_seq_len_q=3)),
    ("seq_len_q_0", ValueError, "seq_len_q", dict(seq_len_q=0)),
    ("seq_len_q_float", TypeError, "seq_len_q", dict(seq_len_q=2.0)),
    ("packed_without_max_seq_len_q", ValueError, "max_seq_len_q", dict(qo_indptr=ip(QO))),
    ("packed_seq_len_q_2", ValueError, "seq_len_q", dict(qo_indptr=ip(QO), max_seq_len_q=3, seq_len_q=2)),
    ("packed_qo_vs_batch", ValueError, "qo_indptr", dict(qo_indptr=ip([0, 1, 3, 5]), max_seq_len_q=3)),
    ("packed_qo_int64", ValueError, "qo_indptr", dict(qo_indptr=ip(QO, torch.int64), max_seq_len_q=3)),
    ("q_dtype_float32", ValueError, "q_dtype", dict(q_dtype=FP32)),
    ("q_dtype_str", TypeError, "q_dtype", dict(q_dtype="float16")),
    ("kv_dtype_vs_q_dtype", ValueError, "kv_dtype", dict(q_dtype=FP16, kv_dtype=BF16)),
    ("kv_dtype_float32", ValueError, "kv_dtype", dict(kv_dtype=FP32)),
    ("out_dtype_float64", ValueError, "out_dtype", dict(out_dtype=torch.float64)),
    ("out_dtype_str", TypeError, "out_dtype", dict(out_dtype="float32")),
    ("mask_unknown", ValueError, "mask_type", dict(mask_type="full")),
    ("window_without_causal", ValueError, "window_left", dict(window_left=3)),
    ("window_minus_2", ValueError, "window_left", dict(mask_type="causal", window_left=-2)),
    ("kv_layout_NHD", ValueError, "kv_layout", dict(kv_layout="NHD")),
    ("kv_layout_none", TypeError, "kv_layout", dict(kv_layout=None)),
    ("packed_qo_list", TypeError, "qo_indptr", dict(qo_indptr=list(QO), max_seq_len_q=3)),
]


def _params(cases):
    """(id, exc, match, make-or-mods[, marks]) rows as pytest params."""
    return [pytest.param(*c[1:4], marks=c[4] if len(c) > 4 else (), id=c[0]) for c in cases]


@pytest.mark.parametrize("exc,match,mods", _params(WS_CASES))
def test_workspace_size_errors(exc, match, mods):
    kw = dict(batch_size=B, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS, max_seq_len=MAX_LEN)
    kw.update(mods)
    with pytest.raises(exc, match=match):
        get_prims_ts_batch_decode_workspace_size(kw.pop("batch_size"), kw.pop("num_qo_heads"),
                                                 kw.pop("num_kv_heads"), kw.pop("head_dim"), kw.pop("page_size"),
                                                 kw.pop("max_seq_len"), device="cpu", **kw)


def test_workspace_size_accepts_every_query_form():
    """Single, fixed multi-token and packed forms (packed with its explicit bound); page_size is the
    5th positional argument and may be given by name."""
    one = get_prims_ts_batch_decode_workspace_size(B, HQ, HKV, D, PS, 4096, device="cpu")
    assert one == get_prims_ts_batch_decode_workspace_size(B, HQ, HKV, D, max_seq_len=4096, page_size=PS,
                                                           device="cpu")
    fixed3 = get_prims_ts_batch_decode_workspace_size(B, HQ, HKV, D, PS, 4096, seq_len_q=3, max_seq_len_q=3,
                                                      device="cpu")
    packed3 = get_prims_ts_batch_decode_workspace_size(B, HQ, HKV, D, PS, 4096, qo_indptr=ip(QO), max_seq_len_q=3,
                                                       q_dtype=BF16, kv_dtype=BF16, out_dtype=FP32,
                                                       mask_type="causal", window_left=4, device="cpu")
    assert min(one, fixed3, packed3) >= 256 and fixed3 >= one and packed3 >= one


# ----------------------------------------------------------------------------
# BatchDecodePagedTSWrapper.plan
# ----------------------------------------------------------------------------

LAST = [4, 5]  # request 0: (2 - 1) * 16 + 4 = 20 tokens; request 1: 5 tokens
HEADS = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS)


def plan_args(indptr=INDPTR, indices=INDICES, last=LAST, **kw):
    conv = [ip(x) if isinstance(x, list) else x for x in (indptr, indices, last)]
    args = dict(HEADS)
    for key in ("qo_indptr",):
        if isinstance(kw.get(key), list):
            kw[key] = ip(kw[key])
    args.update(kw)
    args = {k: v for k, v in args.items() if v is not DROP}
    return tuple(conv), args


PLAN_CASES = [
    # --- CSR page metadata
    ("indptr_not_start_0", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=[1, 2, 3])),
    ("indptr_not_strict", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=[0, 3, 3])),
    ("indptr_zero_pages_first", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=[0, 0, 3])),
    ("indptr_decreasing", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=[0, 3, 2], last=[4, 5])),
    ("indptr_end_short", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=[0, 1, 2])),
    ("indptr_end_past", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=[0, 2, 4])),
    ("indptr_int64", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=ip(INDPTR, torch.int64))),
    ("indptr_rank2", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=ip([INDPTR]))),
    ("indptr_noncontig", ValueError, "paged_kv_indptr", lambda: plan_args(indptr=ip([0, 9, 2, 9, 3, 9])[::2])),
    ("indptr_single_entry", ValueError, "paged_kv_indptr|last_page_len",
     lambda: plan_args(indptr=[0], indices=[], last=[])),
    ("indptr_list", TypeError, "paged_kv_indptr", lambda: plan_args(indptr=tuple(INDPTR))),
    ("indptr_meta", ValueError, "paged_kv_indptr|paged_kv_indices", lambda: plan_args(indptr=ip(INDPTR).to("meta"))),
    ("last_page_len_0", ValueError, "paged_kv_last_page_len", lambda: plan_args(last=[0, 5])),
    ("last_page_len_gt_page_size", ValueError, "paged_kv_last_page_len", lambda: plan_args(last=[4, PS + 1])),
    ("last_page_len_negative", ValueError, "paged_kv_last_page_len", lambda: plan_args(last=[-3, 5])),
    ("last_page_len_wrong_length", ValueError, "paged_kv_last_page_len", lambda: plan_args(last=[4, 5, 6])),
    ("last_page_len_int64", ValueError, "paged_kv_last_page_len", lambda: plan_args(last=ip(LAST, torch.int64))),
    ("last_page_len_meta", ValueError, "last_page_len|indptr", lambda: plan_args(last=ip(LAST).to("meta"))),
    ("last_page_len_list", TypeError, "paged_kv_last_page_len", lambda: plan_args(last=tuple(LAST))),
    ("page_id_negative", ValueError, "paged_kv_indices", lambda: plan_args(indices=[3, -1, 5])),
    ("page_id_min_int", ValueError, "paged_kv_indices", lambda: plan_args(indices=[3, 1, -2**31])),
    ("indices_int64", ValueError, "paged_kv_indices", lambda: plan_args(indices=ip(INDICES, torch.int64))),
    ("indices_meta", ValueError, "indices|indptr", lambda: plan_args(indices=ip(INDICES).to("meta"))),
    ("indices_tuple", TypeError, "paged_kv_indices", lambda: plan_args(indices=tuple(INDICES))),
    # --- static arguments
    ("page_size_8", ValueError, "page_size", lambda: plan_args(page_size=8)),
    ("page_size_48", ValueError, "page_size", lambda: plan_args(page_size=48)),
    ("page_size_256", ValueError, "page_size", lambda: plan_args(page_size=256)),
    ("page_size_str", TypeError, "page_size", lambda: plan_args(page_size="16")),
    ("page_size_float", TypeError, "page_size", lambda: plan_args(page_size=16.0)),
    ("q_data_type_str", TypeError, "q_data_type", lambda: plan_args(q_data_type="bfloat16")),
    ("q_data_type_none", TypeError, "q_data_type", lambda: plan_args(q_data_type=None)),
    ("q_data_type_float32", ValueError, "q_data_type", lambda: plan_args(q_data_type=FP32)),
    ("kv_data_type_vs_q_data_type", ValueError, "kv_data_type", lambda: plan_args(q_data_type=BF16,
                                                                                 kv_data_type=FP16)),
    ("kv_data_type_fp8", ValueError, "kv_data_type", lambda: plan_args(kv_data_type=torch.float8_e4m3fn)),
    ("kv_data_type_str", TypeError, "kv_data_type", lambda: plan_args(kv_data_type="float16")),
    ("o_data_type_float64", ValueError, "o_data_type", lambda: plan_args(o_data_type=torch.float64)),
    ("o_data_type_int32", ValueError, "o_data_type", lambda: plan_args(o_data_type=I32)),
    ("o_data_type_str", TypeError, "o_data_type", lambda: plan_args(o_data_type="float32")),
    ("max_kv_len_below_longest", ValueError, "max_kv_len", lambda: plan_args(max_kv_len=19)),
    ("max_kv_len_0", ValueError, "max_kv_len", lambda: plan_args(max_kv_len=0)),
    ("max_kv_len_past_bound", ValueError, "max_kv_len", lambda: plan_args(max_kv_len=BOUND + 1)),
    ("max_kv_len_float", TypeError, "max_kv_len", lambda: plan_args(max_kv_len=32.0)),
    ("num_qo_heads_zero", ValueError, "num_qo_heads", lambda: plan_args(num_qo_heads=0)),
    ("num_kv_heads_float", TypeError, "num_kv_heads", lambda: plan_args(num_kv_heads=2.0)),
    ("heads_not_multiple", ValueError, "num_qo_heads|num_kv_heads", lambda: plan_args(num_qo_heads=3)),
    ("head_dim_96", ValueError, "head_dim", lambda: plan_args(head_dim=96)),
    ("head_dim_float", TypeError, "head_dim", lambda: plan_args(head_dim=128.0)),
    ("mask_unknown", ValueError, "mask_type", lambda: plan_args(mask_type="full")),
    ("window_without_causal", ValueError, "window_left", lambda: plan_args(window_left=3)),
    ("window_minus_2", ValueError, "window_left", lambda: plan_args(mask_type="causal", window_left=-2)),
    # --- query modes: fixed multi-token (seq_len_q) and packed (qo_indptr)
    ("seq_len_q_0", ValueError, "seq_len_q", lambda: plan_args(seq_len_q=0)),
    ("seq_len_q_float", TypeError, "seq_len_q", lambda: plan_args(seq_len_q=2.0)),
    ("seq_len_q_none", TypeError, "seq_len_q", lambda: plan_args(seq_len_q=None)),
    ("max_seq_len_q_vs_seq_len_q", ValueError, "max_seq_len_q", lambda: plan_args(seq_len_q=3, max_seq_len_q=4)),
    ("max_seq_len_q_vs_default_seq_len_q", ValueError, "max_seq_len_q", lambda: plan_args(max_seq_len_q=2)),
    ("max_seq_len_q_0", ValueError, "max_seq_len_q", lambda: plan_args(max_seq_len_q=0)),
    ("max_seq_len_q_float", TypeError, "max_seq_len_q", lambda: plan_args(max_seq_len_q=1.0)),
    ("causal_fixed_q_past_len", ValueError, "causal", lambda: plan_args(seq_len_q=6, mask_type="causal")),
    ("packed_seq_len_q_2", ValueError, "seq_len_q", lambda: plan_args(qo_indptr=QO, seq_len_q=2)),
    ("packed_max_seq_len_q_below_counts", ValueError, "max_seq_len_q",
     lambda: plan_args(qo_indptr=QO, max_seq_len_q=2)),
    ("packed_qo_not_start_0", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[1, 3, 5])),
    ("packed_qo_decreasing", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 3, 2])),
    ("packed_qo_empty_request", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 3, 3])),
    ("packed_qo_wrong_length", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 1, 3, 5])),
    ("packed_qo_int64", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=ip(QO, torch.int64))),
    ("packed_qo_meta", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=ip(QO).to("meta"))),
    ("packed_qo_list", TypeError, "qo_indptr", lambda: plan_args(qo_indptr=tuple(QO))),
    ("causal_packed_q_past_len", ValueError, "causal",
     lambda: plan_args(qo_indptr=QO, last=[4, 1], mask_type="causal")),  # request 1: 2 queries, 1 key
]


@pytest.mark.parametrize("exc,match,make", _params(PLAN_CASES))
def test_wrapper_plan_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, BatchDecodePagedTSWrapper().plan, *args, **kwargs)


def test_failed_plan_keeps_the_previous_plan():
    """A refused plan changes nothing: the wrapper still runs its previous plan."""
    w, _ = planned()
    want = w.run(_q, _kv)
    args, kwargs = plan_args(max_kv_len=19, q_data_type=BF16)
    expect(ValueError, "max_kv_len", w.plan, *args, **kwargs)
    torch.testing.assert_close(w.run(_q, _kv), want, rtol=0, atol=0)


def test_wrapper_plan_accepts_edge_values():
    """last_page_len == page_size, max_kv_len == the longest request, the largest bound, explicit
    defaults, a packed bound above the largest count, kv_data_type equal to q_data_type."""
    for kw in (dict(last=[PS, PS], max_kv_len=2 * PS), dict(last=[1, 1], max_kv_len=17), dict(max_kv_len=BOUND),
               dict(max_kv_len=DROP), dict(kv_data_type=BF16, o_data_type=FP32, seq_len_q=1, max_seq_len_q=1),
               dict(mask_type="causal", window_left=0)):
        w = BatchDecodePagedTSWrapper()
        args, kwargs = plan_args(q_data_type=BF16, **kw)
        w.plan(*args, **kwargs)
        assert w.run(_q, _kv).shape == _q.shape
    for kw, q in ((dict(seq_len_q=3, max_seq_len_q=3, mask_type="causal"), _q4),
                  (dict(qo_indptr=QO, max_seq_len_q=7, mask_type="causal"), _qp),
                  (dict(qo_indptr=QO, seq_len_q=1), _qp)):
        w = BatchDecodePagedTSWrapper()
        args, kwargs = plan_args(q_data_type=BF16, **kw)
        w.plan(*args, **kwargs)
        assert w.run(q, _kv).shape == q.shape


# ----------------------------------------------------------------------------
# BatchDecodePagedTSWrapper.run(q, paged_kv_cache, *, bmm1_scale, bmm2_scale, out)
# ----------------------------------------------------------------------------


def planned(**kw):
    w = BatchDecodePagedTSWrapper()
    args, kwargs = plan_args(**kw)
    kwargs.setdefault("q_data_type", BF16)
    w.plan(*args, **kwargs)
    return w, args


def test_wrapper_run_before_plan():
    with pytest.raises(RuntimeError, match=r"^plan\(\) must be called before run\(\)$"):
        BatchDecodePagedTSWrapper().run(_q, _kv)
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        BatchDecodePagedTSWrapper(tuning=prims_ts.Tuning(cluster_merge=False)).run(_q, (_k, _v), out=_q.clone())


def test_wrapper_base_run_is_valid():
    w, _ = planned(mask_type="causal")
    out = torch.empty(_q.shape, dtype=BF16)
    assert w.run(_q, _kv, out=out) is out
    # a cache with exactly max_page + 1 pages is enough; a tuple cache works too; scales at run
    max_page = max(INDICES)
    assert w.run(_q, _kv[:max_page + 1]).shape == _q.shape
    assert w.run(_q, (_k, _v), bmm1_scale=0.05, bmm2_scale=2.0).shape == _q.shape


RUN_CASES = [
    # (id, plan kwargs, exc, match, make -> (q, cache[, out]) or (q, cache, out, run kwargs))
    ("q_other_batch", {}, ValueError, r"\bq\b", lambda: (make_q(b=3), _kv)),
    ("q_other_heads", {}, ValueError, r"\bq\b", lambda: (make_q(hq=2 * HQ), _kv)),
    ("q_other_head_dim", {}, ValueError, r"\bq\b", lambda: (make_q(d=256), make_cache(d=256))),
    ("q_rank4", {}, ValueError, r"\bq\b", lambda: (_q.unsqueeze(1), _kv)),
    ("q_fp16_vs_plan_bf16", {}, ValueError, r"\bq\b", lambda: (_q.half(), _kv.half())),
    ("q_bf16_vs_plan_fp16", dict(q_data_type=FP16), ValueError, r"\bq\b", lambda: (_q, _kv)),
    ("q_float32", {}, ValueError, r"\bq\b", lambda: (_q.float(), _kv)),
    ("q_not_tensor", {}, TypeError, r"\bq\b", lambda: (_q.tolist(), _kv)),
    ("cache_dtype_vs_q", {}, ValueError, r"query|\bq\b|cache", lambda: (_q, _kv.half())),
    ("cache_too_few_pages", {}, ValueError, "paged_kv_cache", lambda: (_q, _kv[:max(INDICES)])),
    ("tuple_cache_too_few_pages", {}, ValueError, "paged_kv_cache",
     lambda: (_q, (_k[:max(INDICES)], _v[:max(INDICES)]))),
    ("cache_page_size_32", {}, ValueError, "paged_kv_cache|page", lambda: (_q, make_cache(ps=32))),
    ("cache_page_size_64_tuple", {}, ValueError, "paged_kv_cache|page",
     lambda: (_q, (make_pool(ps=64), make_pool(ps=64, seed=4)))),
    ("cache_other_heads", {}, ValueError, "paged_kv_cache|heads", lambda: (_q, make_cache(hkv=1))),
    ("cache_dim1_3", {}, ValueError, "paged_kv_cache", lambda: (_q, make_cache(two=3))),
    ("cache_tuple_of_3", {}, ValueError, "paged_kv_cache", lambda: (_q, (_k, _v, _v))),
    ("cache_tuple_dtypes_differ", {}, ValueError, "paged_kv_cache", lambda: (_q, (_k, _v.half()))),
    ("cache_inner_noncontig", {}, ValueError, "paged_kv_cache", lambda: (_q, _noncontig_inner(_kv))),
    ("cache_none", {}, TypeError, "paged_kv_cache", lambda: (_q, None)),
    ("out_is_q", {}, ValueError, r"\bout\b", lambda: (_q, _kv, _q)),
    ("out_in_cache", {}, ValueError, r"\bout\b", lambda: (_q, _kv, _kv.view(-1)[: _q.numel()].view(_q.shape))),
    ("out_in_tuple_v", {}, ValueError, r"\bout\b",
     lambda: (_q, (_k, _v), _v.view(-1)[-_q.numel():].view(_q.shape))),
    ("out_wrong_dtype", {}, ValueError, r"\bout\b", lambda: (_q, _kv, torch.empty(_q.shape, dtype=FP16))),
    ("out_vs_o_data_type", dict(o_data_type=FP32), ValueError, r"\bout\b",
     lambda: (_q, _kv, torch.empty(_q.shape, dtype=BF16))),
    ("out_wrong_shape", {}, ValueError, r"\bout\b", lambda: (_q, _kv, torch.empty(B, HQ, D + 1, dtype=BF16))),
    ("out_noncontig", {}, ValueError, r"\bout\b",
     lambda: (_q, _kv, torch.empty(B, D, HQ, dtype=BF16).transpose(1, 2))),
    ("out_misaligned", {}, ValueError, r"\bout\b",
     lambda: (_q, _kv, torch.empty(_q.numel() + 8, dtype=BF16)[1:1 + _q.numel()].view(_q.shape))),
    ("out_meta", {}, ValueError, r"\bout\b", lambda: (_q, _kv, torch.empty(_q.shape, dtype=BF16, device="meta"))),
    ("out_not_tensor", {}, TypeError, r"\bout\b", lambda: (_q, _kv, 0)),
    ("q_meta", {}, ValueError, r"\bq\b|query|cache|indptr", lambda: (_q.to("meta"), _kv)),
    # --- multi-token and packed plans: the query must have the planned shape
    ("fixed3_plan_single_q", dict(seq_len_q=3), ValueError, r"\bq\b", lambda: (_q, _kv)),
    ("fixed3_plan_sq2_q", dict(seq_len_q=3), ValueError, r"\bq\b", lambda: (make_q(sq=2), _kv)),
    ("fixed3_plan_packed_q", dict(seq_len_q=3), ValueError, r"\bq\b",
     lambda: (_rand(B * 3, HQ, D, seed=7), _kv)),
    ("fixed3_plan_out_single", dict(seq_len_q=3), ValueError, r"\bout\b",
     lambda: (_q4, _kv, torch.empty(_q.shape, dtype=BF16))),
    ("packed_plan_single_q", dict(qo_indptr=QO), ValueError, r"\bq\b", lambda: (_q, _kv)),
    ("packed_plan_rows_4", dict(qo_indptr=QO), ValueError, r"\bq\b", lambda: (_qp[:4], _kv)),
    ("packed_plan_rank4_q", dict(qo_indptr=QO), ValueError, r"\bq\b", lambda: (_qp.unsqueeze(0), _kv)),
    ("packed_plan_out_rows_4", dict(qo_indptr=QO), ValueError, r"\bout\b",
     lambda: (_qp, _kv, torch.empty(4, HQ, D, dtype=BF16))),
    # --- scales are run arguments, checked on every run
    ("bmm1_scale_zero", {}, ValueError, "bmm1_scale", lambda: (_q, _kv, None, dict(bmm1_scale=0.0))),
    ("bmm1_scale_negative", {}, ValueError, "bmm1_scale", lambda: (_q, _kv, None, dict(bmm1_scale=-0.1))),
    ("bmm1_scale_nan", {}, ValueError, "bmm1_scale", lambda: (_q, _kv, None, dict(bmm1_scale=math.nan))),
    ("bmm1_scale_inf", {}, ValueError, "bmm1_scale", lambda: (_q, _kv, None, dict(bmm1_scale=math.inf))),
    ("bmm1_scale_str", {}, TypeError, "bmm1_scale", lambda: (_q, _kv, None, dict(bmm1_scale="0.1"))),
    ("bmm1_scale_tensor", {}, TypeError, "bmm1_scale",
     lambda: (_q, _kv, None, dict(bmm1_scale=torch.tensor(0.1)))),
    ("bmm2_scale_zero", {}, ValueError, "bmm2_scale", lambda: (_q, _kv, None, dict(bmm2_scale=0.0))),
    ("bmm2_scale_negative", {}, ValueError, "bmm2_scale", lambda: (_q, _kv, None, dict(bmm2_scale=-2.0))),
    ("bmm2_scale_inf", {}, ValueError, "bmm2_scale", lambda: (_q, _kv, None, dict(bmm2_scale=-math.inf))),
    ("bmm2_scale_none", {}, TypeError, "bmm2_scale", lambda: (_q, _kv, None, dict(bmm2_scale=None))),
    ("bmm2_scale_bool", {}, TypeError, "bmm2_scale", lambda: (_q, _kv, None, dict(bmm2_scale=True))),
    # --- the query's layout (the old run went through the standalone, which refuses these on every device)
    ("q_inner_noncontig", {}, ValueError, r"\bq\b|query", lambda: (_noncontig_inner(_q), _kv)),
    ("q_misaligned", {}, ValueError, r"\bq\b|query",
     lambda: (torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape), _kv)),
]


@pytest.mark.parametrize("name,plan_kw,exc,match,make",
                         [pytest.param(*c[:5], marks=c[5] if len(c) > 5 else (), id=c[0]) for c in RUN_CASES])
def test_wrapper_run_errors(name, plan_kw, exc, match, make):
    w, _ = planned(**plan_kw)
    args = make()
    kwargs = dict(args[3]) if len(args) > 3 else {}
    if len(args) > 2 and args[2] is not None:
        kwargs["out"] = args[2]
    expect(exc, match, w.run, *args[:2], **kwargs)


@pytest.mark.parametrize("which", ["paged_kv_indptr", "paged_kv_indices", "qo_indptr"])
def test_wrapper_run_out_overlapping_bound_metadata(which):
    """The plan binds paged_kv_indptr, paged_kv_indices and qo_indptr (run reads them): out must not
    overlap them."""
    q = _qp if which == "qo_indptr" else _q
    meta, out = _out_sharing(which)
    key = {"paged_kv_indptr": "indptr", "paged_kv_indices": "indices", "qo_indptr": "qo_indptr"}[which]
    w, _ = planned(**{key: meta})
    expect(ValueError, rf"\bout\b.*{which}", w.run, q, _kv, out=out)
    assert w.run(q, _kv, out=torch.empty(q.shape, dtype=BF16)).shape == q.shape


# ----------------------------------------------------------------------------
# One-shot batch_decode_with_paged_kv_cache: values are read and checked
# ----------------------------------------------------------------------------


def oneshot_args(**mods):
    args = dict(q=_q, paged_kv_cache=_kv, paged_kv_indptr=ip(INDPTR), paged_kv_indices=ip(INDICES),
                paged_kv_last_page_len=ip(LAST))
    kwargs = {}
    for key, val in mods.items():
        if isinstance(val, list) and (key.startswith("paged_kv_") or key == "qo_indptr") and key != "paged_kv_cache":
            val = ip(val)
        (args if key in args else kwargs)[key] = val
    return tuple(args.values()), kwargs


ONESHOT_WRAPPER_CASES = [
    ("page_id_eq_num_pages", ValueError, "paged_kv_indices", lambda: oneshot_args(paged_kv_indices=[3, P, 5])),
    ("page_id_max_int", ValueError, "paged_kv_indices",
     lambda: oneshot_args(paged_kv_indices=[3, 1, 2**31 - 1])),
    ("page_id_vs_smaller_cache", ValueError, "paged_kv_indices", lambda: oneshot_args(paged_kv_cache=_kv[:5])),
    ("page_id_vs_tuple_cache", ValueError, "paged_kv_indices",
     lambda: oneshot_args(paged_kv_cache=(_k[:4], _v[:4]))),
    ("page_id_negative", ValueError, "indices", lambda: oneshot_args(paged_kv_indices=[3, -1, 5])),
    ("indices_a_list", TypeError, "paged_kv_indices",
     lambda: (oneshot_args()[0][:3] + ([3, 1, 5],) + oneshot_args()[0][4:], {})),
    ("indptr_a_list", TypeError, "paged_kv_indptr",
     lambda: (oneshot_args()[0][:2] + ([0, 1, 3],) + oneshot_args()[0][3:], {})),
    ("indptr_not_start_0", ValueError, "indptr", lambda: oneshot_args(paged_kv_indptr=[1, 2, 3])),
    ("indptr_not_increasing", ValueError, "indptr", lambda: oneshot_args(paged_kv_indptr=[0, 2, 2])),
    ("indptr_end", ValueError, "indptr", lambda: oneshot_args(paged_kv_indptr=[0, 1, 2])),
    ("last_page_len_0", ValueError, "last_page_len", lambda: oneshot_args(paged_kv_last_page_len=[0, 5])),
    ("last_page_len_past_page", ValueError, "last_page_len",
     lambda: oneshot_args(paged_kv_last_page_len=[4, PS + 1])),
    ("page_size_8", ValueError, "page_size|page size", lambda: oneshot_args(paged_kv_cache=make_cache(ps=8))),
    ("window_without_causal", ValueError, "window_left", lambda: oneshot_args(window_left=2)),
    ("kv_layout_NHD", ValueError, "kv_layout", lambda: oneshot_args(kv_layout="NHD")),
    ("q_rank4", ValueError, r"\bq\b", lambda: oneshot_args(q=_q4)),
    ("q_fp16_cache_bf16", ValueError, r"\bq\b|query|cache|kv_data_type", lambda: oneshot_args(q=_q.half())),
    ("head_dim_96", ValueError, r"head|query|\bq\b", lambda: oneshot_args(q=make_q(d=96),
                                                                         paged_kv_cache=make_cache(d=96))),
    ("bmm1_scale_nan", ValueError, "bmm1_scale", lambda: oneshot_args(bmm1_scale=math.nan)),
    ("bmm1_scale_zero", ValueError, "bmm1_scale", lambda: oneshot_args(bmm1_scale=0.0)),
    ("bmm2_scale_negative", ValueError, "bmm2_scale", lambda: oneshot_args(bmm2_scale=-1.0)),
    ("out_is_q", ValueError, r"\bout\b", lambda: oneshot_args(out=_q)),
    ("out_dtype_disagrees", ValueError, r"\bout\b|out_dtype",
     lambda: oneshot_args(out=torch.empty(_q.shape, dtype=BF16), out_dtype=FP32)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda: oneshot_args(out_dtype=torch.float64)),
    # --- multi-token and packed queries
    ("fixed_seq_len_q_vs_q", ValueError, r"\bq\b|seq_len_q", lambda: oneshot_args(q=_q4, seq_len_q=2)),
    ("fixed_max_seq_len_q_vs_seq_len_q", ValueError, "max_seq_len_q",
     lambda: oneshot_args(q=_q4, seq_len_q=3, max_seq_len_q=4)),
    ("fixed_causal_q_past_len", ValueError, "causal",
     lambda: oneshot_args(q=make_q(sq=6), seq_len_q=6, mask_type="causal")),
    ("packed_qo_not_start_0", ValueError, "qo_indptr", lambda: oneshot_args(q=_qp, qo_indptr=[1, 3, 5])),
    ("packed_qo_vs_q_rows", ValueError, r"\bq\b", lambda: oneshot_args(q=_qp, qo_indptr=[0, 3, 4])),
    ("packed_max_seq_len_q_below_counts", ValueError, "max_seq_len_q",
     lambda: oneshot_args(q=_qp, qo_indptr=QO, max_seq_len_q=2)),
    ("packed_seq_len_q_2", ValueError, "seq_len_q", lambda: oneshot_args(q=_qp, qo_indptr=QO, seq_len_q=2)),
    ("packed_causal_q_past_len", ValueError, "causal",
     lambda: oneshot_args(q=_qp, qo_indptr=QO, paged_kv_last_page_len=[4, 1], mask_type="causal")),
]


@pytest.mark.parametrize("exc,match,make", _params(ONESHOT_WRAPPER_CASES))
def test_oneshot_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, batch_decode_with_paged_kv_cache, *args, **kwargs)


def test_oneshot_base_is_valid():
    args, kw = oneshot_args(mask_type="causal", window_left=3)
    assert batch_decode_with_paged_kv_cache(*args, **kw).shape == _q.shape
    args, kw = oneshot_args(paged_kv_cache=_kv[:max(INDICES) + 1])  # exactly enough pages
    out = torch.empty(_q.shape, dtype=FP32)
    assert batch_decode_with_paged_kv_cache(*args, out=out, **kw) is out
    args, kw = oneshot_args(q=_q4, seq_len_q=3, mask_type="causal", bmm1_scale=0.1, bmm2_scale=2.0)
    assert batch_decode_with_paged_kv_cache(*args, **kw).shape == _q4.shape
    args, kw = oneshot_args(q=_qp, qo_indptr=QO, mask_type="causal", out_dtype=FP16)
    assert batch_decode_with_paged_kv_cache(*args, **kw).dtype == FP16


def test_workspace_case_premises():
    """The workspace cases above rely on these sizes: the minimum for a single-split key, more for split-KV."""
    assert ws_bytes() == ws_bytes(max_seq_len_q=3) == 256
    assert ws_bytes(max_seq_len=4096) > ws_bytes()
    assert ws_bytes(max_seq_len=4096, max_seq_len_q=3) > ws_bytes(max_seq_len=4096)
    packed3 = get_prims_ts_batch_decode_workspace_size(B, HQ, HKV, D, PS, 4096, qo_indptr=ip(QO), max_seq_len_q=3,
                                                       device="cpu")
    assert packed3 > ws_bytes(max_seq_len=4096)


def test_batch_beyond_the_grid_is_refused():
    """Requests sit on the grid's z dimension: more than 65535 in one launch is an error, not a launch failure."""
    from prims_ts.ops import _validate as V

    with pytest.raises(ValueError, match="batch size 65536"):
        V.batch_size("query", 65536)
    assert V.batch_size("query", 65535) == 65535
    qo = torch.zeros(65538, dtype=torch.int32)
    args, kw = packed()
    args = (torch.zeros(1, HQ, D, dtype=BF16),) + tuple(args[1:])
    kw = dict(kw, qo_indptr=qo)
    with pytest.raises(ValueError, match="qo_indptr: batch size 65537"):
        prims_ts_batch_decode_with_kv_cache(*args, **kw)
    # the wrapper's plan: the batch comes from paged_kv_indptr
    n = 65536
    indptr, last = torch.arange(n + 1, dtype=I32), torch.ones(n, dtype=I32)
    with pytest.raises(ValueError, match="paged_kv_indptr: batch size 65536"):
        BatchDecodePagedTSWrapper().plan(indptr, torch.zeros(n, dtype=I32), last, HQ, HKV, D, PS)


def test_row_tiles_beyond_the_grid_are_refused():
    """(K/V head, row tile) blocks sit on the grid's y dimension: too many is an error before any launch,
    for fixed multi-token (seq_len_q) and packed (max_seq_len_q) bounds alike."""
    with pytest.raises(ValueError, match="seq_len_q"):
        get_prims_ts_batch_decode_workspace_size(1, 32, 8, 128, PS, 4096, seq_len_q=200000)
    with pytest.raises(ValueError, match="max_seq_len_q"):
        get_prims_ts_batch_decode_workspace_size(1, 32, 8, 128, PS, 4096, qo_indptr=ip([0, 1]),
                                                 max_seq_len_q=200000)
    get_prims_ts_batch_decode_workspace_size(1, 32, 8, 128, PS, 4096, seq_len_q=1000)
    get_prims_ts_batch_decode_workspace_size(1, 32, 8, 128, PS, 4096, qo_indptr=ip([0, 1]), max_seq_len_q=1000)


def test_mla_row_tiles_beyond_the_grid_are_refused():
    from prims_ts import get_prims_ts_batch_decode_mla_workspace_size

    with pytest.raises(ValueError, match="max_seq_len_q"):
        get_prims_ts_batch_decode_mla_workspace_size(1, 128, 512, 64, PS, 4096, max_seq_len_q=40000)
    with pytest.raises(ValueError, match="seq_len_q"):
        get_prims_ts_batch_decode_mla_workspace_size(1, 128, 512, 64, PS, 4096, seq_len_q=40000)
    get_prims_ts_batch_decode_mla_workspace_size(1, 128, 512, 64, PS, 4096, max_seq_len_q=64)
