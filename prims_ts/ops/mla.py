"""MLA decode: ``batch_mla_decode_with_paged_kv_cache`` and its companions (SPEC §4, seed 004).

Public: ``BatchMLADecodePagedTSWrapper`` (plan/run; ``run(validate=False)`` is capturable),
        ``batch_mla_decode_with_paged_kv_cache`` = ``batch_decode_mla_with_paged_kv_cache``
        (one-shot: its plan + run, reads metadata on the host, not capturable),
        ``prims_ts_batch_decode_with_kv_cache_mla`` (standalone, caller workspace, no host
        synchronisation, capturable) and ``get_prims_ts_batch_decode_mla_workspace_size``.
Ops:    ``torch.ops.prims_ts.batch_mla_decode`` (functional) and
        ``torch.ops.prims_ts.batch_mla_decode_out`` (writes ``out``); both use the workspace.
Fakes:  ``prims_ts/meta/mla.py``; CPU kernel: ``prims_ts.reference.batch_mla_decode``.

Layout: queries ``[B, SQ, H, 576]`` (fixed) or ``[total_q, H, 576]`` (packed, with
``qo_indptr``); a latent cache ``[P, page_size, 576]`` or ``[P, 1, page_size, 576]`` holding one
row per token shared by all H heads (K = the 576-wide row, V = its first 512 values); a dense
page table ``block_tables int32 [B, C]``; ``seq_lens int32 [B]``; output ``[..., 512]``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
import torch

from .. import reference
from ..cuda import decode as K
from ..cuda.keys import DEFAULT_TUNING, BoundedMemo, Tuning, device_limits
from . import _dispatch
from . import _validate as V
from .decode import (WORKSPACE_DTYPES, Standalone, _check_page_size, _workspace, check_dtypes, decode_static,
                     operands, plan_workspace, planned_tuning, rerun_roles)
from .prefill_paged import PAGE_SIZES

MASKS = ("dense", "causal")
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
DIM_QK = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576: Q/K rows
DIM_V = KV_LORA_RANK  # 512: V rows and the output
NUM_HEADS = (8, 16, 32, 64, 128)
DEFAULT_OUT_DTYPE = torch.bfloat16


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _static(dtype, num_heads, page_size, out_dtype, packed, batch, seq_len_q, max_seq_len_q, max_seq_len, mask_type,
            tuning: Tuning):
    """MLA is the decode kernel with one latent head of 576-wide rows."""
    return decode_static(dtype, DIM_QK, num_heads, 1, page_size, out_dtype, packed, batch, seq_len_q, max_seq_len_q,
                         max_seq_len, mask_type, -1, tuning)


def _run(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len, mask_type,
         sm_scale, output_scale, tuning) -> None:
    if out.numel() == 0:
        return
    if query.device.type == "cuda":
        packed = qo_indptr is not None
        batch = qo_indptr.shape[0] - 1 if packed else query.shape[0]
        static = _static(query.dtype, query.shape[-2], kv_cache.shape[1], out.dtype, packed, batch,
                         1 if packed else query.shape[1], max_seq_len_q, max_seq_len, mask_type, Tuning.decode(tuning))
        K.prepared(static, query.device.index).run(query, kv_cache, None, workspace, out, None, block_tables,
                                                   seq_lens, qo_indptr, sm_scale, output_scale,
                                                   bt_stride=block_tables.stride(0))
    else:
        out.copy_(reference.batch_mla_decode(
            query, kv_cache, block_tables, seq_lens, qo_indptr=qo_indptr, mask_type=mask_type, sm_scale=sm_scale,
            output_scale=output_scale, compute_dtype=torch.float32))


def out_shape(query) -> Tuple[int, ...]:
    """``[B, SQ, H, 512]`` / ``[total_q, H, 512]`` for a ``[..., 576]`` query (or its shape)."""
    shape = query.shape if isinstance(query, torch.Tensor) else query
    return tuple(shape[:-1]) + (DIM_V,)


@torch.library.custom_op("prims_ts::batch_mla_decode_out", mutates_args=("workspace", "out"))
def batch_mla_decode_out_op(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    max_seq_len_q: int,
    max_seq_len: int,
    mask_type: str,
    sm_scale: float,
    output_scale: float,
    tuning: str = "",
) -> None:
    """Writes MLA decode attention into ``out`` ``[..., 512]`` (split-KV partials go through
    ``workspace``). ``kv_cache`` is the 3-D ``[P, page_size, 576]`` pool. Trusted arguments."""
    _run(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len, mask_type,
         sm_scale, output_scale, tuning)


@torch.library.custom_op("prims_ts::batch_mla_decode", mutates_args=("workspace",))
def batch_mla_decode_op(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    max_seq_len_q: int,
    max_seq_len: int,
    mask_type: str,
    sm_scale: float,
    output_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    """``batch_mla_decode_out`` returning a new ``[..., 512]`` output tensor."""
    out = torch.empty(out_shape(query), dtype=V.code_dtype(out_dtype), device=query.device)
    _run(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len, mask_type,
         sm_scale, output_scale, tuning)
    return out


# ----------------------------------------------------------------------------
# Static arguments
# ----------------------------------------------------------------------------


def _check_num_heads(name: str, h) -> int:
    if h not in NUM_HEADS:
        V.fail(f"{name}: {h} heads are not supported; expected one of {', '.join(map(str, NUM_HEADS))}")
    return h


def _check_ranks(kv_lora_rank, qk_rope_head_dim) -> None:
    V.integer("kv_lora_rank", kv_lora_rank)
    V.integer("qk_rope_head_dim", qk_rope_head_dim)
    if kv_lora_rank != KV_LORA_RANK:
        V.fail(f"kv_lora_rank: only {KV_LORA_RANK} is supported (with qk_rope_head_dim {QK_ROPE_HEAD_DIM}), "
               f"got {kv_lora_rank}")
    if qk_rope_head_dim != QK_ROPE_HEAD_DIM:
        V.fail(f"qk_rope_head_dim: only {QK_ROPE_HEAD_DIM} is supported (with kv_lora_rank {KV_LORA_RANK}), "
               f"got {qk_rope_head_dim}")


def _fixed_sq(seq_len_q, max_seq_len_q, default: int = 1) -> int:
    """A fixed query's SQ from ``seq_len_q`` and ``max_seq_len_q`` (aliases that must agree)."""
    if seq_len_q is not None:
        V.integer("seq_len_q", seq_len_q, minimum=1)
    if max_seq_len_q is not None:
        V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
    if seq_len_q is not None and max_seq_len_q is not None and seq_len_q != max_seq_len_q:
        V.fail(f"max_seq_len_q: {max_seq_len_q} disagrees with seq_len_q={seq_len_q} (the same bound)")
    return seq_len_q if seq_len_q is not None else (max_seq_len_q if max_seq_len_q is not None else default)


def _workspace_bytes(batch, num_heads, max_seq_len, max_seq_len_q, device, tuning: Tuning = DEFAULT_TUNING) -> int:
    _, sms, limit = device_limits(device)
    balance = K.balances(tuning)
    return _workspace_bytes_for(batch, num_heads, max_seq_len, max_seq_len_q, sms, limit, balance)


@functools.lru_cache(maxsize=1024)  # per static key and device limits: plans and one-shots ask again
def _workspace_bytes_for(batch, num_heads, max_seq_len, max_seq_len_q, sms, limit, balance: int) -> int:
    pol = K.decode_policy(batch, 1, num_heads, max_seq_len_q, K.MLA_DIM_QK, max_seq_len, sms, limit, balance)
    V.row_tiles("max_seq_len_q", 1, pol.rows_max, pol.bm)
    return max(256, int(K.mla_workspace_bytes(batch, num_heads, max_seq_len_q, max_seq_len, sms, limit, balance)))


def get_prims_ts_batch_decode_mla_workspace_size(
    batch_size: int,
    num_heads: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    page_size: int,
    max_seq_len: int,
    *,
    seq_len_q: Optional[int] = None,
    max_seq_len_q: Optional[int] = None,
    q_dtype: torch.dtype = torch.bfloat16,
    kv_dtype: Optional[torch.dtype] = None,
    out_dtype: torch.dtype = DEFAULT_OUT_DTYPE,
    mask_type: str = "causal",
    device: Optional[Union[torch.device, str]] = None,
) -> int:
    """Bytes of ``workspace_buffer`` that ``prims_ts_batch_decode_with_kv_cache_mla`` needs for
    these static arguments on ``device`` (default: the current CUDA device, or the CPU).

    Depends only on static arguments and the device's SM count (the split-KV policy is
    chosen from them, never from metadata values); never shrinks as ``max_seq_len`` or
    ``max_seq_len_q`` grows. At least 256.
    """
    V.integer("batch_size", batch_size, minimum=1)
    _check_num_heads("num_heads", V.integer("num_heads", num_heads))
    _check_ranks(kv_lora_rank, qk_rope_head_dim)
    _check_page_size(page_size)
    V.key_length_bound("max_seq_len", max_seq_len)
    V.choice("mask_type", mask_type, MASKS)
    check_dtypes(q_dtype, kv_dtype, out_dtype, ("q_dtype", "kv_dtype", "out_dtype"))
    return _workspace_bytes(batch_size, num_heads, max_seq_len, _fixed_sq(seq_len_q, max_seq_len_q), device)


def _query_mode(query, qo_indptr, max_seq_len_q, require_max_seq_len_q: bool) -> Tuple[int, Optional[int], bool]:
    """(batch, max_seq_len_q, packed) of a fixed ``[B, SQ, H, 576]`` or packed ``[T, H, 576]`` query."""
    V.tensor("query", query, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if qo_indptr is not None:
        V.int32_vector("qo_indptr", qo_indptr)
        if qo_indptr.shape[0] < 2:
            V.fail(f"qo_indptr: expected [B+1] with B >= 1, got shape {tuple(qo_indptr.shape)}")
        if query.dim() != 3:
            V.fail(f"query: packed queries (qo_indptr given) are [total_q, H, {DIM_QK}], got shape "
                   f"{tuple(query.shape)}")
        if max_seq_len_q is None:
            if require_max_seq_len_q:
                V.fail("max_seq_len_q: max_seq_len_q is required when qo_indptr selects packed queries (the static "
                       "bound of every request's query count)")
        else:
            V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        return V.batch_size("qo_indptr", qo_indptr.shape[0] - 1), max_seq_len_q, True
    if query.dim() != 4:
        V.fail(f"query: fixed queries are [B, SQ, H, {DIM_QK}] (packed [total_q, H, {DIM_QK}] need qo_indptr), "
               f"got shape {tuple(query.shape)}")
    batch, sq = query.shape[0], query.shape[1]
    if batch < 1 or sq < 1:
        V.fail(f"query: a fixed query needs B >= 1 and SQ >= 1, got shape {tuple(query.shape)}")
    if max_seq_len_q is not None:
        V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        if max_seq_len_q != sq:
            V.fail(f"max_seq_len_q: {max_seq_len_q} contradicts the fixed query's sequence extent "
                   f"query.shape[1] = {sq}")
    return V.batch_size("query", batch), sq, False


def _query_heads(query: torch.Tensor) -> int:
    if query.shape[-1] != DIM_QK:
        V.fail(f"query: the last dimension must be {DIM_QK} (kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim "
               f"{QK_ROPE_HEAD_DIM}), got shape {tuple(query.shape)}")
    return _check_num_heads("query", query.shape[-2])


def latent_cache(kv_cache, name: str = "kv_cache") -> torch.Tensor:
    """The 3-D pool ``[P, page_size, 576]`` of a ``[P, page_size, 576]`` or ``[P, 1, page_size, 576]``
    cache (a view, never a copy)."""
    V.tensor(name, kv_cache, dtypes=V.INPUT_DTYPES, ndim=(3, 4), inner_contiguous=True)
    cache = kv_cache
    if kv_cache.dim() == 4:
        if kv_cache.shape[1] != 1:
            V.fail(f"{name}: a 4-D latent cache is [num_pages, 1, page_size, {DIM_QK}] (one latent head); dim 1 "
                   f"must be 1, got shape {tuple(kv_cache.shape)}")
        cache = kv_cache[:, 0]
    if cache.shape[-1] != DIM_QK:
        V.fail(f"{name}: the last dimension must be {DIM_QK} (kv_lora_rank {KV_LORA_RANK} + qk_rope_head_dim "
               f"{QK_ROPE_HEAD_DIM}), got shape {tuple(kv_cache.shape)}")
    if cache.shape[1] not in PAGE_SIZES:
        V.fail(f"{name}: page size {cache.shape[1]} is not supported; prims_ts supports page_size "
               f"{', '.join(map(str, PAGE_SIZES))}")
    V.tensor(name, kv_cache, vector_aligned=True)  # after the shape checks: their message comes first
    if cache.shape[0] < 1:
        V.fail(f"{name}: the cache holds no page")
    V.pool_strides(name, cache, slot_dim=1)
    return cache


def _mla_out_dtype(out_dtype, out) -> torch.dtype:
    """``out_dtype`` (default bfloat16); ``out``, when given, must have exactly that dtype."""
    odt = V.out_dtype(out_dtype if out_dtype is not None else DEFAULT_OUT_DTYPE, None, DEFAULT_OUT_DTYPE)
    if isinstance(out, torch.Tensor) and out.dtype != odt:
        V.fail(f"out: dtype {out.dtype} must equal out_dtype {odt} (MLA's output dtype)")
    return odt


# ----------------------------------------------------------------------------
# The standalone function
# ----------------------------------------------------------------------------


_CHECKED = V.memo()


def _standalone_checks(query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
                       max_seq_len, qo_indptr, max_seq_len_q, out, mask_type, out_dtype) -> Standalone:
    """Every static check of the standalone call (shapes, dtypes, devices, workspace, out)."""
    _check_ranks(kv_lora_rank, qk_rope_head_dim)
    batch, max_sq, packed = _query_mode(query, qo_indptr, max_seq_len_q, require_max_seq_len_q=True)
    h = _query_heads(query)
    cache = latent_cache(kv_cache)
    if query.dtype != cache.dtype:
        V.fail(f"query: dtype {query.dtype} differs from the kv_cache's {cache.dtype}")
    V.block_table("block_tables", block_tables, batch)
    V.int32_vector("seq_lens", seq_lens, length=batch)
    V.key_length_bound("max_seq_len", max_seq_len)
    mask_type = V.choice("mask_type", mask_type, MASKS)
    metadata = [("block_tables", block_tables), ("seq_lens", seq_lens), ("qo_indptr", qo_indptr)]
    device = V.same_device([("query", query), ("kv_cache", cache), ("workspace_buffer", workspace_buffer)]
                           + metadata)
    V.tensor("workspace_buffer", workspace_buffer, dtypes=WORKSPACE_DTYPES, contiguous=True)
    V.start_aligned("workspace_buffer", workspace_buffer)
    need = _workspace_bytes(batch, h, max_seq_len, max_sq, device)
    have = workspace_buffer.numel() * workspace_buffer.element_size()
    if have < need:
        V.fail(f"workspace_buffer: {have} bytes are too few; this key needs {need} "
               "(get_prims_ts_batch_decode_mla_workspace_size)")
    odt = _mla_out_dtype(out_dtype, out)
    V.out_tensor(out, out_shape(query), odt, device, ())
    static = None if V.tracing() else _static(query.dtype, h, cache.shape[1], odt, packed, batch,
                                              1 if packed else max_sq, max_sq, max_seq_len, mask_type, DEFAULT_TUNING)
    names, tensors = operands(out, workspace_buffer, (("query", query), ("kv_cache", kv_cache)) + tuple(metadata))
    return Standalone(static, odt, V.Disjoint(names, tensors, (0, 1)), max_sq=max_sq, mask_type=mask_type,
                      roles=rerun_roles(2, 3, None, 1, 6, None, 4, 5, len(names)))


def prims_ts_batch_decode_with_kv_cache_mla(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    max_seq_len_q: Optional[int] = None,
    out: Optional[torch.Tensor] = None,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    mask_type: str = "causal",
    out_dtype: torch.dtype = DEFAULT_OUT_DTYPE,
) -> torch.Tensor:
    """Fixed ``[B, SQ, H, 576]`` or packed ``[total_q, H, 576]`` (+ ``qo_indptr`` and a required
    ``max_seq_len_q``) MLA decode over a paged latent cache with caller-owned workspace.

    No device-to-host synchronisation: shapes, dtypes, devices, the workspace size and scalar
    arguments are checked here (once per static key: the checks and the prepared launch are
    cached under it); metadata *values* are read on the device only (the caller keeps
    ``1 <= seq_lens[b] <= min(max_seq_len, block_tables.shape[1] * page_size)``, the used page
    IDs inside the cache, packed offsets within ``max_seq_len_q`` and, for causal masks, each
    request's query count <= its length); values that break it fail closed (no read out of
    bounds; such a request writes zeros). Capturable in a CUDA graph once this static key has
    run once. Returns ``query.shape[:-1] + (512,)`` in ``out_dtype``; ``out``, when given,
    must have that dtype.
    """
    traced = V.tracing()
    tensors = (out, workspace_buffer, query, kv_cache, block_tables, seq_lens, qo_indptr)  # in Standalone order
    checked = V.checked_once(
        _CHECKED, tensors,
        (kv_lora_rank, qk_rope_head_dim, max_seq_len, max_seq_len_q, mask_type, out_dtype),
        _standalone_checks, query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
        max_seq_len, qo_indptr, max_seq_len_q, out, mask_type, out_dtype, traced=traced)
    sm_scale = V.fast_scale("bmm1_scale", bmm1_scale, None)
    output_scale = V.fast_scale("bmm2_scale", bmm2_scale, None)
    if not traced:
        starts = checked.checks.check(tensors)
    if _dispatch.launchable(query, out, traced):
        if out is None:
            out = torch.empty(out_shape(query), dtype=checked.out_dtype, device=query.device)
        checked.launch_direct(
            query.device,
            lambda launch: launch.run(query, kv_cache, None, workspace_buffer, out, None, block_tables, seq_lens,
                                      qo_indptr, sm_scale, output_scale, bt_stride=block_tables.stride(0)),
            starts, out.data_ptr(), sm_scale, output_scale)
        return out
    V.run_layout((("query", query), ("kv_cache", kv_cache)))  # per call: not in the key
    args = (block_tables, seq_lens, qo_indptr, checked.max_sq, max_seq_len, checked.mask_type, sm_scale,
            output_scale)
    return _dispatch.call(torch.ops.prims_ts.batch_mla_decode, torch.ops.prims_ts.batch_mla_decode_out, _run,
                          (query, latent_cache(kv_cache), workspace_buffer), args, out, checked.out_dtype,
                          out_shape=out_shape(query))


# ----------------------------------------------------------------------------
# Host checks of metadata values (plan, run(validate=True))
# ----------------------------------------------------------------------------


def _values_lens(lens: np.ndarray, bound: int, bound_name: str) -> None:
    bad = lens < 1
    if bad.any():
        b = V.first(bad)
        V.fail(f"seq_lens: every planned request must contain at least one KV token; request {b} has "
               f"{int(lens[b])}")
    bad = lens > bound
    if bad.any():
        b = V.first(bad)
        V.fail(f"seq_lens: request {b} is longer than {bound_name} ({bound}): got {int(lens[b])}")


def _values_causal(q_lens: np.ndarray, lens: np.ndarray) -> None:
    bad = q_lens > lens
    if bad.any():
        b = V.first(bad)
        V.fail(f"seq_lens: request {b} has length {int(lens[b])}, shorter than its {int(q_lens[b])} queries; "
               "mask_type='causal' needs each request's query count <= its length")


# ----------------------------------------------------------------------------
# Wrapper and one-shot
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class MLAPlan:
    static: object  # cuda.decode.DecodeStatic
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype
    q_shape: tuple
    out_shape: tuple
    page_size: int
    block_tables: torch.Tensor  # bound: read live
    seq_lens: torch.Tensor  # bound: read live
    qo_indptr: Optional[torch.Tensor]  # bound: read live
    workspace: torch.Tensor
    launch: Optional[object]  # cuda.decode.PreparedDecode
    tuning_code: str

    @property
    def bound(self) -> tuple:
        return (("block_tables", self.block_tables), ("seq_lens", self.seq_lens), ("qo_indptr", self.qo_indptr),
                ("workspace_buffer", self.workspace))


@dataclass(frozen=True)
class _PlanArgs:
    """What a plan's static checks derived from its arguments (no metadata value read)."""

    batch: int
    cols: int  # block_tables' columns
    packed: bool
    device: torch.device
    num_heads: int
    page_size: int
    mask_type: str
    dtype: torch.dtype
    out_dtype: torch.dtype
    max_seq_len_q: Optional[int]  # fixed queries: SQ; packed: the given bound, None for the largest delta
    max_kv_len: Optional[int]  # None: the largest of seq_lens


def _plan_checks(block_tables, seq_lens, num_heads, kv_lora_rank, qk_rope_head_dim, page_size, seq_len_q, qo_indptr,
                 max_seq_len_q, q_data_type, kv_data_type, o_data_type, mask_type, max_kv_len) -> _PlanArgs:
    """Every check of a plan's arguments that reads no metadata value."""
    _check_ranks(kv_lora_rank, qk_rope_head_dim)
    V.int32_vector("seq_lens", seq_lens)
    batch = V.batch_size("seq_lens", seq_lens.shape[0])
    if batch < 1:
        V.fail("seq_lens: expected at least one request, got shape [0]")
    _, cols = V.block_table("block_tables", block_tables, batch)
    packed = qo_indptr is not None
    if packed:
        V.int32_vector("qo_indptr", qo_indptr, length=batch + 1)
        if seq_len_q is not None and seq_len_q != 1:
            V.fail(f"seq_len_q: packed queries take their lengths from qo_indptr, got seq_len_q={seq_len_q}")
    device = V.same_device([("block_tables", block_tables), ("seq_lens", seq_lens), ("qo_indptr", qo_indptr)])
    if device.type == "meta":
        V.fail("seq_lens: plan reads the metadata values; got tensors on the meta device")
    _check_num_heads("num_heads", V.integer("num_heads", num_heads))
    page_size = _check_page_size(page_size)
    mask_type = V.choice("mask_type", mask_type, MASKS)
    dtype, odt = check_dtypes(q_data_type, kv_data_type,
                              o_data_type if o_data_type is not None else DEFAULT_OUT_DTYPE)
    if max_kv_len is not None:
        V.key_length_bound("max_kv_len", max_kv_len)
    if packed:
        if max_seq_len_q is not None:
            V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
    else:
        max_seq_len_q = _fixed_sq(seq_len_q, max_seq_len_q)
    return _PlanArgs(batch, cols, packed, device, num_heads, page_size, mask_type, dtype, odt, max_seq_len_q,
                     max_kv_len)


class BatchMLADecodePagedTSWrapper:
    """Plan/run MLA decode over a paged latent cache.

    ``plan`` reads ``seq_lens`` (and ``qo_indptr``) once on the host, validates them and fixes
    the bounds (batch, heads, page size, the query mode and ``max_seq_len_q``, ``max_kv_len``:
    default the longest request), checks that ``block_tables`` has the columns ``max_kv_len``
    needs, and binds ``block_tables``, ``seq_lens`` and ``qo_indptr``: ``run`` reads them on the
    device, so a replay may change lengths, page IDs and (packed) query offsets in place within
    the planned bounds.

    ``run(validate=False)`` (the default) reads those values on the device only (values that
    break the plan's bounds fail closed: no read out of bounds, such a request writes zeros):
    no host synchronisation, no allocation when ``out`` is given, CUDA-graph capturable after
    one warm-up run.
    ``validate=True`` first reads them on the host and checks them against the plan and the
    cache (lengths within ``max_kv_len``, every used page ID in ``[0, P)``, ``qo_indptr`` well
    formed within ``max_seq_len_q``, causal query counts <= lengths).
    """

    def __init__(self, *, tuning: Optional[Tuning] = None):
        self.tuning, self._tuning_code = V.tuning(tuning)
        self._plan: Optional[MLAPlan] = None

    def plan(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_heads: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        page_size: int,
        *,
        seq_len_q: Optional[int] = None,
        qo_indptr: Optional[torch.Tensor] = None,
        max_seq_len_q: Optional[int] = None,
        q_data_type: torch.dtype = torch.bfloat16,
        kv_data_type: Optional[torch.dtype] = None,
        o_data_type: torch.dtype = DEFAULT_OUT_DTYPE,
        mask_type: str = "causal",
        max_kv_len: Optional[int] = None,
    ) -> None:
        """Fixed queries ``[B, SQ, H, 576]`` (``qo_indptr`` None; SQ = ``seq_len_q`` or its alias
        ``max_seq_len_q``, default 1) or packed ``[total_q, H, 576]`` (``qo_indptr`` given;
        ``max_seq_len_q`` defaults to its largest delta and may be larger)."""
        self._plan = self._make_plan(block_tables, seq_lens, num_heads, kv_lora_rank, qk_rope_head_dim, page_size,
                                     seq_len_q, qo_indptr, max_seq_len_q, q_data_type, kv_data_type, o_data_type,
                                     mask_type, max_kv_len)[0]

    def _make_plan(self, block_tables, seq_lens, num_heads, kv_lora_rank, qk_rope_head_dim, page_size, seq_len_q,
                   qo_indptr, max_seq_len_q, q_data_type, kv_data_type, o_data_type, mask_type, max_kv_len,
                   one_shot: bool = False) -> Tuple[MLAPlan, list]:
        """The plan and the host values it read (see ``_plan_from``)."""
        args = _plan_checks(block_tables, seq_lens, num_heads, kv_lora_rank, qk_rope_head_dim, page_size, seq_len_q,
                            qo_indptr, max_seq_len_q, q_data_type, kv_data_type, o_data_type, mask_type, max_kv_len)
        return self._plan_from(args, block_tables, seq_lens, qo_indptr, one_shot)

    def _plan_from(self, a: "_PlanArgs", block_tables, seq_lens, qo_indptr, one_shot: bool,
                   launches: Optional[BoundedMemo] = None) -> Tuple[MLAPlan, list]:
        """The plan of arguments that passed their static checks (`a`), and the host values it
        read: (seq_lens, qo_indptr) values, or for a `one_shot` (seq_lens, block_tables,
        qo_indptr) in the same one copy, for its live checks. A one-shot's plan runs the shared
        prepared launch once, with a workspace of exactly what its policy needs; `launches`: its
        static key's memo of (static, shared launch, workspace bytes) by (max_kv_len,
        max_seq_len_q, the split chosen by the lengths: decode.balanced_by_lengths)."""
        batch, packed, page_size, num_heads, device = a.batch, a.packed, a.page_size, a.num_heads, a.device
        max_kv_len, max_seq_len_q = a.max_kv_len, a.max_seq_len_q
        values = V.host_values(seq_lens, *((block_tables,) if one_shot else ()), *((qo_indptr,) if packed else ()))
        lens, qo = values[0], values[2 if one_shot else 1:]
        if max_kv_len is None:
            _values_lens(lens, V.MAX_SEQ_LEN_BOUND, "the supported bound")
            max_kv_len = int(lens.max())
        else:
            _values_lens(lens, max_kv_len, "max_kv_len")
        need_cols = -(-max_kv_len // page_size)
        if a.cols < need_cols:
            V.fail(f"block_tables: must have at least ceil(max_kv_len / page_size) columns ({need_cols}), "
                   f"got {a.cols}")
        if packed:
            V.values_indptr("qo_indptr", qo[0], None, "")
            q_lens = V.diff(qo[0])
            most = int(q_lens.max())
            if max_seq_len_q is None:
                max_seq_len_q = most
            elif max_seq_len_q < most:
                V.fail(f"max_seq_len_q: {max_seq_len_q} is below the largest query count in qo_indptr ({most})")
            q_shape = (int(qo[0][-1]), num_heads, DIM_QK)
        else:
            q_lens = np.full(batch, max_seq_len_q, dtype=np.int64)
            q_shape = (batch, max_seq_len_q, num_heads, DIM_QK)
        if a.mask_type == "causal":
            _values_causal(q_lens, lens)
        tuning, code = planned_tuning(self.tuning, self._tuning_code, lens, device, batch, 1, num_heads,
                                      max_seq_len_q, DIM_QK, max_kv_len)
        memo = (max_kv_len, max_seq_len_q, tuning.balanced_split)
        got = launches.get(memo) if launches is not None else None
        if got is None:
            need = _workspace_bytes(batch, num_heads, max_kv_len, max_seq_len_q, device, tuning)
            static = _static(a.dtype, num_heads, page_size, a.out_dtype, packed, batch,
                             1 if packed else max_seq_len_q, max_seq_len_q, max_kv_len, a.mask_type, tuning)
            launch = None
            if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                launch = K.prepared(static, device.index)  # loaded before any state changes
                if one_shot:
                    need = launch.workspace_bytes
                if launches is not None:
                    launches.put(memo, (static, launch, need))
        else:
            static, launch, need = got
        ws = plan_workspace(need, device)
        if launch is not None and not one_shot:
            launch = _dispatch.plan_launch(launch, (block_tables, seq_lens, qo_indptr, ws))
        return MLAPlan(static, device, a.dtype, a.out_dtype, q_shape, out_shape(q_shape), page_size, block_tables,
                       seq_lens, qo_indptr, ws, launch, code), values

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor, *, bmm1_scale: float = 1.0, bmm2_scale: float = 1.0,
            out: Optional[torch.Tensor] = None, validate: bool = False) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        if validate is False:
            o = _dispatch.fast_output(plan.launch, out, plan.out_shape, plan.out_dtype, plan.device)
            if o is not None and plan.launch.again(query, kv_cache, None, o,
                                                   V.fast_scale("bmm1_scale", bmm1_scale, None),
                                                   V.fast_scale("bmm2_scale", bmm2_scale, None)):
                return o
        elif validate is not True:
            raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
        live = self._check_live_values if validate and not V.tracing() else None
        return _checked_launch(plan, query, kv_cache, bmm1_scale, bmm2_scale, out, live)

    def _check_live_values(self, query, kv_cache, values=None, num_pages: Optional[int] = None,
                           planned: bool = False) -> None:
        """The bound metadata's values against the plan and the cache (`values`: host copies of
        (seq_lens, block_tables, qo_indptr) already read, else one copy now; `num_pages`: the
        cache's page count, if the caller has it). `planned`: `values` are those the plan was
        just built from (a one-shot), whose lengths and query counts its checks passed (the
        lengths within the plan's bound and the table's row, the query counts within
        max_seq_len_q, causal counts within their lengths): only the page IDs and a packed
        query's rows are left."""
        plan = self._plan
        if num_pages is None:
            num_pages = latent_cache(kv_cache).shape[0]
        if values is None:
            values = V.host_values(plan.seq_lens, plan.block_tables,
                                   *((plan.qo_indptr,) if plan.qo_indptr is not None else ()))
        lens, table, *qo = values
        table = table.reshape(tuple(plan.block_tables.shape))
        if not planned:
            cap = plan.block_tables.shape[1] * plan.page_size
            bound, name = (plan.static.max_seq_len, "max_kv_len") if plan.static.max_seq_len <= cap else (
                cap, "block_tables.shape[1] * page_size")
            _values_lens(lens, bound, name)
        if plan.qo_indptr is not None:
            V.values_indptr("qo_indptr", qo[0], query.shape[0], "query.shape[0]")
        if not planned:
            if plan.qo_indptr is not None:
                q_lens = V.diff(qo[0])
                bad = q_lens > plan.static.max_seq_len_q
                if bad.any():
                    b = V.first(bad)
                    V.fail(f"qo_indptr: request {b} has {int(q_lens[b])} queries, more than the planned "
                           f"max_seq_len_q {plan.static.max_seq_len_q}")
            else:
                q_lens = np.full_like(lens, query.shape[1])
            if plan.static.causal:
                _values_causal(q_lens, lens)
        V.values_block_table("block_tables", table, lens, plan.page_size, num_pages)


def _checked_launch(plan: MLAPlan, query, kv_cache, bmm1_scale, bmm2_scale, out, live=None) -> torch.Tensor:
    """query and the cache against the plan (attribute compares; the precise error when they
    differ), the scales and ``out`` checked, `live(query, kv_cache)` (run(validate=True)'s value
    checks) if given, then ``_launch``."""
    dev, dt = plan.device, plan.dtype
    fast = (V.matches(query, plan.q_shape, dt, dev) and type(kv_cache) is torch.Tensor
            and kv_cache.dtype is dt and kv_cache.device == dev and kv_cache.shape[-1] == DIM_QK
            and kv_cache.shape[-2] == plan.page_size and (kv_cache.dim() == 3 or
                                                          (kv_cache.dim() == 4 and kv_cache.shape[1] == 1)))
    if not fast:
        _check_against_plan(plan, query, kv_cache)
    sm_scale = V.fast_scale("bmm1_scale", bmm1_scale, None)
    output_scale = V.fast_scale("bmm2_scale", bmm2_scale, None)
    _check_out(plan, query, kv_cache, out)
    if live is not None:
        live(query, kv_cache)
    return _launch(plan, query, kv_cache, sm_scale, output_scale, out, fast)


def _check_out(plan: MLAPlan, query, kv_cache, out) -> None:
    if out is not None:
        if isinstance(out, torch.Tensor) and out.dtype != plan.out_dtype:
            V.fail(f"out: dtype {out.dtype} must equal the planned out_dtype {plan.out_dtype}")
        V.out_tensor(out, plan.out_shape, plan.out_dtype, plan.device, (("query", query), ("kv_cache", kv_cache))
                     + plan.bound)


def _launch(plan: MLAPlan, query, kv_cache, sm_scale: float, output_scale: float, out, fast: bool = True):
    """A run's (or a one-shot's) launch of tensors checked against the plan (`fast`: laid out
    as planned; `out` checked): the prepared kernel, or the op where a tracer, a mode or a
    subclass must see the call."""
    if fast and plan.launch is not None and _dispatch.plain_eager(out):
        if out is None:
            out = torch.empty(plan.out_shape, dtype=plan.out_dtype, device=plan.device)
        plan.launch.run(query, kv_cache, None, plan.workspace, out, None, plan.block_tables, plan.seq_lens,
                        plan.qo_indptr, sm_scale, output_scale, bt_stride=plan.block_tables.stride(0))
        return out
    st = plan.static
    V.run_layout((("query", query), ("kv_cache", kv_cache)))
    args = (plan.block_tables, plan.seq_lens, plan.qo_indptr, st.max_seq_len_q, st.max_seq_len,
            "causal" if st.causal else "dense", sm_scale, output_scale)
    return _dispatch.call(torch.ops.prims_ts.batch_mla_decode, torch.ops.prims_ts.batch_mla_decode_out, _run,
                          (query, latent_cache(kv_cache), _workspace(plan.workspace)), args, out, plan.out_dtype,
                          plan.tuning_code, out_shape=plan.out_shape)


def _check_against_plan(plan: MLAPlan, query, kv_cache) -> None:
    V.tensor("query", query, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if plan.qo_indptr is not None and query.dim() == 3 and query.shape[0] != plan.q_shape[0]:
        V.fail(f"query: packed query rows must match the final planned qo_indptr offset ({plan.q_shape[0]}), "
               f"got {query.shape[0]}")
    if tuple(query.shape) != tuple(plan.q_shape):
        V.fail(f"query must have shape {tuple(plan.q_shape)} (the plan's), got {tuple(query.shape)}")
    if query.dtype != plan.dtype:
        V.fail(f"query: dtype {V._dtype_name(query.dtype)} differs from the planned q_data_type "
               f"{V._dtype_name(plan.dtype)}")
    cache = latent_cache(kv_cache)
    if cache.shape[1] != plan.page_size:
        V.fail(f"kv_cache: page size {cache.shape[1]} does not match the plan: expected {plan.page_size}")
    if cache.dtype != plan.dtype:
        V.fail(f"kv_cache: dtype {V._dtype_name(cache.dtype)} must match the plan ({V._dtype_name(plan.dtype)})")
    V.same_device([("query", query), ("kv_cache", cache)])
    if query.device != plan.device:
        V.fail(f"query must be on the planned device {plan.device}, got {query.device}")


def batch_mla_decode_with_paged_kv_cache(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    max_seq_len_q: Optional[int] = None,
    kv_lora_rank: int = KV_LORA_RANK,
    qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
    mask_type: str = "causal",
    max_kv_len: Optional[int] = None,
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    out: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = DEFAULT_OUT_DTYPE,
) -> torch.Tensor:
    """One-shot fixed (``[B, SQ, H, 576]``) or packed-query (``[total_q, H, 576]`` + ``qo_indptr``)
    MLA decode over a paged latent cache; returns ``[..., 512]``.

    A :class:`BatchMLADecodePagedTSWrapper` plan, ``run(validate=True)``'s checks and one launch
    (of the shared prepared kernel, with a workspace only where the policy splits): reads
    ``seq_lens``, ``qo_indptr`` and the used part of ``block_tables`` on the host to validate
    them and derive the plan bounds (``max_seq_len_q``: the query's SQ, or the largest delta of
    ``qo_indptr``; ``max_kv_len``: ``max(seq_lens)``; explicit values may be larger, and for a
    fixed query ``max_seq_len_q`` must equal SQ). Not CUDA-graph capturable: plan a wrapper and
    capture ``run(..., validate=False)`` instead.
    """
    if V.tracing():
        raise RuntimeError("batch_mla_decode_with_paged_kv_cache reads metadata on the host and cannot be traced; "
                           "use BatchMLADecodePagedTSWrapper (plan outside, run inside)")
    operands = (out, query, kv_cache, block_tables, seq_lens, qo_indptr)
    one = V.checked_once(
        _ONESHOT_CHECKED, operands, (max_seq_len_q, kv_lora_rank, qk_rope_head_dim, mask_type, max_kv_len, out_dtype),
        _oneshot_checks, query, kv_cache, block_tables, seq_lens, qo_indptr, max_seq_len_q, kv_lora_rank,
        qk_rope_head_dim, mask_type, max_kv_len, out, out_dtype, traced=False)
    one.checks.check(operands)  # out's start and overlaps (its shape, dtype and device: under the key)
    sm_scale = V.fast_scale("bmm1_scale", bmm1_scale, None)
    output_scale = V.fast_scale("bmm2_scale", bmm2_scale, None)
    # the plan's and run(validate=True)'s value checks, on one copy of the metadata; the plan's
    # workspace is its own (new, or the shared empty one): out cannot overlap it
    w = BatchMLADecodePagedTSWrapper()
    w._plan, values = w._plan_from(one.args, block_tables, seq_lens, qo_indptr, one_shot=True, launches=one.launches)
    w._check_live_values(query, kv_cache, values, one.num_pages, planned=True)
    return _launch(w._plan, query, kv_cache, sm_scale, output_scale, out)


_ONESHOT_CHECKED = V.memo()


@dataclass(frozen=True, eq=False)
class _OneShot:
    """What the one-shot's static checks derived for one key: the plan's arguments, the cache's
    page count, the per-call checks of ``out``'s start and overlaps (``V.Disjoint``: out, query,
    kv_cache, block_tables, seq_lens, qo_indptr) and the launch keys its plans took."""

    args: _PlanArgs
    num_pages: int
    checks: V.Disjoint
    launches: BoundedMemo


def _oneshot_checks(query, kv_cache, block_tables, seq_lens, qo_indptr, max_seq_len_q, kv_lora_rank,
                    qk_rope_head_dim, mask_type, max_kv_len, out, out_dtype) -> _OneShot:
    """The one-shot's static checks (the query's, the cache's, the plan's arguments', ``out``'s
    shape, dtype and device), once per key of its arguments' static facts; under one key the
    query and the cache are laid out as its plan's launch takes them."""
    _, sq, packed = _query_mode(query, qo_indptr, max_seq_len_q, require_max_seq_len_q=False)
    h = _query_heads(query)
    cache = latent_cache(kv_cache)
    if query.dtype != cache.dtype:
        V.fail(f"query: dtype {query.dtype} differs from the kv_cache's {cache.dtype}")
    V.same_device([("query", query), ("kv_cache", cache), ("block_tables", block_tables), ("seq_lens", seq_lens),
                   ("qo_indptr", qo_indptr)])
    odt = _mla_out_dtype(out_dtype, out)
    args = _plan_checks(block_tables, seq_lens, h, kv_lora_rank, qk_rope_head_dim, cache.shape[1], None, qo_indptr,
                        sq, query.dtype, None, odt, mask_type, max_kv_len)
    if not packed and query.shape[0] != args.batch:
        V.fail(f"query must have shape {(args.batch,) + tuple(query.shape[1:])} (the plan's), got "
               f"{tuple(query.shape)}")
    V.out_tensor(out, out_shape(tuple(query.shape)), odt, args.device, ())
    checks = V.Disjoint(("out", "query", "kv_cache", "block_tables", "seq_lens", "qo_indptr"),
                        (out, query, kv_cache, block_tables, seq_lens, qo_indptr))
    return _OneShot(args, cache.shape[0], checks, V.launch_memo())


batch_decode_mla_with_paged_kv_cache = batch_mla_decode_with_paged_kv_cache
