"""Paged block-sparse attention: ``block_sparse_attention_with_paged_kv_cache`` and
``BlockSparsePagedTSWrapper``.

Public: ``block_sparse_attention_with_paged_kv_cache`` (one-shot: validates the live page
        and BSR metadata on the host, plans, runs; not capturable) and
        ``BlockSparsePagedTSWrapper`` (plan outside capture; ``run`` takes live page IDs
        and routes, never synchronises with the host, is capturable).
Ops:    ``torch.ops.prims_ts.block_sparse_attention`` (functional) and
        ``torch.ops.prims_ts.block_sparse_attention_out`` (writes ``out``).
Fakes:  ``prims_ts/meta/block_sparse.py``; CPU kernel: ``prims_ts.reference.block_sparse_attention``.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch

from .. import reference
from . import _dispatch
from . import _validate as V
from .decode import _check_layout, split_cache
from .prefill_paged import PAGE_SIZES

MASKS = ("dense", "causal")
HEAD_DIMS = (128, 256)
VALID_BITS_DTYPES = (torch.uint32, torch.int32)

KVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits,
         q_block_size, kv_block_size, mask_type, sm_scale) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        from ..cuda import kernels

        kernels.launch_block_sparse(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices,
                                    q_block_size, kv_block_size, seq_lens, valid_bits, mask_type == "causal",
                                    sm_scale)
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
) -> None:
    """Writes block-sparse attention into ``out``. Trusted arguments: validate first."""
    _run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits,
         q_block_size, kv_block_size, mask_type, sm_scale)


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
) -> torch.Tensor:
    """Functional form of ``block_sparse_attention_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits,
         q_block_size, kv_block_size, mask_type, sm_scale)
    return out


# ----------------------------------------------------------------------------
# Static validation (no metadata values)
# ----------------------------------------------------------------------------


class _Geometry:
    """What the static checks establish about one call."""

    def __init__(self, batch, sq, hq, hkv, d, page_size, num_pages, rows_r, device, dtype):
        self.batch, self.sq, self.hq, self.hkv, self.d = batch, sq, hq, hkv, d
        self.page_size, self.num_pages, self.rows_r = page_size, num_pages, rows_r
        self.device, self.dtype = device, dtype


def check_block_sizes(q_block_size, kv_block_size, group: int) -> None:
    V.integer("q_block_size", q_block_size, minimum=1)
    V.integer("kv_block_size", kv_block_size, minimum=1)
    if (q_block_size * group) % 8 != 0:
        V.fail(f"q_block_size: q_block_size * (Hq / Hkv) = {q_block_size} * {group} must be a multiple of 8 "
               "(a Q tile must not cross BSR rows)")
    if kv_block_size not in (8, 16, 32) and kv_block_size % 64 != 0:
        V.fail(f"kv_block_size: must be 8, 16, 32 or a positive multiple of 64, got {kv_block_size}")


def _check_static(q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, q_block_size,
                  kv_block_size, max_seq_len_kv, seq_lens, valid_bits) -> _Geometry:
    V.tensor("q", q, dtypes=V.INPUT_DTYPES, ndim=4, inner_contiguous=True, vector_aligned=True)
    if q.dtype != k_cache.dtype:
        V.fail(f"q: dtype {q.dtype} differs from the cache's {k_cache.dtype}")
    batch, sq, hq, d = q.shape
    V.batch_size("q", batch)
    if batch < 1 or sq < 1:
        V.fail(f"q: expected [B, Sq, Hq, D] with B, Sq >= 1, got shape {tuple(q.shape)}")
    num_pages, hkv, page_size, dk = k_cache.shape
    if page_size not in PAGE_SIZES:
        V.fail(f"paged_kv_cache: page size {page_size} is not supported; expected one of "
               f"{', '.join(map(str, PAGE_SIZES))}")
    V.head_dim("q", d, HEAD_DIMS)
    if dk != d:
        V.fail(f"paged_kv_cache: head dim {dk} differs from q's {d}")
    group = V.heads(hq, hkv, ("q", "paged_kv_cache"))
    check_block_sizes(q_block_size, kv_block_size, group)
    V.key_length_bound("max_seq_len_kv", max_seq_len_kv)
    rows_r = -(-sq // q_block_size)
    V.int32_vector("paged_kv_indptr", kv_indptr, length=batch + 1)
    V.int32_vector("paged_kv_indices", kv_indices)
    V.int32_vector("seq_lens_kv", seq_lens, length=batch)
    V.tensor("block_indptr", block_indptr, dtypes=(torch.int32,), ndim=3, contiguous=True)
    if tuple(block_indptr.shape) != (batch, hkv, rows_r + 1):
        V.fail(f"block_indptr: expected [B, Hkv, ceil(Sq / q_block_size) + 1] = {(batch, hkv, rows_r + 1)}, "
               f"got {tuple(block_indptr.shape)}")
    V.int32_vector("block_indices", block_indices)
    if valid_bits is not None:
        V.tensor("kv_valid_bits", valid_bits, dtypes=VALID_BITS_DTYPES, ndim=2, contiguous=True)
        words = -(-max_seq_len_kv // 32)
        if tuple(valid_bits.shape) != (batch, words):
            V.fail(f"kv_valid_bits: expected [B, ceil(max_seq_len_kv / 32)] = {(batch, words)}, "
                   f"got {tuple(valid_bits.shape)}")
    device = V.same_device([("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache),
                            ("paged_kv_indptr", kv_indptr),
                            ("paged_kv_indices", kv_indices), ("block_indptr", block_indptr),
                            ("block_indices", block_indices), ("seq_lens_kv", seq_lens),
                            ("kv_valid_bits", valid_bits)])
    return _Geometry(batch, sq, hq, hkv, d, page_size, num_pages, rows_r, device, q.dtype)


def _inputs(q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits):
    return [("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache), ("paged_kv_indptr", kv_indptr),
            ("paged_kv_indices", kv_indices), ("block_indptr", block_indptr), ("block_indices", block_indices),
            ("seq_lens_kv", seq_lens), ("kv_valid_bits", valid_bits)]


# ----------------------------------------------------------------------------
# Metadata values (host reads: the one-shot and the wrapper's plan only)
# ----------------------------------------------------------------------------


def check_lengths(lens: List[int], max_seq_len_kv: int, sq: int, mask_type: str) -> None:
    for b, n in enumerate(lens):
        if not 1 <= n <= max_seq_len_kv:
            V.fail(f"seq_lens_kv: request {b} has {n} keys; expected 1 <= seq_lens_kv <= max_seq_len_kv "
                   f"({max_seq_len_kv})")
        if mask_type == "causal" and sq > n:
            V.fail(f"seq_lens_kv: causal masking needs Sq <= Sk, but request {b} has Sq={sq} > Sk={n}")


def check_pages(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, lens: List[int], page_size: int,
                num_pages: int) -> None:
    """CSR pages: a valid indptr, enough pages for each live length, and the complete live
    page-ID prefix of every request inside the cache."""
    ip = [int(x) for x in kv_indptr.tolist()]
    V.values_indptr("paged_kv_indptr", ip, kv_indices.shape[0], "paged_kv_indices.numel()", strict=False)
    ids = kv_indices.to("cpu", torch.int64)
    for b, n in enumerate(lens):
        need = -(-n // page_size)
        if ip[b + 1] - ip[b] < need:
            V.fail(f"paged_kv_indptr: request {b} has {ip[b + 1] - ip[b]} pages, fewer than the "
                   f"{need} its {n} keys need")
        live = ids[ip[b]: ip[b] + need]
        bad = (live < 0) | (live >= num_pages)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            V.fail(f"paged_kv_indices: request {b} uses page ID {int(live[i])}, outside [0, {num_pages})")


def check_routes(block_indptr: torch.Tensor, block_indices: torch.Tensor, lens: List[int],
                 kv_block_size: int) -> int:
    """Canonical BSR rows: offsets within ``block_indices``, non-decreasing along each row,
    block IDs strictly increasing, each starting before its request's length. Returns the
    largest number of blocks in a row."""
    ptr = block_indptr.to("cpu", torch.int64)
    ids = block_indices.to("cpu", torch.int64)
    n_ids = ids.shape[0]
    starts, ends = ptr[..., :-1], ptr[..., 1:]
    if bool(((ptr < 0) | (ptr > n_ids)).any()):
        b, h, r = (int(x) for x in ((ptr < 0) | (ptr > n_ids)).nonzero()[0])
        V.fail(f"block_indptr: entry [{b}, {h}, {r}] = {int(ptr[b, h, r])} is outside [0, block_indices.numel() "
               f"= {n_ids}]")
    if bool((ends < starts).any()):
        b, h, r = (int(x) for x in (ends < starts).nonzero()[0])
        V.fail(f"block_indptr: row [{b}, {h}, {r}] ends before it starts ({int(ends[b, h, r])} < "
               f"{int(starts[b, h, r])}); offsets must be non-decreasing")
    most = 0
    for b in range(ptr.shape[0]):
        limit = -(-lens[b] // kv_block_size)  # blocks must start before the request's length
        for h in range(ptr.shape[1]):
            for r in range(ptr.shape[2] - 1):
                row = ids[int(ptr[b, h, r]): int(ptr[b, h, r + 1])]
                most = max(most, row.shape[0])
                if row.numel() == 0:
                    continue
                if bool((row[1:] <= row[:-1]).any()):
                    V.fail(f"block_indices: row [{b}, {h}, {r}] is not strictly increasing "
                           f"(unsorted or repeated block IDs: {row.tolist()[:16]})")
                if int(row[0]) < 0 or int(row[-1]) >= limit:
                    V.fail(f"block_indices: row [{b}, {h}, {r}] selects block "
                           f"{int(row[0]) if int(row[0]) < 0 else int(row[-1])}, outside [0, {limit}) "
                           f"(request {b} has {lens[b]} keys, kv_block_size {kv_block_size})")
    return most


# ----------------------------------------------------------------------------
# Wrapper and one-shot
# ----------------------------------------------------------------------------


class BlockSparsePagedTSWrapper:
    """Plan/run paged block-sparse attention.

    ``plan`` fixes the geometry (batch, Sq, heads, head dim, page size, block sizes,
    ``max_seq_len_kv``, mask, scale, the valid-bits flag) and checks a snapshot of the
    lengths; ``run`` takes the live page IDs, routes and lengths (trusted, within the
    plan: ``1 <= seq_lens_kv <= max_seq_len_kv``, canonical routes, live page IDs in the
    cache), does no host synchronisation and allocates nothing when ``out`` is given, so
    it can be captured in a CUDA graph once warmed.
    """

    def __init__(self, device: Optional[Union[torch.device, str]] = None):
        self.device = torch.device(device) if device is not None else None
        self._plan = None

    def plan(
        self,
        batch_size: int,
        seq_len_q: int,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        q_block_size: int,
        kv_block_size: int,
        max_seq_len_kv: int,
        *,
        seq_lens_kv: Optional[torch.Tensor] = None,
        use_valid_bits: bool = False,
        mask_type: str = "dense",
        sm_scale: Optional[float] = None,
        q_data_type: torch.dtype = torch.bfloat16,
        kv_layout: str = "HND",
    ) -> None:
        _check_layout(kv_layout)
        for name, val in (("batch_size", batch_size), ("seq_len_q", seq_len_q), ("num_qo_heads", num_qo_heads),
                          ("num_kv_heads", num_kv_heads)):
            V.integer(name, val, minimum=1)
        group = V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
        d = V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
        V.integer("page_size", page_size)
        if page_size not in PAGE_SIZES:
            V.fail(f"page_size: {page_size} is not supported; expected one of {', '.join(map(str, PAGE_SIZES))}")
        check_block_sizes(q_block_size, kv_block_size, group)
        V.key_length_bound("max_seq_len_kv", max_seq_len_kv)
        if not isinstance(use_valid_bits, bool):
            raise TypeError(f"use_valid_bits: expected a bool, got {type(use_valid_bits).__name__}")
        V.input_dtype("q_data_type", q_data_type)
        mask_type = V.choice("mask_type", mask_type, MASKS)
        sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(d))
        if seq_lens_kv is not None:  # a snapshot: checked once, here
            V.int32_vector("seq_lens_kv", seq_lens_kv, length=batch_size)
            check_lengths([int(x) for x in seq_lens_kv.tolist()], max_seq_len_kv, seq_len_q, mask_type)
        elif mask_type == "causal" and seq_len_q > max_seq_len_kv:
            V.fail(f"seq_len_q: causal masking needs Sq <= max_seq_len_kv, got {seq_len_q} > {max_seq_len_kv}")
        from ..cuda import kernels

        # the kernel compiled and loaded now, not in run (no device named: the current CUDA one)
        kernels.warm_block_sparse(self.device or (seq_lens_kv.device if seq_lens_kv is not None else None),
                                  q_data_type, d, mask_type == "causal", kv_block_size,
                                  min(q_block_size, seq_len_q) * group)
        self._plan = dict(batch=batch_size, sq=seq_len_q, hq=num_qo_heads, hkv=num_kv_heads, d=d,
                          page_size=page_size, q_block=q_block_size, kv_block=kv_block_size,
                          max_seq_len_kv=max_seq_len_kv, bits=use_valid_bits, mask_type=mask_type,
                          sm_scale=sm_scale, dtype=q_data_type)

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: KVCache,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        block_indptr: torch.Tensor,
        block_indices: torch.Tensor,
        seq_lens_kv: torch.Tensor,
        *,
        kv_valid_bits: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("BlockSparsePagedTSWrapper.run: call plan(...) first")
        k_cache, v_cache = split_cache(paged_kv_cache, "paged_kv_cache")
        expect = (plan["batch"], plan["sq"], plan["hq"], plan["d"])
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
        if tuple(q.shape) != expect:
            V.fail(f"q: expected the planned [B, Sq, Hq, D] = {expect}, got {tuple(q.shape)}")
        if q.dtype != plan["dtype"]:
            V.fail(f"q: dtype {q.dtype} differs from the planned q_data_type {plan['dtype']}")
        if k_cache.shape[1] != plan["hkv"] or k_cache.shape[2] != plan["page_size"]:
            V.fail(f"paged_kv_cache: heads / page size {tuple(k_cache.shape[1:3])} differ from the plan "
                   f"({plan['hkv']}, {plan['page_size']})")
        if (kv_valid_bits is not None) != plan["bits"]:
            V.fail(f"kv_valid_bits: the plan was made with use_valid_bits={plan['bits']}")
        return _launch(q, k_cache, v_cache, paged_kv_indptr, paged_kv_indices, block_indptr, block_indices,
                       plan["q_block"], plan["kv_block"], plan["max_seq_len_kv"], seq_lens_kv, kv_valid_bits,
                       plan["mask_type"], plan["sm_scale"], out)


def _launch(q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, q_block_size, kv_block_size,
            max_seq_len_kv, seq_lens, valid_bits, mask_type, sm_scale, out) -> torch.Tensor:
    """Static checks, then the op (no metadata values read)."""
    geo = _check_static(q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, q_block_size,
                        kv_block_size, max_seq_len_kv, seq_lens, valid_bits)
    odt = V.out_dtype(None, out, q.dtype)
    inputs = _inputs(q, k_cache, v_cache, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits)
    V.out_tensor(out, q.shape, odt, geo.device, inputs)
    args = (kv_indptr, kv_indices, block_indptr, block_indices, seq_lens, valid_bits, q_block_size, kv_block_size,
            mask_type, sm_scale)
    return _dispatch.call(torch.ops.prims_ts.block_sparse_attention, torch.ops.prims_ts.block_sparse_attention_out,
                          _run, (q, k_cache, v_cache), args, out, odt)


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
    max_seq_len_kv: int,
    seq_lens_kv: torch.Tensor,
    kv_valid_bits: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Plan and run one fixed-Q paged block-sparse attention launch.

    Validates the live page and BSR metadata on the host (lengths, the complete live
    page-ID prefix of every request, canonical BSR rows whose blocks start before the
    request's length), builds a capacity-only plan and runs it. Reads metadata on the
    host, so it cannot run during CUDA-graph capture: plan a
    ``BlockSparsePagedTSWrapper`` outside capture and capture only its ``run``.
    """
    k_cache, v_cache = split_cache(paged_kv_cache, "paged_kv_cache")
    mask_type = V.choice("mask_type", mask_type, MASKS)
    geo = _check_static(q, k_cache, v_cache, paged_kv_indptr, paged_kv_indices, block_indptr, block_indices,
                        q_block_size, kv_block_size, max_seq_len_kv, seq_lens_kv, kv_valid_bits)
    sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(geo.d))
    if V.tracing():
        raise RuntimeError("block_sparse_attention_with_paged_kv_cache reads metadata on the host and cannot be "
                           "traced; use BlockSparsePagedTSWrapper (plan outside, run inside)")
    lens = [int(x) for x in seq_lens_kv.tolist()]
    check_lengths(lens, max_seq_len_kv, geo.sq, mask_type)
    check_pages(paged_kv_indptr, paged_kv_indices, lens, geo.page_size, geo.num_pages)
    check_routes(block_indptr, block_indices, lens, kv_block_size)
    wrapper = BlockSparsePagedTSWrapper(geo.device)
    wrapper.plan(geo.batch, geo.sq, geo.hq, geo.hkv, geo.d, geo.page_size, q_block_size, kv_block_size,
                 max_seq_len_kv, use_valid_bits=kv_valid_bits is not None, mask_type=mask_type, sm_scale=sm_scale,
                 q_data_type=q.dtype)
    return wrapper.run(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, block_indptr, block_indices,
                       seq_lens_kv, kv_valid_bits=kv_valid_bits, out=out)
