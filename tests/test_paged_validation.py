"""Every bad input of batch_prefill_with_paged_kv_cache / BatchPrefillPagedTSWrapper is refused on the host.

Contract (SPEC "Errors", §2 and issue 3 item 5): anything outside the contract
raises ``ValueError`` (``TypeError`` for a wrong Python type) whose message names
the argument, before any kernel runs. On CPU the "kernel" of the paged ops is
``prims_ts.reference.batch_prefill_paged``; every error case below runs with it
replaced by a function that fails the test if it is ever reached, so an error
raised *after* the launch does not count.

The wrapper has FlashInfer main's signatures: ``BatchPrefillPagedTSWrapper(kv_layout, *, tuning)``,
``plan(q, k_cache, v_cache, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
*, page_size, mask_type, window_left, sm_scale, output_scale, out_dtype)`` over FlashInfer's CSR
page metadata, and ``run(q, k_cache, v_cache, *, out)``, which checks its tensors against the plan.

Devices: this file runs on a CPU-only machine, so "another device" is 'meta'.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import BatchPrefillPagedTSWrapper, Tuning, batch_prefill_with_paged_kv_cache
from prims_ts.ops._validate import dtype_code
from prims_ts.testing import huge_page_stride, recording_no_host_reads, reference_must_not_run

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
D = 128
HQ, HKV = 4, 2
PS = 16  # page size of the base problem
P = 8  # pages in the pools
QO = [0, 3, 5]  # q lens 3, 2
LENS = [20, 5]  # request 0 uses 2 pages, request 1 uses 1 page
TABLE = [[3, 1, 7], [5, 0, 2]]  # C = 3 columns: a length may reach 3 * 16 = 48
C = len(TABLE[0])


DROP = object()  # base(key=DROP): leave the keyword out (use the function's default)


def _rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def ip(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


def make_q(tq=QO[-1], hq=HQ, d=D, dtype=BF16):
    return _rand(tq, hq, d, dtype=dtype, seed=1)


def make_pool(p=P, hkv=HKV, ps=PS, d=D, dtype=BF16, seed=2):
    return _rand(p, hkv, ps, d, dtype=dtype, seed=seed)


def expect(exc, match, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``match`` and never reaches the kernel."""
    with reference_must_not_run("batch_prefill_paged", "batch_prefill"):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


_q = make_q()
_k = make_pool(seed=2)
_v = make_pool(seed=3)


def base(**mods):
    """Valid one-shot arguments with modifications applied: (args, kwargs)."""
    args = dict(q=_q, k_cache=_k, v_cache=_v, qo_indptr=ip(QO), block_tables=ip(TABLE), seq_lens_kv=ip(LENS))
    kwargs = dict(page_size=PS)
    for key, val in mods.items():
        if isinstance(val, list) and key in ("qo_indptr", "block_tables", "seq_lens_kv"):
            val = ip(val)
        (args if key in args else kwargs)[key] = val
    kwargs = {key: val for key, val in kwargs.items() if val is not DROP}
    return tuple(args.values()), kwargs


def _noncontig_inner(t):
    """Same shape and values as t, last dimension with stride 2."""
    base_ = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    view = base_[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


def _shared(first_name, nbytes_meta=64):
    """An out tensor that shares storage with a fresh metadata tensor holding the base values."""
    buf = torch.zeros(_q.numel() * 2 + nbytes_meta, dtype=torch.uint8)
    values = {"qo_indptr": QO, "block_tables": TABLE, "seq_lens_kv": LENS}[first_name]
    t = ip(values)
    meta = buf[32:32 + t.numel() * 4].view(I32).view(t.shape)
    meta.copy_(t)
    # make them overlap: out (16-byte aligned, so that only the overlap is wrong with it) starts 16 bytes
    # before the metadata tensor and covers it
    out = buf[16:16 + _q.numel() * 2].view(BF16).view(_q.shape)
    assert out.data_ptr() % 16 == 0
    return meta, out


# ----------------------------------------------------------------------------
# Sanity: the base inputs (and some unusual but valid ones) are accepted.
# ----------------------------------------------------------------------------


def test_base_inputs_are_valid():
    args, kw = base()
    assert batch_prefill_with_paged_kv_cache(*args, **kw).shape == _q.shape
    args, kw = base(mask_type="causal", window_left=1)
    out = torch.empty(_q.shape, dtype=FP32)
    assert batch_prefill_with_paged_kv_cache(*args, out=out, **kw) is out
    # longest length the table rows hold, largest valid page ID
    args, kw = base(seq_lens_kv=[C * PS, 1], block_tables=[[0, 1, P - 1], [P - 1, 0, 0]])
    batch_prefill_with_paged_kv_cache(*args, **kw)
    # out.dtype decides the output dtype when out_dtype is not given
    args, kw = base()
    assert batch_prefill_with_paged_kv_cache(*args, out=torch.empty(_q.shape, dtype=FP16), **kw).dtype == FP16


def test_padding_entries_are_not_validated():
    """Only the used prefix of a table row must hold valid page IDs; padding may hold anything."""
    big = torch.full((2, 9), -123, dtype=I32)
    big[0, 5] = 2**31 - 1
    big[0, :2] = ip([3, 1])  # request 0: 20 tokens -> 2 pages
    big[1, :1] = ip([5])  # request 1: 5 tokens -> 1 page
    table = big[:, :C]  # padded, row-strided view: stride(0) = 9
    assert table.stride() == (9, 1)
    args, kw = base(block_tables=table)
    got = batch_prefill_with_paged_kv_cache(*args, **kw)
    args, kw = base(block_tables=[[3, 1, 0], [5, 0, 0]])
    torch.testing.assert_close(got, batch_prefill_with_paged_kv_cache(*args, **kw), rtol=0, atol=0)


def test_dense_allows_sq_greater_than_sk():
    args, kw = base(seq_lens_kv=[2, 1])
    assert batch_prefill_with_paged_kv_cache(*args, **kw).shape == _q.shape


def test_single_column_table_any_inner_stride():
    """With one column the inner stride is meaningless (a column view of a wider table)."""
    big = ip([[3, 9, 9], [5, 9, 9]])
    args, kw = base(block_tables=big[:, :1], seq_lens_kv=[16, 5])
    batch_prefill_with_paged_kv_cache(*args, **kw)


# ----------------------------------------------------------------------------
# One-shot function
# ----------------------------------------------------------------------------

_big_table = torch.zeros(2, 2 * C, dtype=I32)
_big_table[:, ::2] = ip(TABLE)


def _out_overlaps(name, b=base):
    meta, out = _shared(name)
    return b(**{name: meta, "out": out})


# Cases of the pools, q, qo_indptr, page_size, scalars and out: the wrapper's plan + run takes the same
# arguments and refuses them too. `make(b)`: b is base (the one-shot) or plan_args (the wrapper).
COMMON_CASES = [
    # page_size
    ("page_size_8", ValueError, "page_size", lambda b: b(page_size=8, k_cache=make_pool(ps=8),
                                                          v_cache=make_pool(ps=8, seed=3))),
    ("page_size_256", ValueError, "page_size", lambda b: b(page_size=256, k_cache=make_pool(p=1, ps=256),
                                                            v_cache=make_pool(p=1, ps=256, seed=3))),
    ("page_size_48", ValueError, "page_size", lambda b: b(page_size=48)),
    ("page_size_0", ValueError, "page_size", lambda b: b(page_size=0)),
    ("page_size_neg", ValueError, "page_size", lambda b: b(page_size=-16)),
    ("page_size_not_pool", ValueError, "page_size", lambda b: b(page_size=32)),
    ("page_size_default_not_pool", ValueError, "page_size", lambda b: b(page_size=DROP)),  # default 32 vs 16
    ("pool_page_size_differs_64", ValueError, "page_size",
     lambda b: b(k_cache=make_pool(ps=64), v_cache=make_pool(ps=64, seed=3))),
    ("page_size_float", TypeError, "page_size", lambda b: b(page_size=16.0)),
    ("page_size_str", TypeError, "page_size", lambda b: b(page_size="16")),
    ("page_size_bool", TypeError, "page_size", lambda b: b(page_size=True)),
    ("page_size_none", TypeError, "page_size", lambda b: b(page_size=None)),
    # pools
    ("v_fewer_pages", ValueError, "v_cache", lambda b: b(v_cache=make_pool(p=P - 1))),
    ("v_more_pages", ValueError, "v_cache", lambda b: b(v_cache=make_pool(p=P + 1))),
    ("v_other_heads", ValueError, "v_cache", lambda b: b(v_cache=make_pool(hkv=1))),
    ("v_other_page_size", ValueError, "v_cache|page_size", lambda b: b(v_cache=make_pool(ps=32))),
    ("v_other_head_dim", ValueError, "v_cache|head dim", lambda b: b(v_cache=make_pool(d=256))),
    ("k_rank3", ValueError, "k_cache", lambda b: b(k_cache=_k[0], v_cache=_v[0])),
    ("v_rank3", ValueError, "v_cache", lambda b: b(v_cache=_v[:, 0])),
    ("k_combined_rank5", ValueError, "k_cache",
     lambda b: b(k_cache=torch.stack([_k, _v], 1), v_cache=torch.stack([_k, _v], 1))),
    ("pools_head_dim_differs_from_q", ValueError, "k_cache",
     lambda b: b(k_cache=make_pool(d=256), v_cache=make_pool(d=256, seed=3))),
    ("k_inner_noncontig", ValueError, "k_cache", lambda b: b(k_cache=_noncontig_inner(_k))),
    ("v_inner_noncontig", ValueError, "v_cache", lambda b: b(v_cache=_noncontig_inner(_v))),
    ("pools_empty", ValueError, "k_cache", lambda b: b(k_cache=make_pool(p=0), v_cache=make_pool(p=0))),
    ("k_not_tensor", TypeError, "k_cache", lambda b: b(k_cache=_k.tolist())),
    ("k_page_stride_beyond_int32", ValueError, "k_cache: page stride", lambda b: b(k_cache=huge_page_stride(_k))),
    ("v_page_stride_beyond_int32", ValueError, "v_cache: page stride", lambda b: b(v_cache=huge_page_stride(_v))),
    ("v_none", TypeError, "v_cache", lambda b: b(v_cache=None)),
    # qo_indptr
    ("qo_int64", ValueError, "qo_indptr", lambda b: b(qo_indptr=ip(QO, torch.int64))),
    ("qo_float", ValueError, "qo_indptr", lambda b: b(qo_indptr=ip(QO, torch.float32))),
    ("qo_rank2", ValueError, "qo_indptr", lambda b: b(qo_indptr=[QO])),
    ("qo_noncontig", ValueError, "qo_indptr", lambda b: b(qo_indptr=ip([0, 9, 3, 9, 5, 9])[::2])),
    ("qo_not_start_0", ValueError, "qo_indptr", lambda b: b(qo_indptr=[1, 3, 5])),
    ("qo_not_strict", ValueError, "qo_indptr", lambda b: b(qo_indptr=[0, 0, 5])),
    ("qo_not_strict_end", ValueError, "qo_indptr", lambda b: b(qo_indptr=[0, 5, 5])),
    ("qo_not_end_at_q", ValueError, "qo_indptr", lambda b: b(qo_indptr=[0, 3, 4])),
    ("qo_past_end", ValueError, "qo_indptr", lambda b: b(qo_indptr=[0, 3, 6])),
    ("qo_list", TypeError, "qo_indptr", lambda b: b(qo_indptr=tuple(QO))),
    # dtypes
    ("k_fp16_q_bf16", ValueError, "k_cache", lambda b: b(k_cache=_k.half())),
    ("v_fp16_q_bf16", ValueError, "v_cache", lambda b: b(v_cache=_v.half())),
    ("q_fp16_pools_bf16", ValueError, r"\bq\b|k_cache", lambda b: b(q=_q.half())),
    ("all_float32", ValueError, r"\bq\b", lambda b: b(q=_q.float(), k_cache=_k.float(), v_cache=_v.float())),
    ("all_float64", ValueError, r"\bq\b", lambda b: b(q=_q.double(), k_cache=_k.double(), v_cache=_v.double())),
    ("k_int8", ValueError, "k_cache", lambda b: b(k_cache=_k.to(torch.int8))),
    # devices ('meta' stands for another device)
    ("q_meta", ValueError, r"\bq\b|k_cache", lambda b: b(q=_q.to("meta"))),
    ("k_meta", ValueError, "k_cache", lambda b: b(k_cache=_k.to("meta"))),
    ("v_meta", ValueError, "v_cache", lambda b: b(v_cache=_v.to("meta"))),
    ("qo_meta", ValueError, "qo_indptr", lambda b: b(qo_indptr=ip(QO).to("meta"))),
    ("out_meta", ValueError, r"\bout\b", lambda b: b(out=torch.empty(_q.shape, dtype=BF16, device="meta"))),
    # head dims and heads
    ("head_dim_64", ValueError, r"\bq\b", lambda b: b(q=make_q(d=64), k_cache=make_pool(d=64),
                                                       v_cache=make_pool(d=64, seed=3))),
    ("head_dim_96", ValueError, r"\bq\b", lambda b: b(q=make_q(d=96), k_cache=make_pool(d=96),
                                                       v_cache=make_pool(d=96, seed=3))),
    ("q_head_dim_differs", ValueError, r"\bq\b|k_cache", lambda b: b(q=make_q(d=256))),
    ("hq_not_multiple", ValueError, r"\bq\b|k_cache|heads", lambda b: b(q=make_q(hq=3))),
    ("hkv_gt_hq", ValueError, r"\bq\b|k_cache|heads", lambda b: b(q=make_q(hq=1))),
    # q rank, strides, type
    ("q_rank4", ValueError, r"\bq\b", lambda b: b(q=_q.unsqueeze(0))),
    ("q_rank2", ValueError, r"\bq\b", lambda b: b(q=_q[:, 0])),
    ("q_inner_noncontig", ValueError, r"\bq\b", lambda b: b(q=_noncontig_inner(_q))),
    ("q_misaligned", ValueError, r"\bq\b",
     lambda b: b(q=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape))),
    ("q_not_tensor", TypeError, r"\bq\b", lambda b: b(q=_q.tolist())),
    # out
    ("out_wrong_shape", ValueError, r"\bout\b", lambda b: b(out=torch.empty(5, HQ, D + 128, dtype=BF16))),
    ("out_fixed_shape", ValueError, r"\bout\b", lambda b: b(out=torch.empty(1, 5, HQ, D, dtype=BF16))),
    ("out_dtype_disagrees", ValueError, r"\bout\b",
     lambda b: b(out=torch.empty(_q.shape, dtype=BF16), out_dtype=FP32)),
    ("out_float64", ValueError, r"\bout\b", lambda b: b(out=torch.empty(_q.shape, dtype=torch.float64))),
    ("out_int32", ValueError, r"\bout\b", lambda b: b(out=torch.empty(_q.shape, dtype=I32))),
    ("out_noncontig", ValueError, r"\bout\b", lambda b: b(out=torch.empty(5, D, HQ, dtype=BF16).transpose(1, 2))),
    ("out_is_q", ValueError, r"\bout must not overlap q\b", lambda b: b(out=_q)),
    ("out_in_k_cache", ValueError, r"\bout\b", lambda b: b(out=_k.view(-1)[: _q.numel()].view(_q.shape))),
    ("out_tail_of_v_cache", ValueError, r"\bout\b", lambda b: b(out=_v.view(-1)[-_q.numel():].view(_q.shape))),
    ("out_overlaps_qo_indptr", ValueError, r"\bout must not overlap qo_indptr\b",
     lambda b: _out_overlaps("qo_indptr", b)),
    ("out_not_tensor", TypeError, r"\bout\b", lambda b: b(out=0)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda b: b(out_dtype=torch.float64)),
    ("out_dtype_int32", ValueError, "out_dtype", lambda b: b(out_dtype=I32)),
    ("out_dtype_str", TypeError, "out_dtype", lambda b: b(out_dtype="float32")),
    # masks and windows
    ("window_without_causal", ValueError, "window_left", lambda b: b(window_left=4)),
    ("window_zero_without_causal", ValueError, "window_left", lambda b: b(window_left=0)),
    ("window_minus_2", ValueError, "window_left", lambda b: b(mask_type="causal", window_left=-2)),
    ("window_float", TypeError, "window_left", lambda b: b(mask_type="causal", window_left=2.0)),
    ("mask_variable_window", ValueError, "mask_type", lambda b: b(mask_type="variable_window")),
    ("mask_unknown", ValueError, "mask_type", lambda b: b(mask_type="causal_lower")),
    ("mask_none", TypeError, "mask_type", lambda b: b(mask_type=None)),
    # scales
    ("sm_scale_nan", ValueError, "sm_scale", lambda b: b(sm_scale=math.nan)),
    ("sm_scale_inf", ValueError, "sm_scale", lambda b: b(sm_scale=math.inf)),
    ("sm_scale_zero", ValueError, "sm_scale", lambda b: b(sm_scale=0.0)),
    ("sm_scale_negative", ValueError, "sm_scale", lambda b: b(sm_scale=-0.1)),
    ("sm_scale_str", TypeError, "sm_scale", lambda b: b(sm_scale="0.1")),
    ("output_scale_zero", ValueError, "output_scale", lambda b: b(output_scale=0.0)),
    ("output_scale_nan", ValueError, "output_scale", lambda b: b(output_scale=math.nan)),
    ("output_scale_negative", ValueError, "output_scale", lambda b: b(output_scale=-1.0)),
    ("output_scale_none", TypeError, "output_scale", lambda b: b(output_scale=None)),
]

# Cases of the block table, seq_lens_kv and kv_layout: the one-shot's own arguments.
TABLE_CASES = [
    # kv_layout
    ("kv_layout_NHD", ValueError, "kv_layout", lambda b: b(kv_layout="NHD")),
    ("kv_layout_lower", ValueError, "kv_layout", lambda b: b(kv_layout="hnd")),
    ("kv_layout_none", TypeError, "kv_layout", lambda b: b(kv_layout=None)),
    # block_tables: dtype, rank, strides, rows
    ("bt_int64", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE, torch.int64))),
    ("bt_int16", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE, torch.int16))),
    ("bt_float32", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE, torch.float32))),
    ("bt_uint32", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE).view(torch.uint32))),
    ("bt_rank1", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE).flatten())),
    ("bt_rank3", ValueError, "block_tables", lambda b: b(block_tables=ip([TABLE]))),
    ("bt_inner_stride_2", ValueError, "block_tables", lambda b: b(block_tables=_big_table[:, ::2])),
    ("bt_column_major", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE).t().contiguous().t())),
    ("bt_expanded_rows", ValueError, "block_tables",
     lambda b: b(block_tables=ip(TABLE[0]).unsqueeze(0).expand(2, C), seq_lens_kv=[20, 20])),
    ("bt_too_many_rows", ValueError, "block_tables|qo_indptr", lambda b: b(block_tables=TABLE + [[4, 4, 4]])),
    ("bt_too_few_rows", ValueError, "block_tables|qo_indptr", lambda b: b(block_tables=TABLE[:1])),
    ("bt_no_columns", ValueError, "block_tables", lambda b: b(block_tables=torch.zeros(2, 0, dtype=I32))),
    ("bt_list", TypeError, "block_tables", lambda b: b(block_tables=tuple(map(tuple, TABLE)))),
    # seq_lens_kv
    ("len_zero", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=[20, 0])),
    ("len_negative", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=[-5, 5])),
    ("len_past_table_row", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=[C * PS + 1, 5])),
    ("len_far_past_table_row", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=[20, 10**6])),
    ("len_int64", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=ip(LENS, torch.int64))),
    ("len_wrong_length", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=LENS + [5])),
    ("len_rank2", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=[LENS])),
    ("len_noncontig", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=ip([20, 9, 5, 9])[::2])),
    ("len_list", TypeError, "seq_lens_kv", lambda b: b(seq_lens_kv=tuple(LENS))),
    # used page IDs outside [0, P)
    ("page_negative", ValueError, "block_tables", lambda b: b(block_tables=[[3, -1, 7], [5, 0, 2]])),
    ("page_min_int", ValueError, "block_tables", lambda b: b(block_tables=[[3, 1, 7], [-2**31, 0, 2]])),
    ("page_eq_P", ValueError, "block_tables", lambda b: b(block_tables=[[3, P, 7], [5, 0, 2]])),
    ("page_gt_P", ValueError, "block_tables", lambda b: b(block_tables=[[3, 1, 7], [1000, 0, 2]])),
    ("page_max_int", ValueError, "block_tables", lambda b: b(block_tables=[[2**31 - 1, 1, 7], [5, 0, 2]])),
    ("page_in_last_partial_page", ValueError, "block_tables",
     lambda b: b(seq_lens_kv=[20, 33], block_tables=[[3, 1, 7], [5, 0, P]])),
    # qo_indptr
    ("qo_single_entry", ValueError, "qo_indptr|block_tables",
     lambda b: b(qo_indptr=[0], block_tables=torch.zeros(0, C, dtype=I32), seq_lens_kv=ip([]))),
    ("qo_decreasing", ValueError, "qo_indptr",
     lambda b: b(qo_indptr=[0, 4, 3, 5], block_tables=TABLE + [[4, 4, 4]], seq_lens_kv=LENS + [5])),
    ("qo_len_vs_table_rows", ValueError, "qo_indptr|block_tables", lambda b: b(qo_indptr=[0, 1, 3, 5])),
    # causal Sq > Sk
    ("causal_sq_gt_sk", ValueError, r"qo_indptr|seq_lens_kv|Sq",
     lambda b: b(seq_lens_kv=[2, 5], mask_type="causal")),
    ("causal_window_sq_gt_sk", ValueError, r"qo_indptr|seq_lens_kv|Sq",
     lambda b: b(seq_lens_kv=[20, 1], mask_type="causal", window_left=3)),
    # devices ('meta' stands for another device)
    ("bt_meta", ValueError, "block_tables", lambda b: b(block_tables=ip(TABLE).to("meta"))),
    ("lens_meta", ValueError, "seq_lens_kv", lambda b: b(seq_lens_kv=ip(LENS).to("meta"))),
    # out
    ("out_overlaps_block_tables", ValueError, r"\bout must not overlap block_tables\b",
     lambda b: _out_overlaps("block_tables")),
    ("out_overlaps_seq_lens_kv", ValueError, r"\bout must not overlap seq_lens_kv\b",
     lambda b: _out_overlaps("seq_lens_kv")),
]

ONESHOT_CASES = COMMON_CASES + TABLE_CASES


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in ONESHOT_CASES], ids=[c[0] for c in ONESHOT_CASES])
def test_oneshot_errors(exc, match, make):
    args, kwargs = make(base)
    expect(exc, match, batch_prefill_with_paged_kv_cache, *args, **kwargs)


def test_oneshot_static_checks_once_per_static_key(monkeypatch):
    """A second one-shot with the same static facts skips the static checks (shapes, dtypes,
    devices, scalars), yet what is not in that key is still refused every call: a misaligned q,
    an out sharing bytes with an input or a metadata tensor, bad lengths and page IDs."""
    import prims_ts.ops.prefill_paged as pp
    from prims_ts.ops import _validate as V

    calls = []
    real = pp._oneshot_checks
    monkeypatch.setattr(pp, "_ONESHOT_CHECKED", V.memo())
    monkeypatch.setattr(pp, "_oneshot_checks", lambda *a: calls.append(1) or real(*a))
    out = torch.empty(_q.shape, dtype=BF16)
    for _ in range(2):
        args, kw = base(out=out)
        batch_prefill_with_paged_kv_cache(*args, **kw)
    assert len(calls) == 1
    meta, out_in_meta = _shared("block_tables")
    per_call = [
        (r"\bq\b", base(q=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape), out=out)),
        (r"\bout\b.*\bq\b", base(out=_q)),
        (r"\bout\b.*aligned", base(out=torch.zeros(_q.numel() + 8, dtype=BF16)[1:1 + _q.numel()].view(_q.shape))),
        (r"\bout\b.*block_tables", base(block_tables=meta, out=out_in_meta)),
        ("seq_lens_kv", base(seq_lens_kv=[49, 5], out=out)),
        ("block_tables", base(block_tables=[[3, P, 7], [5, 0, 2]], out=out)),
        ("qo_indptr", base(qo_indptr=[0, 3, 4], out=out)),
    ]
    for match, (a, k) in per_call:
        expect(ValueError, match, batch_prefill_with_paged_kv_cache, *a, **k)
    assert len(calls) == 1  # every refused call had the first one's static facts


def test_error_leaves_out_untouched():
    """A refused call writes nothing: the poisoned out is still all NaN."""
    for mods in (dict(block_tables=[[3, P, 7], [5, 0, 2]]), dict(seq_lens_kv=[2, 5], mask_type="causal"),
                 dict(seq_lens_kv=[20, 0]), dict(qo_indptr=[0, 3, 4])):
        out = torch.full(_q.shape, float("nan"), dtype=BF16)
        args, kw = base(out=out, **mods)
        expect(ValueError, "block_tables|qo_indptr|seq_lens_kv", batch_prefill_with_paged_kv_cache, *args, **kw)
        assert torch.isnan(out).all(), mods


def test_metadata_not_modified():
    args, kw = base(mask_type="causal")
    qo, bt, sl = args[3:]
    batch_prefill_with_paged_kv_cache(*args, **kw)
    assert qo.tolist() == QO and bt.tolist() == TABLE and sl.tolist() == LENS


# ----------------------------------------------------------------------------
# BatchPrefillPagedTSWrapper: plan(q, k_cache, v_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
# paged_kv_last_page_len, ...) then run(q, k_cache, v_cache, out=...)
# ----------------------------------------------------------------------------

# The base problem's pages as FlashInfer's CSR metadata: TABLE's used prefix and LENS
# (request 0: pages 3, 1 and 20 = 16 + 4 keys; request 1: page 5 and 5 keys).
INDPTR, INDICES, LAST = [0, 2, 3], [3, 1, 5], [4, 5]
MAX_PAGE = max(INDICES)
CSR_KEYS = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


def plan_args(**mods):
    """Valid wrapper plan arguments with modifications applied: (args, kwargs); ``out`` (a run
    argument) stays in kwargs for _plan_run."""
    args = dict(q=_q, k_cache=_k, v_cache=_v, qo_indptr=ip(QO), paged_kv_indptr=ip(INDPTR),
                paged_kv_indices=ip(INDICES), paged_kv_last_page_len=ip(LAST))
    kwargs = dict(page_size=PS)
    for key, val in mods.items():
        if isinstance(val, list) and key in CSR_KEYS:
            val = ip(val)
        (args if key in args else kwargs)[key] = val
    kwargs = {key: val for key, val in kwargs.items() if val is not DROP}
    return tuple(args.values()), kwargs


def _plan_run(q, k_cache, v_cache, *meta, out=None, **kw):
    """The wrapper form of a call: plan over these tensors and metadata, run them into ``out``."""
    w = BatchPrefillPagedTSWrapper()
    w.plan(q, k_cache, v_cache, *meta, **kw)
    return w.run(q, k_cache, v_cache, out=out)


def test_wrapper_base_inputs_are_valid():
    """The CSR form of the base problem is accepted and means what the one-shot's block table means."""
    args, kw = plan_args(mask_type="causal", window_left=1)
    out = torch.full(_q.shape, float("nan"), dtype=BF16)
    assert _plan_run(*args, out=out, **kw) is out
    one_args, one_kw = base(mask_type="causal", window_left=1)
    torch.testing.assert_close(out, batch_prefill_with_paged_kv_cache(*one_args, **one_kw), rtol=0, atol=0)
    # full last pages, the largest valid page ID, page IDs repeated across requests
    args, kw = plan_args(paged_kv_indptr=[0, 3, 4], paged_kv_indices=[0, P - 1, 2, P - 1],
                         paged_kv_last_page_len=[PS, 1], out_dtype=FP32)
    assert _plan_run(*args, **kw).dtype == FP32


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in COMMON_CASES], ids=[c[0] for c in COMMON_CASES])
def test_wrapper_refuses_common_cases(exc, match, make):
    """The one-shot's cases of q, the pools, qo_indptr, page_size, scalars and out, in plan + run."""
    args, kwargs = make(plan_args)
    expect(exc, match, _plan_run, *args, **kwargs)


# Refused by plan itself. The old plan's cases (block_tables / seq_lens_kv / num_*_heads / head_dim /
# q_data_type) are here in the new signature; the CSR page metadata's are new.
PLAN_CASES = [
    ("page_size_8", ValueError, "page_size", lambda: plan_args(page_size=8)),
    ("page_size_48", ValueError, "page_size", lambda: plan_args(page_size=48)),
    ("page_size_512", ValueError, "page_size", lambda: plan_args(page_size=512)),
    ("page_size_str", TypeError, "page_size", lambda: plan_args(page_size="16")),
    ("page_size_not_pool", ValueError, "page_size", lambda: plan_args(page_size=32)),
    ("page_size_default_not_pool", ValueError, "page_size", lambda: plan_args(page_size=DROP)),
    # shapes and dtypes come from q and the pools (were num_qo_heads, num_kv_heads, head_dim, q_data_type)
    ("q_no_heads", ValueError, r"\bq\b", lambda: plan_args(q=make_q(hq=0))),
    ("heads_not_multiple", ValueError, r"\bq\b|k_cache", lambda: plan_args(q=make_q(hq=3))),
    ("k_cache_list", TypeError, "k_cache", lambda: plan_args(k_cache=_k.tolist())),
    ("head_dim_64", ValueError, r"\bq\b",
     lambda: plan_args(q=make_q(d=64), k_cache=make_pool(d=64), v_cache=make_pool(d=64, seed=3))),
    ("all_float32", ValueError, r"\bq\b", lambda: plan_args(q=_q.float(), k_cache=_k.float(), v_cache=_v.float())),
    ("q_str", TypeError, r"\bq\b", lambda: plan_args(q="bfloat16")),
    ("q_none", TypeError, r"\bq\b", lambda: plan_args(q=None)),
    ("mask_variable_window", ValueError, "mask_type", lambda: plan_args(mask_type="variable_window")),
    ("mask_unknown", ValueError, "mask_type", lambda: plan_args(mask_type="full")),
    ("window_without_causal", ValueError, "window_left", lambda: plan_args(window_left=3)),
    ("window_minus_2", ValueError, "window_left", lambda: plan_args(mask_type="causal", window_left=-2)),
    ("sm_scale_inf", ValueError, "sm_scale", lambda: plan_args(sm_scale=math.inf)),
    ("output_scale_zero", ValueError, "output_scale", lambda: plan_args(output_scale=0.0)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda: plan_args(out_dtype=torch.float64)),
    # qo_indptr
    ("qo_int64", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=ip(QO, torch.int64))),
    ("qo_list", TypeError, "qo_indptr", lambda: plan_args(qo_indptr=tuple(QO))),
    ("qo_single_entry", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0])),
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[1, 3, 5])),
    ("qo_not_strict", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 3, 3])),
    ("qo_not_end_at_q", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=[0, 3, 4])),
    ("qo_len_vs_indptr", ValueError, "qo_indptr|paged_kv_indptr", lambda: plan_args(qo_indptr=[0, 1, 3, 5])),
    ("qo_meta", ValueError, "qo_indptr", lambda: plan_args(qo_indptr=ip(QO).to("meta"))),
    # causal Sq > Sk: request 1 has 2 queries and (pages - 1) * 16 + 1 = 1 key
    ("causal_sq_gt_sk", ValueError, r"qo_indptr|Sq", lambda: plan_args(paged_kv_last_page_len=[4, 1],
                                                                        mask_type="causal")),
    ("causal_window_sq_gt_sk", ValueError, r"qo_indptr|Sq",
     lambda: plan_args(paged_kv_indptr=[0, 1, 3], paged_kv_last_page_len=[2, 5], mask_type="causal",
                       window_left=3)),
    # paged_kv_indptr: dtype, rank, strides, length, type, device
    ("indptr_int64", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=ip(INDPTR, torch.int64))),
    ("indptr_float", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=ip(INDPTR, torch.float32))),
    ("indptr_rank2", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[INDPTR])),
    ("indptr_noncontig", ValueError, "paged_kv_indptr",
     lambda: plan_args(paged_kv_indptr=ip([0, 9, 2, 9, 3, 9])[::2])),
    ("indptr_too_short", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[0, 3])),
    ("indptr_too_long", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[0, 1, 2, 3])),
    ("indptr_list", TypeError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=tuple(INDPTR))),
    ("indptr_meta", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=ip(INDPTR).to("meta"))),
    # paged_kv_indptr values: start at zero, strictly increasing (a page per request), end at indices.numel()
    ("indptr_not_start_0", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[1, 2, 3])),
    ("indptr_negative_start", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[-1, 2, 3])),
    ("indptr_request_without_pages", ValueError, "paged_kv_indptr",
     lambda: plan_args(paged_kv_indptr=[0, 3, 3], paged_kv_last_page_len=[4, 5])),
    ("indptr_first_request_without_pages", ValueError, "paged_kv_indptr",
     lambda: plan_args(paged_kv_indptr=[0, 0, 3])),
    ("indptr_decreasing", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[0, 4, 3])),
    ("indptr_ends_short", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[0, 1, 2])),
    ("indptr_ends_past", ValueError, "paged_kv_indptr", lambda: plan_args(paged_kv_indptr=[0, 2, 4])),
    ("indices_more_than_indptr", ValueError, "paged_kv_indptr",
     lambda: plan_args(paged_kv_indices=INDICES + [0])),
    ("indices_empty", ValueError, "paged_kv_indptr|paged_kv_indices",
     lambda: plan_args(paged_kv_indices=torch.zeros(0, dtype=I32))),
    # paged_kv_indices: dtype, rank, strides, type, device
    ("indices_int64", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=ip(INDICES, torch.int64))),
    ("indices_uint32", ValueError, "paged_kv_indices",
     lambda: plan_args(paged_kv_indices=ip(INDICES).view(torch.uint32))),
    ("indices_rank2", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=[INDICES])),
    ("indices_noncontig", ValueError, "paged_kv_indices",
     lambda: plan_args(paged_kv_indices=ip([3, 9, 1, 9, 5, 9])[::2])),
    ("indices_list", TypeError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=tuple(INDICES))),
    ("indices_meta", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=ip(INDICES).to("meta"))),
    # page IDs outside the pool [0, P)
    ("page_negative", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=[3, -1, 5])),
    ("page_min_int", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=[3, 1, -2**31])),
    ("page_eq_P", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=[3, P, 5])),
    ("page_gt_P", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=[1000, 1, 5])),
    ("page_max_int", ValueError, "paged_kv_indices", lambda: plan_args(paged_kv_indices=[3, 1, 2**31 - 1])),
    ("page_in_last_partial_page", ValueError, "paged_kv_indices",
     lambda: plan_args(paged_kv_indptr=[0, 2, 4], paged_kv_indices=[3, 1, 5, P], paged_kv_last_page_len=[4, 1])),
    # paged_kv_last_page_len: values in [1, page_size], dtype, rank, length, type, device
    ("last_zero", ValueError, "paged_kv_last_page_len", lambda: plan_args(paged_kv_last_page_len=[4, 0])),
    ("last_negative", ValueError, "paged_kv_last_page_len", lambda: plan_args(paged_kv_last_page_len=[-4, 5])),
    ("last_past_page_size", ValueError, "paged_kv_last_page_len",
     lambda: plan_args(paged_kv_last_page_len=[PS + 1, 5])),
    ("last_max_int", ValueError, "paged_kv_last_page_len",
     lambda: plan_args(paged_kv_last_page_len=[4, 2**31 - 1])),
    ("last_int64", ValueError, "paged_kv_last_page_len",
     lambda: plan_args(paged_kv_last_page_len=ip(LAST, torch.int64))),
    ("last_rank2", ValueError, "paged_kv_last_page_len", lambda: plan_args(paged_kv_last_page_len=[LAST])),
    ("last_too_short", ValueError, "paged_kv_last_page_len", lambda: plan_args(paged_kv_last_page_len=[4])),
    ("last_too_long", ValueError, "paged_kv_last_page_len",
     lambda: plan_args(paged_kv_last_page_len=LAST + [1])),
    ("last_list", TypeError, "paged_kv_last_page_len", lambda: plan_args(paged_kv_last_page_len=tuple(LAST))),
    ("last_meta", ValueError, "paged_kv_last_page_len",
     lambda: plan_args(paged_kv_last_page_len=ip(LAST).to("meta"))),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_wrapper_plan_errors(exc, match, make):
    args, kwargs = make()
    w = BatchPrefillPagedTSWrapper()
    expect(exc, match, w.plan, *args, **kwargs)
    # a refused plan leaves no plan behind
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        w.run(_q, _k, _v)


def test_wrapper_plan_names_the_bad_csr_entry():
    """The CSR errors say which entry is wrong and what the bound is (the brief's wording)."""
    for mods, match in [
        (dict(paged_kv_indptr=[2, 2, 3]), r"paged_kv_indptr: must start at zero, got 2"),
        (dict(paged_kv_indptr=[0, 3, 3]), r"paged_kv_indptr: must be strictly increasing.*entries 1 and 2 are 3 and 3"),
        (dict(paged_kv_indptr=[0, 1, 2]), r"paged_kv_indptr: .*paged_kv_indices\.numel\(\) = 3, got 2"),
        (dict(paged_kv_last_page_len=[4, PS + 1]), rf"paged_kv_last_page_len: request 1 has {PS + 1}.*\[1, {PS}\]"),
        (dict(paged_kv_indices=[3, 1, P]), rf"paged_kv_indices: entry 2 is page ID {P}.*\[0, {P}\)"),
    ]:
        args, kw = plan_args(**mods)
        expect(ValueError, match, BatchPrefillPagedTSWrapper().plan, *args, **kw)


@pytest.mark.parametrize("kv_layout,exc", [("NHD", ValueError), ("hnd", ValueError), (None, TypeError),
                                           (torch.device("cpu"), TypeError)], ids=["NHD", "lower", "none", "device"])
def test_wrapper_kv_layout(kv_layout, exc):
    """kv_layout is the constructor's (FlashInfer's); the old constructor's device argument is no layout."""
    with pytest.raises(exc, match="kv_layout"):
        BatchPrefillPagedTSWrapper(kv_layout)


def test_wrapper_old_forms_are_gone():
    """FlashInfer main's plan: no block-table form with head counts, no kv_layout or max_q_len at plan."""
    with reference_must_not_run("batch_prefill_paged"):
        with pytest.raises(TypeError):
            BatchPrefillPagedTSWrapper().plan(ip(QO), ip(TABLE), ip(LENS), num_qo_heads=HQ, num_kv_heads=HKV,
                                              head_dim=D, page_size=PS)
        for extra in (dict(kv_layout="HND"), dict(max_q_len=4), dict(q_data_type=BF16)):
            args, kw = plan_args(**extra)
            with pytest.raises(TypeError):
                BatchPrefillPagedTSWrapper().plan(*args, **kw)


@pytest.mark.parametrize("tuning", ["loop=1", 1], ids=["str", "int"])
def test_wrapper_tuning_must_be_a_tuning(tuning):
    """tuning= takes a prims_ts.Tuning (None: the default); anything else is a TypeError naming tuning,
    raised by the constructor, plan or run, before any launch."""
    args, kw = plan_args()
    with reference_must_not_run("batch_prefill_paged"):
        with pytest.raises(TypeError, match=r"\btuning\b"):
            w = BatchPrefillPagedTSWrapper(tuning=tuning)
            w.plan(*args, **kw)
            w.run(_q, _k, _v)


def planned(**mods):
    w = BatchPrefillPagedTSWrapper()
    args, kwargs = plan_args(**mods)
    w.plan(*args, **kwargs)
    return w, args


def test_wrapper_run_before_plan():
    with reference_must_not_run("batch_prefill_paged"):
        with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
            BatchPrefillPagedTSWrapper().run(_q, _k, _v)


def test_wrapper_base_run_is_valid():
    w, _ = planned(mask_type="causal")
    out = torch.empty(_q.shape, dtype=BF16)
    assert w.run(_q, _k, _v, out=out) is out
    # pools with exactly max_page + 1 pages are enough, and so are pools with more pages than planned
    assert w.run(_q, _k[:MAX_PAGE + 1], _v[:MAX_PAGE + 1]).shape == _q.shape
    assert w.run(_q, make_pool(p=2 * P), make_pool(p=2 * P, seed=3)).shape == _q.shape


def _run_args(**mods):
    args = dict(q=_q, k_cache=_k, v_cache=_v)
    kwargs = {}
    for key, val in mods.items():
        (args if key in args else kwargs)[key] = val
    return tuple(args.values()), kwargs


def _out_overlapping_pool(pool):
    """An aligned out inside a pool's storage."""
    return pool.view(-1)[256: 256 + _q.numel()].view(_q.shape)


RUN_CASES = [
    # q against the plan
    ("q_other_total", {}, ValueError, r"\bq\b", lambda: _run_args(q=make_q(tq=6))),
    ("q_fewer_tokens", {}, ValueError, r"\bq\b", lambda: _run_args(q=make_q(tq=4))),
    ("q_other_heads", {}, ValueError, r"\bq\b|heads", lambda: _run_args(q=make_q(hq=2 * HQ))),
    ("q_fp16_vs_plan", {}, ValueError, r"\bq\b",
     lambda: _run_args(q=_q.half(), k_cache=_k.half(), v_cache=_v.half())),
    ("q_rank4", {}, ValueError, r"\bq\b", lambda: _run_args(q=_q.unsqueeze(0))),
    ("q_inner_noncontig", {}, ValueError, r"\bq\b", lambda: _run_args(q=_noncontig_inner(_q))),
    ("q_misaligned", {}, ValueError, r"\bq\b",
     lambda: _run_args(q=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape))),
    ("q_not_tensor", {}, TypeError, r"\bq\b", lambda: _run_args(q=_q.tolist())),
    # pools against the plan
    ("pools_other_heads", {}, ValueError, r"k_cache|heads",
     lambda: _run_args(k_cache=make_pool(hkv=1), v_cache=make_pool(hkv=1, seed=3))),
    ("head_dim_256", {}, ValueError, r"\bq\b|head",
     lambda: _run_args(q=make_q(d=256), k_cache=make_pool(d=256), v_cache=make_pool(d=256, seed=3))),
    ("k_fp16", {}, ValueError, "k_cache", lambda: _run_args(k_cache=_k.half())),
    ("pools_fp16", {}, ValueError, r"k_cache|\bq\b", lambda: _run_args(k_cache=_k.half(), v_cache=_v.half())),
    ("pool_fewer_pages_than_plan", {}, ValueError, "k_cache",
     lambda: _run_args(k_cache=_k[:MAX_PAGE], v_cache=_v[:MAX_PAGE])),  # the plan's largest page ID is 5
    ("pool_other_page_size", {}, ValueError, "page_size|k_cache",
     lambda: _run_args(k_cache=make_pool(ps=32), v_cache=make_pool(ps=32, seed=3))),
    ("v_other_shape", {}, ValueError, "v_cache", lambda: _run_args(v_cache=_v[:P - 1])),
    ("k_inner_noncontig", {}, ValueError, "k_cache", lambda: _run_args(k_cache=_noncontig_inner(_k))),
    ("v_inner_noncontig", {}, ValueError, "v_cache", lambda: _run_args(v_cache=_noncontig_inner(_v))),
    ("k_page_stride_beyond_int32", {}, ValueError, "k_cache: page stride",
     lambda: _run_args(k_cache=huge_page_stride(_k), v_cache=huge_page_stride(_v))),
    ("v_none", {}, TypeError, "v_cache", lambda: _run_args(v_cache=None)),
    # devices
    ("q_meta", {}, ValueError, r"\bq\b|k_cache", lambda: _run_args(q=_q.to("meta"))),
    ("k_meta", {}, ValueError, "k_cache", lambda: _run_args(k_cache=_k.to("meta"))),
    ("all_meta", {}, ValueError, r"\bq\b",
     lambda: _run_args(q=_q.to("meta"), k_cache=_k.to("meta"), v_cache=_v.to("meta"))),
    # out
    ("out_wrong_shape", {}, ValueError, r"\bout\b", lambda: _run_args(out=torch.empty(5, HQ, D + 1, dtype=BF16))),
    ("out_wrong_dtype", {}, ValueError, r"\bout\b", lambda: _run_args(out=torch.empty(_q.shape, dtype=FP32))),
    ("out_wrong_dtype_vs_plan_fp32", dict(out_dtype=FP32), ValueError, r"\bout\b",
     lambda: _run_args(out=torch.empty(_q.shape, dtype=BF16))),
    ("out_meta", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=torch.empty(_q.shape, dtype=BF16, device="meta"))),
    ("out_noncontig", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=torch.empty(5, D, HQ, dtype=BF16).transpose(1, 2))),
    ("out_misaligned", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape))),
    ("out_is_q", {}, ValueError, r"\bout must not overlap q\b", lambda: _run_args(out=_q)),
    ("out_in_k_cache", {}, ValueError, r"\bout must not overlap k_cache\b",
     lambda: _run_args(out=_out_overlapping_pool(_k))),
    ("out_in_v_cache", {}, ValueError, r"\bout must not overlap v_cache\b",
     lambda: _run_args(out=_v.view(-1)[-_q.numel():].view(_q.shape))),
    ("out_not_tensor", {}, TypeError, r"\bout\b", lambda: _run_args(out=[0.0])),
]


@pytest.mark.parametrize("name,plan_kw,exc,match,make", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_wrapper_run_errors(name, plan_kw, exc, match, make):
    w, _ = planned(**plan_kw)
    args, kwargs = make()
    expect(exc, match, w.run, *args, **kwargs)


def test_wrapper_run_out_overlapping_bound_qo_indptr():
    """qo_indptr stays bound (run reads it): out must not overlap it."""
    meta, out = _shared("qo_indptr")
    w, _ = planned(qo_indptr=meta)
    expect(ValueError, r"\bout must not overlap qo_indptr\b", w.run, _q, _k, _v, out=out)


def test_wrapper_run_reads_nothing_on_the_host():
    """run hands the op the caller's qo_indptr (bound), the plan's own snapshot of the pages and
    lengths (a block table and seq_lens_kv that share no storage with the caller's CSR tensors)
    and the plan's tuning, reading no tensor value on the host."""
    tuning = Tuning(loop=1)
    w = BatchPrefillPagedTSWrapper(tuning=tuning)
    args, kw = plan_args(mask_type="causal")
    w.plan(*args, **kw)
    qo, indptr, indices, last = args[3:]
    out = torch.full(_q.shape, float("nan"), dtype=BF16)
    with recording_no_host_reads("batch_prefill_paged", "batch_prefill_paged") as rec:
        assert w.run(_q, _k, _v, out=out) is out
        w.run(_q, _k, _v)
    assert [c[0] for c in rec.calls] == ["batch_prefill_paged_out", "batch_prefill_paged"]
    (_, out_args), (_, fn_args) = rec.calls
    assert out_args[3] is out
    for got in (out_args[:3] + out_args[4:5], fn_args[:4]):
        assert all(a is b for a, b in zip(got, (_q, _k, _v, qo))), got
    for table, lens in ((out_args[5], out_args[6]), (fn_args[4], fn_args[5])):
        assert lens.tolist() == LENS
        assert table[0, :2].tolist() == INDICES[:2] and table[1, 0].item() == INDICES[2]
        for caller in (indptr, indices, last):
            for own in (table, lens):
                assert own.untyped_storage().data_ptr() != caller.untyped_storage().data_ptr()
    assert out_args[-1] == fn_args[-1] == tuning.encode() != ""
    assert fn_args[-2] == dtype_code(BF16)


def test_wrapper_failed_plan_keeps_previous_plan_usable():
    """A refused re-plan must not leave a half-written plan behind that run would then use."""
    w, _ = planned(mask_type="causal")
    ref = w.run(_q, _k, _v)
    args, kw = plan_args(paged_kv_indices=[3, -1, 5], mask_type="dense")
    expect(ValueError, "paged_kv_indices", w.plan, *args, **kw)
    args, kw = plan_args(paged_kv_last_page_len=[4, PS + 1])
    expect(ValueError, "paged_kv_last_page_len", w.plan, *args, **kw)
    args, kw = plan_args(q=make_q(d=64), k_cache=make_pool(d=64), v_cache=make_pool(d=64, seed=3))
    expect(ValueError, r"\bq\b", w.plan, *args, **kw)
    torch.testing.assert_close(w.run(_q, _k, _v), ref, rtol=0, atol=0)


def test_oneshot_launch_keys_memoised_by_lengths(monkeypatch):
    """A one-shot's static key keeps the (static, launch) pair its plans took by (longest query
    count, work items): a repeat with the same lengths builds no PrefillStatic and takes the same
    launch; another longest query count takes its own (the CUDA lookup stubbed: no GPU here)."""
    import numpy as np

    import prims_ts.ops.prefill_paged as pp
    from prims_ts.cuda.keys import DEFAULT_TUNING
    from prims_ts.ops import _validate as V

    made = []
    monkeypatch.setattr(pp.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(pp.K, "prepared", lambda static, dev: made.append(static) or ("launch", static))
    pb = pp._Problem(4, 2, 128, P, 2, torch.device("cuda", 0), "causal", -1, 0.125, 1.0, BF16)
    memo = V.launch_memo()

    def plan(q_len):  # two requests of q_len queries over 48 keys: no work list (the implicit order)
        qo = np.array([0, q_len, 2 * q_len])
        tables = lambda device, batch, num_pages: (None, None, np.array([48, 48]), qo, 7)  # noqa: E731
        return pp._make_plan(DEFAULT_TUNING, "", torch.empty(2 * q_len, 4, 128, dtype=BF16), None, PS, pb, tables,
                             exact=True, launches=memo)

    first, again, other = plan(3), plan(3), plan(5)
    assert len(made) == 2 and first.work is None
    assert again.launch is first.launch and again.static is first.static
    assert other.launch is not first.launch and other.static.max_q_len == 5 and first.static.max_q_len == 3
