"""Every bad input of the MLA decode APIs is refused on the host, before any kernel runs.

Contract (SPEC "Errors", §4, seed 004 and issue 5 item 6): anything outside the contract
raises ``ValueError`` (``TypeError`` for a wrong Python type) whose message names the
argument. On CPU the "kernel" of ``prims_ts::batch_mla_decode(_out)`` is
``prims_ts.reference.batch_mla_decode``; every error case below runs with it replaced by
a function that fails the test if it is ever reached, so an error raised *after* the
launch does not count.

* ``prims_ts_batch_decode_with_kv_cache_mla(query, kv_cache, workspace_buffer, kv_lora_rank,
  qk_rope_head_dim, block_tables, seq_lens, max_seq_len, *, ...)`` (standalone) checks shapes,
  dtypes, devices, the workspace and scalars, and trusts metadata *values* (no device-to-host
  synchronisation): ``test_standalone_trusts_metadata_values`` checks that invalid values
  reach the op untouched and unread. Its static checks are cached per static key; overlaps
  and scales are checked on every call. Every test here starts from an empty cache.
* ``BatchMLADecodePagedTSWrapper.plan(block_tables, seq_lens, num_heads, kv_lora_rank,
  qk_rope_head_dim, page_size, *, ...)`` reads ``seq_lens``/``qo_indptr`` once and binds
  ``block_tables``, ``seq_lens`` and ``qo_indptr``; ``run(query, kv_cache, *, bmm1_scale,
  bmm2_scale, out, validate=False)`` reads them live: ``validate=True`` checks their live values
  on the host first, ``validate=False`` (the default) trusts them like the standalone (also
  tested for no host reads).
* The one-shot ``batch_mla_decode_with_paged_kv_cache`` reads and checks everything.
* ``out`` must have exactly the output dtype (``out_dtype``, default bfloat16).

Devices: this file runs on a CPU-only machine, so "another device" is 'meta'.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import (
    BatchMLADecodePagedTSWrapper,
    batch_decode_mla_with_paged_kv_cache,
    batch_mla_decode_with_paged_kv_cache,
    get_prims_ts_batch_decode_mla_workspace_size,
    prims_ts_batch_decode_with_kv_cache_mla,
)
import prims_ts.ops._validate as V
import prims_ts.ops.mla as mla_ops
from prims_ts import Tuning
from prims_ts.ops._validate import dtype_code
from prims_ts.testing import huge_page_stride, reference_must_not_run
from prims_ts.testing import recording_no_host_reads as _recording

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, U8 = torch.int32, torch.uint8
NAN = float("nan")
DQK, DV = 576, 512
RANK, ROPE = 512, 64  # kv_lora_rank, qk_rope_head_dim
H = 8
PS = 16
P = 8
B = 2
# request 0: 20 tokens on pages 3, 1; request 1: 5 tokens on page 5. Unused entries hold garbage
# (only the first ceil(len / page_size) entries of a row are page IDs the contract constrains).
BT = [[3, 1, -1], [5, 99, 2**31 - 1]]
LENS = [20, 5]
MAX_LEN = 32
QO = [0, 3, 5]  # packed: q lens 3, 2 (<= LENS, so causal is valid)
BOUND = 2_147_483_520

DROP = object()  # base(key=DROP): leave the keyword out (use the function's default)


def _rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def ip(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


def block_tables(values=BT, pad=2):
    """A row-strided view (row stride C + pad) of a wider table: valid per the seed."""
    rows, cols = len(values), len(values[0])
    wide = torch.full((rows, cols + pad), -7, dtype=I32)
    wide[:, :cols] = ip(values)
    return wide[:, :cols]


def make_q(b=B, sq=1, h=H, d=DQK, dtype=BF16):
    return _rand(b, sq, h, d, dtype=dtype, seed=1)


def make_cache(p=P, ps=PS, d=DQK, dtype=BF16, four=False, seed=2):
    c = _rand(p, ps, d, dtype=dtype, seed=seed)
    return c.unsqueeze(1) if four else c


def ws_bytes(batch=B, h=H, max_seq_len=MAX_LEN, max_seq_len_q=1, page_size=PS):
    return get_prims_ts_batch_decode_mla_workspace_size(batch, h, RANK, ROPE, page_size, max_seq_len,
                                                        max_seq_len_q=max_seq_len_q, device="cpu")


@pytest.fixture(autouse=True)
def fresh_static_checks(monkeypatch):
    """An empty standalone check cache for each test (see the module docstring)."""
    monkeypatch.setattr(mla_ops, "_CHECKED", V.memo())
    monkeypatch.setattr(mla_ops, "_ONESHOT_CHECKED", V.memo())


def make_ws(nbytes=None, dtype=U8):
    n = ws_bytes() if nbytes is None else nbytes
    return torch.zeros(n, dtype=U8).view(dtype) if dtype != U8 else torch.zeros(n, dtype=U8)


def expect(exc, match, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``match`` and never reaches the kernel."""
    with reference_must_not_run("batch_mla_decode"):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


_q = make_q()
_q3 = make_q(sq=3)
_qp = _rand(QO[-1], H, DQK, dtype=BF16, seed=4)
_kv = make_cache()
_kv4 = make_cache(four=True, seed=5)

META = ("block_tables", "seq_lens", "qo_indptr")


def base(**mods):
    """Valid standalone arguments (fixed SQ=1, causal by default) with modifications: (args, kwargs)."""
    args = dict(query=_q, kv_cache=_kv, workspace_buffer=make_ws(), kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                block_tables=block_tables(), seq_lens=ip(LENS), max_seq_len=MAX_LEN)
    kwargs = {}
    for key, val in mods.items():
        if isinstance(val, list) and key in META:
            val = block_tables(val) if key == "block_tables" else ip(val)
        (args if key in args else kwargs)[key] = val
    kwargs = {key: val for key, val in kwargs.items() if val is not DROP}
    return tuple(args.values()), kwargs


def packed(**mods):
    """Valid packed-Q arguments (q lens 3 and 2, max_seq_len_q 3) with modifications."""
    kw = dict(query=_qp, qo_indptr=ip(QO), max_seq_len_q=3, workspace_buffer=make_ws(ws_bytes(max_seq_len_q=3)))
    kw.update(mods)
    return base(**kw)


def fixed(sq=3, **mods):
    kw = dict(query=make_q(sq=sq), workspace_buffer=make_ws(ws_bytes(max_seq_len_q=sq)))
    kw.update(mods)
    return base(**kw)


def _noncontig_inner(t):
    """Same shape and values as t, last dimension with stride 2."""
    base_ = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    view = base_[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


def _misaligned(t):
    """Same shape and values, data starting 2 bytes past a 16-byte boundary."""
    buf = torch.zeros(t.numel() + 8, dtype=t.dtype)
    view = buf[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16
    return view


def _out_sharing(name):
    """(metadata tensor holding the base values, out whose bytes start inside it)."""
    shape = (QO[-1], H, DV) if name == "qo_indptr" else (B, 1, H, DV)
    n = math.prod(shape) * 2
    buf = torch.zeros(n + 256, dtype=U8)
    out = buf[:n].view(BF16).view(shape)  # 16-byte aligned; its last 4 bytes are the metadata's first
    if name == "block_tables":
        meta = buf[n - 4:n - 4 + len(BT) * 5 * 4].view(I32).view(len(BT), 5)[:, :3]
        meta.copy_(ip(BT))
    else:
        values = {"seq_lens": LENS, "qo_indptr": QO}[name]
        meta = buf[n - 4:n - 4 + len(values) * 4].view(I32)
        meta.copy_(ip(values))
    return meta, out


def _out_overlaps(name):
    meta, out = _out_sharing(name)
    if name == "qo_indptr":
        return packed(qo_indptr=meta, out=out)
    return base(**{name: meta, "out": out})


def _out_in_workspace():
    n = ws_bytes()
    nbytes = B * H * DV * 2
    buf = torch.zeros(n + nbytes, dtype=U8)
    ws = buf[:n]
    out = buf[n - 16:n - 16 + nbytes].view(BF16).view(B, 1, H, DV)  # the last 16 workspace bytes shared
    return base(workspace_buffer=ws, out=out)


def _ws_sharing(name):
    """A workspace buffer (big enough) whose bytes overlap the named input."""
    if name == "query":
        return base(workspace_buffer=_q.view(-1).view(U8))
    if name == "kv_cache":
        return base(workspace_buffer=_kv.view(-1).view(U8)[:4096])
    meta, _ = _out_sharing(name)
    st = meta.untyped_storage()
    ws = torch.empty(0, dtype=U8).set_(st, 0, (st.nbytes(),))
    assert ws.numel() >= ws_bytes()
    if name == "qo_indptr":
        return packed(qo_indptr=meta, workspace_buffer=ws)
    return base(**{name: meta, "workspace_buffer": ws})


def _overlapping_rows():
    """block_tables whose rows overlap (row stride 2 < 3 columns)."""
    flat = ip([3, 1, 5, 0, 2, 6])
    return flat.as_strided((2, 3), (2, 1))


# ----------------------------------------------------------------------------
# Sanity: the base inputs (and some unusual but valid ones) are accepted.
# ----------------------------------------------------------------------------


def test_base_inputs_are_valid():
    args, kw = base()
    res = prims_ts_batch_decode_with_kv_cache_mla(*args, **kw)
    assert res.shape == (B, 1, H, DV) and res.dtype == BF16
    args, kw = base(kv_cache=_kv4, mask_type="dense", bmm1_scale=0.05, bmm2_scale=2.0, out_dtype=FP32)
    out = torch.empty(B, 1, H, DV, dtype=FP32)
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, out=out, **kw) is out
    args, kw = packed()
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw).shape == (QO[-1], H, DV)
    args, kw = fixed(sq=3, max_seq_len_q=3)  # an explicit max_seq_len_q equal to the fixed SQ
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw).shape == (B, 3, H, DV)
    # fp16 inputs; int8, 2-D contiguous and larger workspaces; a contiguous block table
    args, kw = base(query=_q.half(), kv_cache=_kv.half(), block_tables=ip(BT), out_dtype=FP16)
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw).dtype == FP16
    for ws in (make_ws(dtype=torch.int8), torch.zeros(2, ws_bytes(), dtype=U8), make_ws(10 * ws_bytes())):
        args, kw = base(workspace_buffer=ws)
        prims_ts_batch_decode_with_kv_cache_mla(*args, **kw)
    # max_seq_len at the representable bound (with a workspace sized for it); explicit defaults
    args, kw = base(max_seq_len=BOUND, workspace_buffer=make_ws(ws_bytes(max_seq_len=BOUND)))
    prims_ts_batch_decode_with_kv_cache_mla(*args, **kw)
    args, kw = base(out_dtype=None)  # None: the default bfloat16
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw).dtype == BF16
    # an out of exactly out_dtype (the default bfloat16, or the one asked for)
    args, kw = base()
    out = torch.empty(B, 1, H, DV, dtype=BF16)
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, out=out, **kw) is out
    for odt in (FP16, FP32, BF16):
        args, kw = base(out_dtype=odt)
        out = torch.empty(B, 1, H, DV, dtype=odt)
        assert prims_ts_batch_decode_with_kv_cache_mla(*args, out=out, **kw) is out
        assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw).dtype == odt


STANDALONE = []  # (id, exc, match, make)


def case(name, exc, match, make):
    STANDALONE.append((name, exc, match, make))


# --- kv_lora_rank / qk_rope_head_dim other than 512 / 64
case("kv_lora_rank_256", ValueError, "kv_lora_rank", lambda: base(kv_lora_rank=256))
case("kv_lora_rank_1024", ValueError, "kv_lora_rank", lambda: base(kv_lora_rank=1024))
case("kv_lora_rank_float", TypeError, "kv_lora_rank", lambda: base(kv_lora_rank=512.0))
case("kv_lora_rank_none", TypeError, "kv_lora_rank", lambda: base(kv_lora_rank=None))
case("qk_rope_head_dim_32", ValueError, "qk_rope_head_dim", lambda: base(qk_rope_head_dim=32))
case("qk_rope_head_dim_128", ValueError, "qk_rope_head_dim", lambda: base(qk_rope_head_dim=128))
case("qk_rope_head_dim_0", ValueError, "qk_rope_head_dim", lambda: base(qk_rope_head_dim=0))
case("qk_rope_head_dim_str", TypeError, "qk_rope_head_dim", lambda: base(qk_rope_head_dim="64"))
# --- a query or cache whose last dimension is not 576
case("query_last_dim_512", ValueError, "query", lambda: base(query=make_q(d=512)))
case("query_last_dim_640", ValueError, "query", lambda: base(query=make_q(d=640)))
case("query_last_dim_128", ValueError, "query", lambda: base(query=make_q(d=128), kv_cache=make_cache(d=128)))
case("cache_last_dim_512", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(d=512)))
case("cache_last_dim_640", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(d=640)))
case("cache_last_dim_577", ValueError, "kv_cache.*576", lambda: base(kv_cache=make_cache(d=577)))  # not "aligned"
case("cache4d_last_dim_512", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(d=512, four=True)))
# --- a cache of the wrong rank
case("cache_rank2", ValueError, "kv_cache", lambda: base(kv_cache=_kv[0]))
case("cache_rank5", ValueError, "kv_cache", lambda: base(kv_cache=_kv4.unsqueeze(0)))
case("cache_rank1", ValueError, "kv_cache", lambda: base(kv_cache=_kv.view(-1)))
case("cache4d_dim1_2", ValueError, "kv_cache", lambda: base(kv_cache=_kv.view(P // 2, 2, PS, DQK)))
case("cache_tuple", TypeError, "kv_cache", lambda: base(kv_cache=(_kv, _kv)))
case("cache_none", TypeError, "kv_cache", lambda: base(kv_cache=None))
# --- page sizes, pages, strides, layout
case("page_size_8", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(ps=8)))
case("page_size_48", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(ps=48)))
case("page_size_256", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(p=2, ps=256)))
case("page_size_8_4d", ValueError, "kv_cache", lambda: base(kv_cache=make_cache(ps=8, four=True)))
case("cache_no_pages", ValueError, "kv_cache", lambda: base(kv_cache=_kv[:0]))
case("cache_inner_noncontig", ValueError, "kv_cache", lambda: base(kv_cache=_noncontig_inner(_kv)))
case("cache_misaligned", ValueError, "kv_cache", lambda: base(kv_cache=_misaligned(_kv)))
case("cache_page_stride_beyond_int32", ValueError, "kv_cache: page stride",
     lambda: base(kv_cache=huge_page_stride(_kv)))
case("cache4d_page_stride_beyond_int32", ValueError, "kv_cache: page stride",
     lambda: base(kv_cache=huge_page_stride(_kv4)))
# --- dtype mixes and unsupported dtypes
case("query_fp16_cache_bf16", ValueError, "query|kv_cache", lambda: base(query=_q.half()))
case("query_bf16_cache_fp16", ValueError, "query|kv_cache", lambda: base(kv_cache=_kv.half()))
case("query_bf16_cache4d_fp16", ValueError, "query|kv_cache", lambda: base(kv_cache=_kv4.half()))
case("all_float32", ValueError, "query|kv_cache", lambda: base(query=_q.float(), kv_cache=_kv.float()))
case("query_float32", ValueError, "query", lambda: base(query=_q.float()))
case("cache_float32", ValueError, "kv_cache", lambda: base(kv_cache=_kv.float()))
case("cache_int8", ValueError, "kv_cache", lambda: base(kv_cache=_kv.to(torch.int8)))
case("cache_fp8", ValueError, "kv_cache", lambda: base(kv_cache=_kv.to(torch.float8_e4m3fn)))
# --- query: type, rank, heads, layout
case("query_not_tensor", TypeError, "query", lambda: base(query=_q.tolist()))
case("query_rank3_without_qo_indptr", ValueError, "query", lambda: base(query=_q[:, 0]))
case("query_rank5", ValueError, "query", lambda: base(query=_q.unsqueeze(0)))
case("query_rank2", ValueError, "query", lambda: base(query=_q[0, 0]))
case("query_heads_4", ValueError, "query", lambda: base(query=make_q(h=4)))
case("query_heads_12", ValueError, "query", lambda: base(query=make_q(h=12)))
case("query_heads_1", ValueError, "query", lambda: base(query=make_q(h=1)))
case("query_heads_256", ValueError, "query", lambda: base(query=make_q(b=1, h=256), block_tables=[BT[0]],
                                                             seq_lens=LENS[:1]))
case("query_inner_noncontig", ValueError, "query", lambda: base(query=_noncontig_inner(_q)))
case("query_misaligned", ValueError, "query", lambda: base(query=_misaligned(_q)))
case("query_batch_0", ValueError, "query", lambda: base(query=make_q(b=0)))
case("query_sq_0", ValueError, "query", lambda: base(query=make_q(sq=0)))
case("query_batch_vs_block_tables", ValueError, "block_tables|query", lambda: base(query=make_q(b=3)))
# --- Q mode: packed needs max_seq_len_q; a fixed query's max_seq_len_q must equal its SQ
case("packed_without_max_seq_len_q", ValueError, "max_seq_len_q", lambda: packed(max_seq_len_q=DROP))
case("packed_max_seq_len_q_none", ValueError, "max_seq_len_q", lambda: packed(max_seq_len_q=None))
case("packed_max_seq_len_q_zero", ValueError, "max_seq_len_q", lambda: packed(max_seq_len_q=0))
case("packed_max_seq_len_q_float", TypeError, "max_seq_len_q", lambda: packed(max_seq_len_q=3.0))
case("packed_query_rank4", ValueError, "query", lambda: packed(query=_qp.unsqueeze(0)))
case("packed_qo_int64", ValueError, "qo_indptr", lambda: packed(qo_indptr=ip(QO, torch.int64)))
case("packed_qo_rank2", ValueError, "qo_indptr", lambda: packed(qo_indptr=ip([QO])))
case("packed_qo_single_entry", ValueError, "qo_indptr", lambda: packed(qo_indptr=[0]))
case("packed_qo_noncontig", ValueError, "qo_indptr", lambda: packed(qo_indptr=ip([0, 9, 3, 9, 5, 9])[::2]))
case("packed_qo_vs_block_tables_rows", ValueError, "block_tables|qo_indptr",
     lambda: packed(qo_indptr=[0, 1, 3, 5]))
case("packed_qo_meta", ValueError, "qo_indptr", lambda: packed(qo_indptr=ip(QO).to("meta")))
case("packed_qo_list", TypeError, "qo_indptr", lambda: packed(qo_indptr=tuple(QO)))
case("fixed_sq1_max_seq_len_q_2", ValueError, "max_seq_len_q", lambda: base(max_seq_len_q=2))
case("fixed_sq3_max_seq_len_q_4", ValueError, "max_seq_len_q", lambda: fixed(sq=3, max_seq_len_q=4))
case("fixed_sq3_max_seq_len_q_2", ValueError, "max_seq_len_q", lambda: fixed(sq=3, max_seq_len_q=2))
case("fixed_max_seq_len_q_float", TypeError, "max_seq_len_q", lambda: fixed(sq=3, max_seq_len_q=3.0))
case("fixed_max_seq_len_q_zero", ValueError, "max_seq_len_q", lambda: base(max_seq_len_q=0))
# --- block_tables
case("block_tables_int64", ValueError, "block_tables", lambda: base(block_tables=ip(BT, torch.int64)))
case("block_tables_uint32", ValueError, "block_tables", lambda: base(block_tables=ip(BT).view(torch.uint32)))
case("block_tables_rank1", ValueError, "block_tables", lambda: base(block_tables=ip(BT[0])))
case("block_tables_rank3", ValueError, "block_tables", lambda: base(block_tables=ip([BT])))
case("block_tables_rows_B_plus_1", ValueError, "block_tables", lambda: base(block_tables=BT + [[0, 0, 0]]))
case("block_tables_rows_B_minus_1", ValueError, "block_tables", lambda: base(block_tables=BT[:1]))
case("block_tables_no_columns", ValueError, "block_tables", lambda: base(block_tables=ip(BT)[:, :0]))
case("block_tables_column_stride_2", ValueError, "block_tables",
     lambda: base(block_tables=ip([[3, 0, 1, 0, 7, 0], [5, 0, 0, 0, 2, 0]])[:, ::2]))
case("block_tables_transposed", ValueError, "block_tables", lambda: base(block_tables=ip(BT).t().contiguous().t()))
case("block_tables_rows_overlap", ValueError, "block_tables", lambda: base(block_tables=_overlapping_rows()))
case("block_tables_meta", ValueError, "block_tables", lambda: base(block_tables=ip(BT).to("meta")))
case("block_tables_tuple", TypeError, "block_tables", lambda: base(block_tables=tuple(map(tuple, BT))))
# --- seq_lens
case("seq_lens_int64", ValueError, "seq_lens", lambda: base(seq_lens=ip(LENS, torch.int64)))
case("seq_lens_float", ValueError, "seq_lens", lambda: base(seq_lens=ip(LENS, FP32)))
case("seq_lens_length_B_plus_1", ValueError, "seq_lens", lambda: base(seq_lens=LENS + [5]))
case("seq_lens_length_B_minus_1", ValueError, "seq_lens", lambda: base(seq_lens=LENS[:1]))
case("seq_lens_rank2", ValueError, "seq_lens", lambda: base(seq_lens=ip([LENS])))
case("seq_lens_noncontig", ValueError, "seq_lens", lambda: base(seq_lens=ip([20, 9, 5, 9])[::2]))
case("seq_lens_meta", ValueError, "seq_lens", lambda: base(seq_lens=ip(LENS).to("meta")))
case("seq_lens_tuple", TypeError, "seq_lens", lambda: base(seq_lens=tuple(LENS)))
case("query_meta", ValueError, "query|kv_cache", lambda: base(query=_q.to("meta")))
case("cache_meta", ValueError, "kv_cache", lambda: base(kv_cache=_kv.to("meta")))
# --- max_seq_len
case("max_seq_len_0", ValueError, "max_seq_len", lambda: base(max_seq_len=0))
case("max_seq_len_negative", ValueError, "max_seq_len", lambda: base(max_seq_len=-1))
case("max_seq_len_bound_plus_1", ValueError, "max_seq_len", lambda: base(max_seq_len=BOUND + 1))
case("max_seq_len_2_31", ValueError, "max_seq_len", lambda: base(max_seq_len=2**31))
case("max_seq_len_float", TypeError, "max_seq_len", lambda: base(max_seq_len=32.0))
case("max_seq_len_bool", TypeError, "max_seq_len", lambda: base(max_seq_len=True))
case("max_seq_len_none", TypeError, "max_seq_len", lambda: base(max_seq_len=None))
case("max_seq_len_tensor", TypeError, "max_seq_len", lambda: base(max_seq_len=torch.tensor(32)))
# --- mask
case("mask_variable_window", ValueError, "mask_type", lambda: base(mask_type="variable_window"))
case("mask_unknown", ValueError, "mask_type", lambda: base(mask_type="full"))
case("mask_upper", ValueError, "mask_type", lambda: base(mask_type="Causal"))
case("mask_none", TypeError, "mask_type", lambda: base(mask_type=None))
case("mask_bool", TypeError, "mask_type", lambda: base(mask_type=True))
# --- scales
case("bmm1_scale_zero", ValueError, "bmm1_scale", lambda: base(bmm1_scale=0.0))
case("bmm1_scale_nan", ValueError, "bmm1_scale", lambda: base(bmm1_scale=math.nan))
case("bmm1_scale_inf", ValueError, "bmm1_scale", lambda: base(bmm1_scale=math.inf))
case("bmm1_scale_negative", ValueError, "bmm1_scale", lambda: base(bmm1_scale=-0.1))
case("bmm1_scale_none", TypeError, "bmm1_scale", lambda: base(bmm1_scale=None))
case("bmm1_scale_str", TypeError, "bmm1_scale", lambda: base(bmm1_scale="0.1"))
case("bmm1_scale_tensor", TypeError, "bmm1_scale", lambda: base(bmm1_scale=torch.tensor(0.1)))
case("bmm2_scale_zero", ValueError, "bmm2_scale", lambda: base(bmm2_scale=0.0))
case("bmm2_scale_negative", ValueError, "bmm2_scale", lambda: base(bmm2_scale=-1.0))
case("bmm2_scale_nan", ValueError, "bmm2_scale", lambda: base(bmm2_scale=math.nan))
case("bmm2_scale_inf", ValueError, "bmm2_scale", lambda: base(bmm2_scale=-math.inf))
case("bmm2_scale_none", TypeError, "bmm2_scale", lambda: base(bmm2_scale=None))
case("bmm2_scale_str", TypeError, "bmm2_scale", lambda: base(bmm2_scale="1"))
# --- workspace
case("ws_float32", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros((ws_bytes() + 3) // 4, dtype=FP32)))
case("ws_int32", ValueError, "workspace_buffer",
     lambda: base(workspace_buffer=torch.zeros((ws_bytes() + 3) // 4, dtype=I32)))
case("ws_bf16", ValueError, "workspace_buffer", lambda: base(workspace_buffer=torch.zeros(ws_bytes(), dtype=BF16)))
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
case("ws_sized_for_fewer_heads", ValueError, "workspace_buffer",
     lambda: base(query=make_q(h=32), max_seq_len=4096, workspace_buffer=make_ws(ws_bytes(max_seq_len=4096))))
case("ws_not_tensor", TypeError, "workspace_buffer", lambda: base(workspace_buffer=bytearray(4096)))
case("ws_none", TypeError, "workspace_buffer", lambda: base(workspace_buffer=None))
# --- out overlapping an input, a metadata tensor or the workspace
case("out_is_query_view", ValueError, r"\bout\b.*query",
     lambda: base(out=_q.view(-1)[:B * H * DV].view(B, 1, H, DV)))
case("out_in_query", ValueError, r"\bout\b.*query",
     lambda: base(out=_q.view(-1)[-B * H * DV:].view(B, 1, H, DV)))
case("out_in_cache", ValueError, r"\bout\b.*kv_cache", lambda: base(out=_kv.view(-1)[:B * H * DV].view(B, 1, H, DV)))
case("out_tail_of_cache4d", ValueError, r"\bout\b.*kv_cache",
     lambda: base(kv_cache=_kv4, out=_kv4.view(-1)[-B * H * DV:].view(B, 1, H, DV)))
case("out_overlaps_block_tables", ValueError, r"\bout\b.*block_tables", lambda: _out_overlaps("block_tables"))
case("out_overlaps_seq_lens", ValueError, r"\bout\b.*seq_lens", lambda: _out_overlaps("seq_lens"))
case("out_overlaps_qo_indptr", ValueError, r"\bout\b.*qo_indptr", lambda: _out_overlaps("qo_indptr"))
case("out_overlaps_workspace", ValueError, r"\bout\b|workspace_buffer", lambda: _out_in_workspace())
# --- out: shape, dtype, device, layout
case("out_query_shape", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, 1, H, DQK, dtype=BF16)))
case("out_3d_for_fixed", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, H, DV, dtype=BF16)))
case("out_fixed_for_packed", ValueError, r"\bout\b", lambda: packed(out=torch.empty(1, QO[-1], H, DV, dtype=BF16)))
case("out_dtype_disagrees", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, 1, H, DV, dtype=BF16),
                                                                   out_dtype=FP32))
case("out_dtype_fp16_vs_out_fp32", ValueError, r"\bout\b",
     lambda: base(out=torch.empty(B, 1, H, DV, dtype=FP32), out_dtype=FP16))
case("out_float64", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, 1, H, DV, dtype=torch.float64)))
case("out_noncontig", ValueError, r"\bout\b",
     lambda: base(out=torch.empty(B, 1, DV, H, dtype=BF16).transpose(2, 3)))
case("out_misaligned", ValueError, r"\bout\b",
     lambda: base(out=torch.empty(B * H * DV + 8, dtype=BF16)[1:1 + B * H * DV].view(B, 1, H, DV)))
case("out_meta", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, 1, H, DV, dtype=BF16, device="meta")))
case("out_not_tensor", TypeError, r"\bout\b", lambda: base(out=0))
case("out_dtype_float64", ValueError, "out_dtype", lambda: base(out_dtype=torch.float64))
case("out_dtype_int32", ValueError, "out_dtype", lambda: base(out_dtype=I32))
case("out_dtype_str", TypeError, "out_dtype", lambda: base(out_dtype="bfloat16"))
# --- out's dtype must equal out_dtype (default bfloat16): out.dtype no longer decides
case("out_fp32_default_out_dtype", ValueError, r"\bout\b.*out_dtype",
     lambda: base(out=torch.empty(B, 1, H, DV, dtype=FP32)))
case("out_fp16_default_out_dtype", ValueError, r"\bout\b.*out_dtype",
     lambda: base(out=torch.empty(B, 1, H, DV, dtype=FP16)))
case("out_fp32_out_dtype_none", ValueError, r"\bout\b.*out_dtype",
     lambda: base(out=torch.empty(B, 1, H, DV, dtype=FP32), out_dtype=None))
case("out_fp32_packed_default_out_dtype", ValueError, r"\bout\b.*out_dtype",
     lambda: packed(out=torch.empty(QO[-1], H, DV, dtype=FP32)))


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in STANDALONE], ids=[c[0] for c in STANDALONE])
def test_standalone_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, prims_ts_batch_decode_with_kv_cache_mla, *args, **kwargs)


@pytest.mark.parametrize("name", ["query", "kv_cache", "block_tables", "seq_lens", "qo_indptr"])
def test_standalone_workspace_overlapping_an_input(name):
    """The workspace must not share memory with the query, the cache or a metadata tensor."""
    args, kwargs = _ws_sharing(name)
    expect(ValueError, f"workspace_buffer.*{name}", prims_ts_batch_decode_with_kv_cache_mla, *args, **kwargs)


def test_error_leaves_out_and_workspace_untouched():
    """A refused call writes nothing: the poisoned out is still all NaN, the workspace unchanged."""
    for mods in (dict(kv_lora_rank=256), dict(max_seq_len=0), dict(mask_type="full"), dict(bmm1_scale=0.0),
                 dict(seq_lens=LENS + [1]), dict(kv_cache=make_cache(d=512))):
        out = torch.full((B, 1, H, DV), float("nan"), dtype=BF16)
        ws = torch.full((ws_bytes(),), 0xA5, dtype=U8)
        args, kw = base(out=out, workspace_buffer=ws, **mods)
        expect((ValueError, TypeError), ".", prims_ts_batch_decode_with_kv_cache_mla, *args, **kw)
        assert torch.isnan(out).all(), mods
        assert (ws == 0xA5).all(), mods


# ----------------------------------------------------------------------------
# The standalone (and run(validate=False)) trusts metadata values: never reads them
# ----------------------------------------------------------------------------


def recording_no_host_reads():
    return _recording("batch_mla_decode", "batch_mla_decode", out_dim=DV)


INVALID_VALUES = [
    # seq_lens of 0 and beyond every bound; page IDs negative and past the cache (in used entries)
    dict(seq_lens=[0, 0], block_tables=[[-1, 10**6, P], [P, -5, 0]]),
    dict(seq_lens=[-7, MAX_LEN + 1000], block_tables=[[2**31 - 1, -2**31, 0], [P + 1, 0, 0]]),
]


def _check_recorded(rec, meta, tuning="", out_dtype=BF16):
    """One functional call then one out call; the metadata tensors reach both ops as themselves; the
    functional op gets the output dtype's code, both the tuning string, last."""
    assert [c[0] for c in rec.calls] == ["batch_mla_decode", "batch_mla_decode_out"]
    for _, call in rec.calls:
        ids = {id(a) for a in call if isinstance(a, torch.Tensor)}
        for m in meta:
            assert id(m) in ids, "a metadata tensor was copied or replaced before the op"
        assert call[-1] == tuning
    assert rec.calls[0][1][-2] == dtype_code(out_dtype)


@pytest.mark.parametrize("mode", ["fixed1", "fixed3", "packed"])
@pytest.mark.parametrize("which", [0, 1])
def test_standalone_trusts_metadata_values(mode, which):
    """Invalid metadata values (the caller's obligations) raise nothing on the host: they reach the
    op as the very same tensors, and no tensor value is read on the host on the way."""
    mods = dict(INVALID_VALUES[which])
    if mode == "packed":
        mods["qo_indptr"] = [3, 1, 0]  # not starting at 0, decreasing, not ending at total_q
        args, kw = packed(**mods)
    elif mode == "fixed3":
        args, kw = fixed(sq=3, **mods)  # causal with lengths below SQ, too
    else:
        args, kw = base(**mods)
    out = torch.empty(tuple(args[0].shape[:-1]) + (DV,), dtype=FP32)
    with recording_no_host_reads() as rec:
        res = prims_ts_batch_decode_with_kv_cache_mla(*args, out_dtype=FP16, **kw)
        res_out = prims_ts_batch_decode_with_kv_cache_mla(*args, out=out, out_dtype=FP32, **kw)
    assert res.shape == tuple(args[0].shape[:-1]) + (DV,) and res.dtype == FP16
    assert res_out is out
    _check_recorded(rec, (args[5], args[6]) + ((kw["qo_indptr"],) if "qo_indptr" in kw else ()), out_dtype=FP16)
    assert rec.calls[1][1][3] is out


def test_standalone_does_not_modify_metadata():
    args, kw = packed()
    before = [t.clone() for t in args[5:7]] + [kw["qo_indptr"].clone()]
    prims_ts_batch_decode_with_kv_cache_mla(*args, **kw)
    for a, b in zip(before, list(args[5:7]) + [kw["qo_indptr"]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["fixed", "packed"])
def test_wrapper_run_unvalidated_trusts_metadata_values(mode):
    """run(validate=False), the default: the bound metadata, rewritten in place after plan with values
    that break every obligation, reach the op as the bound tensors themselves, unread on the host;
    the plan's tuning reaches the op."""
    tuning = Tuning(cluster_merge=False)
    w = BatchMLADecodePagedTSWrapper(tuning=tuning)
    bt, lens = block_tables(), ip(LENS)
    qo = ip(QO) if mode == "packed" else None
    w.plan(bt, lens, H, RANK, ROPE, PS, qo_indptr=qo, o_data_type=FP32)
    q = _qp if mode == "packed" else _q
    bt.copy_(ip(INVALID_VALUES[0]["block_tables"]))
    lens.copy_(ip(INVALID_VALUES[1]["seq_lens"]))
    if qo is not None:
        qo.copy_(ip([3, 1, 0]))
    out = torch.empty(tuple(q.shape[:-1]) + (DV,), dtype=FP32)
    with recording_no_host_reads() as rec:
        w.run(q, _kv)
        assert w.run(q, _kv, out=out, validate=False) is out
    _check_recorded(rec, (bt, lens) + ((qo,) if qo is not None else ()), tuning=tuning.encode(), out_dtype=FP32)


# ----------------------------------------------------------------------------
# The standalone's static checks are cached per static key; per-call facts are not
# ----------------------------------------------------------------------------


@pytest.fixture
def counted_static_checks(monkeypatch):
    """Counts the standalone's static-check passes (the cache misses)."""
    calls = []
    real = mla_ops._standalone_checks

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(mla_ops, "_standalone_checks", counting)
    return calls


def test_standalone_static_key_cache_still_checks_per_call_inputs(counted_static_checks):
    """A second call with the same static key skips the static checks, yet every per-call input that is
    not part of the key is still refused: an out (of the cached layout) whose bytes are the query's, the
    cache's, a metadata tensor's or the workspace's, a workspace (of the cached size) inside the cache,
    and non-positive or non-finite scales. A refused call leaves the poisoned out untouched."""
    out = torch.full((B, 1, H, DV), NAN, dtype=BF16)
    args, kw = base(out=out)
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw) is out
    assert not torch.isnan(out).any()
    args, kw = base(out=out)
    assert prims_ts_batch_decode_with_kv_cache_mla(*args, **kw) is out
    assert len(counted_static_checks) == 1  # the same static key: one check pass
    n = B * H * DV
    meta, out_in_meta = _out_sharing("seq_lens")
    in_ws = torch.zeros(ws_bytes() + n * 2, dtype=U8)
    per_call = [
        (r"\bout\b.*query", base(out=_q.view(-1)[:n].view(B, 1, H, DV))),
        (r"\bout\b.*kv_cache", base(out=_kv.view(-1)[-n:].view(B, 1, H, DV))),
        (r"\bout\b.*seq_lens", base(seq_lens=meta, out=out_in_meta)),
        (r"\bout\b|workspace_buffer",
         base(workspace_buffer=in_ws[:ws_bytes()], out=in_ws[ws_bytes() - 16:][:n * 2].view(BF16).view(B, 1, H, DV))),
        ("workspace_buffer.*kv_cache", base(workspace_buffer=_kv.view(-1).view(U8)[:ws_bytes()], out=out)),
        ("bmm1_scale", base(bmm1_scale=0.0, out=out)),
        ("bmm1_scale", base(bmm1_scale=-1.0, out=out)),
        ("bmm1_scale", base(bmm1_scale=math.inf, out=out)),
        ("bmm2_scale", base(bmm2_scale=math.nan, out=out)),
        ("bmm2_scale", base(bmm2_scale=0.0, out=out)),
    ]
    for match, (a, k) in per_call:
        out.fill_(NAN)
        assert V.meta(k["out"]) == V.meta(out)  # the cached static key
        expect(ValueError, match, prims_ts_batch_decode_with_kv_cache_mla, *a, **k)
        assert torch.isnan(out).all(), match
    a, k = base(bmm2_scale=None, out=out)
    expect(TypeError, "bmm2_scale", prims_ts_batch_decode_with_kv_cache_mla, *a, **k)
    assert len(counted_static_checks) == 1, "a per-call refusal re-ran the static checks"


def test_standalone_static_key_cache_rechecks_a_changed_static_fact(counted_static_checks):
    """Another dtype, shape or scalar is another static key: its static checks run (and refuse)."""
    args, kw = base()
    prims_ts_batch_decode_with_kv_cache_mla(*args, **kw)
    assert len(counted_static_checks) == 1
    changed = [
        ("query|kv_cache", base(query=_q.half())),  # another query dtype, the cache's still bf16
        ("kv_cache|query", base(kv_cache=_kv.half())),
        (r"\bout\b.*out_dtype", base(out=torch.empty(B, 1, H, DV, dtype=FP32))),  # an out of another dtype
        ("out_dtype", base(out_dtype=torch.float64)),
        ("workspace_buffer", base(workspace_buffer=make_ws(ws_bytes() - 16))),
        ("workspace_buffer", base(max_seq_len=4096)),  # a split-KV key needs more workspace
        ("kv_lora_rank", base(kv_lora_rank=256)),
        ("mask_type", base(mask_type="full")),
        ("block_tables", base(block_tables=ip(BT, torch.int64))),
    ]
    for i, (match, (a, k)) in enumerate(changed):
        expect(ValueError, match, prims_ts_batch_decode_with_kv_cache_mla, *a, **k)
        assert len(counted_static_checks) == 2 + i, match
    args16, kw16 = base(query=_q.half(), kv_cache=_kv.half(), out_dtype=FP16)
    n = len(counted_static_checks)
    for _ in range(2):
        assert prims_ts_batch_decode_with_kv_cache_mla(*args16, **kw16).dtype == FP16
    prims_ts_batch_decode_with_kv_cache_mla(*args, **kw)
    assert len(counted_static_checks) == n + 1


# ----------------------------------------------------------------------------
# get_prims_ts_batch_decode_mla_workspace_size(batch_size, num_heads, kv_lora_rank, qk_rope_head_dim,
#                                              page_size, max_seq_len, *, seq_len_q, max_seq_len_q, ...)
# ----------------------------------------------------------------------------

WS_CASES = [
    ("batch_0", ValueError, "batch_size", dict(batch_size=0)),
    ("batch_float", TypeError, "batch_size", dict(batch_size=2.0)),
    ("heads_0", ValueError, "num_heads", dict(num_heads=0)),
    ("heads_12", ValueError, "num_heads", dict(num_heads=12)),
    ("heads_256", ValueError, "num_heads", dict(num_heads=256)),
    ("heads_float", TypeError, "num_heads", dict(num_heads=8.0)),
    ("kv_lora_rank_256", ValueError, "kv_lora_rank", dict(kv_lora_rank=256)),
    ("kv_lora_rank_float", TypeError, "kv_lora_rank", dict(kv_lora_rank=512.0)),
    ("qk_rope_head_dim_32", ValueError, "qk_rope_head_dim", dict(qk_rope_head_dim=32)),
    ("qk_rope_head_dim_str", TypeError, "qk_rope_head_dim", dict(qk_rope_head_dim="64")),
    # the old positional order (batch, heads, max_seq_len, max_seq_len_q, ...) lands a length in kv_lora_rank
    ("old_positional_order", ValueError, "kv_lora_rank", dict(kv_lora_rank=MAX_LEN, qk_rope_head_dim=1)),
    ("page_size_8", ValueError, "page_size", dict(page_size=8)),
    ("page_size_48", ValueError, "page_size", dict(page_size=48)),
    ("page_size_str", TypeError, "page_size", dict(page_size="16")),
    ("max_seq_len_0", ValueError, "max_seq_len", dict(max_seq_len=0)),
    ("max_seq_len_past_bound", ValueError, "max_seq_len", dict(max_seq_len=BOUND + 1)),
    ("max_seq_len_float", TypeError, "max_seq_len", dict(max_seq_len=32.0)),
    ("max_seq_len_q_0", ValueError, "max_seq_len_q", dict(max_seq_len_q=0)),
    ("max_seq_len_q_float", TypeError, "max_seq_len_q", dict(max_seq_len_q=1.0)),
    ("seq_len_q_0", ValueError, "seq_len_q", dict(seq_len_q=0)),
    ("seq_len_q_vs_max_seq_len_q", ValueError, "max_seq_len_q|seq_len_q", dict(seq_len_q=2, max_seq_len_q=3)),
    ("q_dtype_float32", ValueError, "q_dtype", dict(q_dtype=FP32)),
    ("q_dtype_str", TypeError, "q_dtype", dict(q_dtype="bfloat16")),
    ("kv_dtype_vs_q_dtype", ValueError, "kv_dtype", dict(kv_dtype=FP16)),
    ("out_dtype_float64", ValueError, "out_dtype", dict(out_dtype=torch.float64)),
    ("out_dtype_str", TypeError, "out_dtype", dict(out_dtype="float32")),
    ("mask_unknown", ValueError, "mask_type", dict(mask_type="full")),
]


@pytest.mark.parametrize("exc,match,mods", [c[1:] for c in WS_CASES], ids=[c[0] for c in WS_CASES])
def test_workspace_size_errors(exc, match, mods):
    kw = dict(batch_size=B, num_heads=H, kv_lora_rank=RANK, qk_rope_head_dim=ROPE, page_size=PS, max_seq_len=MAX_LEN)
    kw.update(mods)
    with pytest.raises(exc, match=match):
        get_prims_ts_batch_decode_mla_workspace_size(
            kw.pop("batch_size"), kw.pop("num_heads"), kw.pop("kv_lora_rank"), kw.pop("qk_rope_head_dim"),
            kw.pop("page_size"), kw.pop("max_seq_len"), device="cpu", **kw)


def test_workspace_size_properties():
    """A positive int, deterministic, at least 256, the same for a device string and a torch.device,
    never shrinking as max_seq_len or the query bound grows, and the minimum for a one-split key."""
    G = get_prims_ts_batch_decode_mla_workspace_size
    for b in (1, 2, 7, 64):
        for h in (8, 16, 32, 64, 128):
            for msq in (1, 2, 4):
                prev = 0
                for L in (1, 64, 127, 128, 500, 1000, 4096, 8192, 65536, 131072, BOUND):
                    n = G(b, h, RANK, ROPE, PS, L, max_seq_len_q=msq, device="cpu")
                    assert type(n) is int and n >= 256
                    assert n == G(b, h, RANK, ROPE, PS, L, seq_len_q=msq, device=torch.device("cpu"))
                    assert n >= prev, (b, h, msq, L)
                    prev = n
                    if msq > 1:
                        assert n >= G(b, h, RANK, ROPE, PS, L, max_seq_len_q=msq - 1, device="cpu")
    assert ws_bytes() == ws_bytes(max_seq_len_q=3) == 256  # premises of the workspace cases above
    assert ws_bytes(max_seq_len=4096) > ws_bytes()
    assert ws_bytes(max_seq_len=4096, max_seq_len_q=3) > ws_bytes(max_seq_len=4096)
    assert ws_bytes(max_seq_len=4096, h=32) > ws_bytes(max_seq_len=4096)
    # the default query bound is 1 (seq_len_q and max_seq_len_q left out, or None); positional arguments work
    assert G(B, H, RANK, ROPE, PS, 4096, device="cpu") == ws_bytes(max_seq_len=4096)
    assert G(B, H, RANK, ROPE, PS, 4096, seq_len_q=None, max_seq_len_q=None, q_dtype=FP16, kv_dtype=FP16,
             out_dtype=FP32, mask_type="dense", device="cpu") == ws_bytes(max_seq_len=4096)


# ----------------------------------------------------------------------------
# One-shot batch_mla_decode_with_paged_kv_cache: values are read and checked
# ----------------------------------------------------------------------------


def oneshot(**mods):
    args = dict(query=_q, kv_cache=_kv, block_tables=block_tables(), seq_lens=ip(LENS))
    kwargs = {}
    for key, val in mods.items():
        if isinstance(val, list) and key in META:
            val = block_tables(val) if key == "block_tables" else ip(val)
        (args if key in args else kwargs)[key] = val
    return tuple(args.values()), kwargs


def oneshot_packed(**mods):
    kw = dict(query=_qp, qo_indptr=QO)
    kw.update(mods)
    return oneshot(**kw)


def test_oneshot_base_is_valid():
    for args, kw in (oneshot(), oneshot(kv_cache=_kv4, mask_type="dense"), oneshot_packed(),
                     oneshot_packed(max_seq_len_q=7, max_kv_len=3 * PS), oneshot(query=_q3, max_seq_len_q=3),
                     # lengths at the block-table row capacity (3 pages of 16)
                     oneshot(block_tables=[[3, 1, 7], [5, 0, 2]], seq_lens=[48, 48]),
                     oneshot(kv_cache=_kv[:6]),  # exactly max used page ID + 1 pages
                     oneshot(query=make_q(sq=3), seq_lens=[3, 3]),  # causal q_len == seq_len
                     oneshot(query=make_q(sq=4), seq_lens=[3, 1], mask_type="dense")):  # dense q_len > seq_len
        res = batch_mla_decode_with_paged_kv_cache(*args, **kw)
        assert res.shape == tuple(args[0].shape[:-1]) + (DV,) and res.dtype == BF16
        assert torch.isfinite(res).all()
    args, kw = oneshot(out_dtype=FP32)
    out = torch.empty(B, 1, H, DV, dtype=FP32)
    assert batch_mla_decode_with_paged_kv_cache(*args, out=out, **kw) is out
    assert batch_decode_mla_with_paged_kv_cache is batch_mla_decode_with_paged_kv_cache


ONESHOT_CASES = [
    # --- seq_lens < 1 or beyond the block-table row (or the explicit max_kv_len)
    ("seq_lens_0", ValueError, "seq_lens", lambda: oneshot(seq_lens=[0, 5])),
    ("seq_lens_negative", ValueError, "seq_lens", lambda: oneshot(seq_lens=[20, -1])),
    ("seq_lens_past_row", ValueError, "seq_lens|block_tables", lambda: oneshot(seq_lens=[20, 3 * PS + 1])),
    ("seq_lens_past_narrow_row", ValueError, "seq_lens|block_tables",
     lambda: oneshot(block_tables=[[3], [5]], seq_lens=[PS + 1, 5])),
    ("seq_lens_past_max_kv_len", ValueError, "seq_lens", lambda: oneshot(max_kv_len=19)),
    ("seq_lens_int_max", ValueError, "seq_lens", lambda: oneshot(seq_lens=[20, 2**31 - 1])),
    ("max_kv_len_past_table_columns", ValueError, "block_tables", lambda: oneshot(max_kv_len=3 * PS + 1)),
    # --- a used page ID out of range
    ("page_id_eq_num_pages", ValueError, "block_tables", lambda: oneshot(block_tables=[[3, P, -1], [5, 0, 0]])),
    ("page_id_past_smaller_cache", ValueError, "block_tables", lambda: oneshot(kv_cache=_kv[:5])),
    ("page_id_past_cache4d", ValueError, "block_tables", lambda: oneshot(kv_cache=_kv4[:4])),
    ("page_id_negative", ValueError, "block_tables", lambda: oneshot(block_tables=[[3, 1, 0], [-1, 0, 0]])),
    ("page_id_int_min", ValueError, "block_tables", lambda: oneshot(block_tables=[[-2**31, 1, 0], [5, 0, 0]])),
    ("page_id_int_max", ValueError, "block_tables", lambda: oneshot(block_tables=[[3, 2**31 - 1, 0], [5, 0, 0]])),
    ("page_id_in_longer_request", ValueError, "block_tables", lambda: oneshot(seq_lens=[20, 17])),  # uses 99
    # --- malformed qo_indptr
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: oneshot_packed(qo_indptr=[1, 3, 5])),
    ("qo_decreasing", ValueError, "qo_indptr", lambda: oneshot_packed(qo_indptr=[0, 4, 3])),
    ("qo_empty_request", ValueError, "qo_indptr", lambda: oneshot_packed(qo_indptr=[0, 0, 5])),
    ("qo_end_short", ValueError, "qo_indptr|query", lambda: oneshot_packed(qo_indptr=[0, 2, 4])),
    ("qo_end_past", ValueError, "qo_indptr|query", lambda: oneshot_packed(qo_indptr=[0, 3, 6])),
    ("qo_negative", ValueError, "qo_indptr", lambda: oneshot_packed(qo_indptr=[0, -1, 5])),
    ("qo_wrong_length", ValueError, "qo_indptr|block_tables|seq_lens",
     lambda: oneshot_packed(qo_indptr=[0, 1, 3, 5])),
    ("qo_int64", ValueError, "qo_indptr", lambda: oneshot_packed(qo_indptr=ip(QO, torch.int64))),
    ("qo_single_entry", ValueError, "qo_indptr", lambda: oneshot_packed(qo_indptr=[0])),
    ("qo_delta_past_max_seq_len_q", ValueError, "max_seq_len_q", lambda: oneshot_packed(max_seq_len_q=2)),
    ("packed_query_rank4", ValueError, "query", lambda: oneshot_packed(query=_qp.unsqueeze(0))),
    # --- explicit max_seq_len_q that contradicts a fixed query
    ("fixed_max_seq_len_q_2_for_sq1", ValueError, "max_seq_len_q", lambda: oneshot(max_seq_len_q=2)),
    ("fixed_max_seq_len_q_4_for_sq3", ValueError, "max_seq_len_q", lambda: oneshot(query=_q3, max_seq_len_q=4)),
    ("fixed_max_seq_len_q_1_for_sq3", ValueError, "max_seq_len_q", lambda: oneshot(query=_q3, max_seq_len_q=1)),
    ("max_seq_len_q_zero", ValueError, "max_seq_len_q", lambda: oneshot_packed(max_seq_len_q=0)),
    # --- causal with q_len > seq_len
    ("causal_fixed_sq3_len2", ValueError, "causal", lambda: oneshot(query=_q3, seq_lens=[20, 2])),
    ("causal_packed_q3_len2", ValueError, "causal", lambda: oneshot_packed(seq_lens=[2, 5])),
    ("causal_packed_q2_len1", ValueError, "causal", lambda: oneshot_packed(seq_lens=[20, 1])),
    # --- max_kv_len
    ("max_kv_len_0", ValueError, "max_kv_len", lambda: oneshot(max_kv_len=0)),
    ("max_kv_len_past_bound", ValueError, "max_kv_len", lambda: oneshot(max_kv_len=BOUND + 1)),
    ("max_kv_len_float", TypeError, "max_kv_len", lambda: oneshot(max_kv_len=32.0)),
    # --- static errors through the one-shot
    ("kv_lora_rank_256", ValueError, "kv_lora_rank", lambda: oneshot(kv_lora_rank=256)),
    ("qk_rope_head_dim_32", ValueError, "qk_rope_head_dim", lambda: oneshot(qk_rope_head_dim=32)),
    ("query_last_dim_512", ValueError, "query", lambda: oneshot(query=make_q(d=512))),
    ("cache_last_dim_512", ValueError, "kv_cache", lambda: oneshot(kv_cache=make_cache(d=512))),
    ("cache_rank2", ValueError, "kv_cache", lambda: oneshot(kv_cache=_kv[0])),
    ("cache_rank5", ValueError, "kv_cache", lambda: oneshot(kv_cache=_kv4.unsqueeze(0))),
    ("cache4d_dim1_2", ValueError, "kv_cache", lambda: oneshot(kv_cache=_kv.view(P // 2, 2, PS, DQK))),
    ("page_size_8", ValueError, "kv_cache", lambda: oneshot(kv_cache=make_cache(ps=8))),
    ("query_fp16_cache_bf16", ValueError, "query|kv_cache", lambda: oneshot(query=_q.half())),
    ("query_bf16_cache_fp16", ValueError, "query|kv_cache", lambda: oneshot(kv_cache=_kv.half())),
    ("query_float32", ValueError, "query", lambda: oneshot(query=_q.float(), kv_cache=_kv.float())),
    ("query_heads_12", ValueError, "query", lambda: oneshot(query=make_q(h=12))),
    ("query_rank3_without_qo", ValueError, "query", lambda: oneshot(query=_q[:, 0])),
    ("query_misaligned", ValueError, "query", lambda: oneshot(query=_misaligned(_q))),
    ("block_tables_int64", ValueError, "block_tables", lambda: oneshot(block_tables=ip(BT, torch.int64))),
    ("block_tables_rows_overlap", ValueError, "block_tables", lambda: oneshot(block_tables=_overlapping_rows())),
    ("block_tables_rows", ValueError, "block_tables|seq_lens", lambda: oneshot(block_tables=BT[:1])),
    ("seq_lens_int64", ValueError, "seq_lens", lambda: oneshot(seq_lens=ip(LENS, torch.int64))),
    ("seq_lens_length", ValueError, "seq_lens|block_tables", lambda: oneshot(seq_lens=[20])),
    ("seq_lens_meta", ValueError, "seq_lens", lambda: oneshot(seq_lens=ip(LENS).to("meta"))),
    ("mask_unknown", ValueError, "mask_type", lambda: oneshot(mask_type="sliding")),
    ("bmm1_scale_nan", ValueError, "bmm1_scale", lambda: oneshot(bmm1_scale=math.nan)),
    ("bmm2_scale_zero", ValueError, "bmm2_scale", lambda: oneshot(bmm2_scale=0.0)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda: oneshot(out_dtype=torch.float64)),
    ("out_dtype_str", TypeError, "out_dtype", lambda: oneshot(out_dtype="float32")),
    # --- overlapping out
    ("out_in_query", ValueError, r"\bout\b.*query",
     lambda: oneshot(out=_q.view(-1)[:B * H * DV].view(B, 1, H, DV))),
    ("out_in_cache", ValueError, r"\bout\b.*kv_cache",
     lambda: oneshot(out=_kv.view(-1)[-B * H * DV:].view(B, 1, H, DV))),
    ("out_over_block_tables", ValueError, r"\bout\b.*block_tables",
     lambda: oneshot(**dict(zip(("block_tables", "out"), _out_sharing("block_tables"))))),
    ("out_over_seq_lens", ValueError, r"\bout\b.*seq_lens",
     lambda: oneshot(**dict(zip(("seq_lens", "out"), _out_sharing("seq_lens"))))),
    ("out_over_qo_indptr", ValueError, r"\bout\b.*qo_indptr",
     lambda: oneshot_packed(**dict(zip(("qo_indptr", "out"), _out_sharing("qo_indptr"))))),
    ("out_wrong_shape", ValueError, r"\bout\b", lambda: oneshot(out=torch.empty(B, 1, H, DQK, dtype=BF16))),
    ("out_dtype_disagrees", ValueError, r"\bout\b",
     lambda: oneshot(out=torch.empty(B, 1, H, DV, dtype=FP16), out_dtype=FP32)),
    # --- out's dtype must equal out_dtype (default bfloat16)
    ("out_fp32_default_out_dtype", ValueError, r"\bout\b.*out_dtype",
     lambda: oneshot(out=torch.empty(B, 1, H, DV, dtype=FP32))),
    ("out_fp16_packed_default_out_dtype", ValueError, r"\bout\b.*out_dtype",
     lambda: oneshot_packed(out=torch.empty(QO[-1], H, DV, dtype=FP16))),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in ONESHOT_CASES], ids=[c[0] for c in ONESHOT_CASES])
def test_oneshot_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, batch_mla_decode_with_paged_kv_cache, *args, **kwargs)


def test_oneshot_static_checks_once_per_static_key(monkeypatch):
    """A second one-shot with the same static facts skips the static checks (the query's, the
    cache's, the plan arguments', out's shape and dtype), yet what is not in that key is still
    refused every call: a misaligned query, an out sharing bytes with an input, bad lengths,
    page IDs and query offsets."""
    calls = []
    real = mla_ops._oneshot_checks
    monkeypatch.setattr(mla_ops, "_oneshot_checks", lambda *a: calls.append(1) or real(*a))
    out = torch.empty(B, 1, H, DV, dtype=BF16)
    for _ in range(2):
        args, kw = oneshot(out=out)
        batch_mla_decode_with_paged_kv_cache(*args, **kw)
    assert len(calls) == 1
    wide = torch.zeros(_q.numel() + 8, dtype=BF16)
    per_call = [
        (r"query", oneshot(query=wide[1:1 + _q.numel()].view(_q.shape), out=out)),
        (r"\bout\b.*\bquery\b", oneshot(out=_q.view(-1)[:out.numel()].view(out.shape))),
        (r"\bout\b.*aligned", oneshot(out=torch.zeros(out.numel() + 8, dtype=BF16)[1:1 + out.numel()].view(out.shape))),
        ("seq_lens", oneshot(seq_lens=[0, 5], out=out)),
        ("block_tables", oneshot(block_tables=[[3, P, -1], [5, 0, 0]], out=out)),
    ]
    for match, (a, k) in per_call:
        expect(ValueError, match, batch_mla_decode_with_paged_kv_cache, *a, **k)
    assert len(calls) == 1  # every refused call had the first one's static facts
    pout = torch.empty(QO[-1], H, DV, dtype=BF16)
    args, kw = oneshot_packed(out=pout)
    batch_mla_decode_with_paged_kv_cache(*args, **kw)
    assert len(calls) == 2
    args, kw = oneshot_packed(qo_indptr=[0, 3, 4], out=pout)
    expect(ValueError, "qo_indptr", batch_mla_decode_with_paged_kv_cache, *args, **kw)
    assert len(calls) == 2


# ----------------------------------------------------------------------------
# BatchMLADecodePagedTSWrapper(*, tuning): plan(block_tables, seq_lens, num_heads, kv_lora_rank,
#                                                qk_rope_head_dim, page_size, *, ...)
# ----------------------------------------------------------------------------



def plan_args(block_tables_=BT, seq_lens=LENS, num_heads=H, page_size=PS, **kw):
    bt = block_tables(block_tables_) if isinstance(block_tables_, list) else block_tables_
    sl = ip(seq_lens) if isinstance(seq_lens, list) else seq_lens
    if isinstance(kw.get("qo_indptr"), list):
        kw["qo_indptr"] = ip(kw["qo_indptr"])
    args = dict(block_tables=bt, seq_lens=sl, num_heads=num_heads, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                page_size=page_size)
    for key in ("kv_lora_rank", "qk_rope_head_dim"):
        if key in kw:
            args[key] = kw.pop(key)
    return tuple(args.values()), {k: v for k, v in kw.items() if v is not DROP}


PLAN_CASES = [
    # --- seq_lens (read once at plan)
    ("seq_lens_0", ValueError, "seq_lens", lambda: plan_args(seq_lens=[0, 5])),
    ("seq_lens_negative", ValueError, "seq_lens", lambda: plan_args(seq_lens=[-4, 5])),
    ("seq_lens_past_max_kv_len", ValueError, "seq_lens|max_kv_len", lambda: plan_args(max_kv_len=19)),
    ("seq_lens_past_bound", ValueError, "seq_lens", lambda: plan_args(seq_lens=[20, 2**31 - 1])),
    ("seq_lens_empty", ValueError, "seq_lens", lambda: plan_args(block_tables_=ip(BT)[:0], seq_lens=[])),
    ("seq_lens_int64", ValueError, "seq_lens", lambda: plan_args(seq_lens=ip(LENS, torch.int64))),
    ("seq_lens_rank2", ValueError, "seq_lens", lambda: plan_args(seq_lens=ip([LENS]))),
    ("seq_lens_noncontig", ValueError, "seq_lens", lambda: plan_args(seq_lens=ip([20, 9, 5, 9])[::2])),
    ("seq_lens_list", TypeError, "seq_lens", lambda: plan_args(seq_lens=tuple(LENS))),
    ("seq_lens_meta", ValueError, "seq_lens", lambda: plan_args(seq_lens=ip(LENS).to("meta"))),
    # --- block_tables (bound: run reads it live)
    ("block_tables_int64", ValueError, "block_tables", lambda: plan_args(block_tables_=ip(BT, torch.int64))),
    ("block_tables_uint32", ValueError, "block_tables", lambda: plan_args(block_tables_=ip(BT).view(torch.uint32))),
    ("block_tables_rank1", ValueError, "block_tables", lambda: plan_args(block_tables_=ip(BT[0]))),
    ("block_tables_rank3", ValueError, "block_tables", lambda: plan_args(block_tables_=ip([BT]))),
    ("block_tables_rows_B_plus_1", ValueError, "block_tables", lambda: plan_args(block_tables_=BT + [[0, 0, 0]])),
    ("block_tables_rows_B_minus_1", ValueError, "block_tables", lambda: plan_args(block_tables_=BT[:1])),
    ("block_tables_no_columns", ValueError, "block_tables", lambda: plan_args(block_tables_=ip(BT)[:, :0])),
    ("block_tables_column_stride_2", ValueError, "block_tables",
     lambda: plan_args(block_tables_=ip([[3, 0, 1, 0, 7, 0], [5, 0, 0, 0, 2, 0]])[:, ::2])),
    ("block_tables_rows_overlap", ValueError, "block_tables", lambda: plan_args(block_tables_=_overlapping_rows())),
    ("block_tables_meta", ValueError, "block_tables", lambda: plan_args(block_tables_=ip(BT).to("meta"))),
    ("block_tables_tuple", TypeError, "block_tables", lambda: plan_args(block_tables_=tuple(map(tuple, BT)))),
    ("block_tables_columns_below_longest", ValueError, "block_tables",
     lambda: plan_args(block_tables_=[[3], [5]])),  # request 0 (20 tokens) needs 2 pages
    ("block_tables_columns_below_max_kv_len", ValueError, "block_tables",
     lambda: plan_args(max_kv_len=3 * PS + 1)),  # 4 pages of 16; the table has 3 columns
    # --- qo_indptr (read once, bound)
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[1, 3, 5])),
    ("qo_decreasing", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 3, 2])),
    ("qo_empty_request", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 3, 3])),
    ("qo_wrong_length", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 1, 3, 5])),
    ("qo_int64", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=ip(QO, torch.int64))),
    ("qo_meta", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=ip(QO).to("meta"))),
    ("qo_tuple", TypeError, "qo_indptr", lambda: plan_args(qo_indptr=tuple(QO))),
    ("packed_seq_len_q_2", ValueError, "seq_len_q", lambda: plan_args(qo_indptr=QO, seq_len_q=2)),
    ("max_seq_len_q_below_qo", ValueError, "max_seq_len_q", lambda: plan_args(qo_indptr=QO, max_seq_len_q=2)),
    ("packed_max_seq_len_q_zero", ValueError, "max_seq_len_q", lambda: plan_args(qo_indptr=QO, max_seq_len_q=0)),
    # --- a fixed query's SQ: seq_len_q or its alias max_seq_len_q (which must agree)
    ("max_seq_len_q_zero", ValueError, "max_seq_len_q", lambda: plan_args(max_seq_len_q=0)),
    ("max_seq_len_q_float", TypeError, "max_seq_len_q", lambda: plan_args(max_seq_len_q=1.0)),
    ("seq_len_q_zero", ValueError, "seq_len_q", lambda: plan_args(seq_len_q=0)),
    ("seq_len_q_float", TypeError, "seq_len_q", lambda: plan_args(seq_len_q=2.0)),
    ("seq_len_q_vs_max_seq_len_q", ValueError, "max_seq_len_q|seq_len_q",
     lambda: plan_args(seq_len_q=2, max_seq_len_q=3)),
    ("causal_fixed_sq_past_len", ValueError, "causal", lambda: plan_args(max_seq_len_q=6)),
    ("causal_fixed_seq_len_q_past_len", ValueError, "causal", lambda: plan_args(seq_len_q=6)),
    ("causal_packed_q_past_len", ValueError, "causal", lambda: plan_args(seq_lens=[2, 5], qo_indptr=QO)),
    # --- static arguments
    ("max_kv_len_0", ValueError, "max_kv_len", lambda: plan_args(max_kv_len=0)),
    ("max_kv_len_past_bound", ValueError, "max_kv_len", lambda: plan_args(max_kv_len=BOUND + 1)),
    ("max_kv_len_str", TypeError, "max_kv_len", lambda: plan_args(max_kv_len="32")),
    ("num_heads_12", ValueError, "num_heads", lambda: plan_args(num_heads=12)),
    ("num_heads_0", ValueError, "num_heads", lambda: plan_args(num_heads=0)),
    ("num_heads_float", TypeError, "num_heads", lambda: plan_args(num_heads=8.0)),
    ("page_size_8", ValueError, "page_size", lambda: plan_args(page_size=8)),
    ("page_size_48", ValueError, "page_size", lambda: plan_args(page_size=48)),
    ("page_size_str", TypeError, "page_size", lambda: plan_args(page_size="16")),
    ("kv_lora_rank_256", ValueError, "kv_lora_rank", lambda: plan_args(kv_lora_rank=256)),
    ("kv_lora_rank_none", TypeError, "kv_lora_rank", lambda: plan_args(kv_lora_rank=None)),
    ("qk_rope_head_dim_32", ValueError, "qk_rope_head_dim", lambda: plan_args(qk_rope_head_dim=32)),
    ("mask_unknown", ValueError, "mask_type", lambda: plan_args(mask_type="full")),
    ("q_data_type_str", TypeError, "q_data_type", lambda: plan_args(q_data_type="bfloat16")),
    ("q_data_type_float32", ValueError, "q_data_type", lambda: plan_args(q_data_type=FP32)),
    ("kv_data_type_vs_q_data_type", ValueError, "kv_data_type", lambda: plan_args(kv_data_type=FP16)),
    ("kv_data_type_str", TypeError, "kv_data_type", lambda: plan_args(kv_data_type="bfloat16")),
    ("o_data_type_float64", ValueError, "o_data_type", lambda: plan_args(o_data_type=torch.float64)),
    ("o_data_type_str", TypeError, "o_data_type", lambda: plan_args(o_data_type="float32")),
]


@pytest.mark.parametrize("exc,match,make",
                         [pytest.param(*c[1:4], marks=c[4] if len(c) > 4 else (), id=c[0]) for c in PLAN_CASES])
def test_wrapper_plan_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, BatchMLADecodePagedTSWrapper().plan, *args, **kwargs)


def test_wrapper_constructor_and_device_rules():
    """The wrapper owns its workspace: the old positional workspace_buffer is refused (not ignored).
    plan reads values (metadata on the meta device cannot be planned from) and binds its tensors,
    which must share a device; run refuses a query or cache on another device than the plan's."""
    with pytest.raises(TypeError):
        BatchMLADecodePagedTSWrapper(torch.zeros(256, dtype=U8))
    expect(ValueError, "seq_lens", BatchMLADecodePagedTSWrapper().plan, ip(BT).to("meta"), ip(LENS).to("meta"), H,
           RANK, ROPE, PS)
    expect(ValueError, "block_tables|seq_lens", BatchMLADecodePagedTSWrapper().plan, block_tables(),
           ip(LENS).to("meta"), H, RANK, ROPE, PS)
    expect(ValueError, "qo_indptr", BatchMLADecodePagedTSWrapper().plan, block_tables(), ip(LENS), H, RANK, ROPE, PS,
           qo_indptr=ip(QO).to("meta"))
    w = planned()
    expect(ValueError, "query|kv_cache", w.run, _q.to("meta"), _kv)
    expect(ValueError, "query", w.run, _q.to("meta"), _kv.to("meta"))
    expect(ValueError, "kv_cache|query", w.run, _q, _kv.to("meta"))


def test_wrapper_owns_a_zeroed_workspace_large_enough():
    """Each plan allocates (zeroed) at least the standalone's workspace for its key."""
    for kw, need in ((dict(), ws_bytes()), (dict(max_kv_len=3 * PS), ws_bytes(max_seq_len=3 * PS)),
                     (dict(qo_indptr=QO, max_seq_len_q=3), ws_bytes(max_seq_len_q=3))):
        w = BatchMLADecodePagedTSWrapper()
        args, kwargs = plan_args(**kw)
        w.plan(*args, **kwargs)
        ws = w._plan.workspace
        assert ws.dtype == U8 and ws.numel() >= need and not ws.any()
    wide = block_tables([[3, 1, 7] + [0] * 253, [5, 2, 0] + [0] * 253])
    w = BatchMLADecodePagedTSWrapper()
    w.plan(wide, ip(LENS), 64, RANK, ROPE, PS, max_kv_len=4096)
    assert w._plan.workspace.numel() >= ws_bytes(h=64, max_seq_len=4096) > 256


def test_wrapper_plan_accepts_edge_values():
    for args, kw in (plan_args(max_kv_len=20), plan_args(max_kv_len=3 * PS),
                     plan_args(qo_indptr=QO, max_seq_len_q=3), plan_args(qo_indptr=QO, max_seq_len_q=40),
                     plan_args(qo_indptr=QO, seq_len_q=1), plan_args(max_seq_len_q=5), plan_args(seq_len_q=5),
                     plan_args(seq_len_q=5, max_seq_len_q=5), plan_args(max_seq_len_q=6, mask_type="dense"),
                     plan_args(block_tables_=[[3]], seq_lens=[1], max_kv_len=1),
                     plan_args(block_tables_=[[3], [5]], seq_lens=[16, 5]),  # one column holds 16 tokens
                     plan_args(q_data_type=FP16, kv_data_type=FP16, o_data_type=FP32),
                     plan_args(o_data_type=None), plan_args(block_tables_=ip(BT))):
        BatchMLADecodePagedTSWrapper().plan(*args, **kw)


def test_failed_plan_keeps_the_previous_plan():
    w = planned()
    want = w.run(_q, _kv)
    args, kwargs = plan_args(max_kv_len=3 * PS + 1)
    expect(ValueError, "block_tables", w.plan, *args, **kwargs)
    torch.testing.assert_close(w.run(_q, _kv), want, rtol=0, atol=0)


# ----------------------------------------------------------------------------
# BatchMLADecodePagedTSWrapper.run(query, kv_cache, *, bmm1_scale, bmm2_scale, out, validate=False)
# ----------------------------------------------------------------------------


def planned(packed_q=False, bound=None, **kw):
    """A planned wrapper (plan_args() metadata); ``bound``, when given, receives the bound tensors."""
    w = BatchMLADecodePagedTSWrapper()
    if packed_q:
        kw.setdefault("qo_indptr", QO)
    args, kwargs = plan_args(**kw)
    w.plan(*args, **kwargs)
    if bound is not None:
        bound.update(block_tables=args[0], seq_lens=args[1], qo_indptr=kwargs.get("qo_indptr"))
    return w


def run_args(**mods):
    """(query, kv_cache) + run kwargs for a plan_args() wrapper."""
    args = dict(query=_q, kv_cache=_kv)
    kw = {}
    for key, val in mods.items():
        (args if key in args else kw)[key] = val
    return tuple(args.values()), kw


def test_wrapper_run_before_plan():
    with pytest.raises(RuntimeError, match=r"^plan\(\) must be called before run\(\)$"):
        BatchMLADecodePagedTSWrapper().run(_q, _kv)
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        BatchMLADecodePagedTSWrapper(tuning=Tuning(cluster_merge=False)).run(_q, _kv, validate=True)


def test_wrapper_base_runs_are_valid():
    w = planned()
    for validate in (True, False):
        out = torch.empty(B, 1, H, DV, dtype=BF16)
        assert w.run(_q, _kv, out=out, validate=validate) is out
        assert w.run(_q, _kv4[:6], validate=validate, bmm1_scale=0.05, bmm2_scale=2.0).shape == (B, 1, H, DV)
    wp = planned(packed_q=True)
    for validate in (True, False):
        assert wp.run(_qp, _kv, validate=validate).shape == (QO[-1], H, DV)
    # live metadata different from the plan's, within its bounds (rewritten in place)
    bound = {}
    w = planned(max_kv_len=48, bound=bound)
    bound["block_tables"].copy_(ip([[3, 1, 7], [5, 2, 0]]))
    bound["seq_lens"].copy_(ip([48, 33]))
    assert w.run(_q, _kv, validate=True).shape == (B, 1, H, DV)


RUN_CASES = [
    # (id, plan kwargs, exc, match, in-place rewrites of the bound metadata, run mods)
    ("seq_lens_0", {}, ValueError, "seq_lens", dict(seq_lens=[0, 5]), {}),
    ("seq_lens_past_planned_max_kv_len", {}, ValueError, "seq_lens", dict(seq_lens=[21, 5]), {}),
    ("seq_lens_past_explicit_max_kv_len", dict(max_kv_len=40), ValueError, "seq_lens", dict(seq_lens=[20, 41]), {}),
    ("page_id_past_cache", {}, ValueError, "block_tables", {}, dict(kv_cache=_kv[:5])),
    ("page_id_past_cache4d", {}, ValueError, "block_tables", {}, dict(kv_cache=_kv4[:3])),
    ("page_id_negative", {}, ValueError, "block_tables", dict(block_tables=[[3, -1, 0], [5, 0, 0]]), {}),
    ("page_id_in_longer_request", dict(max_kv_len=48), ValueError, "block_tables", dict(seq_lens=[20, 17]), {}),
    ("causal_sq_past_len", dict(max_seq_len_q=3), ValueError, "causal", dict(seq_lens=[20, 2]), dict(query=_q3)),
    ("qo_end", dict(packed_q=True), ValueError, "qo_indptr", dict(qo_indptr=[0, 3, 4]), dict(query=_qp)),
    ("qo_not_start_0", dict(packed_q=True), ValueError, "qo_indptr", dict(qo_indptr=[1, 3, 5]), dict(query=_qp)),
    ("qo_decreasing", dict(packed_q=True), ValueError, "qo_indptr", dict(qo_indptr=[0, 4, 3]), dict(query=_qp)),
    ("qo_past_planned_max_seq_len_q", dict(packed_q=True), ValueError, "qo_indptr",
     dict(qo_indptr=[0, 1, 5]), dict(query=_qp)),
    ("qo_causal_past_len", dict(packed_q=True), ValueError, "causal",
     dict(qo_indptr=[0, 2, 5], seq_lens=[20, 2]), dict(query=_qp)),
]


@pytest.mark.parametrize("plan_kw,exc,match,rewrite,mods", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_wrapper_run_validate_errors(plan_kw, exc, match, rewrite, mods):
    """run(validate=True) checks the live values of the bound metadata (rewritten in place after plan);
    run(validate=False) trusts them."""
    bound = {}
    w = planned(bound=bound, **plan_kw)
    args, kw = run_args(**mods)
    if rewrite:
        w.run(*args, validate=True, **kw)  # the planned values pass; the rewrite below breaks them
    for key, values in rewrite.items():
        bound[key].copy_(ip(values))
    expect(exc, match, w.run, *args, validate=True, **kw)
    with recording_no_host_reads():
        w.run(*args, **kw, validate=False)  # accepted unread
        w.run(*args, **kw)  # validate defaults to False


STATIC_RUN_CASES = [
    ("packed_plan_fixed_query", dict(packed_q=True), ValueError, "query", dict(query=_q)),
    ("packed_plan_rows_4", dict(packed_q=True), ValueError, "query", dict(query=_qp[:4])),
    ("fixed_plan_packed_query", {}, ValueError, "query", dict(query=_qp)),
    ("query_heads_vs_plan", {}, ValueError, "query", dict(query=make_q(h=16))),
    ("query_sq_vs_plan", {}, ValueError, "query", dict(query=_q3)),
    ("query_batch_vs_plan", {}, ValueError, "query", dict(query=make_q(b=3))),
    ("query_fp16_vs_plan", {}, ValueError, "query", dict(query=_q.half(), kv_cache=_kv.half())),
    ("query_bf16_vs_plan_fp16", dict(q_data_type=FP16), ValueError, "query", {}),
    ("query_last_dim_512", {}, ValueError, "query", dict(query=make_q(d=512))),
    ("query_not_tensor", {}, TypeError, "query", dict(query=_q.tolist())),
    ("cache_dtype_vs_query", {}, ValueError, "query|kv_cache", dict(kv_cache=_kv.half())),
    ("cache_page_size_vs_plan", {}, ValueError, "kv_cache|page", dict(kv_cache=make_cache(ps=32))),
    ("cache_last_dim_512", {}, ValueError, "kv_cache", dict(kv_cache=make_cache(d=512))),
    ("cache_rank2", {}, ValueError, "kv_cache", dict(kv_cache=_kv[0])),
    ("cache4d_dim1_2", {}, ValueError, "kv_cache", dict(kv_cache=_kv.view(P // 2, 2, PS, DQK))),
    ("cache_misaligned", {}, ValueError, "kv_cache", dict(kv_cache=_misaligned(_kv))),
    ("cache_inner_noncontig", {}, ValueError, "kv_cache", dict(kv_cache=_noncontig_inner(_kv))),
    ("cache_tuple", {}, TypeError, "kv_cache", dict(kv_cache=(_kv, _kv))),
    ("out_dtype_vs_plan", {}, ValueError, r"\bout\b", dict(out=torch.empty(B, 1, H, DV, dtype=FP32))),
    ("out_dtype_vs_plan_fp32", dict(o_data_type=FP32), ValueError, r"\bout\b",
     dict(out=torch.empty(B, 1, H, DV, dtype=BF16))),
    ("out_in_query", {}, ValueError, r"\bout\b.*query", dict(out=_q.view(-1)[:B * H * DV].view(B, 1, H, DV))),
    ("out_in_cache", {}, ValueError, r"\bout\b.*kv_cache", dict(out=_kv.view(-1)[-B * H * DV:].view(B, 1, H, DV))),
    ("out_wrong_shape", {}, ValueError, r"\bout\b", dict(out=torch.empty(B, 1, H, DQK, dtype=BF16))),
    ("out_packed_rows_4", dict(packed_q=True), ValueError, r"\bout\b",
     dict(query=_qp, out=torch.empty(4, H, DV, dtype=BF16))),
    ("out_noncontig", {}, ValueError, r"\bout\b", dict(out=torch.empty(B, 1, DV, H, dtype=BF16).transpose(2, 3))),
    ("out_misaligned", {}, ValueError, r"\bout\b",
     dict(out=torch.empty(B * H * DV + 8, dtype=BF16)[1:1 + B * H * DV].view(B, 1, H, DV))),
    ("out_not_tensor", {}, TypeError, r"\bout\b", dict(out=0)),
    ("validate_not_bool", {}, TypeError, "validate", dict(validate=1)),
    # --- scales are run arguments, checked on every run
    ("bmm1_scale_zero", {}, ValueError, "bmm1_scale", dict(bmm1_scale=0.0)),
    ("bmm1_scale_nan", {}, ValueError, "bmm1_scale", dict(bmm1_scale=math.nan)),
    ("bmm1_scale_negative", {}, ValueError, "bmm1_scale", dict(bmm1_scale=-0.1)),
    ("bmm1_scale_none", {}, TypeError, "bmm1_scale", dict(bmm1_scale=None)),
    ("bmm1_scale_str", {}, TypeError, "bmm1_scale", dict(bmm1_scale="0.1")),
    ("bmm2_scale_inf", {}, ValueError, "bmm2_scale", dict(bmm2_scale=math.inf)),
    ("bmm2_scale_zero", {}, ValueError, "bmm2_scale", dict(bmm2_scale=0.0)),
    ("bmm2_scale_tensor", {}, TypeError, "bmm2_scale", dict(bmm2_scale=torch.tensor(1.0))),
    # --- the query's layout (the old run went through the standalone, which refuses these on every device)
    ("query_inner_noncontig", {}, ValueError, "query", dict(query=_noncontig_inner(_q))),
    ("query_misaligned", {}, ValueError, "query", dict(query=_misaligned(_q))),
]


@pytest.mark.parametrize("plan_kw,exc,match,mods",
                         [pytest.param(*c[1:5], marks=c[5] if len(c) > 5 else (), id=c[0]) for c in STATIC_RUN_CASES])
@pytest.mark.parametrize("validate", [True, False])
def test_wrapper_run_static_errors(plan_kw, exc, match, mods, validate):
    """Shapes, dtypes, devices, scales, out and the plan's bounds are checked on both run paths."""
    w = planned(**plan_kw)
    mods = dict(mods)
    mods.setdefault("validate", validate)
    args, kw = run_args(**mods)
    expect(exc, match, w.run, *args, **kw)


@pytest.mark.parametrize("which", ["block_tables", "seq_lens", "qo_indptr"])
def test_wrapper_run_out_overlapping_bound_metadata(which):
    """The plan binds block_tables, seq_lens and qo_indptr (run reads them): out must not overlap them."""
    meta, out = _out_sharing(which)
    w = planned(packed_q=which == "qo_indptr", **{{"block_tables": "block_tables_"}.get(which, which): meta})
    q = _qp if which == "qo_indptr" else _q
    for validate in (True, False):
        expect(ValueError, rf"\bout\b.*{which}", w.run, q, _kv, out=out, validate=validate)
    assert w.run(q, _kv, out=torch.empty(out.shape, dtype=BF16)).shape == out.shape
