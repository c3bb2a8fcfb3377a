"""Every bad input of the paged block-sparse API is refused on the host, before any kernel runs.

Contract (SPEC "Errors", §5, seed 002 and issue 6 item 5): anything outside the contract
raises ``ValueError`` (``TypeError`` for a wrong Python type) whose message names the
argument. On CPU the "kernel" of ``prims_ts::block_sparse_attention(_out)`` is
``prims_ts.reference.block_sparse_attention``; every error case below runs with it
replaced by a function that fails the test if it is ever reached, so an error raised
*after* the launch does not count.

* The one-shot ``block_sparse_attention_with_paged_kv_cache`` takes exactly one length bound:
  ``max_seq_len_kv`` (the seed's, with ``seq_lens_kv``) or FlashInfer's ``seq_len_kv``
  (``seq_lens_kv`` optional: every request has ``seq_len_kv`` keys). It reads and checks the
  live metadata with whole-tensor checks: lengths, the CSR page offsets and the complete live
  page-ID prefix of every request, canonical BSR rows (offsets inside ``block_indices``,
  non-decreasing along each row, block IDs strictly increasing and starting before the
  request's length); ``test_oneshot_large_routes`` plants single bad entries deep inside a
  route of tens of thousands of block IDs.
* ``BlockSparsePagedTSWrapper.plan(paged_kv_indptr, seq_len_q, seq_len_kv, num_qo_heads,
  num_kv_heads, head_dim, q_block_size, kv_block_size, page_size, *, max_blocks_per_row,
  use_kv_valid_bits, seq_lens_kv=None, mask_type, q_data_type, kv_data_type, o_data_type)``
  checks the geometry and reads ``paged_kv_indptr`` (and ``seq_lens_kv``) once: lengths in
  ``[lo, seq_len_kv]``, enough pages per request. ``run(q, paged_kv_cache, paged_kv_indices,
  block_indptr, block_indices, *, kv_valid_bits, sm_scale, out)`` checks shapes, dtypes,
  devices, the scale and the plan, and trusts metadata *values*: it reads none of them on
  the host (``test_wrapper_run_trusts_metadata_values``).

Devices: this file runs on a CPU-only machine, so "another device" is 'meta'.
"""
from __future__ import annotations

import math
import re
from unittest import mock

import pytest
import torch

import prims_ts
import prims_ts.ops.block_sparse as bsm
from prims_ts import reference as R
from prims_ts.ops.block_sparse import BlockSparsePagedTSWrapper, block_sparse_attention_with_paged_kv_cache
import prims_ts.meta.block_sparse  # noqa: F401,E402  (registers the fakes; after the ops they describe)
from prims_ts.testing import TOLERANCE, huge_page_stride, rel_err, reference_must_not_run
from prims_ts.testing import recording_no_host_reads as _recording

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32, U32 = torch.int32, torch.uint32
D = 128
SQ, HQ, HKV = 5, 4, 2  # group 2
PS = 16
P = 8
B = 2
INDPTR = [0, 2, 3]  # request 0 owns 2 pages, request 1 one page
INDICES = [3, 1, 5]
LENS = [20, 5]  # request 0: blocks 0..2 (kv_block 8); request 1: block 0
MAX_LEN = 32  # one valid-bit word per request
QB, KVB = 4, 8  # 4 * 2 % 8 == 0; R = ceil(5 / 4) = 2
# (b, h) segments at absolute offsets: (0,0) rows [0, 2] | [1]; (0,1) [] | [0]; (1,0) [0] | [];
# a garbage entry at 5 that no row covers; (1,1) [0] | []
BIP = [[[0, 2, 3], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]]
BI = [0, 2, 1, 0, 0, -1, 0]
BITS = [[0xFFFF0FFF], [0x7]]
BOUND = 2_147_483_520
MBR = 2  # the wrapper's max_blocks_per_row: the base routes' longest row (ceil(32 / 8) = 4 at most)
# FlashInfer's one-shot form without lengths: every request has seq_len_kv = MAX_LEN keys (2 pages each)
FI_INDPTR = [0, 2, 4]
FI_INDICES = [3, 1, 5, 2]

DROP = object()  # base(key=DROP): leave the keyword out (use the function's default)


def _rand(*shape, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def ip(values, dtype=I32):
    return torch.tensor(values, dtype=dtype)


def bits(values=BITS, dtype=U32):
    t = ip([[w - 2**32 if w >= 2**31 else w for w in row] for row in values])
    return t.view(dtype) if dtype == U32 else t.to(dtype)


def make_q(b=B, sq=SQ, hq=HQ, d=D, dtype=BF16):
    return _rand(b, sq, hq, d, dtype=dtype, seed=1)


def make_cache(p=P, hkv=HKV, ps=PS, d=D, dtype=BF16, two=2, seed=2):
    return _rand(p, two, hkv, ps, d, dtype=dtype, seed=seed)


def make_pool(p=P, hkv=HKV, ps=PS, d=D, dtype=BF16, seed=3):
    return _rand(p, hkv, ps, d, dtype=dtype, seed=seed)


def expect(exc, match, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` raises ``exc`` matching ``match`` and never reaches the kernel."""
    with reference_must_not_run("block_sparse_attention"):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)


_q = make_q()
_kv = make_cache()
_k = make_pool(seed=5)
_v = make_pool(seed=6)

META = ("paged_kv_indptr", "paged_kv_indices", "block_indptr", "block_indices", "seq_lens_kv")


def base(**mods):
    """Valid one-shot arguments with modifications applied: (args, kwargs). Lists become int32 tensors."""
    args = dict(q=_q, paged_kv_cache=_kv, paged_kv_indptr=ip(INDPTR), paged_kv_indices=ip(INDICES),
                block_indptr=ip(BIP), block_indices=ip(BI), q_block_size=QB, kv_block_size=KVB)
    kwargs = dict(max_seq_len_kv=MAX_LEN, seq_lens_kv=ip(LENS))
    for key, val in mods.items():
        if isinstance(val, list) and key in META:
            val = ip(val)
        (args if key in args else kwargs)[key] = val
    kwargs = {key: val for key, val in kwargs.items() if val is not DROP}
    return tuple(args.values()), kwargs


def fi(**mods):
    """Valid one-shot arguments in FlashInfer's form (``seq_len_kv=``, no ``seq_lens_kv``: every request
    has MAX_LEN keys), with modifications applied."""
    mods = dict(dict(max_seq_len_kv=DROP, seq_lens_kv=DROP, seq_len_kv=MAX_LEN, paged_kv_indptr=FI_INDPTR,
                     paged_kv_indices=FI_INDICES), **mods)
    return base(**mods)


def _noncontig_inner(t):
    """Same shape and values as t, last dimension with stride 2."""
    base_ = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    view = base_[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2
    return view


def _noncontig(t):
    """Same shape and values as t, not contiguous (every dimension strided by 2 in the last)."""
    wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
    view = wide[..., 0]
    view.copy_(t)
    assert not view.is_contiguous()
    return view


def _out_sharing(name):
    """(metadata tensor holding the base values, out whose bytes start inside it)."""
    values = {"paged_kv_indptr": ip(INDPTR), "paged_kv_indices": ip(INDICES), "block_indptr": ip(BIP),
              "block_indices": ip(BI), "seq_lens_kv": ip(LENS), "kv_valid_bits": bits()}[name]
    n = _q.numel()
    buf = torch.zeros(n * 2 + values.numel() * 4 + 64, dtype=torch.uint8)
    meta = buf[:values.numel() * 4].view(values.dtype).view(values.shape)
    meta.copy_(values)
    out = buf[4:4 + n * 2].view(BF16).view(_q.shape)
    return meta, out


def _out_overlaps(name):
    meta, out = _out_sharing(name)
    return base(**{name: meta, "out": out})


# ----------------------------------------------------------------------------
# Sanity: the base inputs (and some unusual but valid ones) are accepted.
# ----------------------------------------------------------------------------


def test_base_inputs_are_valid():
    args, kw = base()
    assert block_sparse_attention_with_paged_kv_cache(*args, **kw).shape == _q.shape
    args, kw = base(paged_kv_cache=(_k, _v), mask_type="causal", kv_valid_bits=bits(), sm_scale=0.5)
    out = torch.empty(_q.shape, dtype=FP32)
    assert block_sparse_attention_with_paged_kv_cache(*args, out=out, **kw) is out
    # int32 words holding the same bits; a cache with exactly max page + 1 pages
    args, kw = base(paged_kv_cache=_kv[:max(INDICES) + 1], kv_valid_bits=bits(dtype=I32))
    block_sparse_attention_with_paged_kv_cache(*args, **kw)
    # out's dtype decides the output dtype
    args, kw = base()
    assert block_sparse_attention_with_paged_kv_cache(*args, out=torch.empty(_q.shape, dtype=FP16), **kw).dtype == FP16


EDGE_CASES = [
    # lengths equal to max_seq_len_kv (2 pages, 4 blocks: request 0 may select block 3)
    ("lengths_at_max", dict(seq_lens_kv=[32, 5], block_indices=[0, 3, 1, 0, 0, -1, 0])),
    # an indptr entry equal to block_indices.numel(); every row of a segment empty
    ("offsets_at_the_end", dict(block_indptr=[[[0, 2, 3], [3, 3, 4]], [[4, 5, 5], [7, 7, 7]]])),
    # every row empty and no block IDs at all
    ("no_blocks", dict(block_indptr=[[[0, 0, 0]] * 2] * 2, block_indices=[])),
    # CSR entries past the live pages hold garbage (never read), a request owning extra entries
    ("csr_slack_garbage", dict(paged_kv_indptr=[0, 3, 5], paged_kv_indices=[3, 1, -1, 5, 2**31 - 1])),
    # repeated page IDs within and across requests
    ("repeated_pages", dict(paged_kv_indices=[3, 3, 3])),
    # q_block larger than Sq (R = 1), and kv blocks of 64 / 128 / 192 keys (block 0 only)
    ("q_block_larger_than_sq", dict(q_block_size=8, block_indptr=[[[0, 2], [2, 3]], [[3, 4], [4, 5]]],
                                    block_indices=[0, 2, 1, 0, 0])),
    ("kv_block_64", dict(kv_block_size=64, block_indices=[0, 0, 0, 0, 0, -1, 0],
                         block_indptr=[[[0, 1, 2], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]])),
    ("kv_block_128", dict(kv_block_size=128, block_indices=[0, 0, 0, 0, 0, -1, 0],
                          block_indptr=[[[0, 1, 2], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]])),
    ("kv_block_192", dict(kv_block_size=192, block_indices=[0, 0, 0, 0, 0, -1, 0],
                          block_indptr=[[[0, 1, 2], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]])),
    # q_block 1 with group 8 (Hq 8, Hkv 1); Sq 1
    ("q_block_1_group_8", dict(q=make_q(hq=8, sq=1), paged_kv_cache=make_cache(hkv=1), q_block_size=1,
                               block_indptr=[[[0, 1]], [[1, 2]]], block_indices=[2, 0])),
    # max_seq_len_kv at the representable bound (no valid bits: those would need 2**26 words)
    ("max_seq_len_kv_bound", dict(max_seq_len_kv=BOUND)),
    # causal with Sq == Sk
    ("causal_sq_eq_sk", dict(mask_type="causal")),
    # FlashInfer's form: seq_len_kv, seq_lens_kv optional
    ("fi_no_lengths", dict(max_seq_len_kv=DROP, seq_lens_kv=DROP, seq_len_kv=MAX_LEN, paged_kv_indptr=FI_INDPTR,
                           paged_kv_indices=FI_INDICES, block_indices=[0, 3, 1, 0, 3, -1, 2])),
    ("fi_no_lengths_bits_causal", dict(max_seq_len_kv=DROP, seq_lens_kv=DROP, seq_len_kv=MAX_LEN,
                                       paged_kv_indptr=FI_INDPTR, paged_kv_indices=FI_INDICES,
                                       kv_valid_bits=bits([[0xFFFF0FFF], [0x80000007]]), mask_type="causal")),
    ("fi_with_lengths", dict(max_seq_len_kv=DROP, seq_len_kv=MAX_LEN, kv_valid_bits=bits())),
    ("fi_bound", dict(max_seq_len_kv=DROP, seq_len_kv=BOUND)),
    ("fi_one_page_each", dict(max_seq_len_kv=DROP, seq_lens_kv=DROP, seq_len_kv=PS, paged_kv_indptr=[0, 1, 3],
                              paged_kv_indices=[3, 1, 5],
                              block_indices=[0, 1, 1, 0, 0, -1, 0])),
]


@pytest.mark.parametrize("mods", [c[1] for c in EDGE_CASES], ids=[c[0] for c in EDGE_CASES])
def test_edge_values_are_accepted(mods):
    args, kw = base(**mods)
    out = torch.full(args[0].shape, float("nan"), dtype=BF16)
    assert block_sparse_attention_with_paged_kv_cache(*args, out=out, **kw) is out
    assert not out.isnan().any()


def test_kernel_patch_is_effective():
    """The error cases' guard does catch a launch: a valid call under it fails."""
    args, kw = base()
    with reference_must_not_run("block_sparse_attention"):
        with pytest.raises(AssertionError, match="CPU kernel"):
            block_sparse_attention_with_paged_kv_cache(*args, **kw)


ONESHOT = []  # filled below: (id, exc, match, make)


def case(name, exc, match, make):
    ONESHOT.append((name, exc, match, make))


# --- block sizes
case("q_block_0", ValueError, "q_block_size", lambda: base(q_block_size=0))
case("q_block_negative", ValueError, "q_block_size", lambda: base(q_block_size=-4))
case("q_block_float", TypeError, "q_block_size", lambda: base(q_block_size=4.0))
case("q_block_bool", TypeError, "q_block_size", lambda: base(q_block_size=True))
case("q_block_none", TypeError, "q_block_size", lambda: base(q_block_size=None))
case("q_block_tensor", TypeError, "q_block_size", lambda: base(q_block_size=torch.tensor(4)))
case("q_block_3_group_2", ValueError, "q_block_size", lambda: base(q_block_size=3))  # 6 % 8
case("q_block_2_group_2", ValueError, "q_block_size",
     lambda: base(q_block_size=2, block_indptr=[[[0, 1, 2, 2]] * 2] * 2))  # 4 % 8, R = 3
case("q_block_6_group_2", ValueError, "q_block_size", lambda: base(q_block_size=6))  # 12 % 8
case("q_block_4_group_1", ValueError, "q_block_size",
     lambda: base(q=make_q(hq=HKV)))  # 4 * 1 % 8
case("q_block_12_group_1", ValueError, "q_block_size", lambda: base(q=make_q(hq=HKV), q_block_size=12))
case("kv_block_0", ValueError, "kv_block_size", lambda: base(kv_block_size=0))
case("kv_block_negative_64", ValueError, "kv_block_size", lambda: base(kv_block_size=-64))
case("kv_block_4", ValueError, "kv_block_size", lambda: base(kv_block_size=4))
case("kv_block_1", ValueError, "kv_block_size", lambda: base(kv_block_size=1))
case("kv_block_24", ValueError, "kv_block_size", lambda: base(kv_block_size=24))
case("kv_block_48", ValueError, "kv_block_size", lambda: base(kv_block_size=48))
case("kv_block_96", ValueError, "kv_block_size", lambda: base(kv_block_size=96))
case("kv_block_100", ValueError, "kv_block_size", lambda: base(kv_block_size=100))
case("kv_block_65", ValueError, "kv_block_size", lambda: base(kv_block_size=65))
case("kv_block_float", TypeError, "kv_block_size", lambda: base(kv_block_size=8.0))
case("kv_block_str", TypeError, "kv_block_size", lambda: base(kv_block_size="8"))
case("kv_block_none", TypeError, "kv_block_size", lambda: base(kv_block_size=None))
# --- block_indptr: shape, dtype, layout, device, values
case("bip_int64", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP, torch.int64)))
case("bip_uint32", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP).view(U32)))
case("bip_float", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP, FP32)))
case("bip_rank2", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP).view(B, -1)))
case("bip_rank4", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP).unsqueeze(0)))
case("bip_flat", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP).flatten()))
case("bip_R_plus_1", ValueError, "block_indptr", lambda: base(block_indptr=[[[0, 2, 3, 3]] * 2] * 2))
case("bip_R_minus_1", ValueError, "block_indptr", lambda: base(block_indptr=[[[0, 2]] * 2] * 2))
case("bip_R_of_other_q_block", ValueError, "block_indptr", lambda: base(q_block_size=8))  # R = 1
case("bip_batch_plus_1", ValueError, "block_indptr", lambda: base(block_indptr=BIP + [BIP[0]]))
case("bip_batch_1", ValueError, "block_indptr", lambda: base(block_indptr=BIP[:1]))
case("bip_per_query_head", ValueError, "block_indptr", lambda: base(block_indptr=[BIP[0] * 2, BIP[1] * 2]))
case("bip_one_kv_head", ValueError, "block_indptr", lambda: base(block_indptr=[BIP[0][:1], BIP[1][:1]]))
case("bip_noncontig", ValueError, "block_indptr", lambda: base(block_indptr=_noncontig(ip(BIP))))
case("bip_meta", ValueError, "block_indptr", lambda: base(block_indptr=ip(BIP).to("meta")))
case("bip_tuple", TypeError, "block_indptr", lambda: base(block_indptr=tuple(BIP)))
case("bip_none", TypeError, "block_indptr", lambda: base(block_indptr=None))
case("bip_row_decreasing", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[0, 2, 1], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]]))
case("bip_row_decreasing_last_segment", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[0, 2, 3], [3, 3, 4]], [[4, 5, 5], [6, 7, 6]]]))
case("bip_past_numel", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[0, 2, 3], [3, 3, 4]], [[4, 5, 5], [6, 7, 8]]]))
case("bip_far_past_numel", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[0, 2, 3], [3, 3, 2**31 - 1]], [[4, 5, 5], [6, 7, 7]]]))
case("bip_negative", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[-1, 2, 3], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]]))
case("bip_min_int", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[0, 2, 3], [-2**31, -2**31, 4]], [[4, 5, 5], [6, 7, 7]]]))
case("bip_past_numel_of_empty_indices", ValueError, "block_indptr",
     lambda: base(block_indptr=[[[0, 0, 0], [0, 0, 1]], [[0, 0, 0], [0, 0, 0]]], block_indices=[]))
# --- block_indices: values, dtype, layout, device
case("blocks_unsorted", ValueError, "block_indices", lambda: base(block_indices=[2, 0, 1, 0, 0, -1, 0]))
case("blocks_repeated", ValueError, "block_indices", lambda: base(block_indices=[1, 1, 1, 0, 0, -1, 0]))
case("blocks_unsorted_request_1", ValueError, "block_indices",
     lambda: base(block_indptr=[[[0, 2, 3], [3, 3, 4]], [[4, 5, 5], [5, 7, 7]]], block_indices=[0, 2, 1, 0, 0, 1, 0],
                  seq_lens_kv=[20, 16]))
case("block_past_length", ValueError, "block_indices", lambda: base(block_indices=[0, 3, 1, 0, 0, -1, 0]))
case("block_past_length_request_1", ValueError, "block_indices",
     lambda: base(block_indices=[0, 2, 1, 0, 0, -1, 1]))  # Sk 5: only block 0 starts before it
case("block_starting_at_length", ValueError, "block_indices",
     lambda: base(seq_lens_kv=[16, 5]))  # block 2 starts at key 16 == Sk
case("block_past_length_kv_64", ValueError, "block_indices",
     lambda: base(kv_block_size=64, block_indptr=[[[0, 1, 2], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]],
                  block_indices=[0, 1, 0, 0, 0, -1, 0]))
case("block_negative", ValueError, "block_indices", lambda: base(block_indices=[-1, 2, 1, 0, 0, -1, 0]))
case("block_min_int", ValueError, "block_indices", lambda: base(block_indices=[0, 2, 1, -2**31, 0, -1, 0]))
case("block_max_int", ValueError, "block_indices", lambda: base(block_indices=[0, 2**31 - 1, 1, 0, 0, -1, 0]))
case("blocks_int64", ValueError, "block_indices", lambda: base(block_indices=ip(BI, torch.int64)))
case("blocks_rank2", ValueError, "block_indices", lambda: base(block_indices=[BI]))
case("blocks_noncontig", ValueError, "block_indices", lambda: base(block_indices=_noncontig(ip(BI))))
case("blocks_meta", ValueError, "block_indices", lambda: base(block_indices=ip(BI).to("meta")))
case("blocks_tuple", TypeError, "block_indices", lambda: base(block_indices=tuple(BI)))
# --- pages: CSR offsets and the live page-ID prefix
case("page_id_eq_num_pages", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=[3, P, 5]))
case("page_id_negative", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=[3, 1, -1]))
case("page_id_max_int", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=[2**31 - 1, 1, 5]))
case("page_id_min_int", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=[3, -2**31, 5]))
case("page_id_vs_smaller_cache", ValueError, "paged_kv_indices", lambda: base(paged_kv_cache=_kv[:5]))
case("page_id_vs_smaller_tuple_cache", ValueError, "paged_kv_indices",
     lambda: base(paged_kv_cache=(_k[:4], _v[:4])))
case("indptr_not_start_0", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[1, 2, 3]))
case("indptr_decreasing", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 3, 2]))
case("indptr_end_short", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 2, 2]))
case("indptr_end_past", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 2, 4]))
# the final offset past paged_kv_indices.numel() where a request's live pages reach past the IDs
case("indptr_end_past_live_pages", ValueError, "paged_kv_indptr",
     lambda: base(paged_kv_indptr=[0, 2, 4], seq_lens_kv=[20, 20]))
case("indptr_far_past_indices", ValueError, "paged_kv_indptr",
     lambda: base(paged_kv_indptr=[0, 2, 2**31 - 1], seq_lens_kv=[20, 20]))
case("indptr_too_few_pages", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 1, 3]))
case("indptr_no_pages", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 3, 3]))
case("indptr_int64", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=ip(INDPTR, torch.int64)))
case("indptr_length_B", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 3]))
case("indptr_length_B_plus_2", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[0, 1, 2, 3]))
case("indptr_rank2", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=[INDPTR]))
case("indptr_noncontig", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=_noncontig(ip(INDPTR))))
case("indptr_meta", ValueError, "paged_kv_indptr", lambda: base(paged_kv_indptr=ip(INDPTR).to("meta")))
case("indptr_list", TypeError, "paged_kv_indptr", lambda: base(paged_kv_indptr=tuple(INDPTR)))
case("indices_int64", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=ip(INDICES, torch.int64)))
case("indices_rank2", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=[INDICES]))
case("indices_meta", ValueError, "paged_kv_indices", lambda: base(paged_kv_indices=ip(INDICES).to("meta")))
case("indices_tuple", TypeError, "paged_kv_indices", lambda: base(paged_kv_indices=tuple(INDICES)))
# --- kv_valid_bits
case("bits_two_words", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits([[1, 1], [1, 1]])))
case("bits_words_for_smaller_max", ValueError, "kv_valid_bits",
     lambda: base(max_seq_len_kv=33, kv_valid_bits=bits()))  # ceil(33 / 32) = 2 words
case("bits_three_rows", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(BITS + [[1]])))
case("bits_one_row", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(BITS[:1])))
case("bits_rank1", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits().flatten()))
case("bits_rank3", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits().unsqueeze(0)))
case("bits_int64", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(dtype=torch.int64)))
case("bits_uint8", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(dtype=torch.uint8)))
case("bits_int16", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(dtype=torch.int16)))
case("bits_bool", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(dtype=torch.bool)))
case("bits_float32", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits(dtype=FP32)))
case("bits_noncontig", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=_noncontig(bits())))
case("bits_meta", ValueError, "kv_valid_bits", lambda: base(kv_valid_bits=bits().to("meta")))
case("bits_list", TypeError, "kv_valid_bits", lambda: base(kv_valid_bits=BITS))
# --- seq_lens_kv
case("seq_len_above_max", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[MAX_LEN + 1, 5]))
case("seq_len_far_above_max", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[20, 2**31 - 1]))
case("seq_len_0", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[20, 0]))
case("seq_len_negative", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[-3, 5]))
case("seq_len_below_sq_causal", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[20, 4], mask_type="causal"))
case("seq_lens_int64", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=ip(LENS, torch.int64)))
case("seq_lens_length_B_plus_1", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=LENS + [5]))
case("seq_lens_length_B_minus_1", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=LENS[:1]))
case("seq_lens_rank2", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=[LENS]))
case("seq_lens_noncontig", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=_noncontig(ip(LENS))))
case("seq_lens_meta", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=ip(LENS).to("meta")))
case("seq_lens_tuple", TypeError, "seq_lens_kv", lambda: base(seq_lens_kv=tuple(LENS)))
case("seq_lens_missing", ValueError, "seq_lens_kv", lambda: base(seq_lens_kv=DROP))  # required with max_seq_len_kv
# --- max_seq_len_kv
case("max_len_0", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=0))
case("max_len_negative", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=-1))
case("max_len_below_longest", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=19))
case("max_len_bound_plus_1", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=BOUND + 1))
case("max_len_2_31", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=2**31))
case("max_len_float", TypeError, "max_seq_len_kv", lambda: base(max_seq_len_kv=32.0))
case("max_len_bool", TypeError, "max_seq_len_kv", lambda: base(max_seq_len_kv=True))
case("max_len_none", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=None))  # None: no bound given
case("max_len_str", TypeError, "max_seq_len_kv", lambda: base(max_seq_len_kv="32"))
case("max_len_tensor", TypeError, "max_seq_len_kv", lambda: base(max_seq_len_kv=torch.tensor(32)))
case("max_len_missing", ValueError, "max_seq_len_kv", lambda: base(max_seq_len_kv=DROP))
# --- seq_len_kv (FlashInfer's bound): exactly one of the two bounds; then as max_seq_len_kv
case("both_bounds", ValueError, "max_seq_len_kv/seq_len_kv", lambda: base(seq_len_kv=MAX_LEN))
case("both_bounds_fi_lengths", ValueError, "max_seq_len_kv/seq_len_kv", lambda: fi(max_seq_len_kv=MAX_LEN))
case("neither_bound", ValueError, "max_seq_len_kv/seq_len_kv", lambda: base(max_seq_len_kv=DROP))
case("neither_bound_no_lengths", ValueError, "max_seq_len_kv/seq_len_kv", lambda: fi(seq_len_kv=DROP))
case("fi_seq_len_kv_0", ValueError, "seq_len_kv", lambda: fi(seq_len_kv=0))
case("fi_seq_len_kv_negative", ValueError, "seq_len_kv", lambda: fi(seq_len_kv=-32))
case("fi_seq_len_kv_past_bound", ValueError, "seq_len_kv", lambda: fi(seq_len_kv=BOUND + 1))
case("fi_seq_len_kv_float", TypeError, "seq_len_kv", lambda: fi(seq_len_kv=32.0))
case("fi_seq_len_kv_bool", TypeError, "seq_len_kv", lambda: fi(seq_len_kv=True))
case("fi_seq_len_kv_str", TypeError, "seq_len_kv", lambda: fi(seq_len_kv="32"))
case("fi_seq_len_kv_tensor", TypeError, "seq_len_kv", lambda: fi(seq_len_kv=torch.tensor(32)))
case("fi_length_above_seq_len_kv", ValueError, "seq_lens_kv", lambda: fi(seq_lens_kv=[MAX_LEN + 1, 5]))
case("fi_seq_len_kv_below_longest", ValueError, "seq_lens_kv", lambda: base(max_seq_len_kv=DROP, seq_len_kv=19))
case("fi_length_0", ValueError, "seq_lens_kv", lambda: fi(seq_lens_kv=[20, 0]))
case("fi_lengths_int64", ValueError, "seq_lens_kv", lambda: fi(seq_lens_kv=ip(LENS, torch.int64)))
case("fi_lengths_tuple", TypeError, "seq_lens_kv", lambda: fi(seq_lens_kv=tuple(LENS)))
case("fi_too_few_pages_for_seq_len_kv", ValueError, "paged_kv_indptr",
     lambda: fi(paged_kv_indptr=INDPTR, paged_kv_indices=INDICES))  # request 1: one page for 32 keys
case("fi_page_id_past_cache", ValueError, "paged_kv_indices", lambda: fi(paged_kv_indices=[3, 1, 5, P]))
case("fi_block_past_seq_len_kv", ValueError, "block_indices", lambda: fi(block_indices=[0, 4, 1, 0, 0, -1, 0]))
case("fi_bits_words_for_seq_len_kv", ValueError, "kv_valid_bits",
     lambda: base(max_seq_len_kv=DROP, seq_len_kv=33, kv_valid_bits=bits()))  # ceil(33 / 32) = 2 words
case("fi_causal_sq_above_seq_len_kv", ValueError, "seq_lens?_kv",
     lambda: fi(seq_len_kv=SQ - 1, mask_type="causal"))
# --- mask and scale
case("mask_unknown", ValueError, "mask_type", lambda: base(mask_type="full"))
case("mask_variable_window", ValueError, "mask_type", lambda: base(mask_type="variable_window"))
case("mask_upper", ValueError, "mask_type", lambda: base(mask_type="CAUSAL"))
case("mask_none", TypeError, "mask_type", lambda: base(mask_type=None))
case("sm_scale_zero", ValueError, "sm_scale", lambda: base(sm_scale=0.0))
case("sm_scale_negative", ValueError, "sm_scale", lambda: base(sm_scale=-0.1))
case("sm_scale_nan", ValueError, "sm_scale", lambda: base(sm_scale=math.nan))
case("sm_scale_inf", ValueError, "sm_scale", lambda: base(sm_scale=math.inf))
case("sm_scale_str", TypeError, "sm_scale", lambda: base(sm_scale="0.1"))
case("sm_scale_tensor", TypeError, "sm_scale", lambda: base(sm_scale=torch.tensor(0.1)))
# --- q: type, rank, dtype, layout, heads, head dim
case("q_not_tensor", TypeError, r"\bq\b", lambda: base(q=_q.tolist()))
case("q_rank3", ValueError, r"\bq\b", lambda: base(q=_q[:, 0]))
case("q_rank5", ValueError, r"\bq\b", lambda: base(q=_q.unsqueeze(0)))
case("q_batch_0", ValueError, r"\bq\b", lambda: base(q=make_q(b=0)))
case("q_sq_0", ValueError, r"\bq\b", lambda: base(q=make_q(sq=0)))
case("q_fp16_cache_bf16", ValueError, r"\bq\b|paged_kv_cache", lambda: base(q=_q.half()))
case("q_bf16_cache_fp16", ValueError, r"\bq\b|paged_kv_cache", lambda: base(paged_kv_cache=_kv.half()))
case("all_float32", ValueError, r"\bq\b|paged_kv_cache", lambda: base(q=_q.float(), paged_kv_cache=_kv.float()))
case("q_float32", ValueError, r"\bq\b", lambda: base(q=_q.float()))
case("q_head_dim_64", ValueError, r"\bq\b|head dim", lambda: base(q=make_q(d=64), paged_kv_cache=make_cache(d=64)))
case("q_head_dim_96", ValueError, r"\bq\b|head dim", lambda: base(q=make_q(d=96), paged_kv_cache=make_cache(d=96)))
case("q_head_dim_512", ValueError, r"\bq\b|head dim",
     lambda: base(q=make_q(d=512), paged_kv_cache=make_cache(d=512)))
case("q_vs_cache_head_dim", ValueError, "paged_kv_cache|head dim", lambda: base(paged_kv_cache=make_cache(d=256)))
case("hq_not_multiple_of_hkv", ValueError, r"\bq\b|paged_kv_cache", lambda: base(q=make_q(hq=3)))
case("hkv_gt_hq", ValueError, r"\bq\b|paged_kv_cache", lambda: base(q=make_q(hq=1)))
case("hq_6_hkv_4", ValueError, r"\bq\b|paged_kv_cache", lambda: base(q=make_q(hq=6), paged_kv_cache=make_cache(hkv=4)))
case("q_inner_noncontig", ValueError, r"\bq\b", lambda: base(q=_noncontig_inner(_q)))
case("q_misaligned", ValueError, r"\bq\b", lambda: base(q=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape)))
case("q_batch_vs_indptr", ValueError, r"paged_kv_indptr|block_indptr|seq_lens_kv|\bq\b",
     lambda: base(q=make_q(b=3)))
case("q_meta", ValueError, r"\bq\b|paged_kv_cache", lambda: base(q=_q.to("meta")))
# --- the cache: forms, page size, layout, device
case("cache_meta", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=_kv.to("meta")))
case("tuple_k_meta", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=(_k.to("meta"), _v.to("meta"))))
case("combined_dim1_3", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=make_cache(two=3)))
case("combined_dim1_1", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=make_cache(two=1)))
case("combined_rank4", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=_k))
case("combined_rank6", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=_kv.unsqueeze(0)))
case("tuple_of_3", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=(_k, _v, _v)))
case("tuple_of_1", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=(_k,)))
case("tuple_shapes_differ", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=(_k, _v[:P - 1])))
case("tuple_k_bf16_v_fp16", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=(_k, _v.half())))
case("tuple_rank5", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=(_kv, _kv)))
case("tuple_of_lists", TypeError, "paged_kv_cache", lambda: base(paged_kv_cache=(_k.tolist(), _v)))
case("cache_none", TypeError, "paged_kv_cache", lambda: base(paged_kv_cache=None))
case("cache_int8", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=_kv.to(torch.int8)))
case("cache_inner_noncontig", ValueError, "paged_kv_cache", lambda: base(paged_kv_cache=_noncontig_inner(_kv)))
case("page_size_8", ValueError, "page size|paged_kv_cache", lambda: base(paged_kv_cache=make_cache(ps=8)))
case("page_size_8_tuple", ValueError, "page size|paged_kv_cache",
     lambda: base(paged_kv_cache=(make_pool(ps=8), make_pool(ps=8, seed=4))))
case("page_size_48", ValueError, "page size|paged_kv_cache", lambda: base(paged_kv_cache=make_cache(ps=48)))
case("page_size_256", ValueError, "page size|paged_kv_cache", lambda: base(paged_kv_cache=make_cache(p=2, ps=256)))
case("combined_page_stride_beyond_int32", ValueError, "paged_kv_cache: page stride",
     lambda: base(paged_kv_cache=_kv.as_strided((1,) + tuple(_kv.shape[1:]), (2**31,) + _kv.stride()[1:])))
case("tuple_k_page_stride_beyond_int32", ValueError, r"paged_kv_cache\[0\]: page stride",
     lambda: base(paged_kv_cache=(huge_page_stride(_k), huge_page_stride(_v))))
# --- out: overlap with any input, shape, dtype, device, layout
case("out_is_q", ValueError, r"\bout\b", lambda: base(out=_q))
_q3 = make_q(b=B + 1)
case("out_in_q", ValueError, r"\bout\b", lambda: base(q=_q3[:B], out=_q3[1:B + 1]))
case("out_in_combined_cache", ValueError, r"\bout\b", lambda: base(out=_kv.view(-1)[: _q.numel()].view(_q.shape)))
case("out_tail_of_combined_cache", ValueError, r"\bout\b",
     lambda: base(out=_kv.view(-1)[-_q.numel():].view(_q.shape)))
case("out_in_tuple_k", ValueError, r"\bout\b",
     lambda: base(paged_kv_cache=(_k, _v), out=_k.view(-1)[100:100 + _q.numel()].view(_q.shape)))
case("out_in_tuple_v", ValueError, r"\bout\b",
     lambda: base(paged_kv_cache=(_k, _v), out=_v.view(-1)[-_q.numel():].view(_q.shape)))
for _name in ("paged_kv_indptr", "paged_kv_indices", "block_indptr", "block_indices", "seq_lens_kv", "kv_valid_bits"):
    case(f"out_overlaps_{_name}", ValueError, r"\bout\b", lambda _name=_name: _out_overlaps(_name))
case("out_wrong_shape", ValueError, r"\bout\b", lambda: base(out=torch.empty(B, SQ, HQ, D + 128, dtype=BF16)))
case("out_rank3", ValueError, r"\bout\b", lambda: base(out=torch.empty(B * SQ, HQ, D, dtype=BF16)))
case("out_float64", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=torch.float64)))
case("out_int32", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=I32)))
case("out_noncontig", ValueError, r"\bout\b",
     lambda: base(out=torch.empty(B, SQ, D, HQ, dtype=BF16).transpose(2, 3)))
case("out_meta", ValueError, r"\bout\b", lambda: base(out=torch.empty(_q.shape, dtype=BF16, device="meta")))
case("out_not_tensor", TypeError, r"\bout\b", lambda: base(out=0))


@pytest.mark.parametrize("exc,match,make", [c[1:] for c in ONESHOT], ids=[c[0] for c in ONESHOT])
def test_oneshot_errors(exc, match, make):
    args, kwargs = make()
    expect(exc, match, block_sparse_attention_with_paged_kv_cache, *args, **kwargs)


@pytest.mark.parametrize("where", ["v_meta", "v_meta_k_cpu_out"])
def test_oneshot_tuple_v_on_another_device(where):
    out = torch.empty(_q.shape, dtype=BF16) if where == "v_meta_k_cpu_out" else None
    args, kw = base(paged_kv_cache=(_k, _v.to("meta")), out=out)
    expect(ValueError, "paged_kv_cache", block_sparse_attention_with_paged_kv_cache, *args, **kw)


def misaligned_out(dtype, shift_bytes, shape=_q.shape, device="cpu"):
    """A contiguous out whose start is `shift_bytes` past a 16-byte boundary."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(n + 64, dtype=torch.uint8, device=device)
    start = (-buf.data_ptr()) % 16 + shift_bytes
    out = buf[start:start + n].view(dtype).view(shape)
    assert out.is_contiguous() and out.data_ptr() % 16 == shift_bytes
    return out


@pytest.mark.parametrize("dtype,shift", [(BF16, 2), (FP16, 6), (FP32, 4)], ids=["bf16+2", "fp16+6", "fp32+4"])
def test_oneshot_out_misaligned(dtype, shift):
    """Like the MLA API (and q, whose rows must be 16-byte aligned): an out the kernel cannot store to
    is refused on every device, before any launch."""
    args, kw = base(out=misaligned_out(dtype, shift))
    expect(ValueError, r"\bout\b", block_sparse_attention_with_paged_kv_cache, *args, **kw)


def test_error_leaves_out_untouched():
    """A refused call writes nothing: the poisoned out is still all NaN."""
    for mods in (dict(kv_block_size=24), dict(max_seq_len_kv=0), dict(block_indices=[2, 0, 1, 0, 0, -1, 0]),
                 dict(paged_kv_indices=[3, P, 5]), dict(seq_lens_kv=[33, 5]), dict(sm_scale=0.0),
                 dict(block_indptr=[[[0, 2, 1], [3, 3, 4]], [[4, 5, 5], [6, 7, 7]]])):
        out = torch.full(_q.shape, float("nan"), dtype=BF16)
        args, kw = base(out=out, **mods)
        expect((ValueError, TypeError), ".", block_sparse_attention_with_paged_kv_cache, *args, **kw)
        assert torch.isnan(out).all(), mods


def test_oneshot_does_not_modify_metadata():
    args, kw = base(kv_valid_bits=bits(), mask_type="causal")
    meta = [args[2], args[3], args[4], args[5], kw["seq_lens_kv"], kw["kv_valid_bits"]]
    before = [t.clone() for t in meta]
    block_sparse_attention_with_paged_kv_cache(*args, **kw)
    for a, b in zip(before, meta):
        assert torch.equal(a, b)



# ----------------------------------------------------------------------------
# The one-shot's whole-tensor route checks on a large route
# ----------------------------------------------------------------------------

LARGE_LENS = [4096, 3001]  # 512 and 376 blocks of 8 keys
LARGE = dict(hq=8, hkv=8, sq=64, q_block=8, kv_block=8, ps=128)  # R = 8 rows per (request, K/V head)


def large_problem(seed=20):
    """B 2, Hkv 8, 8 rows per head, ~70% of every request's blocks in every row: ~40k block IDs, the
    (b, h) segments back to back; shuffled pages, the pool's unused page poisoned."""
    c = LARGE
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // c["kv_block"]) for n in LARGE_LENS]
    rows = c["sq"] // c["q_block"]
    sel = torch.rand(len(LARGE_LENS), c["hkv"], rows, max(nblk), generator=g) < 0.7
    sel[1, :, :, nblk[1]:] = False
    counts = sel.sum(-1)
    ends = counts.flatten().cumsum(0).view(counts.shape)
    block_indptr = torch.cat([ends - counts, ends[..., -1:]], dim=-1).to(I32)
    block_indices = sel.nonzero()[:, 3].to(I32)
    pages = [-(-n // c["ps"]) for n in LARGE_LENS]
    perm = torch.randperm(sum(pages) + 1, generator=g).to(I32)
    kv = _rand(sum(pages) + 1, 2, c["hkv"], c["ps"], D, seed=seed + 1)
    kv[perm[-1]] = float("nan")  # the page no request uses
    q = _rand(len(LARGE_LENS), c["sq"], c["hq"], D, seed=seed + 2)
    args = (q, kv, ip([0, pages[0], sum(pages)]), perm[:-1].clone(), block_indptr, block_indices, c["q_block"],
            c["kv_block"])
    return args, dict(max_seq_len_kv=max(LARGE_LENS), seq_lens_kv=ip(LARGE_LENS)), int(counts.max())


def _row_ids(args, b, h, r):
    """Absolute positions in block_indices of row [b, h, r]."""
    ptr = args[4]
    return int(ptr[b, h, r]), int(ptr[b, h, r + 1])


def test_oneshot_large_routes_pass():
    """Tens of thousands of block IDs: the whole-tensor route checks run (once), accept the valid routes and
    report the longest row; the call then writes every element of a poisoned out, matching the float64
    reference."""
    args, kw, longest = large_problem()
    assert args[5].numel() > 30_000 and tuple(args[4].shape) == (2, 8, 9)
    returned = []

    def spy(*a, **k):
        returned.append(real(*a, **k))
        return returned[-1]

    real = bsm.check_route_values
    out = torch.full(args[0].shape, float("nan"), dtype=FP32)
    with mock.patch.object(bsm, "check_route_values", spy):
        assert block_sparse_attention_with_paged_kv_cache(*args, out=out, **kw) is out
    assert returned == [longest]
    q, kv = args[0], args[1]
    want = R.block_sparse_attention(q, kv[:, 0], kv[:, 1], *args[2:6], *args[6:8], kw["seq_lens_kv"],
                                    compute_dtype=torch.float64)
    assert rel_err(out, want) <= TOLERANCE[BF16]


def _plant(kind, args):
    """One bad entry planted deep inside the large route (request 1, K/V head 6, row 5, mid-row or at the
    row's end): (block_indptr, block_indices, the error's pattern)."""
    ptr, ids = args[4].clone(), args[5].clone()
    b, h, r = 1, 6, 5
    s, e = _row_ids(args, b, h, r)
    assert e - s >= 8
    mid = (s + e) // 2
    row = re.escape(f"row [{b}, {h}, {r}]")
    if kind == "unsorted":
        ids[mid], ids[mid + 1] = int(ids[mid + 1]), int(ids[mid])
        return ptr, ids, f"block_indices: {row} is not strictly increasing"
    if kind == "repeated":
        ids[mid + 1] = ids[mid]
        return ptr, ids, f"block_indices: {row} is not strictly increasing"
    if kind == "past_length":
        limit = -(-LARGE_LENS[b] // LARGE["kv_block"])
        ids[e - 1] = limit  # still increasing: only its range is wrong
        return ptr, ids, f"block_indices: {row} selects block {limit}, outside \\[0, {limit}\\)"
    if kind == "negative":
        ids[s] = -1
        return ptr, ids, f"block_indices: {row} selects block -1"
    if kind == "offsets_decreasing":
        ptr[b, h, r + 1] = s - 1  # row r ends before it starts
        return ptr, ids, f"block_indptr: {row} ends before it starts"
    if kind == "offset_outside":
        ptr[b, h, r] = ids.numel() + 1
        return ptr, ids, re.escape(f"block_indptr: entry [{b}, {h}, {r}] = {ids.numel() + 1} is outside")
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["unsorted", "repeated", "past_length", "negative", "offsets_decreasing",
                                  "offset_outside"])
def test_oneshot_large_routes_pinpoint_one_bad_entry(kind):
    """A single bad entry among tens of thousands of valid ones is refused before launch, and the error
    names its row [b, h, r] (or its block_indptr entry)."""
    args, kw, _ = large_problem()
    ptr, ids, pattern = _plant(kind, args)
    args = args[:4] + (ptr, ids) + args[6:]
    expect(ValueError, pattern, block_sparse_attention_with_paged_kv_cache, *args, **kw)


# ----------------------------------------------------------------------------
# BlockSparsePagedTSWrapper.plan
# ----------------------------------------------------------------------------


def plan_args(**mods):
    """(positional, keyword) plan arguments of the base problem with modifications (DROP: leave it out)."""
    pos = dict(paged_kv_indptr=ip(INDPTR), seq_len_q=SQ, seq_len_kv=MAX_LEN, num_qo_heads=HQ, num_kv_heads=HKV,
               head_dim=D, q_block_size=QB, kv_block_size=KVB, page_size=PS)
    kw = dict(max_blocks_per_row=MBR, use_kv_valid_bits=False, seq_lens_kv=ip(LENS), q_data_type=BF16)
    for key, val in mods.items():
        if key in ("seq_lens_kv", "paged_kv_indptr") and isinstance(val, list):
            val = ip(val)
        (pos if key in pos else kw)[key] = val
    kw = {key: val for key, val in kw.items() if val is not DROP}
    return tuple(pos.values()), kw


PLAN_CASES = [
    # --- paged_kv_indptr (the batch comes from it)
    ("indptr_one_entry", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[0], seq_lens_kv=None)),
    ("indptr_empty", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=ip([]), seq_lens_kv=None)),
    ("indptr_tuple", TypeError, "paged_kv_indptr", dict(paged_kv_indptr=tuple(INDPTR))),
    ("indptr_none", TypeError, "paged_kv_indptr", dict(paged_kv_indptr=None)),
    ("indptr_int64", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=ip(INDPTR, torch.int64))),
    ("indptr_float", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=ip(INDPTR, FP32))),
    ("indptr_rank2", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[INDPTR])),
    ("indptr_noncontig", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=_noncontig(ip(INDPTR)))),
    ("indptr_not_start_0", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[1, 2, 3])),
    ("indptr_negative_start", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[-1, 2, 3])),
    ("indptr_decreasing", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[0, 3, 2])),
    ("indptr_too_few_pages", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[0, 1, 3])),
    ("indptr_no_pages", ValueError, "paged_kv_indptr", dict(paged_kv_indptr=[0, 3, 3])),
    ("indptr_too_few_pages_page_32", ValueError, "paged_kv_indptr",
     dict(paged_kv_indptr=[0, 1, 1], page_size=32)),  # request 1 (5 keys) has no page
    ("indptr_too_few_pages_without_lengths", ValueError, "paged_kv_indptr", dict(seq_lens_kv=None)),
    ("indptr_batch_past_grid", ValueError, "paged_kv_indptr",
     dict(paged_kv_indptr=torch.arange(65537, dtype=I32) * 2, seq_lens_kv=None)),
    ("lengths_on_another_device", ValueError, "seq_lens_kv|paged_kv_indptr",
     dict(seq_lens_kv=ip(LENS).to("meta"))),
    # --- seq_len_q, seq_len_kv
    ("seq_len_q_0", ValueError, "seq_len_q", dict(seq_len_q=0)),
    ("seq_len_q_negative", ValueError, "seq_len_q", dict(seq_len_q=-5)),
    ("seq_len_q_str", TypeError, "seq_len_q", dict(seq_len_q="5")),
    ("seq_len_q_float", TypeError, "seq_len_q", dict(seq_len_q=5.0)),
    ("seq_len_q_bool", TypeError, "seq_len_q", dict(seq_len_q=True)),
    ("seq_len_kv_0", ValueError, "seq_len_kv", dict(seq_len_kv=0)),
    ("seq_len_kv_negative", ValueError, "seq_len_kv", dict(seq_len_kv=-1)),
    ("seq_len_kv_past_bound", ValueError, "seq_len_kv", dict(seq_len_kv=BOUND + 1)),
    ("seq_len_kv_float", TypeError, "seq_len_kv", dict(seq_len_kv=32.0)),
    ("seq_len_kv_none", TypeError, "seq_len_kv", dict(seq_len_kv=None)),
    ("seq_len_kv_tensor", TypeError, "seq_len_kv", dict(seq_len_kv=torch.tensor(32))),
    ("causal_sq_above_seq_len_kv", ValueError, "seq_len_q|seq_len_kv",
     dict(mask_type="causal", seq_len_q=MAX_LEN + 1, q_block_size=40)),
    # --- heads, head dim, page size
    ("hq_0", ValueError, "num_qo_heads", dict(num_qo_heads=0)),
    ("hq_str", TypeError, "num_qo_heads", dict(num_qo_heads="4")),
    ("hkv_0", ValueError, "num_kv_heads", dict(num_kv_heads=0)),
    ("hkv_float", TypeError, "num_kv_heads", dict(num_kv_heads=2.0)),
    ("heads_not_multiple", ValueError, "num_qo_heads|num_kv_heads", dict(num_qo_heads=3)),
    ("hkv_gt_hq", ValueError, "num_qo_heads|num_kv_heads", dict(num_qo_heads=1, q_block_size=8)),
    ("head_dim_64", ValueError, "head_dim", dict(head_dim=64)),
    ("head_dim_96", ValueError, "head_dim", dict(head_dim=96)),
    ("head_dim_512", ValueError, "head_dim", dict(head_dim=512)),
    ("head_dim_float", TypeError, "head_dim", dict(head_dim=128.0)),
    ("page_size_0", ValueError, "page_size", dict(page_size=0)),
    ("page_size_8", ValueError, "page_size", dict(page_size=8)),
    ("page_size_48", ValueError, "page_size", dict(page_size=48)),
    ("page_size_256", ValueError, "page_size", dict(page_size=256)),
    ("page_size_str", TypeError, "page_size", dict(page_size="16")),
    ("page_size_float", TypeError, "page_size", dict(page_size=16.0)),
    # --- block sizes
    ("q_block_0", ValueError, "q_block_size", dict(q_block_size=0)),
    ("q_block_negative", ValueError, "q_block_size", dict(q_block_size=-4)),
    ("q_block_3_group_2", ValueError, "q_block_size", dict(q_block_size=3)),
    ("q_block_4_group_1", ValueError, "q_block_size", dict(num_qo_heads=2)),
    ("q_block_float", TypeError, "q_block_size", dict(q_block_size=4.0)),
    ("q_block_bool", TypeError, "q_block_size", dict(q_block_size=True)),
    ("kv_block_0", ValueError, "kv_block_size", dict(kv_block_size=0)),
    ("kv_block_4", ValueError, "kv_block_size", dict(kv_block_size=4)),
    ("kv_block_24", ValueError, "kv_block_size", dict(kv_block_size=24)),
    ("kv_block_100", ValueError, "kv_block_size", dict(kv_block_size=100)),
    ("kv_block_str", TypeError, "kv_block_size", dict(kv_block_size="8")),
    ("kv_block_none", TypeError, "kv_block_size", dict(kv_block_size=None)),
    # --- max_blocks_per_row: a Python int in [0, ceil(seq_len_kv / kv_block_size)]
    ("max_blocks_float", TypeError, "max_blocks_per_row", dict(max_blocks_per_row=2.0)),
    ("max_blocks_bool", TypeError, "max_blocks_per_row", dict(max_blocks_per_row=True)),
    ("max_blocks_none", TypeError, "max_blocks_per_row", dict(max_blocks_per_row=None)),
    ("max_blocks_str", TypeError, "max_blocks_per_row", dict(max_blocks_per_row="2")),
    ("max_blocks_tensor", TypeError, "max_blocks_per_row", dict(max_blocks_per_row=torch.tensor(2))),
    ("max_blocks_negative", ValueError, "max_blocks_per_row", dict(max_blocks_per_row=-1)),
    ("max_blocks_above_blocks", ValueError, "max_blocks_per_row", dict(max_blocks_per_row=5)),  # ceil(32 / 8) = 4
    ("max_blocks_above_blocks_kv_64", ValueError, "max_blocks_per_row",
     dict(kv_block_size=64, max_blocks_per_row=2)),  # ceil(32 / 64) = 1
    ("max_blocks_above_blocks_ragged", ValueError, "max_blocks_per_row",
     dict(seq_len_kv=33, max_blocks_per_row=6)),  # ceil(33 / 8) = 5
    # --- use_kv_valid_bits: a bool
    ("use_bits_int", TypeError, "use_kv_valid_bits", dict(use_kv_valid_bits=1)),
    ("use_bits_zero", TypeError, "use_kv_valid_bits", dict(use_kv_valid_bits=0)),
    ("use_bits_none", TypeError, "use_kv_valid_bits", dict(use_kv_valid_bits=None)),
    ("use_bits_str", TypeError, "use_kv_valid_bits", dict(use_kv_valid_bits="True")),
    ("use_bits_tensor", TypeError, "use_kv_valid_bits", dict(use_kv_valid_bits=bits())),
    # --- seq_lens_kv: values in [lo, seq_len_kv], shape, dtype, layout
    ("lengths_above_seq_len_kv", ValueError, "seq_lens_kv", dict(seq_lens_kv=[MAX_LEN + 1, 5])),
    ("lengths_far_above", ValueError, "seq_lens_kv", dict(seq_lens_kv=[20, 2**31 - 1])),
    ("lengths_zero", ValueError, "seq_lens_kv", dict(seq_lens_kv=[20, 0])),
    ("lengths_negative", ValueError, "seq_lens_kv", dict(seq_lens_kv=[-3, 5])),
    ("lengths_below_sq_causal", ValueError, "seq_lens_kv", dict(seq_lens_kv=[20, 4], mask_type="causal")),
    ("lengths_above_smaller_seq_len_kv", ValueError, "seq_lens_kv", dict(seq_len_kv=19)),
    ("lengths_int64", ValueError, "seq_lens_kv", dict(seq_lens_kv=ip(LENS, torch.int64))),
    ("lengths_length_B_plus_1", ValueError, "seq_lens_kv", dict(seq_lens_kv=LENS + [5])),
    ("lengths_length_B_minus_1", ValueError, "seq_lens_kv", dict(seq_lens_kv=LENS[:1])),
    ("lengths_rank2", ValueError, "seq_lens_kv", dict(seq_lens_kv=[LENS])),
    ("lengths_noncontig", ValueError, "seq_lens_kv", dict(seq_lens_kv=_noncontig(ip(LENS)))),
    ("lengths_tuple", TypeError, "seq_lens_kv", dict(seq_lens_kv=(20, 5))),
    # --- mask, dtypes
    ("mask_unknown", ValueError, "mask_type", dict(mask_type="full")),
    ("mask_variable_window", ValueError, "mask_type", dict(mask_type="variable_window")),
    ("mask_none", TypeError, "mask_type", dict(mask_type=None)),
    ("q_data_type_float32", ValueError, "q_data_type", dict(q_data_type=FP32)),
    ("q_data_type_str", TypeError, "q_data_type", dict(q_data_type="bfloat16")),
    ("q_data_type_none", TypeError, "q_data_type", dict(q_data_type=None)),
    ("kv_data_type_vs_q", ValueError, "kv_data_type", dict(kv_data_type=FP16)),
    ("kv_data_type_float32", ValueError, "kv_data_type", dict(kv_data_type=FP32)),
    ("kv_data_type_str", TypeError, "kv_data_type", dict(kv_data_type="bfloat16")),
    ("o_data_type_int8", ValueError, "o_data_type", dict(o_data_type=torch.int8)),
    ("o_data_type_float64", ValueError, "o_data_type", dict(o_data_type=torch.float64)),
    ("o_data_type_str", TypeError, "o_data_type", dict(o_data_type="float32")),
]


@pytest.mark.parametrize("exc,match,mods", [c[1:] for c in PLAN_CASES], ids=[c[0] for c in PLAN_CASES])
def test_wrapper_plan_errors(exc, match, mods):
    pos, kw = plan_args(**mods)
    expect(exc, match, BlockSparsePagedTSWrapper().plan, *pos, **kw)


@pytest.mark.parametrize("mods,name", [
    (dict(max_blocks_per_row=DROP), "max_blocks_per_row"),  # no default
    (dict(use_kv_valid_bits=DROP), "use_kv_valid_bits"),  # no default
    (dict(sm_scale=0.5), "sm_scale"),  # a run argument now
    (dict(kv_layout="HND"), "kv_layout"),  # gone: HND only
    (dict(use_valid_bits=False), "use_valid_bits"),  # the old name
    (dict(max_seq_len_kv=MAX_LEN), "max_seq_len_kv"),  # the old name of seq_len_kv
], ids=["no_max_blocks", "no_use_bits", "sm_scale", "kv_layout", "use_valid_bits", "max_seq_len_kv"])
def test_wrapper_plan_signature(mods, name):
    """FlashInfer main's plan: max_blocks_per_row and use_kv_valid_bits are required keywords; the old
    plan's keywords are refused, naming them."""
    pos, kw = plan_args(**mods)
    expect(TypeError, name, BlockSparsePagedTSWrapper().plan, *pos, **kw)


def test_wrapper_plan_accepts_edge_values():
    for mods in (dict(), dict(seq_lens_kv=[MAX_LEN, 5]), dict(seq_lens_kv=[1, 1]), dict(seq_len_kv=BOUND),
                 dict(kv_block_size=192, max_blocks_per_row=1), dict(max_blocks_per_row=0),
                 dict(max_blocks_per_row=4), dict(seq_len_kv=33, max_blocks_per_row=5),
                 dict(mask_type="causal", seq_len_q=MAX_LEN, q_block_size=8, paged_kv_indptr=FI_INDPTR,
                      seq_lens_kv=None),
                 dict(mask_type="causal", seq_lens_kv=[20, SQ]), dict(use_kv_valid_bits=True),
                 dict(q_data_type=FP16, kv_data_type=FP16, o_data_type=FP32, head_dim=256, page_size=128),
                 dict(o_data_type=BF16, kv_data_type=BF16), dict(num_qo_heads=8, num_kv_heads=1, q_block_size=1),
                 dict(q_data_type=DROP), dict(paged_kv_indptr=FI_INDPTR, seq_lens_kv=None),
                 dict(paged_kv_indptr=[0, 3, 7]),  # spare pages past the live ones
                 dict(seq_lens_kv=DROP, paged_kv_indptr=FI_INDPTR)):
        pos, kw = plan_args(**mods)
        BlockSparsePagedTSWrapper().plan(*pos, **kw)


def test_failed_plan_keeps_no_plan():
    """A refused plan leaves a fresh wrapper unplanned (run still says to plan first)."""
    w = BlockSparsePagedTSWrapper()
    pos, kw = plan_args(kv_block_size=24)
    with pytest.raises(ValueError):
        w.plan(*pos, **kw)
    with pytest.raises(RuntimeError, match=r"^plan\(\) must be called before run\(\)$"):
        w.run(_q, _kv, ip(INDICES), ip(BIP), ip(BI))


@pytest.mark.cuda
def test_wrapper_plan_during_graph_capture_is_refused():
    """plan reads metadata on the host: planning while a CUDA graph is being captured is a RuntimeError
    (before anything is read or copied); planning before the capture works."""
    pos, kw = plan_args(paged_kv_indptr=ip(INDPTR).cuda(), seq_lens_kv=ip(LENS).cuda())
    w = BlockSparsePagedTSWrapper()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="capture"):
        with torch.cuda.graph(graph, stream=stream):
            w.plan(*pos, **kw)
    with pytest.raises(RuntimeError, match=r"plan\(\) must be called before run\(\)"):
        w.run(_q.cuda(), _kv.cuda(), ip(INDICES).cuda(), ip(BIP).cuda(), ip(BI).cuda())
    w.plan(*pos, **kw)


# ----------------------------------------------------------------------------
# BlockSparsePagedTSWrapper.run
# ----------------------------------------------------------------------------


def planned(**mods):
    w = BlockSparsePagedTSWrapper()
    pos, kw = plan_args(**mods)
    w.plan(*pos, **kw)
    return w


RUN_META = ("paged_kv_indices", "block_indptr", "block_indices")


def run_args(**mods):
    """Base run arguments: (positional, keyword)."""
    pos = dict(q=_q, paged_kv_cache=_kv, paged_kv_indices=ip(INDICES), block_indptr=ip(BIP), block_indices=ip(BI))
    kw = {}
    for key, val in mods.items():
        if isinstance(val, list) and key in RUN_META:
            val = ip(val)
        (pos if key in pos else kw)[key] = val
    return tuple(pos.values()), kw


def test_wrapper_run_before_plan():
    pos, kw = run_args()
    with reference_must_not_run("block_sparse_attention"):
        with pytest.raises(RuntimeError, match=r"^plan\(\) must be called before run\(\)$"):
            BlockSparsePagedTSWrapper().run(*pos, **kw)


def test_wrapper_base_runs_are_valid():
    w = planned(mask_type="causal")
    pos, kw = run_args()
    out = torch.full(_q.shape, float("nan"), dtype=BF16)
    assert w.run(*pos, out=out, sm_scale=0.5, **kw) is out
    assert not out.isnan().any()
    pos, kw = run_args(paged_kv_cache=(_k, _v))
    assert w.run(*pos, **kw).shape == _q.shape
    # a cache with exactly max page + 1 pages
    pos, kw = run_args(paged_kv_cache=_kv[:max(INDICES) + 1])
    assert w.run(*pos, **kw).dtype == BF16
    # the output dtype is the plan's o_data_type
    w = planned(use_kv_valid_bits=True, o_data_type=FP32)
    for b in (bits(), bits(dtype=I32)):
        pos, kw = run_args(kv_valid_bits=b)
        assert w.run(*pos, **kw).dtype == FP32
        assert w.run(*pos, out=torch.empty(_q.shape, dtype=FP32), **kw).dtype == FP32


RUN_CASES = [
    # (id, plan mods, exc, match, run mods)
    # --- q against the plan
    ("q_other_batch", {}, ValueError, r"\bq\b", dict(q=make_q(b=3))),
    ("q_other_sq", {}, ValueError, r"\bq\b", dict(q=make_q(sq=SQ + 1))),
    ("q_other_heads", {}, ValueError, r"\bq\b", dict(q=make_q(hq=2 * HQ))),
    ("q_other_head_dim", {}, ValueError, r"\bq\b", dict(q=make_q(d=256), paged_kv_cache=make_cache(d=256))),
    ("q_rank3", {}, ValueError, r"\bq\b", dict(q=_q[:, 0])),
    ("q_rank5", {}, ValueError, r"\bq\b", dict(q=_q.unsqueeze(0))),
    ("q_fp16_vs_plan_bf16", {}, ValueError, r"\bq\b", dict(q=_q.half(), paged_kv_cache=_kv.half())),
    ("q_bf16_vs_plan_fp16", dict(q_data_type=FP16), ValueError, r"\bq\b", {}),
    ("q_float32", {}, ValueError, r"\bq\b", dict(q=_q.float())),
    ("q_inner_noncontig", {}, ValueError, r"\bq\b", dict(q=_noncontig_inner(_q))),
    ("q_misaligned", {}, ValueError, r"\bq\b",
     dict(q=torch.zeros(_q.numel() + 1, dtype=BF16)[1:].view(_q.shape))),
    ("q_meta", {}, ValueError, r"\bq\b|paged_kv_cache", dict(q=_q.to("meta"))),
    ("q_list", {}, TypeError, r"\bq\b", dict(q=_q.tolist())),
    # --- the cache against the plan
    ("cache_dtype_vs_q", {}, ValueError, r"\bq\b|paged_kv_cache", dict(paged_kv_cache=_kv.half())),
    ("cache_other_heads", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=make_cache(hkv=1))),
    ("cache_page_size_32", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=make_cache(ps=32))),
    ("cache_page_size_64_tuple", {}, ValueError, "paged_kv_cache",
     dict(paged_kv_cache=(make_pool(ps=64), make_pool(ps=64, seed=4)))),
    ("cache_dim1_3", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=make_cache(two=3))),
    ("cache_rank4", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=_k)),
    ("cache_tuple_of_3", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=(_k, _v, _v))),
    ("cache_tuple_shapes_differ", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=(_k, _v[:P - 1]))),
    ("cache_tuple_dtypes_differ", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=(_k, _v.half()))),
    ("cache_head_dim_vs_q", {}, ValueError, "paged_kv_cache|head dim", dict(paged_kv_cache=make_cache(d=256))),
    ("cache_int8", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=_kv.to(torch.int8))),
    ("cache_inner_noncontig", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=_noncontig_inner(_kv))),
    ("cache_meta", {}, ValueError, "paged_kv_cache", dict(paged_kv_cache=_kv.to("meta"))),
    ("cache_none", {}, TypeError, "paged_kv_cache", dict(paged_kv_cache=None)),
    ("cache_page_stride_beyond_int32", {}, ValueError, "paged_kv_cache",
     dict(paged_kv_cache=(huge_page_stride(_k), huge_page_stride(_v)))),
    # --- valid bits against the plan's use_kv_valid_bits
    ("bits_without_plan", {}, ValueError, "kv_valid_bits.*use_kv_valid_bits=False", dict(kv_valid_bits=bits())),
    ("no_bits_with_plan", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits.*use_kv_valid_bits=True", {}),
    ("bits_wrong_words", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits",
     dict(kv_valid_bits=bits([[1, 1], [1, 1]]))),
    ("bits_three_rows", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits",
     dict(kv_valid_bits=bits(BITS + [[1]]))),
    ("bits_rank1", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits", dict(kv_valid_bits=bits().flatten())),
    ("bits_int64", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits",
     dict(kv_valid_bits=bits(dtype=torch.int64))),
    ("bits_float32", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits", dict(kv_valid_bits=bits(dtype=FP32))),
    ("bits_noncontig", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits",
     dict(kv_valid_bits=_noncontig(bits()))),
    ("bits_meta", dict(use_kv_valid_bits=True), ValueError, "kv_valid_bits", dict(kv_valid_bits=bits().to("meta"))),
    ("bits_list", dict(use_kv_valid_bits=True), TypeError, "kv_valid_bits", dict(kv_valid_bits=BITS)),
    # --- paged_kv_indices: exactly the planned paged_kv_indptr[-1] entries
    ("indices_shorter", {}, ValueError, "paged_kv_indices", dict(paged_kv_indices=INDICES[:2])),
    ("indices_longer", {}, ValueError, "paged_kv_indices", dict(paged_kv_indices=INDICES + [0])),
    ("indices_vs_spare_plan", dict(paged_kv_indptr=[0, 3, 5]), ValueError, "paged_kv_indices", {}),
    ("indices_int64", {}, ValueError, "paged_kv_indices", dict(paged_kv_indices=ip(INDICES, torch.int64))),
    ("indices_rank2", {}, ValueError, "paged_kv_indices", dict(paged_kv_indices=[INDICES])),
    ("indices_noncontig", {}, ValueError, "paged_kv_indices", dict(paged_kv_indices=_noncontig(ip(INDICES)))),
    ("indices_meta", {}, ValueError, "paged_kv_indices", dict(paged_kv_indices=ip(INDICES).to("meta"))),
    ("indices_tuple", {}, TypeError, "paged_kv_indices", dict(paged_kv_indices=tuple(INDICES))),
    ("indices_none", {}, TypeError, "paged_kv_indices", dict(paged_kv_indices=None)),
    # --- routes (static facts only: their values are trusted)
    ("bip_int64", {}, ValueError, "block_indptr", dict(block_indptr=ip(BIP, torch.int64))),
    ("bip_rank2", {}, ValueError, "block_indptr", dict(block_indptr=ip(BIP).view(B, -1))),
    ("bip_R_plus_1", {}, ValueError, "block_indptr", dict(block_indptr=[[[0, 2, 3, 3]] * 2] * 2)),
    ("bip_batch_plus_1", {}, ValueError, "block_indptr", dict(block_indptr=BIP + [BIP[0]])),
    ("bip_one_kv_head", {}, ValueError, "block_indptr", dict(block_indptr=[BIP[0][:1], BIP[1][:1]])),
    ("bip_noncontig", {}, ValueError, "block_indptr", dict(block_indptr=_noncontig(ip(BIP)))),
    ("bip_meta", {}, ValueError, "block_indptr", dict(block_indptr=ip(BIP).to("meta"))),
    ("bip_tuple", {}, TypeError, "block_indptr", dict(block_indptr=tuple(BIP))),
    ("blocks_int64", {}, ValueError, "block_indices", dict(block_indices=ip(BI, torch.int64))),
    ("blocks_rank2", {}, ValueError, "block_indices", dict(block_indices=[BI])),
    ("blocks_noncontig", {}, ValueError, "block_indices", dict(block_indices=_noncontig(ip(BI)))),
    ("blocks_meta", {}, ValueError, "block_indices", dict(block_indices=ip(BI).to("meta"))),
    ("blocks_tuple", {}, TypeError, "block_indices", dict(block_indices=tuple(BI))),
    # --- sm_scale (a run argument)
    ("sm_scale_zero", {}, ValueError, "sm_scale", dict(sm_scale=0.0)),
    ("sm_scale_negative", {}, ValueError, "sm_scale", dict(sm_scale=-0.1)),
    ("sm_scale_nan", {}, ValueError, "sm_scale", dict(sm_scale=math.nan)),
    ("sm_scale_inf", {}, ValueError, "sm_scale", dict(sm_scale=math.inf)),
    ("sm_scale_str", {}, TypeError, "sm_scale", dict(sm_scale="0.1")),
    ("sm_scale_tensor", {}, TypeError, "sm_scale", dict(sm_scale=torch.tensor(0.1))),
    ("sm_scale_bool", {}, TypeError, "sm_scale", dict(sm_scale=True)),
    # --- out
    ("out_is_q", {}, ValueError, r"\bout\b", dict(out=_q)),
    ("out_in_cache", {}, ValueError, r"\bout\b", dict(out=_kv.view(-1)[: _q.numel()].view(_q.shape))),
    ("out_in_tuple_v", {}, ValueError, r"\bout\b",
     dict(paged_kv_cache=(_k, _v), out=_v.view(-1)[-_q.numel():].view(_q.shape))),
    ("out_wrong_shape", {}, ValueError, r"\bout\b", dict(out=torch.empty(B, SQ, HQ, D + 1, dtype=BF16))),
    ("out_float64", {}, ValueError, r"\bout\b", dict(out=torch.empty(_q.shape, dtype=torch.float64))),
    ("out_fp32_vs_planned_bf16", {}, ValueError, r"\bout\b", dict(out=torch.empty(_q.shape, dtype=FP32))),
    ("out_bf16_vs_planned_fp32", dict(o_data_type=FP32), ValueError, r"\bout\b",
     dict(out=torch.empty(_q.shape, dtype=BF16))),
    ("out_noncontig", {}, ValueError, r"\bout\b", dict(out=torch.empty(B, SQ, D, HQ, dtype=BF16).transpose(2, 3))),
    ("out_meta", {}, ValueError, r"\bout\b", dict(out=torch.empty(_q.shape, dtype=BF16, device="meta"))),
    ("out_not_tensor", {}, TypeError, r"\bout\b", dict(out=0)),
]


@pytest.mark.parametrize("plan_mods,exc,match,mods", [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES])
def test_wrapper_run_errors(plan_mods, exc, match, mods):
    w = planned(**plan_mods)
    pos, kw = run_args(**mods)
    expect(exc, match, w.run, *pos, **kw)


@pytest.mark.parametrize("mods,name", [
    (dict(seq_lens_kv=ip(LENS)), "seq_lens_kv"),  # planned (copied) now
    (dict(paged_kv_indptr=ip(INDPTR)), "paged_kv_indptr"),  # planned (copied) now
], ids=["seq_lens_kv", "paged_kv_indptr"])
def test_wrapper_run_signature(mods, name):
    """The old run's metadata that plan now copies are not run arguments any more."""
    w = planned()
    pos, kw = run_args(**mods)
    expect(TypeError, name, w.run, *pos, **kw)


def test_wrapper_run_old_positional_form():
    """The old run's positional form (paged_kv_indptr before the page IDs, lengths last) is refused."""
    w = planned()
    expect(TypeError, "positional", w.run, _q, _kv, ip(INDPTR), ip(INDICES), ip(BIP), ip(BI), ip(LENS))


@pytest.mark.parametrize("name", ["paged_kv_indices", "block_indptr", "block_indices", "kv_valid_bits"])
def test_wrapper_run_out_overlapping_metadata(name):
    meta, out = _out_sharing(name)
    w = planned(use_kv_valid_bits=name == "kv_valid_bits")
    pos, kw = run_args(**{name: meta, "out": out})
    expect(ValueError, r"\bout\b", w.run, *pos, **kw)


def test_wrapper_run_tuple_v_on_another_device():
    w = planned()
    pos, kw = run_args(paged_kv_cache=(_k, _v.to("meta")))
    expect(ValueError, "paged_kv_cache", w.run, *pos, **kw)


def test_wrapper_run_out_misaligned():
    w = planned()
    pos, kw = run_args(out=misaligned_out(BF16, 2))
    expect(ValueError, r"\bout\b", w.run, *pos, **kw)


def test_wrapper_run_error_leaves_out_untouched():
    w = planned(use_kv_valid_bits=True)
    for mods in (dict(sm_scale=0.0), dict(paged_kv_indices=INDICES[:2], kv_valid_bits=bits()),
                 dict(kv_valid_bits=None), dict(kv_valid_bits=bits([[1, 1], [1, 1]])),
                 dict(block_indptr=[[[0, 2, 3, 3]] * 2] * 2, kv_valid_bits=bits())):
        out = torch.full(_q.shape, float("nan"), dtype=BF16)
        pos, kw = run_args(out=out, **mods)
        expect((ValueError, TypeError), ".", w.run, *pos, **kw)
        assert torch.isnan(out).all(), mods


# ----------------------------------------------------------------------------
# The wrapper's run trusts metadata values: it neither reads nor validates them
# ----------------------------------------------------------------------------


def recording_no_host_reads():
    return _recording("block_sparse_attention", "block_sparse_attention")


# values the plan reads and refuses (lengths of 0 and beyond the bound; CSR offsets not starting at 0,
# decreasing, or without the pages the lengths need) ...
INVALID_PLAN_VALUES = [
    dict(seq_lens_kv=[0, MAX_LEN + 1000], paged_kv_indptr=[5, 1, 99]),
    dict(seq_lens_kv=[-7, 2**31 - 1], paged_kv_indptr=[0, 0, 0]),
]
# ... and values a run trusts: page IDs outside the cache; BSR offsets decreasing and out of bounds; block
# IDs unsorted, repeated, negative and past every length; garbage valid bits
INVALID_RUN_VALUES = [
    dict(paged_kv_indices=[-1, 10**6, P], block_indptr=[[[9, 2, -1], [3, 3, 400]], [[4, 5, 5], [6, 7, 7]]],
         block_indices=[3, 3, -5, 99, 0, -1, 2**31 - 1], kv_valid_bits=bits([[2**32 - 1], [0]])),
    dict(paged_kv_indices=[2**31 - 1, -2**31, 0],
         block_indptr=[[[-2**31, 0, 0], [0, 0, 0]], [[0, 0, 0], [2**31 - 1, 0, 0]]], block_indices=[],
         kv_valid_bits=bits([[0], [0x80000000]])),
]
INVALID_VALUES = [dict(p, **r) for p, r in zip(INVALID_PLAN_VALUES, INVALID_RUN_VALUES)]


@pytest.mark.parametrize("mask", ["dense", "causal"])
@pytest.mark.parametrize("which", [0, 1])
def test_wrapper_run_trusts_metadata_values(which, mask):
    """Invalid run metadata values (the caller's obligations) raise nothing in run: they reach the op as the
    very same tensors, next to the plan's own copies of paged_kv_indptr and seq_lens_kv, and no tensor value
    is read on the host on the way (functional and out= forms)."""
    indptr, lens = ip(INDPTR), ip(LENS)
    w = planned(use_kv_valid_bits=True, mask_type=mask, paged_kv_indptr=indptr, seq_lens_kv=lens)
    pos, kw = run_args(**INVALID_RUN_VALUES[which])
    out = torch.empty(_q.shape, dtype=BF16)
    with recording_no_host_reads() as rec:
        res = w.run(*pos, sm_scale=0.25, **kw)
        res_out = w.run(*pos, sm_scale=0.25, out=out, **kw)
    assert res.shape == _q.shape and res.dtype == BF16
    assert res_out is out
    assert [c[0] for c in rec.calls] == ["block_sparse_attention", "block_sparse_attention_out"]
    meta = list(pos[2:]) + [kw["kv_valid_bits"]]
    for name, call in rec.calls:
        ids = {id(a) for a in call if isinstance(a, torch.Tensor)}
        for m in meta:
            assert id(m) in ids, "a metadata tensor was copied or replaced before the op"
        assert id(indptr) not in ids and id(lens) not in ids, "the op reads the caller's planned tensors"
        i = 4 if name.endswith("_out") else 3  # kv_indptr's position (after out in the out= form)
        assert torch.equal(call[i], indptr) and torch.equal(call[i + 4], lens)
        scalars = [a for a in call if not isinstance(a, torch.Tensor)]
        assert QB in scalars and KVB in scalars and mask in scalars and 0.25 in scalars


@pytest.mark.parametrize("which", [0, 1])
def test_wrapper_plan_reads_and_refuses_its_values(which):
    """The plan reads its metadata (lengths and CSR offsets) and refuses each invalid value, naming it."""
    for key, val in INVALID_PLAN_VALUES[which].items():
        pos, kw = plan_args(**{key: val})
        expect(ValueError, key, BlockSparsePagedTSWrapper().plan, *pos, **kw)


@pytest.mark.parametrize("which", [0, 1])
def test_oneshot_reads_and_refuses_the_same_values(which):
    """The positive control: the one-shot reads those values and refuses them."""
    args, kw = base(**INVALID_VALUES[which])
    expect(ValueError, "seq_lens_kv|paged_kv|block_", block_sparse_attention_with_paged_kv_cache, *args, **kw)


def test_oneshot_refuses_each_invalid_value_alone():
    """Each invalid value of INVALID_VALUES[0] on its own is refused, naming its argument."""
    for key, val in INVALID_VALUES[0].items():
        if key == "kv_valid_bits":
            continue  # bits are values, not metadata to validate: any word is valid
        args, kw = base(**{key: val})
        expect(ValueError, key, block_sparse_attention_with_paged_kv_cache, *args, **kw)
