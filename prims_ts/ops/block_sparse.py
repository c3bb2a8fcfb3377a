"""Paged block-sparse attention: ``BlockSparsePagedTSWrapper`` and
``block_sparse_attention_with_paged_kv_cache``.

Public: ``BlockSparsePagedTSWrapper`` (plan outside capture; ``run`` takes live page IDs
        and routes, never synchronises with the host, is capturable) and
        ``block_sparse_attention_with_paged_kv_cache`` (one-shot: validates the live page
        and BSR metadata on the host with whole-tensor checks, then the wrapper's plan and
        run; not capturable).
Ops:    ``torch.ops.prims_ts.block_sparse_attention`` (functional) and
        ``torch.ops.prims_ts.block_sparse_attention_out`` (writes ``out``).
Fakes:  ``prims_ts/meta/block_sparse.py``; CPU kernel: ``prims_ts.reference.block_sparse_attention``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import numpy as np
import torch

from .. import reference
from ..cuda import block_sparse as K
from ..cuda.keys import Tuning, cuda_index
from . import _dispatch
from . import _validate as V
from .decode import _check_page_size, check_dtypes, named_cache, plan_cache, split_cache
from .prefill_paged import PAGE_SIZES

MASKS = ("dense", "causal")
HEAD_DIMS = (128, 256)
VALID_BITS_DTYPES = (torch.uint32, torch.int32)

KVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _static(dtype, head_dim, num_qo_heads, num_kv_heads, page_size, batch, seq_len_q, q_block_size, kv_block_size,
            valid_words, mask_type, out_dtype, tuning: Tuning, seq_len_kv: Optional[int] = None):
    """The prepared launch's key; `seq_len_kv` given: the contiguous form (page_size unused)."""
    return K.BlockSparseStatic(dtype, head_dim, num_qo_heads, num_kv_heads, page_size, batch, seq_len_q, q_block_size,
                               kv_block_size, valid_words, mask_type == "causal", out_dtype, tuning,
                               contiguous=seq_len_kv is not None, seq_len_kv=seq_len_kv or 0)


def _run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits,
         q_block_size, kv_block_size, mask_type, sm_scale, tuning) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        batch, sq, hq, d = q.shape
        static = _static(q.dtype, d, hq, k_cache.shape[1], k_cache.shape[2], batch, sq, q_block_size, kv_block_size,
                         valid_bits.shape[1] if valid_bits is not None else 0, mask_type, out.dtype,
                         Tuning.decode(tuning))
        K.prepared(static, q.device.index).run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr,
                                               block_indices, seq_lens, valid_bits, sm_scale)
    else:
        out.copy_(reference.block_sparse_attention(
            q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, q_block_size, kv_block_size,
            seq_lens, kv_valid_bits=valid_bits, mask_type=mask_type, sm_scale=sm_scale,
            compute_dtype=torch.float32))


@torch.library.custom_op("prims_ts::block_sparse_attention_out", mutates_args=("out",))
def block_sparse_attention_out_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    valid_bits: Optional[torch.Tensor],
    q_block_size: int,
    kv_block_size: int,
    mask_type: str,
    sm_scale: float,
    tuning: str = "",
) -> None:
    """Writes block-sparse attention into ``out``. Trusted arguments: validate first."""
    _run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits,
         q_block_size, kv_block_size, mask_type, sm_scale, tuning)


@torch.library.custom_op("prims_ts::block_sparse_attention", mutates_args=())
def block_sparse_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    valid_bits: Optional[torch.Tensor],
    q_block_size: int,
    kv_block_size: int,
    mask_type: str,
    sm_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    """Functional form of ``block_sparse_attention_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits,
         q_block_size, kv_block_size, mask_type, sm_scale, tuning)
    return out


def _run_contiguous(q, k, v, out, block_indptr, block_indices, valid_bits, q_block_size, kv_block_size, mask_type,
                    sm_scale, tuning) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        batch, sq, hq, d = q.shape
        static = _static(q.dtype, d, hq, k.shape[2], 0, batch, sq, q_block_size, kv_block_size,
                         valid_bits.shape[1] if valid_bits is not None else 0, mask_type, out.dtype,
                         Tuning.decode(tuning), seq_len_kv=k.shape[1])
        K.prepared(static, q.device.index).run(q, k, v, out, None, None, block_indptr, block_indices, None,
                                               valid_bits, sm_scale)
    else:
        out.copy_(reference.block_sparse_attention_contiguous(
            q, k, v, block_indptr, block_indices, q_block_size, kv_block_size, kv_valid_bits=valid_bits,
            mask_type=mask_type, sm_scale=sm_scale, compute_dtype=torch.float32))


@torch.library.custom_op("prims_ts::block_sparse_attention_contiguous_out", mutates_args=("out",))
def block_sparse_attention_contiguous_out_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    valid_bits: Optional[torch.Tensor],
    q_block_size: int,
    kv_block_size: int,
    mask_type: str,
    sm_scale: float,
    tuning: str = "",
) -> None:
    """Writes block-sparse attention over contiguous K/V ``[B, Skv, Hkv, D]`` into ``out``.
    Trusted arguments: validate first."""
    _run_contiguous(q, k, v, out, block_indptr, block_indices, valid_bits, q_block_size, kv_block_size, mask_type,
                    sm_scale, tuning)


@torch.library.custom_op("prims_ts::block_sparse_attention_contiguous", mutates_args=())
def block_sparse_attention_contiguous_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    valid_bits: Optional[torch.Tensor],
    q_block_size: int,
    kv_block_size: int,
    mask_type: str,
    sm_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    """Functional form of ``block_sparse_attention_contiguous_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run_contiguous(q, k, v, out, block_indptr, block_indices, valid_bits, q_block_size, kv_block_size, mask_type,
                    sm_scale, tuning)
    return out


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def check_block_sizes(q_block_size, kv_block_size, group: int) -> None:
    V.integer("q_block_size", q_block_size, minimum=1)
    V.integer("kv_block_size", kv_block_size, minimum=1)
    if (q_block_size * group) % 8 != 0:
        V.fail(f"q_block_size: q_block_size * (Hq / Hkv) = {q_block_size} * {group} must be divisible by 8 "
               "(a Q tile must not cross BSR rows)")
    if kv_block_size not in (8, 16, 32) and kv_block_size % 64 != 0:
        V.fail(f"kv_block_size: must be 8, 16, 32, or a positive multiple of 64, got {kv_block_size}")


def check_geometry(seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim, q_block_size, kv_block_size,
                   max_blocks_per_row, use_kv_valid_bits, mask_type, q_data_type, kv_data_type, o_data_type):
    """A block-sparse plan's scalars (both wrappers): returns (head_dim, dtype, out dtype, mask)."""
    V.integer("seq_len_q", seq_len_q)
    if seq_len_q < 1:
        V.fail(f"seq_len_q: seq_len_q must be positive, got {seq_len_q}")
    V.key_length_bound("seq_len_kv", seq_len_kv)
    for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        V.integer(name, val, minimum=1)
    group = V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
    d = V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
    check_block_sizes(q_block_size, kv_block_size, group)
    if isinstance(max_blocks_per_row, bool) or not isinstance(max_blocks_per_row, int):
        raise TypeError(f"max_blocks_per_row: expected a Python integer, got {type(max_blocks_per_row).__name__}")
    blocks = -(-seq_len_kv // kv_block_size)
    if max_blocks_per_row < 0:
        V.fail(f"max_blocks_per_row: must be non-negative, got {max_blocks_per_row}")
    if max_blocks_per_row > blocks:
        V.fail(f"max_blocks_per_row: {max_blocks_per_row} cannot exceed the number of semantic KV blocks "
               f"({blocks}: ceil(seq_len_kv / kv_block_size))")
    if not isinstance(use_kv_valid_bits, bool):
        raise TypeError(f"use_kv_valid_bits: expected a bool, got {type(use_kv_valid_bits).__name__}")
    dtype, odt = check_dtypes(q_data_type, kv_data_type, o_data_type)
    mask_type = V.choice("mask_type", mask_type, MASKS)
    if mask_type == "causal" and seq_len_q > seq_len_kv:
        V.fail(f"seq_len_q: causal block-sparse requires seq_len_q <= seq_len_kv, got {seq_len_q} > {seq_len_kv}")
    return d, dtype, odt, mask_type


def check_routes_static(block_indptr, block_indices, batch: int, hkv: int, rows_r: int) -> None:
    V.tensor("block_indptr", block_indptr, dtypes=(torch.int32,), contiguous=True)
    if block_indptr.dim() != 3:
        V.fail(f"block_indptr must be rank 3 ([B, Hkv, ceil(Sq / q_block_size) + 1]), got rank {block_indptr.dim()}")
    if tuple(block_indptr.shape) != (batch, hkv, rows_r + 1):
        V.fail(f"block_indptr: expected [B, Hkv, ceil(Sq / q_block_size) + 1] = {(batch, hkv, rows_r + 1)}, "
               f"got {tuple(block_indptr.shape)}")
    V.int32_vector("block_indices", block_indices)


def check_valid_bits(valid_bits, batch: int, seq_len_kv: int, use: bool, bound_name: str) -> int:
    """Words per request of ``kv_valid_bits`` (0 without), against the plan's flag."""
    if use and valid_bits is None:
        V.fail("kv_valid_bits: kv_valid_bits is required when use_kv_valid_bits=True")
    if not use and valid_bits is not None:
        V.fail("kv_valid_bits: kv_valid_bits must be None when use_kv_valid_bits=False")
    if valid_bits is None:
        return 0
    V.tensor("kv_valid_bits", valid_bits, dtypes=VALID_BITS_DTYPES, ndim=2, contiguous=True)
    words = -(-seq_len_kv // 32)
    if tuple(valid_bits.shape) != (batch, words):
        V.fail(f"kv_valid_bits: expected [B, ceil({bound_name} / 32)] = {(batch, words)}, "
               f"got {tuple(valid_bits.shape)}")
    return words


def check_route_values(ptr: np.ndarray, ids: np.ndarray, lens: np.ndarray, kv_block_size: int) -> int:
    """Canonical BSR rows, whole-array checks over host arrays (``ptr`` ``[B, Hkv, R + 1]``):
    offsets inside ``block_indices`` and non-decreasing along each row, block IDs strictly
    increasing within a row and starting before the row's request length. Returns the
    largest number of blocks in a row."""
    n_ids = ids.shape[0]
    bad = (ptr < 0) | (ptr > n_ids)
    if bad.any():
        b, h, r = V.first(bad)
        V.fail(f"block_indptr: entry [{b}, {h}, {r}] = {int(ptr[b, h, r])} is outside [0, block_indices.numel() "
               f"= {n_ids}]")
    starts, ends = ptr[..., :-1].reshape(-1), ptr[..., 1:].reshape(-1)
    counts = ends - starts
    bad = counts < 0
    if bad.any():
        b, h, r = _row_index(V.first(bad), ptr.shape)
        V.fail(f"block_indptr: row [{b}, {h}, {r}] ends before it starts ({int(ptr[b, h, r + 1])} < "
               f"{int(ptr[b, h, r])}); offsets must be non-decreasing")
    total = int(counts.sum())
    if total == 0:
        return 0
    rows_per_b = ptr.shape[1] * (ptr.shape[2] - 1)
    limits = (lens + kv_block_size - 1) // kv_block_size  # blocks must start before the request's length
    if (starts[1:] == ends[:-1]).all():
        _check_packed_rows(ids[int(starts[0]):int(ends[-1])], starts - starts[0], counts, limits, rows_per_b,
                           ptr, lens, kv_block_size)
    else:  # rows that skip or share entries: gather each row's blocks
        row = np.repeat(np.arange(counts.shape[0]), counts)
        first = np.cumsum(counts) - counts
        _check_rows(ids[starts[row] + np.arange(total) - first[row]], row, limits[row // rows_per_b], ptr, lens,
                    kv_block_size)
    return int(counts.max())


def _row_of(rel_starts: np.ndarray, counts: np.ndarray, i: int) -> int:
    """The (non-empty) row holding entry i of back-to-back rows."""
    r = int(np.searchsorted(rel_starts, i, side="right")) - 1
    while int(counts[r]) == 0:  # an empty row shares its offset with the next
        r += 1
    return r


def _check_packed_rows(vals, rel_starts, counts, limits, rows_per_b, ptr, lens, kv_block_size) -> None:
    """Rows stored back to back (the usual BSR layout): whole-array compares, no gather. A row
    starts at each offset; a block must exceed its predecessor unless it starts a row; each
    request's blocks (a contiguous stretch) must lie in [0, its block count)."""
    starts_row = np.zeros(vals.shape[0] + 1, dtype=bool)
    starts_row[rel_starts[counts > 0]] = True
    bad = (vals[1:] <= vals[:-1]) & ~starts_row[1:-1]
    if bad.any():
        r = _row_of(rel_starts, counts, V.first(bad) + 1)
        b, h, rr = _row_index(r, ptr.shape)
        n0 = int(rel_starts[r])
        V.fail(f"block_indices: row [{b}, {h}, {rr}] is not strictly increasing (unsorted or repeated block IDs: "
               f"{vals[n0:n0 + int(counts[r])].tolist()[:16]})")
    per_b = counts.reshape(-1, rows_per_b).sum(1)
    if int(vals.min()) >= 0 and int(vals.max()) < int(limits[per_b > 0].min()):
        return  # every block is in range
    ends_b = np.cumsum(per_b)
    seg_start = np.concatenate([[0], ends_b[:-1]])
    nonempty = per_b > 0
    hi = np.full(per_b.shape, -1, dtype=np.int64)
    lo = np.zeros(per_b.shape, dtype=np.int64)
    hi[nonempty] = np.maximum.reduceat(vals, seg_start[nonempty])
    lo[nonempty] = np.minimum.reduceat(vals, seg_start[nonempty])
    bad_b = nonempty & ((lo < 0) | (hi >= limits))
    if bad_b.any():
        b = V.first(bad_b)
        seg_vals = vals[seg_start[b]:ends_b[b]]
        j = V.first((seg_vals < 0) | (seg_vals >= limits[b])) + int(seg_start[b])
        bb, h, rr = _row_index(_row_of(rel_starts, counts, j), ptr.shape)
        V.fail(f"block_indices: row [{bb}, {h}, {rr}] selects block {int(vals[j])}, outside [0, {int(limits[b])}) "
               f"(request {bb} has {int(lens[bb])} keys, kv_block_size {kv_block_size})")


def _check_rows(vals, row, limit, ptr, lens, kv_block_size) -> None:
    """The gathered blocks of every row (``row``: each block's row; ``limit``: its request's block count)."""
    bad = (row[1:] == row[:-1]) & (vals[1:] <= vals[:-1])
    if bad.any():
        i = V.first(bad)
        b, h, r = _row_index(int(row[i]), ptr.shape)
        V.fail(f"block_indices: row [{b}, {h}, {r}] is not strictly increasing (unsorted or repeated block IDs: "
               f"{vals[row == row[i]].tolist()[:16]})")
    bad = (vals < 0) | (vals >= limit)
    if bad.any():
        i = V.first(bad)
        b, h, r = _row_index(int(row[i]), ptr.shape)
        V.fail(f"block_indices: row [{b}, {h}, {r}] selects block {int(vals[i])}, outside [0, {int(limit[i])}) "
               f"(request {b} has {int(lens[b])} keys, kv_block_size {kv_block_size})")


def _row_index(flat: int, shape) -> Tuple[int, int, int]:
    rows = shape[2] - 1
    return flat // (shape[1] * rows), flat // rows % shape[1], flat % rows


def check_lengths(lens: np.ndarray, seq_len_kv: int, sq: int, mask_type: str, name: str, bound_name: str) -> None:
    lo = sq if mask_type == "causal" else 1
    bad = (lens < lo) | (lens > seq_len_kv)
    if bad.any():
        b = V.first(bad)
        V.fail(f"{name}: request {b} has {int(lens[b])} keys; seq_lens_kv values must be in [{lo}, {seq_len_kv}] "
               f"(1 <= length <= {bound_name}" + (", and Sq <= Sk under causal masking)" if lo > 1 else ")"))


def check_page_counts(ip: np.ndarray, lens: np.ndarray, page_size: int) -> None:
    """CSR pages: indptr starts at zero, never decreases, and gives every request the pages its
    live length needs."""
    V.values_indptr("paged_kv_indptr", ip, None, "", strict=False)
    need = (lens + page_size - 1) // page_size
    have = V.diff(ip)
    bad = have < need
    if bad.any():
        b = V.first(bad)
        V.fail(f"paged_kv_indptr: each paged_kv_indptr request must contain at least {int(need[b])} pages for its "
               f"{int(lens[b])} keys; request {b} contains {int(have[b])}")


# ----------------------------------------------------------------------------
# The plan and its wrapper
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BlockSparsePlan:
    static: object  # cuda.block_sparse.BlockSparseStatic
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype
    q_shape: tuple
    geometry: tuple  # (Hkv, page_size, D)
    route_shape: tuple  # block_indptr's
    seq_len_kv: int
    max_blocks_per_row: int
    use_valid_bits: bool
    kv_indptr: torch.Tensor  # the plan's copy
    seq_lens: torch.Tensor  # the plan's copy (or seq_len_kv for every request)
    num_indices: int  # paged_kv_indptr[-1]: the length a run's paged_kv_indices must have
    launch: Optional[object]  # cuda.block_sparse.PreparedBlockSparse
    tuning_code: str

    @property
    def default_scale(self) -> float:
        """sm_scale when run gets None: 1 / sqrt(D)."""
        return 1.0 / math.sqrt(self.geometry[2])


class BlockSparsePagedTSWrapper:
    """Plan/run paged block-sparse attention.

    ``plan`` fixes the geometry (batch, Sq, heads, head dim, page size, block sizes, the
    length bound ``seq_len_kv``, the mask, whether runs pass valid bits and the route
    capacity ``max_blocks_per_row``), reads ``paged_kv_indptr`` (and ``seq_lens_kv``, if given:
    else every request has ``seq_len_kv`` keys) once on the host, validates them and copies
    them into the plan's own device tensors. ``run`` takes the live page IDs, routes and
    valid bits (read on the device only; the contract: canonical routes, live page IDs inside
    the cache; a route row that breaks it, or reads a page ID outside the cache, writes
    zeros and nothing is read out of bounds), does no host synchronisation and allocates
    nothing when ``out`` is given, so it can be captured in a CUDA graph once warmed.
    """

    def __init__(self, *, tuning: Optional[Tuning] = None):
        self.tuning, self._tuning_code = V.tuning(tuning)
        self._plan: Optional[BlockSparsePlan] = None

    def plan(
        self,
        paged_kv_indptr: torch.Tensor,
        seq_len_q: int,
        seq_len_kv: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_block_size: int,
        kv_block_size: int,
        page_size: int,
        *,
        max_blocks_per_row: int,
        use_kv_valid_bits: bool,
        seq_lens_kv: Optional[torch.Tensor] = None,
        mask_type: str = "dense",
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: Optional[torch.dtype] = None,
        o_data_type: Optional[torch.dtype] = None,
    ) -> None:
        self._plan = self._make_plan(paged_kv_indptr, seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim,
                                     q_block_size, kv_block_size, page_size, max_blocks_per_row, use_kv_valid_bits,
                                     seq_lens_kv, mask_type, q_data_type, kv_data_type, o_data_type, None)

    def _make_plan(self, paged_kv_indptr, seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim, q_block_size,
                   kv_block_size, page_size, max_blocks_per_row, use_kv_valid_bits, seq_lens_kv, mask_type,
                   q_data_type, kv_data_type, o_data_type, values) -> BlockSparsePlan:
        """`values`: the one-shot's host copies (indptr, lengths) of metadata it already read; its
        plan runs the shared prepared launch once."""
        d, dtype, odt, mask_type = check_geometry(seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim,
                                                  q_block_size, kv_block_size, max_blocks_per_row, use_kv_valid_bits,
                                                  mask_type, q_data_type, kv_data_type, o_data_type)
        page_size = _check_page_size(page_size)
        V.int32_vector("paged_kv_indptr", paged_kv_indptr)
        if paged_kv_indptr.shape[0] < 2:
            V.fail(f"paged_kv_indptr: expected [B+1] with B >= 1, got shape {tuple(paged_kv_indptr.shape)}")
        batch = V.batch_size("paged_kv_indptr", paged_kv_indptr.shape[0] - 1)
        if seq_lens_kv is not None:
            V.int32_vector("seq_lens_kv", seq_lens_kv, length=batch)
        device = V.same_device([("paged_kv_indptr", paged_kv_indptr), ("seq_lens_kv", seq_lens_kv)])
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("BlockSparsePagedTSWrapper: planning reads metadata on the host and cannot run during "
                               "CUDA Graph capture; plan before capturing")
        if values is None:
            ip, *lens = V.host_values(paged_kv_indptr, *((seq_lens_kv,) if seq_lens_kv is not None else ()))
            lens = lens[0] if lens else np.full(batch, seq_len_kv, dtype=np.int64)
        else:
            ip, lens = values
        check_lengths(lens, seq_len_kv, seq_len_q, mask_type, "seq_lens_kv", "seq_len_kv")
        check_page_counts(ip, lens, page_size)
        rows_r = -(-seq_len_q // q_block_size)
        words = -(-seq_len_kv // 32) if use_kv_valid_bits else 0
        static = _static(dtype, d, num_qo_heads, num_kv_heads, page_size, batch, seq_len_q, q_block_size,
                         kv_block_size, words, mask_type, odt, self.tuning)
        launch = None
        if device.type == "cuda":
            launch = K.prepared(static, device.index)  # loaded before any state changes
        kv_indptr, seq_lens = V.to_device(device, ip, lens)
        if launch is not None and values is None:
            launch = _dispatch.plan_launch(launch, (kv_indptr, seq_lens), loose=(6,))
        return BlockSparsePlan(static, device, dtype, odt, (batch, seq_len_q, num_qo_heads, d),
                               (num_kv_heads, page_size, d), (batch, num_kv_heads, rows_r + 1), seq_len_kv,
                               max_blocks_per_row, use_kv_valid_bits, kv_indptr, seq_lens, int(ip[-1]),
                               launch, self._tuning_code)

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: KVCache,
        paged_kv_indices: torch.Tensor,
        block_indptr: torch.Tensor,
        block_indices: torch.Tensor,
        *,
        kv_valid_bits: Optional[torch.Tensor] = None,
        sm_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        o = _dispatch.fast_output(plan.launch, out, plan.q_shape, plan.out_dtype, plan.device)
        if o is not None:
            kv = paged_kv_cache
            k, v = kv if type(kv) is tuple and len(kv) == 2 else (kv, None)
            if plan.launch.again(q, k, v, o, paged_kv_indices, block_indptr, block_indices, kv_valid_bits,
                                 V.fast_scale("sm_scale", sm_scale, plan.default_scale)):
                return o
        dev, dt = plan.device, plan.dtype
        cache = paged_kv_cache
        kv = plan_cache(cache, plan.geometry, dt, dev, -1) if V.matches(q, plan.q_shape, dt, dev) else None
        fast = (kv is not None and type(paged_kv_indices) is torch.Tensor
                and paged_kv_indices.shape[0] == plan.num_indices and paged_kv_indices.dtype is torch.int32
                and paged_kv_indices.device == dev and paged_kv_indices.is_contiguous()
                and V.matches(block_indptr, plan.route_shape, torch.int32, dev) and block_indptr.is_contiguous()
                and type(block_indices) is torch.Tensor and block_indices.dim() == 1
                and block_indices.dtype is torch.int32 and block_indices.device == dev
                and block_indices.is_contiguous() and (kv_valid_bits is not None) == plan.use_valid_bits)
        if fast and kv_valid_bits is not None:
            fast = (type(kv_valid_bits) is torch.Tensor
                    and kv_valid_bits.shape == (plan.q_shape[0], plan.static.valid_words)
                    and kv_valid_bits.dtype in VALID_BITS_DTYPES and kv_valid_bits.device == dev
                    and kv_valid_bits.is_contiguous())
        if not fast:
            _check_against_plan(plan, q, cache, paged_kv_indices, block_indptr, block_indices, kv_valid_bits)
        return _launch(plan, q, cache, kv if fast else None, paged_kv_indices, block_indptr, block_indices,
                       kv_valid_bits, V.fast_scale("sm_scale", sm_scale, plan.default_scale), out)


def _launch(plan: BlockSparsePlan, q, cache, kv, kv_indices, block_indptr, block_indices, valid_bits,
            sm_scale: float, out) -> torch.Tensor:
    """A run's (or a one-shot's) launch of operands checked against the plan (`kv`: the cache's
    K and V pools when every operand is laid out as planned, else None): `out` checked, then
    the prepared kernel, or the op where a tracer, a mode or a subclass must see the call."""
    dev = plan.device
    if out is not None:
        V.out_tensor(out, plan.q_shape, plan.out_dtype, dev,
                     (("q", q),) + named_cache("paged_kv_cache", cache) + (
                         ("paged_kv_indices", kv_indices), ("block_indptr", block_indptr),
                         ("block_indices", block_indices), ("kv_valid_bits", valid_bits)))
    if kv is not None and plan.launch is not None and _dispatch.plain_eager(out):
        if out is None:
            out = torch.empty(plan.q_shape, dtype=plan.out_dtype, device=dev)
        plan.launch.run(q, kv[0], kv[1], out, plan.kv_indptr, kv_indices, block_indptr, block_indices,
                        plan.seq_lens, valid_bits, sm_scale)
        return out
    k_cache, v_cache = split_cache(cache, "paged_kv_cache")
    V.run_layout((("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache)))
    st = plan.static
    args = (plan.kv_indptr, kv_indices, block_indptr, block_indices, plan.seq_lens, valid_bits,
            st.q_block_size, st.kv_block_size, "causal" if st.causal else "dense", sm_scale)
    return _dispatch.call(torch.ops.prims_ts.block_sparse_attention,
                          torch.ops.prims_ts.block_sparse_attention_out, _run, (q, k_cache, v_cache), args, out,
                          plan.out_dtype, plan.tuning_code)


def _check_against_plan(plan: BlockSparsePlan, q, cache, kv_indices, block_indptr, block_indices, valid_bits) -> None:
    k_cache, v_cache = split_cache(cache, "paged_kv_cache")
    V.tensor("q", q, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if q.dim() != 4:
        V.fail(f"q must be rank 4 ([B, Sq, Hq, D]), got rank {q.dim()}")
    if tuple(q.shape) != tuple(plan.q_shape):
        V.fail(f"q: expected the planned [B, Sq, Hq, D] = {tuple(plan.q_shape)}, got {tuple(q.shape)}")
    if q.dtype != plan.dtype:
        V.fail(f"q: dtype {V._dtype_name(q.dtype)} differs from the planned q_data_type {V._dtype_name(plan.dtype)}")
    if k_cache.dtype != plan.dtype:
        V.fail(f"paged_kv_cache: dtype {V._dtype_name(k_cache.dtype)} differs from the planned kv dtype "
               f"{V._dtype_name(plan.dtype)}")
    if tuple(k_cache.shape[1:]) != plan.geometry:
        V.fail(f"paged_kv_cache: (Hkv, page_size, D) = {tuple(k_cache.shape[1:])} differs from the plan's "
               f"{plan.geometry}")
    V.int32_vector("paged_kv_indices", kv_indices)
    if kv_indices.shape[0] != plan.num_indices:
        V.fail(f"paged_kv_indices: expected the planned paged_kv_indptr[-1] = {plan.num_indices} page IDs, got "
               f"{kv_indices.shape[0]}")
    check_routes_static(block_indptr, block_indices, *plan.route_shape[:2], plan.route_shape[2] - 1)
    check_valid_bits(valid_bits, plan.q_shape[0], plan.seq_len_kv, plan.use_valid_bits, "seq_len_kv")
    V.same_device([("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache), ("paged_kv_indices", kv_indices),
                   ("block_indptr", block_indptr), ("block_indices", block_indices), ("kv_valid_bits", valid_bits)])
    if q.device != plan.device:
        V.fail(f"q must be on planned device {plan.device}, got {q.device}")


def block_sparse_attention_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache: KVCache,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    q_block_size: int,
    kv_block_size: int,
    *,
    max_seq_len_kv: Optional[int] = None,
    seq_lens_kv: Optional[torch.Tensor] = None,
    seq_len_kv: Optional[int] = None,
    kv_valid_bits: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plan and run one fixed-Q paged block-sparse attention launch.

    The length bound is ``max_seq_len_kv`` (the seed's, with ``seq_lens_kv`` the live lengths)
    or FlashInfer main's ``seq_len_kv`` (``seq_lens_kv`` then optional: every request has
    ``seq_len_kv`` keys). Validates the live page and BSR metadata on the host with one copy
    and whole-tensor checks (lengths, the complete live page-ID prefix of every request,
    canonical BSR rows whose blocks start before the request's length), then launches a
    :class:`BlockSparsePagedTSWrapper` plan with the routes' largest row as its capacity once
    (the shared prepared kernel).
    It cannot run during CUDA-graph capture: plan a wrapper outside capture and capture only
    its ``run``.
    """
    if (max_seq_len_kv is None) == (seq_len_kv is None):
        V.fail("max_seq_len_kv/seq_len_kv: give exactly one length bound (max_seq_len_kv, with seq_lens_kv; or "
               "FlashInfer's seq_len_kv)")
    bound_name = "max_seq_len_kv" if max_seq_len_kv is not None else "seq_len_kv"
    bound = max_seq_len_kv if max_seq_len_kv is not None else seq_len_kv
    V.key_length_bound(bound_name, bound)
    if max_seq_len_kv is not None and seq_lens_kv is None:
        V.fail("seq_lens_kv: required with max_seq_len_kv (the live lengths it bounds)")
    k_cache, v_cache = split_cache(paged_kv_cache, "paged_kv_cache")
    V.tensor("q", q, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if q.dim() != 4:
        V.fail(f"q must be rank 4 ([B, Sq, Hq, D]), got rank {q.dim()}")
    batch, sq, hq, d = q.shape
    if batch < 1 or sq < 1:
        V.fail(f"q: expected [B, Sq, Hq, D] with B, Sq >= 1, got shape {tuple(q.shape)}")
    if q.dtype != k_cache.dtype:
        V.fail(f"q: dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    num_pages, hkv, page_size, dk = k_cache.shape
    if page_size not in PAGE_SIZES:
        V.fail(f"paged_kv_cache: page size {page_size} is not supported; prims_ts supports page_size "
               f"{', '.join(map(str, PAGE_SIZES))}")
    V.head_dim("q", d, HEAD_DIMS)
    if dk != d:
        V.fail(f"paged_kv_cache: head dim {dk} differs from q's {d}")
    group = V.heads(hq, hkv, ("q", "paged_kv_cache"))
    check_block_sizes(q_block_size, kv_block_size, group)
    mask_type = V.choice("mask_type", mask_type, MASKS)
    V.int32_vector("paged_kv_indptr", paged_kv_indptr, length=batch + 1)
    V.int32_vector("paged_kv_indices", paged_kv_indices)
    if seq_lens_kv is not None:
        V.int32_vector("seq_lens_kv", seq_lens_kv, length=batch)
    rows_r = -(-sq // q_block_size)
    check_routes_static(block_indptr, block_indices, batch, hkv, rows_r)
    check_valid_bits(kv_valid_bits, batch, bound, kv_valid_bits is not None, bound_name)
    V.same_device([("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache),
                   ("paged_kv_indptr", paged_kv_indptr), ("paged_kv_indices", paged_kv_indices),
                   ("block_indptr", block_indptr), ("block_indices", block_indices), ("seq_lens_kv", seq_lens_kv),
                   ("kv_valid_bits", kv_valid_bits)])
    if V.tracing():
        raise RuntimeError("block_sparse_attention_with_paged_kv_cache reads metadata on the host and cannot be "
                           "traced; use BlockSparsePagedTSWrapper (plan outside, run inside)")
    ip, ids, ptr, routes, *lens = V.host_values(paged_kv_indptr, paged_kv_indices, block_indptr, block_indices,
                                                *((seq_lens_kv,) if seq_lens_kv is not None else ()))
    lens = lens[0] if lens else np.full(batch, bound, dtype=np.int64)
    check_lengths(lens, bound, sq, mask_type, "seq_lens_kv", bound_name)
    V.values_indptr("paged_kv_indptr", ip, ids.shape[0], "paged_kv_indices.numel()", strict=False)
    check_page_counts(ip, lens, page_size)
    need = (lens + page_size - 1) // page_size
    live = np.repeat(ip[:-1] - (np.cumsum(need) - need), need) + np.arange(int(need.sum()))
    bad = (ids[live] < 0) | (ids[live] >= num_pages)
    if bad.any():
        i = int(live[V.first(bad)])
        b = int(np.searchsorted(ip, i, side="right")) - 1
        V.fail(f"paged_kv_indices: request {b} uses page ID {int(ids[i])}, outside [0, {num_pages}); entries must "
               "index the physical page pool")
    most = check_route_values(ptr.reshape(batch, hkv, rows_r + 1), routes, lens, kv_block_size)
    plan = BlockSparsePagedTSWrapper()._make_plan(
        paged_kv_indptr, sq, bound, hq, hkv, d, q_block_size, kv_block_size, page_size,
        min(most, -(-bound // kv_block_size)), kv_valid_bits is not None, seq_lens_kv, mask_type, q.dtype, None,
        V.resolve_out_dtype(None, out, q), (ip, lens))
    kv = plan_cache(paged_kv_cache, plan.geometry, plan.dtype, plan.device, -1)  # None: a subclass (the op)
    return _launch(plan, q, paged_kv_cache, kv, paged_kv_indices, block_indptr, block_indices, kv_valid_bits,
                   V.fast_scale("sm_scale", sm_scale, plan.default_scale), out)


# ----------------------------------------------------------------------------
# Contiguous K/V: BlockSparseTSWrapper and block_sparse_attention
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ContiguousBlockSparsePlan:
    static: object  # cuda.block_sparse.BlockSparseStatic (contiguous)
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype
    q_shape: tuple  # [B, Sq, Hq, D]
    kv_shape: tuple  # [B, Skv, Hkv, D]
    route_shape: tuple  # block_indptr's
    use_valid_bits: bool
    q_block_size: int
    kv_block_size: int
    mask_type: str
    launch: Optional[object]  # cuda.block_sparse.PreparedBlockSparse
    tuning_code: str

    @property
    def default_scale(self) -> float:
        """sm_scale when run gets None: 1 / sqrt(D)."""
        return 1.0 / math.sqrt(self.q_shape[3])


def _plan_device(device) -> torch.device:
    """The ``device`` of a plan that takes no tensor: a torch.device, its name, or a CUDA index."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device: expected a torch.device, a device name or a CUDA index, got {type(device).__name__}")
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            V.fail(f"device: {dev} was requested but CUDA is not available")
        dev = torch.device("cuda", cuda_index(dev))
    elif dev.type != "cpu":
        V.fail(f"device: block-sparse plans run on CUDA (or the CPU reference), got {dev}")
    return dev


class BlockSparseTSWrapper:
    """Plan/run block-sparse attention over contiguous K/V (FlashInfer's ``BlockSparseTSWrapper``).

    Q and the output are ``[B, Sq, Hq, D]``, K and V ``[B, Skv, Hkv, D]``; BSR routes per
    (request, K/V head, query block) as in :class:`BlockSparsePagedTSWrapper` (``block_indptr``
    ``[B, Hkv, ceil(Sq / q_block_size) + 1]`` of absolute offsets into ``block_indices``, strictly
    increasing block IDs per row, every block starting before Skv). ``plan`` fixes the geometry,
    the mask, whether runs pass valid bits and the per-row capacity ``max_blocks_per_row``; it
    reads no tensor. ``run`` takes any routes within that capacity (read on the device only:
    a row that breaks the BSR rules writes zeros, nothing is read out of bounds), does no host
    synchronisation, allocates nothing when ``out`` is given, and can be captured in a CUDA
    graph once warmed: a replay reads the routes in the captured tensors as they are then.
    """

    def __init__(self, *, tuning: Optional[Tuning] = None):
        self.tuning, self._tuning_code = V.tuning(tuning)
        self._plan: Optional[ContiguousBlockSparsePlan] = None

    def plan(
        self,
        batch_size: int,
        seq_len_q: int,
        seq_len_kv: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_block_size: int,
        kv_block_size: int,
        *,
        device,
        max_blocks_per_row: int,
        use_kv_valid_bits: bool,
        mask_type: str = "dense",
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: Optional[torch.dtype] = None,
        o_data_type: Optional[torch.dtype] = None,
    ) -> None:
        self._plan = self._make_plan(batch_size, seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim,
                                     q_block_size, kv_block_size, device, max_blocks_per_row, use_kv_valid_bits,
                                     mask_type, q_data_type, kv_data_type, o_data_type)

    def _make_plan(self, batch_size, seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim, q_block_size,
                   kv_block_size, device, max_blocks_per_row, use_kv_valid_bits, mask_type, q_data_type, kv_data_type,
                   o_data_type, one_shot: bool = False) -> "ContiguousBlockSparsePlan":
        """The plan; a `one_shot`'s runs the shared prepared launch once."""
        batch = V.batch_size("batch_size", V.integer("batch_size", batch_size, minimum=1))
        d, dtype, odt, mask_type = check_geometry(seq_len_q, seq_len_kv, num_qo_heads, num_kv_heads, head_dim,
                                                  q_block_size, kv_block_size, max_blocks_per_row, use_kv_valid_bits,
                                                  mask_type, q_data_type, kv_data_type, o_data_type)
        dev = _plan_device(device)
        rows_r = -(-seq_len_q // q_block_size)
        words = -(-seq_len_kv // 32) if use_kv_valid_bits else 0
        static = _static(dtype, d, num_qo_heads, num_kv_heads, 0, batch, seq_len_q, q_block_size, kv_block_size,
                         words, mask_type, odt, self.tuning, seq_len_kv=seq_len_kv)
        launch = None
        if dev.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("BlockSparseTSWrapper: plan before capturing a CUDA graph (it loads the kernel)")
            launch = K.prepared(static, dev.index)
            if not one_shot:
                launch = _dispatch.plan_launch(launch, (), loose=(6,))
        return ContiguousBlockSparsePlan(
            static, dev, dtype, odt, (batch, seq_len_q, num_qo_heads, d), (batch, seq_len_kv, num_kv_heads, d),
            (batch, num_kv_heads, rows_r + 1), use_kv_valid_bits, q_block_size, kv_block_size, mask_type, launch,
            self._tuning_code)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        block_indptr: torch.Tensor,
        block_indices: torch.Tensor,
        *,
        kv_valid_bits: Optional[torch.Tensor] = None,
        sm_scale: Optional[float] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        launch = plan.launch
        o = _dispatch.fast_output(launch, out, plan.q_shape, plan.out_dtype, plan.device)
        if o is not None and launch.again(q, k, v, o, None, block_indptr, block_indices, kv_valid_bits,
                                          V.fast_scale("sm_scale", sm_scale, plan.default_scale)):
            return o
        _check_contiguous_against_plan(plan, q, k, v, block_indptr, block_indices, kv_valid_bits)
        return _launch_contiguous(plan, q, k, v, block_indptr, block_indices, kv_valid_bits,
                                  V.fast_scale("sm_scale", sm_scale, plan.default_scale), out)


def _launch_contiguous(plan: "ContiguousBlockSparsePlan", q, k, v, block_indptr, block_indices, valid_bits,
                       sm_scale: float, out) -> torch.Tensor:
    """A run's (or a one-shot's) launch of operands checked against the plan: `out` checked,
    then the prepared kernel, or the op where a tracer, a mode or a subclass must see the call."""
    if out is not None:
        V.out_tensor(out, plan.q_shape, plan.out_dtype, plan.device,
                     (("q", q), ("k", k), ("v", v), ("block_indptr", block_indptr),
                      ("block_indices", block_indices), ("kv_valid_bits", valid_bits)))
    if plan.launch is not None and _dispatch.plain_eager(out) and all(
            type(t) is torch.Tensor for t in (q, k, v, block_indptr, block_indices)) and (
            valid_bits is None or type(valid_bits) is torch.Tensor):
        if out is None:
            out = torch.empty(plan.q_shape, dtype=plan.out_dtype, device=plan.device)
        plan.launch.run(q, k, v, out, None, None, block_indptr, block_indices, None, valid_bits, sm_scale)
        return out
    return _dispatch.call(torch.ops.prims_ts.block_sparse_attention_contiguous,
                          torch.ops.prims_ts.block_sparse_attention_contiguous_out, _run_contiguous, (q, k, v),
                          (block_indptr, block_indices, valid_bits, plan.q_block_size, plan.kv_block_size,
                           plan.mask_type, sm_scale), out, plan.out_dtype, plan.tuning_code)


def _check_qkv_contiguous(q, k, v) -> None:
    """Ranks, dtypes and layouts of q ``[B, Sq, Hq, D]`` and K/V ``[B, Skv, Hkv, D]``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.tensor(name, t, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
        if t.dim() != 4:
            V.fail(f"{name} must be rank 4 ([B, S, H, D]), got rank {t.dim()}")
    if tuple(v.shape) != tuple(k.shape):
        V.fail(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    V.same_dtype([("q", q), ("k", k), ("v", v)])
    if k.shape[0] != q.shape[0]:
        V.fail(f"k: batch {k.shape[0]} differs from q's {q.shape[0]}")
    if k.shape[3] != q.shape[3]:
        V.fail(f"k: head dim {k.shape[3]} differs from q's {q.shape[3]}")


def _check_contiguous_against_plan(plan: ContiguousBlockSparsePlan, q, k, v, block_indptr, block_indices,
                                   valid_bits) -> None:
    _check_qkv_contiguous(q, k, v)
    if tuple(q.shape) != plan.q_shape:
        V.fail(f"q: expected the planned [B, Sq, Hq, D] = {plan.q_shape}, got {tuple(q.shape)}")
    if tuple(k.shape) != plan.kv_shape:
        V.fail(f"k: expected the planned [B, Skv, Hkv, D] = {plan.kv_shape}, got {tuple(k.shape)}")
    if q.dtype != plan.dtype:
        V.fail(f"q: dtype {V._dtype_name(q.dtype)} differs from the planned q_data_type {V._dtype_name(plan.dtype)}")
    check_routes_static(block_indptr, block_indices, *plan.route_shape[:2], plan.route_shape[2] - 1)
    check_valid_bits(valid_bits, plan.q_shape[0], plan.kv_shape[1], plan.use_valid_bits, "seq_len_kv")
    V.same_device([("q", q), ("k", k), ("v", v), ("block_indptr", block_indptr), ("block_indices", block_indices),
                   ("kv_valid_bits", valid_bits)])
    if q.device != plan.device:
        V.fail(f"q must be on the planned device {plan.device}, got {q.device}")


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indptr: torch.Tensor,
    block_indices: torch.Tensor,
    q_block_size: int,
    kv_block_size: int,
    *,
    kv_valid_bits: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plan and run one block-sparse attention launch over contiguous K/V ``[B, Skv, Hkv, D]``.

    Validates the routes on the host with one copy and whole-array checks (canonical BSR rows:
    offsets inside ``block_indices`` and non-decreasing, block IDs strictly increasing and
    starting before Skv), then launches a :class:`BlockSparseTSWrapper` plan with the routes'
    largest row as its capacity once (the shared prepared kernel). It cannot run during CUDA-graph capture: plan a wrapper
    outside capture and capture only its ``run``.
    """
    _check_qkv_contiguous(q, k, v)
    batch, sq, hq, d = q.shape
    _, skv, hkv, _ = k.shape
    if batch < 1 or sq < 1 or skv < 1:
        V.fail(f"q/k: expected B, Sq, Skv >= 1, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    V.head_dim("q", d, HEAD_DIMS)
    group = V.heads(hq, hkv, ("q", "k"))
    check_block_sizes(q_block_size, kv_block_size, group)
    mask_type = V.choice("mask_type", mask_type, MASKS)
    rows_r = -(-sq // q_block_size)
    check_routes_static(block_indptr, block_indices, batch, hkv, rows_r)
    check_valid_bits(kv_valid_bits, batch, skv, kv_valid_bits is not None, "Skv")
    V.same_device([("q", q), ("k", k), ("v", v), ("block_indptr", block_indptr), ("block_indices", block_indices),
                   ("kv_valid_bits", kv_valid_bits)])
    if V.tracing():
        raise RuntimeError("block_sparse_attention reads the routes on the host and cannot be traced; use "
                           "BlockSparseTSWrapper (plan outside, run inside)")
    if mask_type == "causal" and sq > skv:
        V.fail(f"q: causal block-sparse requires Sq <= Skv, got {sq} > {skv}")
    ptr, routes = V.host_values(block_indptr, block_indices)
    lens = np.full(batch, skv, dtype=np.int64)
    most = check_route_values(ptr.reshape(batch, hkv, rows_r + 1), routes, lens, kv_block_size)
    plan = BlockSparseTSWrapper()._make_plan(batch, sq, skv, hq, hkv, d, q_block_size, kv_block_size, q.device,
                                             min(most, -(-skv // kv_block_size)), kv_valid_bits is not None,
                                             mask_type, q.dtype, None, V.resolve_out_dtype(None, out, q),
                                             one_shot=True)
    return _launch_contiguous(plan, q, k, v, block_indptr, block_indices, kv_valid_bits,
                              V.fast_scale("sm_scale", sm_scale, plan.default_scale), out)
