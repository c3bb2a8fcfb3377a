"""Every bad input of batch_prefill_with_paged_kv_cache / BatchPrefillPagedTSWrapper is refused on the host.

Contract (SPEC "Errors", §2 and issue 3 item 5): anything outside the contract
raises ``ValueError`` (``TypeError`` for a wrong Python type) whose message names
the argument, before any kernel runs. On CPU the "kernel" of the paged ops is
``prims_ts.reference.batch_prefill_paged``; every error case below runs with it
replaced by a function that fails the test if it is ever reached, so an error
raised *after* the launch does not count.

Devices: this file runs on a CPU-only machine, so "another device" is 'meta'.
"""
from __future__ import annotations

import math

import pytest
import torch

from prims_ts import BatchPrefillPagedTSWrapper, batch_prefill_with_paged_kv_cache
from prims_ts.testing import huge_page_stride, reference_must_not_run

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
    out = buf[nbytes_meta:].view(BF16).view(_q.shape)
    values = {"qo_indptr": QO, "block_tables": TABLE, "seq_lens_kv": LENS}[first_name]
    t = ip(values)
    meta = buf[:t.numel() * 4].view(I32).view(t.shape)
    meta.copy_(t)
    # make them overlap: out starts inside the metadata tensor's bytes
    out = buf[4:4 + _q.numel() * 2].view(BF16).view(_q.shape)
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


def _out_overlaps(name):
    meta, out = _shared(name)
    return base(**{name: meta, "out": out})


ONESHOT_CASES = [
    # page_size
    ("page_size_8", ValueError, "page_size", lambda: base(page_size=8, k_cache=make_pool(ps=8),
                                                          v_cache=make_pool(ps=8, seed=3))),
    ("page_size_256", ValueError, "page_size", lambda: base(page_size=256, k_cache=make_pool(p=1, ps=256),
                                                            v_cache=make_pool(p=1, ps=256, seed=3))),
    ("page_size_48", ValueError, "page_size", lambda: base(page_size=48)),
    ("page_size_0", ValueError, "page_size", lambda: base(page_size=0)),
    ("page_size_neg", ValueError, "page_size", lambda: base(page_size=-16)),
    ("page_size_not_pool", ValueError, "page_size", lambda: base(page_size=32)),
    ("page_size_default_not_pool", ValueError, "page_size", lambda: base(page_size=DROP)),  # default 32 vs 16
    ("pool_page_size_differs_64", ValueError, "page_size",
     lambda: base(k_cache=make_pool(ps=64), v_cache=make_pool(ps=64, seed=3))),
    ("page_size_float", TypeError, "page_size", lambda: base(page_size=16.0)),
    ("page_size_str", TypeError, "page_size", lambda: base(page_size="16")),
    ("page_size_bool", TypeError, "page_size", lambda: base(page_size=True)),
    ("page_size_none", TypeError, "page_size", lambda: base(page_size=None)),
    # kv_layout
    ("kv_layout_NHD", ValueError, "kv_layout", lambda: base(kv_layout="NHD")),
    ("kv_layout_lower", ValueError, "kv_layout", lambda: base(kv_layout="hnd")),
    ("kv_layout_none", TypeError, "kv_layout", lambda: base(kv_layout=None)),
    # pools
    ("v_fewer_pages", ValueError, "v_cache", lambda: base(v_cache=make_pool(p=P - 1))),
    ("v_more_pages", ValueError, "v_cache", lambda: base(v_cache=make_pool(p=P + 1))),
    ("v_other_heads", ValueError, "v_cache", lambda: base(v_cache=make_pool(hkv=1))),
    ("v_other_page_size", ValueError, "v_cache|page_size", lambda: base(v_cache=make_pool(ps=32))),
    ("v_other_head_dim", ValueError, "v_cache|head dim", lambda: base(v_cache=make_pool(d=256))),
    ("k_rank3", ValueError, "k_cache", lambda: base(k_cache=_k[0], v_cache=_v[0])),
    ("v_rank3", ValueError, "v_cache", lambda: base(v_cache=_v[:, 0])),
    ("k_combined_rank5", ValueError, "k_cache",
     lambda: base(k_cache=torch.stack([_k, _v], 1), v_cache=torch.stack([_k, _v], 1))),
    ("pools_head_dim_differs_from_q", ValueError, "k_cache",
     lambda: base(k_cache=make_pool(d=256), v_cache=make_pool(d=256, seed=3))),
    ("k_inner_noncontig", ValueError, "k_cache", lambda: base(k_cache=_noncontig_inner(_k))),
    ("v_inner_noncontig", ValueError, "v_cache", lambda: base(v_cache=_noncontig_inner(_v))),
    ("pools_empty", ValueError, "k_cache", lambda: base(k_cache=make_pool(p=0), v_cache=make_pool(p=0))),
    ("k_not_tensor", TypeError, "k_cache", lambda: base(k_cache=_k.tolist())),
    ("k_page_stride_beyond_int32", ValueError, "k_cache: page stride", lambda: base(k_cache=huge_page_stride(_k))),
    ("v_page_stride_beyond_int32", ValueError, "v_cache: page stride", lambda: base(v_cache=huge_page_stride(_v))),
    ("v_none", TypeError, "v_cache", lambda: base(v_cache=None)),
    # block_tables: dtype, rank, strides, rows
    ("bt_int64", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE, torch.int64))),
    ("bt_int16", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE, torch.int16))),
    ("bt_float32", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE, torch.float32))),
    ("bt_uint32", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE).view(torch.uint32))),
    ("bt_rank1", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE).flatten())),
    ("bt_rank3", ValueError, "block_tables", lambda: base(block_tables=ip([TABLE]))),
    ("bt_inner_stride_2", ValueError, "block_tables", lambda: base(block_tables=_big_table[:, ::2])),
    ("bt_column_major", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE).t().contiguous().t())),
    ("bt_expanded_rows", ValueError, "block_tables",
     lambda: base(block_tables=ip(TABLE[0]).unsqueeze(0).expand(2, C), seq_lens_kv=[20, 20])),
    ("bt_too_many_rows", ValueError, "block_tables|qo_indptr", lambda: base(block_tables=TABLE + [[4, 4, 4]])),
    ("bt_too_few_rows", ValueError, "block_tables|qo_indptr", lambda: base(block_tables=TABLE[:1])),
    ("bt_no_columns", ValueError, "block_tables", lambda: base(block_tables=torch.zeros(2, 0, dtype=I32))),
    ("bt_list", TypeError, "block_tables", lambda: base(block_tables=tuple(map(tuple, TABLE)))),
    # seq_lens_kv
    ("len_zero", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[20, 0])),
    ("len_negative", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[-5, 5])),
    ("len_past_table_row", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[C * PS + 1, 5])),
    ("len_far_past_table_row", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[20, 10**6])),
    ("len_int64", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=ip(LENS, torch.int64))),
    ("len_wrong_length", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=LENS + [5])),
    ("len_rank2", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[LENS])),
    ("len_noncontig", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=ip([20, 9, 5, 9])[::2])),
    ("len_list", TypeError, "seq_lens_kv", lambda: base(seq_lens_kv=tuple(LENS))),
    # used page IDs outside [0, P)
    ("page_negative", ValueError, "block_tables", lambda: base(block_tables=[[3, -1, 7], [5, 0, 2]])),
    ("page_min_int", ValueError, "block_tables", lambda: base(block_tables=[[3, 1, 7], [-2**31, 0, 2]])),
    ("page_eq_P", ValueError, "block_tables", lambda: base(block_tables=[[3, P, 7], [5, 0, 2]])),
    ("page_gt_P", ValueError, "block_tables", lambda: base(block_tables=[[3, 1, 7], [1000, 0, 2]])),
    ("page_max_int", ValueError, "block_tables", lambda: base(block_tables=[[2**31 - 1, 1, 7], [5, 0, 2]])),
    ("page_in_last_partial_page", ValueError, "block_tables",
     lambda: base(seq_lens_kv=[20, 33], block_tables=[[3, 1, 7], [5, 0, P]])),
    # qo_indptr
    ("qo_int64", ValueError, "qo_indptr", lambda: base(qo_indptr=ip(QO, torch.int64))),
    ("qo_float", ValueError, "qo_indptr", lambda: base(qo_indptr=ip(QO, torch.float32))),
    ("qo_rank2", ValueError, "qo_indptr", lambda: base(qo_indptr=[QO])),
    ("qo_noncontig", ValueError, "qo_indptr", lambda: base(qo_indptr=ip([0, 9, 3, 9, 5, 9])[::2])),
    ("qo_single_entry", ValueError, "qo_indptr|block_tables",
     lambda: base(qo_indptr=[0], block_tables=torch.zeros(0, C, dtype=I32), seq_lens_kv=ip([]))),
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: base(qo_indptr=[1, 3, 5])),
    ("qo_not_strict", ValueError, "qo_indptr", lambda: base(qo_indptr=[0, 0, 5])),
    ("qo_not_strict_end", ValueError, "qo_indptr", lambda: base(qo_indptr=[0, 5, 5])),
    ("qo_decreasing", ValueError, "qo_indptr",
     lambda: base(qo_indptr=[0, 4, 3, 5], block_tables=TABLE + [[4, 4, 4]], seq_lens_kv=LENS + [5])),
    ("qo_not_end_at_q", ValueError, "qo_indptr", lambda: base(qo_indptr=[0, 3, 4])),
    ("qo_past_end", ValueError, "qo_indptr", lambda: base(qo_indptr=[0, 3, 6])),
    ("qo_len_vs_table_rows", ValueError, "qo_indptr|block_tables", lambda: base(qo_indptr=[0, 1, 3, 5])),
    ("qo_list", TypeError, "qo_indptr", lambda: base(qo_indptr=tuple(QO))),
    # causal Sq > Sk
    ("causal_sq_gt_sk", ValueError, r"qo_indptr|seq_lens_kv|Sq",
     lambda: base(seq_lens_kv=[2, 5], mask_type="causal")),
    ("causal_window_sq_gt_sk", ValueError, r"qo_indptr|seq_lens_kv|Sq",
     lambda: base(seq_lens_kv=[20, 1], mask_type="causal", window_left=3)),
    # dtypes
    ("k_fp16_q_bf16", ValueError, "k_cache", lambda: base(k_cache=_k.half())),
    ("v_fp16_q_bf16", ValueError, "v_cache", lambda: base(v_cache=_v.half())),
    ("q_fp16_pools_bf16", ValueError, r"\bq\b|k_cache", lambda: base(q=_q.half())),
    ("all_float32", ValueError, r"\bq\b", lambda: base(q=_q.float(), k_cache=_k.float(), v_cache=_v.float())),
    ("all_float64", ValueError, r"\bq\b", lambda: base(q=_q.double(), k_cache=_k.double(), v_cache=_v.double())),
    ("k_int8", ValueError, "k_cache", lambda: base(k_cache=_k.to(torch.int8))),
    # devices ('meta' stands for another device)
    ("q_meta", ValueError, r"\bq\b|k_cache", lambda: base(q=_q.to("meta"))),
    ("k_meta", ValueError, "k_cache", lambda: base(k_cache=_k.to("meta"))),
    ("v_meta", ValueError, "v_cache", lambda: base(v_cache=_v.to("meta"))),
    ("qo_meta", ValueError, "qo_indptr", lambda: base(qo_indptr=ip(QO).to("meta"))),
    ("bt_meta", ValueError, "block_tables", lambda: base(block_tables=ip(TABLE).to("meta"))),
    ("lens_meta", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=ip(LENS).to("meta"))),
    ("out_meta", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=BF16, device="meta"))),
    # head dims and heads
    ("head_dim_64", ValueError, r"\bq\b", lambda: base(q=make_q(d=64), k_cache=make_pool(d=64),
                                                       v_cache=make_pool(d=64, seed=3))),
    ("head_dim_96", ValueError, r"\bq\b", lambda: base(q=make_q(d=96), k_cache=make_pool(d=96),
                                                       v_cache=make_pool(d=96, seed=3))),
    ("q_head_dim_differs", ValueError, r"\bq\b|k_cache", lambda: base(q=make_q(d=256))),
    ("hq_not_multiple", ValueError, r"\bq\b|k_cache|heads", lambda: base(q=make_q(hq=3))),
    ("hkv_gt_hq", ValueError, r"\bq\b|k_cache|heads", lambda: base(q=make_q(hq=1))),
    # q rank, strides, type
    ("q_rank4", ValueError, r"\bq\b", lambda: base(q=_q.unsqueeze(0))),
    ("q_rank2", ValueError, r"\bq\b", lambda: base(q=_q[:, 0])),
    ("q_inner_noncontig", ValueError, r"\bq\b", lambda: base(q=_noncontig_inner(_q))),
    ("q_misaligned", ValueError, r"\bq\b",
     lambda: base(q=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape))),
    ("q_not_tensor", TypeError, r"\bq\b", lambda: base(q=_q.tolist())),
    # out
    ("out_wrong_shape", ValueError, r"\bout\b", lambda: base(out=torch.empty(5, HQ, D + 128, dtype=BF16))),
    ("out_fixed_shape", ValueError, r"\bout\b", lambda: base(out=torch.empty(1, 5, HQ, D, dtype=BF16))),
    ("out_dtype_disagrees", ValueError, r"\bout\b",
     lambda: base(out=torch.empty(_q.shape, dtype=BF16), out_dtype=FP32)),
    ("out_float64", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=torch.float64))),
    ("out_int32", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=I32))),
    ("out_noncontig", ValueError, r"\bout\b", lambda: base(out=torch.empty(5, D, HQ, dtype=BF16).transpose(1, 2))),
    ("out_is_q", ValueError, r"\bout\b", lambda: base(out=_q)),
    ("out_in_k_cache", ValueError, r"\bout\b", lambda: base(out=_k.view(-1)[: _q.numel()].view(_q.shape))),
    ("out_tail_of_v_cache", ValueError, r"\bout\b", lambda: base(out=_v.view(-1)[-_q.numel():].view(_q.shape))),
    ("out_overlaps_qo_indptr", ValueError, r"\bout\b", lambda: _out_overlaps("qo_indptr")),
    ("out_overlaps_block_tables", ValueError, r"\bout\b", lambda: _out_overlaps("block_tables")),
    ("out_overlaps_seq_lens_kv", ValueError, r"\bout\b", lambda: _out_overlaps("seq_lens_kv")),
    ("out_not_tensor", TypeError, r"\bout\b", lambda: base(out=0)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda: base(out_dtype=torch.float64)),
    ("out_dtype_int32", ValueError, "out_dtype", lambda: base(out_dtype=I32)),
    ("out_dtype_str", TypeError, "out_dtype", lambda: base(out_dtype="float32")),
    # masks and windows
    ("window_without_causal", ValueError, "window_left", lambda: base(window_left=4)),
    ("window_zero_without_causal", ValueError, "window_left", lambda: base(window_left=0)),
    ("window_minus_2", ValueError, "window_left", lambda: base(mask_type="causal", window_left=-2)),
    ("window_float", TypeError, "window_left", lambda: base(mask_type="causal", window_left=2.0)),
    ("mask_variable_window", ValueError, "mask_type", lambda: base(mask_type="variable_window")),
    ("mask_unknown", ValueError, "mask_type", lambda: base(mask_type="causal_lower")),
    ("mask_none", TypeError, "mask_type", lambda: base(mask_type=None)),
    # scales
    ("sm_scale_nan", ValueError, "sm_scale", lambda: base(sm_scale=math.nan)),
    ("sm_scale_inf", ValueError, "sm_scale", lambda: base(sm_scale=math.inf)),
    ("sm_scale_zero", ValueError, "sm_scale", lambda: base(sm_scale=0.0)),
    ("sm_scale_negative", ValueError, "sm_scale", lambda: base(sm_scale=-0.1)),
    ("sm_scale_str", TypeError, "sm_scale", lambda: base(sm_scale="0.1")),
    ("output_scale_zero", ValueError, "output_scale", lambda: base(output_scale=0.0)),
    ("output_scale_nan", ValueError, "output_scale", lambda: base(output_scale=math.nan)),
    ("output_scale_negative", ValueError, "output_scale", lambda: base(output_scale=-1.0)),
    ("output_scale_none", TypeError, "output_scale", lambda: base(output_scale=None)),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in ONESHOT_CASES], ids=[c[0] for c in ONESHOT_CASES])
def test_oneshot_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, batch_prefill_with_paged_kv_cache, *args, **kwargs)


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
# BatchPrefillPagedTSWrapper.plan
# ----------------------------------------------------------------------------

HEADS = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS)


def plan_args(qo=QO, table=TABLE, lens=LENS, **kw):
    conv = [ip(x) if isinstance(x, list) else x for x in (qo, table, lens)]
    args = dict(HEADS)
    args.update(kw)
    return tuple(conv), args


PLAN_CASES = [
    ("page_size_8", ValueError, "page_size", lambda: plan_args(page_size=8)),
    ("page_size_48", ValueError, "page_size", lambda: plan_args(page_size=48)),
    ("page_size_512", ValueError, "page_size", lambda: plan_args(page_size=512)),
    ("page_size_str", TypeError, "page_size", lambda: plan_args(page_size="16")),
    ("kv_layout_NHD", ValueError, "kv_layout", lambda: plan_args(kv_layout="NHD")),
    ("num_qo_heads_zero", ValueError, "num_qo_heads", lambda: plan_args(num_qo_heads=0)),
    ("num_kv_heads_float", TypeError, "num_kv_heads", lambda: plan_args(num_kv_heads=2.0)),
    ("heads_not_multiple", ValueError, "num_qo_heads|num_kv_heads", lambda: plan_args(num_qo_heads=3)),
    ("head_dim_64", ValueError, "head_dim", lambda: plan_args(head_dim=64)),
    ("head_dim_float", TypeError, "head_dim", lambda: plan_args(head_dim=128.0)),
    ("q_data_type_float32", ValueError, "q_data_type", lambda: plan_args(q_data_type=FP32)),
    ("mask_variable_window", ValueError, "mask_type", lambda: plan_args(mask_type="variable_window")),
    ("mask_unknown", ValueError, "mask_type", lambda: plan_args(mask_type="full")),
    ("window_without_causal", ValueError, "window_left", lambda: plan_args(window_left=3)),
    ("window_minus_2", ValueError, "window_left", lambda: plan_args(mask_type="causal", window_left=-2)),
    ("sm_scale_inf", ValueError, "sm_scale", lambda: plan_args(sm_scale=math.inf)),
    ("output_scale_zero", ValueError, "output_scale", lambda: plan_args(output_scale=0.0)),
    ("out_dtype_float64", ValueError, "out_dtype", lambda: plan_args(out_dtype=torch.float64)),
    ("max_q_len_too_small", ValueError, "max_q_len", lambda: plan_args(max_q_len=2)),
    ("max_q_len_float", TypeError, "max_q_len", lambda: plan_args(max_q_len=4.0)),
    ("qo_int64", ValueError, "qo_indptr", lambda: plan_args(qo=ip(QO, torch.int64))),
    ("qo_list", TypeError, "qo_indptr", lambda: plan_args(qo=tuple(QO))),
    ("qo_not_start_0", ValueError, "qo_indptr", lambda: plan_args(qo=[1, 3, 5])),
    ("qo_not_strict", ValueError, "qo_indptr", lambda: plan_args(qo=[0, 3, 3])),
    ("qo_len_vs_table_rows", ValueError, "qo_indptr|block_tables", lambda: plan_args(qo=[0, 1, 3, 5])),
    ("bt_int64", ValueError, "block_tables", lambda: plan_args(table=ip(TABLE, torch.int64))),
    ("bt_rank1", ValueError, "block_tables", lambda: plan_args(table=ip(TABLE).flatten())),
    ("bt_inner_stride_2", ValueError, "block_tables", lambda: plan_args(table=_big_table[:, ::2])),
    ("bt_list", TypeError, "block_tables", lambda: plan_args(table=tuple(map(tuple, TABLE)))),
    ("page_negative", ValueError, "block_tables", lambda: plan_args(table=[[3, 1, 7], [-1, 0, 2]])),
    ("len_zero", ValueError, "seq_lens_kv", lambda: plan_args(lens=[0, 5])),
    ("len_past_table_row", ValueError, "seq_lens_kv", lambda: plan_args(lens=[20, C * PS + 1])),
    ("len_int64", ValueError, "seq_lens_kv", lambda: plan_args(lens=ip(LENS, torch.int64))),
    ("len_wrong_length", ValueError, "seq_lens_kv", lambda: plan_args(lens=[20])),
    ("causal_sq_gt_sk", ValueError, r"qo_indptr|seq_lens_kv|Sq",
     lambda: plan_args(lens=[2, 5], mask_type="causal")),
    ("bt_meta", ValueError, "block_tables", lambda: plan_args(table=ip(TABLE).to("meta"))),
    ("lens_meta", ValueError, "seq_lens_kv", lambda: plan_args(lens=ip(LENS).to("meta"))),
]


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_wrapper_plan_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, BatchPrefillPagedTSWrapper().plan, *args, **kwargs)


@pytest.mark.parametrize("value", ["bfloat16", None], ids=["str", "none"])
def test_wrapper_plan_q_data_type_wrong_python_type(value):
    args, kwargs = plan_args(q_data_type=value)
    expect(TypeError, "q_data_type", BatchPrefillPagedTSWrapper().plan, *args, **kwargs)


# ----------------------------------------------------------------------------
# BatchPrefillPagedTSWrapper.run
# ----------------------------------------------------------------------------


def planned(**kw):
    w = BatchPrefillPagedTSWrapper()
    args, kwargs = plan_args(**kw)
    w.plan(*args, **kwargs)
    return w, args


def test_wrapper_run_before_plan():
    with pytest.raises((RuntimeError, ValueError), match="plan"):
        BatchPrefillPagedTSWrapper().run(_q, _k, _v)


def test_wrapper_base_run_is_valid():
    w, _ = planned(mask_type="causal", q_data_type=BF16)
    out = torch.empty(_q.shape, dtype=BF16)
    assert w.run(_q, _k, _v, out=out) is out
    # pools with exactly max_page + 1 pages are enough
    max_page = max(3, 1, 5)
    assert w.run(_q, _k[:max_page + 1], _v[:max_page + 1]).shape == _q.shape


def _run_args(**mods):
    args = dict(q=_q, k_cache=_k, v_cache=_v)
    kwargs = {}
    for key, val in mods.items():
        (args if key in args else kwargs)[key] = val
    return tuple(args.values()), kwargs


RUN_CASES = [
    ("q_other_total", {}, ValueError, r"\bq\b", lambda: _run_args(q=make_q(tq=6))),
    ("q_fewer_tokens", {}, ValueError, r"\bq\b", lambda: _run_args(q=make_q(tq=4))),
    ("q_other_heads", {}, ValueError, r"\bq\b|heads", lambda: _run_args(q=make_q(hq=2 * HQ))),
    ("pools_other_heads", {}, ValueError, r"k_cache|heads",
     lambda: _run_args(k_cache=make_pool(hkv=1), v_cache=make_pool(hkv=1, seed=3))),
    ("head_dim_256", {}, ValueError, r"\bq\b|head",
     lambda: _run_args(q=make_q(d=256), k_cache=make_pool(d=256), v_cache=make_pool(d=256, seed=3))),
    ("q_fp16_vs_plan", {}, ValueError, r"\bq\b",
     lambda: _run_args(q=_q.half(), k_cache=_k.half(), v_cache=_v.half())),
    ("k_fp16", {}, ValueError, "k_cache", lambda: _run_args(k_cache=_k.half())),
    ("q_rank4", {}, ValueError, r"\bq\b", lambda: _run_args(q=_q.unsqueeze(0))),
    ("pool_fewer_pages_than_plan", {}, ValueError, "k_cache",
     lambda: _run_args(k_cache=_k[:5], v_cache=_v[:5])),  # plan's largest page ID is 5
    ("pool_other_page_size", {}, ValueError, "page_size|k_cache",
     lambda: _run_args(k_cache=make_pool(ps=32), v_cache=make_pool(ps=32, seed=3))),
    ("v_other_shape", {}, ValueError, "v_cache", lambda: _run_args(v_cache=_v[:P - 1])),
    ("q_meta", {}, ValueError, r"\bq\b|k_cache|qo_indptr", lambda: _run_args(q=_q.to("meta"))),
    ("k_meta", {}, ValueError, "k_cache", lambda: _run_args(k_cache=_k.to("meta"))),
    ("all_meta", {}, ValueError, r"qo_indptr|block_tables|seq_lens_kv|\bq\b",
     lambda: _run_args(q=_q.to("meta"), k_cache=_k.to("meta"), v_cache=_v.to("meta"))),
    ("out_wrong_shape", {}, ValueError, r"\bout\b", lambda: _run_args(out=torch.empty(5, HQ, D + 1, dtype=BF16))),
    ("out_wrong_dtype", {}, ValueError, r"\bout\b", lambda: _run_args(out=torch.empty(_q.shape, dtype=FP32))),
    ("out_wrong_dtype_vs_plan_fp32", dict(out_dtype=FP32), ValueError, r"\bout\b",
     lambda: _run_args(out=torch.empty(_q.shape, dtype=BF16))),
    ("out_meta", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=torch.empty(_q.shape, dtype=BF16, device="meta"))),
    ("out_noncontig", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=torch.empty(5, D, HQ, dtype=BF16).transpose(1, 2))),
    ("out_is_q", {}, ValueError, r"\bout\b", lambda: _run_args(out=_q)),
    ("out_in_k_cache", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=_k.view(-1)[: _q.numel()].view(_q.shape))),
    ("out_in_v_cache", {}, ValueError, r"\bout\b",
     lambda: _run_args(out=_v.view(-1)[-_q.numel():].view(_q.shape))),
    ("out_not_tensor", {}, TypeError, r"\bout\b", lambda: _run_args(out=[0.0])),
]


@pytest.mark.parametrize("name,plan_kw,exc,match,make", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_wrapper_run_errors(name, plan_kw, exc, match, make):
    w, _ = planned(**plan_kw)
    args, kwargs = make()
    expect(exc, match, w.run, *args, **kwargs)


@pytest.mark.parametrize("which", ["qo_indptr", "block_tables", "seq_lens_kv"])
def test_wrapper_run_out_overlapping_planned_metadata(which):
    meta, out = _shared(which)
    w, _ = planned(**{{"qo_indptr": "qo", "block_tables": "table", "seq_lens_kv": "lens"}[which]: meta})
    expect(ValueError, r"\bout\b", w.run, _q, _k, _v, out=out)


def test_wrapper_failed_plan_keeps_previous_plan_usable():
    """A refused re-plan must not leave a half-written plan behind that run would then use."""
    w, _ = planned(mask_type="causal")
    ref = w.run(_q, _k, _v)
    args, kw = plan_args(table=[[3, 1, 7], [-1, 0, 2]], mask_type="dense")
    expect(ValueError, "block_tables", w.plan, *args, **kw)
    args, kw = plan_args(head_dim=64)
    expect(ValueError, "head_dim", w.plan, *args, **kw)
    torch.testing.assert_close(w.run(_q, _k, _v), ref, rtol=0, atol=0)
