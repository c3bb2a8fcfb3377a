"""Paged decode: ``prims_ts_batch_decode_with_kv_cache`` and its companions.

Public: ``prims_ts_batch_decode_with_kv_cache`` (standalone, caller workspace, no host
        synchronisation, capturable), ``get_prims_ts_batch_decode_workspace_size``,
        ``BatchDecodePagedTSWrapper`` (plan/run over FlashInfer's CSR page metadata, owns its
        workspace) and the one-shot ``batch_decode_with_paged_kv_cache`` (its plan + run).
Ops:    ``torch.ops.prims_ts.batch_decode`` (functional) and
        ``torch.ops.prims_ts.batch_decode_out`` (writes ``out``); both use the workspace.
Fakes:  ``prims_ts/meta/decode.py``; CPU kernel: ``prims_ts.reference.batch_decode``.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import numpy as np
import torch

from .. import reference
from ..cuda import decode as K
from ..cuda.keys import DEFAULT_TUNING, Tuning, device_limits
from . import _dispatch
from . import _validate as V
from .prefill_paged import PAGE_SIZES, check_csr_values, check_layout, check_page_ids

MASKS = ("dense", "causal")
HEAD_DIMS = (64, 128, 256)
WORKSPACE_DTYPES = (torch.uint8, torch.int8)

KVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def decode_static(dtype, head_dim: int, num_qo_heads: int, num_kv_heads: int, page_size: int, out_dtype,
                  packed: bool, batch: int, seq_len_q: int, max_seq_len_q: int, max_seq_len: int, mask_type: str,
                  window_left: int, tuning: Tuning):
    """The prepared launch's key (what a plan knows, or what an op's arguments say)."""
    return K.DecodeStatic(dtype, head_dim, num_qo_heads, num_kv_heads, page_size, mask_type == "causal", window_left,
                          out_dtype, batch, seq_len_q, max_seq_len_q, max_seq_len, packed, tuning)


def _run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
         max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale, tuning) -> None:
    if out.numel() == 0:
        return
    if query.device.type == "cuda":
        packed = qo_indptr is not None
        batch = qo_indptr.shape[0] - 1 if packed else query.shape[0]
        static = decode_static(query.dtype, query.shape[-1], query.shape[-2], k_cache.shape[1], k_cache.shape[2],
                               out.dtype, packed, batch, seq_len_q, max_seq_len_q, max_seq_len, mask_type, window_left,
                               Tuning.decode(tuning))
        K.prepared(static, query.device.index).run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices,
                                                   seq_lens, qo_indptr, sm_scale, output_scale)
    else:
        out.copy_(reference.batch_decode(
            query, k_cache, v_cache, kv_indptr, kv_indices, seq_lens, qo_indptr=qo_indptr, mask_type=mask_type,
            window_left=window_left, sm_scale=sm_scale, output_scale=output_scale, compute_dtype=torch.float32))


@torch.library.custom_op("prims_ts::batch_decode_out", mutates_args=("workspace", "out"))
def batch_decode_out_op(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    workspace: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    seq_len_q: int,
    max_seq_len_q: int,
    max_seq_len: int,
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    tuning: str = "",
) -> None:
    """Writes decode attention into ``out`` (split-KV partials go through ``workspace``). Trusted arguments."""
    _run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
         max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale, tuning)


@torch.library.custom_op("prims_ts::batch_decode", mutates_args=("workspace",))
def batch_decode_op(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    workspace: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    seq_len_q: int,
    max_seq_len_q: int,
    max_seq_len: int,
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    """``batch_decode_out`` returning a new output tensor."""
    out = torch.empty(query.shape, dtype=V.code_dtype(out_dtype), device=query.device)
    _run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
         max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale, tuning)
    return out


# ----------------------------------------------------------------------------
# Static arguments
# ----------------------------------------------------------------------------


def split_cache(kv_cache: KVCache, name: str = "kv_cache") -> Tuple[torch.Tensor, torch.Tensor]:
    """(K, V) pools ``[P, Hkv, ps, D]`` from a combined ``[P, 2, Hkv, ps, D]`` cache or a tuple (views, no copy)."""
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            V.fail(f"{name}: a tuple cache must hold exactly (K, V), got {len(kv_cache)} tensors")
        k, v = kv_cache
        for n, t in ((f"{name}[0]", k), (f"{name}[1]", v)):
            V.tensor(n, t, dtypes=V.INPUT_DTYPES, ndim=4, inner_contiguous=True, vector_aligned=True)
        if tuple(k.shape) != tuple(v.shape):
            V.fail(f"{name}: K and V pools differ in shape: {tuple(k.shape)} vs {tuple(v.shape)}")
        if k.dtype != v.dtype:
            V.fail(f"{name}: K and V pools differ in dtype: {k.dtype} vs {v.dtype}")
        V.pool_strides(f"{name}[0]", k)
        V.pool_strides(f"{name}[1]", v)
        return k, v
    V.tensor(name, kv_cache, dtypes=V.INPUT_DTYPES, ndim=5, inner_contiguous=True, vector_aligned=True)
    if kv_cache.shape[1] != 2:
        V.fail(f"{name}: a combined cache is [num_pages, 2, Hkv, page_size, D]; dim 1 must be 2, got "
               f"shape {tuple(kv_cache.shape)}")
    k, v = kv_cache[:, 0], kv_cache[:, 1]
    V.pool_strides(name, k)
    return k, v


def plan_cache(cache, geometry: tuple, dtype: torch.dtype, device: torch.device, max_page: int):
    """A run's paged cache as launch operands, when it is a plain combined ``[P, 2, Hkv, ps, D]``
    tensor or a ``(K, V)`` tuple matching the plan's (Hkv, page_size, D), dtype, device and
    largest page ID: ``(cache, None)`` or ``(k, v)``; None for anything else (the slow check)."""
    if type(cache) is torch.Tensor:
        if (cache.dim() == 5 and cache.shape[1] == 2 and cache.shape[2:] == geometry and cache.dtype is dtype
                and cache.device == device and max_page < cache.shape[0]):
            return cache, None
        return None
    if type(cache) is tuple and len(cache) == 2:
        k, v = cache
        if (type(k) is torch.Tensor and type(v) is torch.Tensor and k.dim() == 4 and k.shape[1:] == geometry
                and v.shape == k.shape and k.dtype is dtype and v.dtype is dtype and k.device == device
                and v.device == device and max_page < k.shape[0]):
            return k, v
    return None


def query_mode(batch: int, qo_indptr, seq_len_q, max_seq_len_q, query_shape=None) -> Tuple[int, int, int]:
    """(batch, seq_len_q, max_seq_len_q) of fixed [B,Hq,D] / [B,SQ,Hq,D] or packed [T,Hq,D] queries
    (query_shape: the query's shape, checked against the mode when given; batch: the fixed
    batch size, as packed queries take theirs from qo_indptr)."""
    V.integer("seq_len_q", seq_len_q, minimum=1)
    if qo_indptr is not None:
        V.int32_vector("qo_indptr", qo_indptr)
        if qo_indptr.shape[0] < 2:
            V.fail(f"qo_indptr: expected [B+1] with B >= 1, got shape {tuple(qo_indptr.shape)}")
        if query_shape is not None and len(query_shape) != 3:
            V.fail(f"query: packed queries (qo_indptr given) are [total_q, Hq, D], got shape {tuple(query_shape)}")
        if max_seq_len_q is None:
            V.fail("max_seq_len_q: max_seq_len_q is required when qo_indptr selects packed queries (the static "
                   "bound of every request's query count)")
        V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        if seq_len_q != 1:
            V.fail("seq_len_q: packed queries take their lengths from qo_indptr; leave seq_len_q at 1, "
                   f"got {seq_len_q}")
        return qo_indptr.shape[0] - 1, 1, max_seq_len_q
    if query_shape is not None:
        if seq_len_q == 1:
            if len(query_shape) != 3:
                V.fail(f"query: seq_len_q=1 expects [B, Hq, D], got shape {tuple(query_shape)}")
        elif len(query_shape) != 4 or query_shape[1] != seq_len_q:
            V.fail(f"query: seq_len_q={seq_len_q} expects [B, {seq_len_q}, Hq, D], got shape {tuple(query_shape)}")
        if query_shape[0] < 1:
            V.fail(f"query: needs at least one request, got shape {tuple(query_shape)}")
    if max_seq_len_q is not None:
        V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        if max_seq_len_q != seq_len_q:
            V.fail(f"max_seq_len_q: {max_seq_len_q} contradicts the fixed query length seq_len_q={seq_len_q}")
    return batch, seq_len_q, seq_len_q


def _workspace_bytes(batch, num_qo_heads, num_kv_heads, head_dim, max_seq_len, max_seq_len_q, device,
                     tuning: Tuning = DEFAULT_TUNING) -> int:
    _, sms, limit = device_limits(device)
    group = num_qo_heads // num_kv_heads
    balance = K.balances(tuning)
    pol = K.decode_policy(batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sms, limit, balance)
    V.row_tiles("max_seq_len_q", num_kv_heads, pol.rows_max, pol.bm)
    return max(256, K.decode_workspace_bytes(batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sms,
                                             limit, balance))


def planned_tuning(tuning: Tuning, code: str, lens, device, batch: int, num_kv_heads: int, group: int,
                   max_seq_len_q: int, head_dim: int, max_seq_len: int) -> Tuple[Tuning, str]:
    """A decode-shaped plan's tuning and its op code (`code`: `tuning`'s): `tuning` with the
    split-KV that the requests' lengths `lens` choose (cuda.decode.balanced_by_lengths)."""
    arch, sms, limit = device_limits(device)
    got = K.balanced_by_lengths(tuning, lens, batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sms,
                                limit, arch)
    return (tuning, code) if got is tuning else (got, got.encode())


def check_dtypes(q_dtype, kv_dtype, out_dtype, names=("q_data_type", "kv_data_type", "o_data_type")):
    """A plan's dtypes: the query's (fp16/bf16), the cache's (the query's: prims_ts reads one dtype),
    the output's (fp16/bf16/fp32; default the query's). Returns (dtype, out dtype)."""
    V.input_dtype(names[0], q_dtype)
    if kv_dtype is not None:
        V.input_dtype(names[1], kv_dtype)
        if kv_dtype != q_dtype:
            V.fail(f"{names[1]}: {kv_dtype} differs from {names[0]} {q_dtype}; prims_ts reads the query and the "
                   "cache in one dtype")
    return q_dtype, V.out_dtype(out_dtype, None, q_dtype, names[2])


def get_prims_ts_batch_decode_workspace_size(
    batch_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    max_seq_len: int,
    *,
    seq_len_q: int = 1,
    qo_indptr: Optional[torch.Tensor] = None,
    max_seq_len_q: Optional[int] = None,
    q_dtype: torch.dtype = torch.float16,
    kv_dtype: Optional[torch.dtype] = None,
    out_dtype: Optional[torch.dtype] = None,
    mask_type: str = "dense",
    window_left: int = -1,
    kv_layout: str = "HND",
    device: Optional[Union[torch.device, str]] = None,
) -> int:
    """Bytes of ``workspace_buffer`` that ``prims_ts_batch_decode_with_kv_cache`` needs for
    these static arguments on ``device`` (default: the current CUDA device, or the CPU).

    The size depends only on static arguments (and the device's SM count): the
    split-KV policy is chosen from them, never from metadata values.
    """
    for name, val in (("batch_size", batch_size), ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        V.integer(name, val, minimum=1)
    V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
    V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
    _check_page_size(page_size)
    V.key_length_bound("max_seq_len", max_seq_len)
    check_layout(kv_layout)
    V.mask_and_window(mask_type, window_left, MASKS)
    check_dtypes(q_dtype, kv_dtype, out_dtype, ("q_dtype", "kv_dtype", "out_dtype"))
    n, _, max_sq = query_mode(batch_size, qo_indptr, seq_len_q, max_seq_len_q)
    if n != batch_size:
        V.fail(f"qo_indptr: {n} requests differ from batch_size {batch_size}")
    return _workspace_bytes(batch_size, num_qo_heads, num_kv_heads, head_dim, max_seq_len, max_sq, device)


def _check_page_size(page_size) -> int:
    V.integer("page_size", page_size)
    if page_size not in PAGE_SIZES:
        V.fail(f"page_size: {page_size} is not supported; prims_ts supports page_size "
               f"{', '.join(map(str, PAGE_SIZES))}")
    return page_size


# ----------------------------------------------------------------------------
# The standalone function: static checks once per static key
# ----------------------------------------------------------------------------


def named_cache(name: str, cache) -> tuple:
    """(name, tensor) pairs of a combined cache or a (K, V) tuple (the overlap checks' inputs)."""
    if isinstance(cache, (tuple, list)):
        return tuple((name, t) for t in cache if isinstance(t, torch.Tensor))
    return ((name, cache),)


@dataclass(eq=False)
class Standalone:
    """What a standalone call's static checks derived for one static key, and what its calls
    under that key share: the per-call checks of its operands' addresses (``checks``: ``out``
    aligned, neither ``out`` nor the workspace overlapping another operand) and, from the first
    direct launch on, a prepared launch of its own. The key fixes every operand's layout, so
    once a call has written that launch's struct in full, a later call writes only its
    addresses and scales (``PreparedDecode.rerun``)."""

    static: Optional[object]  # cuda.decode.DecodeStatic (None while traced: the op builds its own)
    out_dtype: torch.dtype
    checks: V.Disjoint  # over the operands in order: out, workspace_buffer, then the inputs (see operands)
    sq: int = 1
    max_sq: int = 1
    head_dim: int = 0
    mask_type: str = "dense"
    window_left: int = -1
    launch: Optional[object] = None  # cuda.decode.PreparedDecode: this key's own copy
    written: bool = False  # a full run under this key wrote launch's struct
    roles: Optional[Callable] = None  # starts + (0,) -> the relaunch's addresses (``rerun_roles``)

    def prepared(self, device: torch.device):
        if self.launch is None:
            self.launch = K.prepared(self.static, device.index).for_plan(None)
        return self.launch

    def launch_direct(self, device: torch.device, full, starts: tuple, out: int, sm_scale: float,
                      output_scale: float, num_indices: int = -1) -> None:
        """Launch this key's prepared kernel: ``full(launch)`` (a full ``run``) the first time,
        then ``rerun`` with the addresses of ``starts`` (``checks.check``'s), ``out``'s and the loose
        ``num_indices`` (-1: the key fixes it), falling back to ``full`` when it refuses (a
        misaligned start)."""
        launch = self.prepared(device)
        if self.written and launch.rerun(*self.roles(starts + (0,)), out, sm_scale, output_scale, num_indices):
            return
        full(launch)
        self.written = True


def rerun_roles(q: int, k: int, v: Optional[int], ws: int, qo_indptr: int, kv_indptr: Optional[int],
                kv_indices: int, seq_lens: int, count: int) -> Callable:
    """The getter of a relaunch's addresses (``PreparedDecode.rerun``: q, k, v, workspace,
    qo_indptr, kv_indptr, kv_indices, seq_lens) from a standalone's operand starts followed by a
    0 (``Disjoint.check``'s, ``count`` operands): each role's operand position, None for a role
    with no operand (V in a one-tensor cache, kv_indptr of a block table)."""
    return operator.itemgetter(*[count if i is None else i for i in (q, k, v, ws, qo_indptr, kv_indptr,
                                                                     kv_indices, seq_lens)])


def operands(out, workspace, named: Tuple[Tuple[str, Optional[torch.Tensor]], ...]) -> Tuple[tuple, tuple]:
    """(names, tensors) of a standalone call's operands in ``Standalone`` order."""
    return (("out", "workspace_buffer") + tuple(n for n, _ in named),
            (out, workspace) + tuple(t for _, t in named))


_CHECKED = V.memo()


def _standalone_checks(query, kv_cache, workspace_buffer, paged_kv_indptr, paged_kv_indices, seq_lens, max_seq_len,
                       seq_len_q, qo_indptr, max_seq_len_q, out_dtype, out, mask_type, window_left,
                       kv_layout) -> Standalone:
    """Every static check of the standalone call (no tensor value is read)."""
    check_layout(kv_layout)
    k_cache, v_cache = split_cache(kv_cache)
    V.tensor("query", query, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if query.dtype != k_cache.dtype:
        V.fail(f"query: dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    batch, sq, max_sq = query_mode(query.shape[0], qo_indptr, seq_len_q, max_seq_len_q, query.shape)
    V.batch_size("qo_indptr" if qo_indptr is not None else "query", batch)
    num_pages, hkv, page_size, d = k_cache.shape
    if page_size not in PAGE_SIZES:
        V.fail(f"kv_cache: page size {page_size} is not supported; prims_ts supports page_size "
               f"{', '.join(map(str, PAGE_SIZES))}")
    V.head_dim("query", query.shape[-1], HEAD_DIMS)
    if d != query.shape[-1]:
        V.fail(f"kv_cache: head dim {d} differs from query's {query.shape[-1]}")
    hq = query.shape[-2]
    V.heads(hq, hkv, ("query", "kv_cache"))
    V.int32_vector("paged_kv_indptr", paged_kv_indptr, length=batch + 1)
    V.int32_vector("paged_kv_indices", paged_kv_indices)
    V.int32_vector("seq_lens", seq_lens, length=batch)
    V.key_length_bound("max_seq_len", max_seq_len)
    mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
    metadata = [("paged_kv_indptr", paged_kv_indptr), ("paged_kv_indices", paged_kv_indices),
                ("seq_lens", seq_lens), ("qo_indptr", qo_indptr)]
    device = V.same_device([("query", query), ("kv_cache", k_cache), ("kv_cache", v_cache),
                            ("workspace_buffer", workspace_buffer)] + metadata)
    V.tensor("workspace_buffer", workspace_buffer, dtypes=WORKSPACE_DTYPES, contiguous=True)
    V.start_aligned("workspace_buffer", workspace_buffer)
    need = _workspace_bytes(batch, hq, hkv, d, max_seq_len, max_sq, device)
    have = workspace_buffer.numel() * workspace_buffer.element_size()
    if have < need:
        V.fail(f"workspace_buffer: {have} bytes are too few; this key needs {need} "
               "(get_prims_ts_batch_decode_workspace_size)")
    odt = V.resolve_out_dtype(out_dtype, out, query, "query")
    V.out_tensor(out, query.shape, odt, device, ())
    static = None if V.tracing() else decode_static(query.dtype, d, hq, hkv, page_size, odt, qo_indptr is not None,
                                                    batch, sq, max_sq, max_seq_len, mask_type, window_left,
                                                    DEFAULT_TUNING)
    names, tensors = operands(out, workspace_buffer, (("query", query),) + named_cache("kv_cache", kv_cache)
                              + tuple(metadata))
    n = len(names) - 4  # the metadata follow the cache's one or two tensors
    return Standalone(static, odt, V.Disjoint(names, tensors, (0, 1), loose=n + 1), sq, max_sq, d, mask_type,
                      window_left, roles=rerun_roles(2, 3, 4 if n == 5 else None, 1, n + 3, n, n + 1, n + 2,
                                                     len(names)))


def prims_ts_batch_decode_with_kv_cache(
    query: torch.Tensor,
    kv_cache: KVCache,
    workspace_buffer: torch.Tensor,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    seq_len_q: int = 1,
    qo_indptr: Optional[torch.Tensor] = None,
    max_seq_len_q: Optional[int] = None,
    bmm1_scale: Optional[float] = None,
    bmm2_scale: float = 1.0,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    mask_type: str = "dense",
    window_left: int = -1,
    kv_layout: str = "HND",
) -> torch.Tensor:
    """Fixed or packed-Q decode over CSR pages with caller-owned workspace.

    No device-to-host synchronisation: shapes, dtypes, devices, the workspace size and
    scalar arguments are checked here (once per static key: the checks and the prepared
    launch are cached under it); metadata *values* are read on the device only (the caller
    keeps ``1 <= seq_lens[b] <= max_seq_len``, enough CSR pages per request, page IDs inside
    the cache, packed offsets within ``max_seq_len_q`` and, for causal masks, each request's
    query count <= its length). Values that break it fail closed: nothing is read out of
    bounds, such a request writes zeros (packed offsets outside the query rows: nothing).
    Capturable in a CUDA graph once this static key has run once.
    """
    traced = V.tracing()
    cache = V.cache_operands(kv_cache)
    # the operands in Standalone order: out, workspace_buffer, query, the cache's tensors, the metadata
    tensors = (out, workspace_buffer, query) + cache + (paged_kv_indptr, paged_kv_indices, seq_lens, qo_indptr)
    checked = V.checked_once(
        _CHECKED, tensors,
        (type(kv_cache), len(cache), max_seq_len, seq_len_q, max_seq_len_q, out_dtype, mask_type, window_left,
         kv_layout),
        _standalone_checks, query, kv_cache, workspace_buffer, paged_kv_indptr, paged_kv_indices, seq_lens,
        max_seq_len, seq_len_q, qo_indptr, max_seq_len_q, out_dtype, out, mask_type, window_left, kv_layout,
        traced=traced, loose=(len(cache) + 4,))
    sm_scale = V.fast_scale("bmm1_scale", bmm1_scale, 1.0 / math.sqrt(checked.head_dim))
    output_scale = V.fast_scale("bmm2_scale", bmm2_scale, None)
    if not traced:
        starts = checked.checks.check(tensors)
    if _dispatch.launchable(query, out, traced):
        if out is None:
            out = torch.empty(query.shape, dtype=checked.out_dtype, device=query.device)
        checked.launch_direct(
            query.device,
            lambda launch: launch.run(query, cache[0], cache[1] if len(cache) == 2 else None, workspace_buffer, out,
                                      paged_kv_indptr, paged_kv_indices, seq_lens, qo_indptr, sm_scale, output_scale),
            starts, out.data_ptr(), sm_scale, output_scale, paged_kv_indices.shape[0])
        return out
    k_cache, v_cache = split_cache(kv_cache)
    V.run_layout((("query", query), ("kv_cache", k_cache), ("kv_cache", v_cache)))  # per call: not in the key
    args = (paged_kv_indptr, paged_kv_indices, seq_lens, qo_indptr, checked.sq, checked.max_sq, max_seq_len,
            checked.mask_type, checked.window_left, sm_scale, output_scale)
    return _dispatch.call(torch.ops.prims_ts.batch_decode, torch.ops.prims_ts.batch_decode_out, _run,
                          (query, k_cache, v_cache, workspace_buffer), args, out, checked.out_dtype)


# ----------------------------------------------------------------------------
# Wrapper and one-shot
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """A planned decode: static facts, the bound and derived metadata, the workspace and the
    prepared launch."""

    static: object  # cuda.decode.DecodeStatic
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype
    q_shape: tuple
    geometry: tuple  # (Hkv, page_size, D)
    max_page: int
    kv_indptr: torch.Tensor  # bound: read live
    kv_indices: torch.Tensor  # bound: read live
    seq_lens: torch.Tensor  # derived at plan: (pages - 1) * page_size + last_page_len
    qo_indptr: Optional[torch.Tensor]  # bound: read live
    workspace: torch.Tensor
    launch: Optional[object]  # cuda.decode.PreparedDecode
    tuning_code: str

    @property
    def bound(self) -> tuple:
        return (("paged_kv_indptr", self.kv_indptr), ("paged_kv_indices", self.kv_indices),
                ("qo_indptr", self.qo_indptr), ("workspace_buffer", self.workspace))

    @property
    def default_scale(self) -> float:
        """bmm1_scale when run gets None: 1 / sqrt(D)."""
        return 1.0 / math.sqrt(self.geometry[2])


class BatchDecodePagedTSWrapper:
    """FlashInfer-style plan/run decode over CSR pages; owns its workspace.

    ``plan`` reads ``paged_kv_indptr`` and ``paged_kv_last_page_len`` (and ``qo_indptr``) once
    on the host, validates them, derives each request's length ``(pages - 1) * page_size +
    last_page_len`` into the plan's own device tensor, fixes ``max_kv_len`` (default: the
    longest request) and binds ``paged_kv_indptr``, ``paged_kv_indices`` and ``qo_indptr``:
    ``run`` reads their values on the device, so page IDs may be remapped in place between
    replays (the indptr and the last-page lengths must stay as planned; a change needs a new
    plan). ``run`` does no host synchronisation and allocates nothing when ``out`` is given.
    """

    def __init__(self, kv_layout: str = "HND", *, tuning: Optional[Tuning] = None):
        check_layout(kv_layout)
        self.kv_layout = kv_layout
        self.tuning, self._tuning_code = V.tuning(tuning)
        self._plan: Optional[DecodePlan] = None

    def plan(
        self,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        seq_len_q: int = 1,
        qo_indptr: Optional[torch.Tensor] = None,
        max_seq_len_q: Optional[int] = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: Optional[torch.dtype] = None,
        o_data_type: Optional[torch.dtype] = None,
        mask_type: str = "dense",
        window_left: int = -1,
        max_kv_len: Optional[int] = None,
    ) -> None:
        self._plan = self._make_plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                                     num_kv_heads, head_dim, page_size, seq_len_q, qo_indptr, max_seq_len_q,
                                     q_data_type, kv_data_type, o_data_type, mask_type, window_left, max_kv_len)

    def _make_plan(self, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
                   head_dim, page_size, seq_len_q, qo_indptr, max_seq_len_q, q_data_type, kv_data_type, o_data_type,
                   mask_type, window_left, max_kv_len, one_shot: bool = False) -> "DecodePlan":
        """The plan; a `one_shot`'s runs the shared prepared launch once, with a workspace of
        exactly what its policy needs."""
        V.int32_vector("paged_kv_indptr", paged_kv_indptr)
        if paged_kv_indptr.shape[0] < 2:
            V.fail(f"paged_kv_indptr: expected [B+1] with B >= 1, got shape {tuple(paged_kv_indptr.shape)}")
        batch = V.batch_size("paged_kv_indptr", paged_kv_indptr.shape[0] - 1)
        V.int32_vector("paged_kv_indices", paged_kv_indices)
        V.int32_vector("paged_kv_last_page_len", paged_kv_last_page_len, length=batch)
        for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
            V.integer(name, val, minimum=1)
        V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
        d = V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
        page_size = _check_page_size(page_size)
        dtype, odt = check_dtypes(q_data_type, kv_data_type, o_data_type)
        mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
        V.integer("seq_len_q", seq_len_q, minimum=1)
        packed = qo_indptr is not None
        if packed:
            V.int32_vector("qo_indptr", qo_indptr, length=batch + 1)
            if seq_len_q != 1:
                V.fail(f"seq_len_q: packed queries take their lengths from qo_indptr; leave seq_len_q at 1, "
                       f"got {seq_len_q}")
        if max_seq_len_q is not None:
            V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
            if not packed and max_seq_len_q != seq_len_q:
                V.fail(f"max_seq_len_q: {max_seq_len_q} contradicts the fixed query length seq_len_q={seq_len_q}")
        device = V.same_device([("paged_kv_indptr", paged_kv_indptr), ("paged_kv_indices", paged_kv_indices),
                                ("paged_kv_last_page_len", paged_kv_last_page_len), ("qo_indptr", qo_indptr)])
        if device.type == "meta":
            V.fail("paged_kv_indptr: plan reads the metadata values; got tensors on the meta device")
        if max_kv_len is not None:
            V.key_length_bound("max_kv_len", max_kv_len)
        ip, ids, last, *qo = V.host_values(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                                           *((qo_indptr,) if packed else ()))
        lens = check_csr_values(ip, ids.shape[0], last, page_size)
        check_page_ids("paged_kv_indices", ids, None)
        longest = int(lens.max())
        if max_kv_len is None:
            max_kv_len = V.key_length_bound("max_kv_len", longest)
        elif longest > max_kv_len:
            b = V.first(lens > max_kv_len)
            V.fail(f"max_kv_len: the planned KV metadata contains a request longer than max_kv_len ({max_kv_len}): "
                   f"got {int(lens[b])} (request {b})")
        if packed:
            V.values_indptr("qo_indptr", qo[0], None, "")
            q_lens = V.diff(qo[0])
            most = int(q_lens.max())
            if max_seq_len_q is None:
                max_seq_len_q = most
            elif most > max_seq_len_q:
                V.fail(f"max_seq_len_q: {max_seq_len_q} is below the largest query count in qo_indptr ({most})")
            q_shape = (int(qo[0][-1]), num_qo_heads, d)
        else:
            max_seq_len_q = seq_len_q
            q_lens = np.full(batch, seq_len_q, dtype=np.int64)
            q_shape = (batch, num_qo_heads, d) if seq_len_q == 1 else (batch, seq_len_q, num_qo_heads, d)
        if mask_type == "causal":
            bad = q_lens > lens
            if bad.any():
                b = V.first(bad)
                V.fail(f"paged_kv_last_page_len: causal decode requires every per-request Q length to be no greater "
                       f"than its K/V length; request {b} has Q={int(q_lens[b])} and K/V={int(lens[b])}")
        tuning, code = planned_tuning(self.tuning, self._tuning_code, lens, device, batch, num_kv_heads,
                                      num_qo_heads // num_kv_heads, max_seq_len_q, d, max_kv_len)
        need = _workspace_bytes(batch, num_qo_heads, num_kv_heads, d, max_kv_len, max_seq_len_q, device, tuning)
        static = decode_static(dtype, d, num_qo_heads, num_kv_heads, page_size, odt, packed, batch,
                               1 if packed else seq_len_q, max_seq_len_q, max_kv_len, mask_type, window_left,
                               tuning)
        launch = None
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            launch = K.prepared(static, device.index)  # loaded before any state changes
            if one_shot:
                need = launch.workspace_bytes
        ws = plan_workspace(need, device)
        (seq_lens,) = V.to_device(device, lens)
        if launch is not None and not one_shot:
            launch = _dispatch.plan_launch(launch, (paged_kv_indptr, paged_kv_indices, seq_lens, qo_indptr, ws))
        return DecodePlan(static, device, dtype, odt, q_shape, (num_kv_heads, page_size, d), int(ids.max()),
                          paged_kv_indptr, paged_kv_indices, seq_lens, qo_indptr, ws, launch, code)

    def run(self, q: torch.Tensor, paged_kv_cache: KVCache, *, bmm1_scale: Optional[float] = None,
            bmm2_scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        sm_scale = V.fast_scale("bmm1_scale", bmm1_scale, plan.default_scale)
        output_scale = V.fast_scale("bmm2_scale", bmm2_scale, None)
        o = _dispatch.fast_output(plan.launch, out, plan.q_shape, plan.out_dtype, plan.device)
        if o is not None:
            kv = paged_kv_cache
            k, v = kv if type(kv) is tuple and len(kv) == 2 else (kv, None)
            if plan.launch.again(q, k, v, o, sm_scale, output_scale):
                return o
        return _checked_launch(plan, q, paged_kv_cache, sm_scale, output_scale, out)


def _checked_launch(plan: "DecodePlan", q, cache, sm_scale: float, output_scale: float, out) -> torch.Tensor:
    """q and the cache against the plan (attribute compares; the precise error when they
    differ), then ``_launch``."""
    dev, dt = plan.device, plan.dtype
    kv = plan_cache(cache, plan.geometry, dt, dev, plan.max_page) if V.matches(q, plan.q_shape, dt, dev) else None
    if kv is None:
        _check_against_plan(plan, q, cache)
    return _launch(plan, q, cache, kv, sm_scale, output_scale, out)


def _launch(plan: "DecodePlan", q, cache, kv, sm_scale: float, output_scale: float, out) -> torch.Tensor:
    """A run's (or a one-shot's) launch of tensors checked against the plan (`kv`: the cache's
    K and V pools laid out as planned, else None): `out` checked, then the prepared kernel, or
    the op where a tracer, a mode or a subclass must see the call."""
    dev = plan.device
    if out is not None:
        V.out_tensor(out, plan.q_shape, plan.out_dtype, dev,
                     (("q", q),) + named_cache("paged_kv_cache", cache) + plan.bound)
    if kv is not None and plan.launch is not None and _dispatch.plain_eager(out):
        if out is None:
            out = torch.empty(plan.q_shape, dtype=plan.out_dtype, device=dev)
        plan.launch.run(q, kv[0], kv[1], plan.workspace, out, plan.kv_indptr, plan.kv_indices, plan.seq_lens,
                        plan.qo_indptr, sm_scale, output_scale)
        return out
    k_cache, v_cache = split_cache(cache, "paged_kv_cache")
    V.run_layout((("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache)))
    st = plan.static
    args = (plan.kv_indptr, plan.kv_indices, plan.seq_lens, plan.qo_indptr, st.seq_len_q, st.max_seq_len_q,
            st.max_seq_len, "causal" if st.causal else "dense", st.window_left, sm_scale, output_scale)
    return _dispatch.call(torch.ops.prims_ts.batch_decode, torch.ops.prims_ts.batch_decode_out, _run,
                          (q, k_cache, v_cache, _workspace(plan.workspace)), args, out, plan.out_dtype,
                          plan.tuning_code)


_NO_WORKSPACE = {}


def plan_workspace(need: int, device: torch.device) -> torch.Tensor:
    """A decode-shaped plan's workspace: `need` zeroed bytes, or (a policy that does not split)
    one empty tensor per device, shared (it holds nothing)."""
    if need:
        return torch.zeros(need, dtype=torch.uint8, device=device)
    ws = _NO_WORKSPACE.get(device)
    if ws is None:
        ws = _NO_WORKSPACE[device] = torch.empty(0, dtype=torch.uint8, device=device)
    return ws


def _workspace(ws: torch.Tensor) -> torch.Tensor:
    """A plan's workspace as a traced run uses it: while torch.compile / torch.export trace, a
    zeroed one the graph allocates (an op may not mutate a constant the graph lifts: AOTInductor
    refuses it); otherwise the plan's own."""
    return torch.zeros(ws.shape, dtype=ws.dtype, device=ws.device) if V.tracing() else ws


def _check_against_plan(plan: DecodePlan, q, cache) -> None:
    k_cache, v_cache = split_cache(cache, "paged_kv_cache")
    V.tensor("q", q, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if tuple(q.shape) != tuple(plan.q_shape):
        V.fail(f"q must have shape {tuple(plan.q_shape)} (the plan's), got {tuple(q.shape)}")
    if q.dtype != plan.dtype:
        V.fail(f"q: dtype {V._dtype_name(q.dtype)} must match the plan ({V._dtype_name(plan.dtype)})")
    if tuple(k_cache.shape[1:]) != plan.geometry:
        V.fail(f"paged_kv_cache: geometry does not match the plan: expected Hkv/page/D={plan.geometry}, got "
               f"{tuple(k_cache.shape[1:])}")
    if k_cache.dtype != plan.dtype:
        V.fail(f"paged_kv_cache: dtype {V._dtype_name(k_cache.dtype)} must match the plan "
               f"({V._dtype_name(plan.dtype)})")
    V.same_device([("q", q), ("paged_kv_cache", k_cache), ("paged_kv_cache", v_cache)])
    if q.device != plan.device:
        V.fail(f"q must be on the planned device {plan.device}, got {q.device}")
    if plan.max_page >= k_cache.shape[0]:
        V.fail(f"paged_kv_cache: the plan reads page ID {plan.max_page} but the cache holds {k_cache.shape[0]} pages")


def batch_decode_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache: KVCache,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    paged_kv_last_page_len: torch.Tensor,
    *,
    seq_len_q: int = 1,
    qo_indptr: Optional[torch.Tensor] = None,
    max_seq_len_q: Optional[int] = None,
    mask_type: str = "dense",
    window_left: int = -1,
    kv_layout: str = "HND",
    bmm1_scale: Optional[float] = None,
    bmm2_scale: float = 1.0,
    out: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """One-shot decode: a :class:`BatchDecodePagedTSWrapper` plan (which reads and validates the
    metadata on the host, every page ID against the cache included) and one launch (of the
    shared prepared kernel, with a workspace only where the policy splits).
    Not CUDA-graph capturable; plan a wrapper for that."""
    k_cache, _ = split_cache(paged_kv_cache, "paged_kv_cache")
    V.tensor("q", q, dtypes=V.INPUT_DTYPES)
    w = BatchDecodePagedTSWrapper(kv_layout)
    plan = w._make_plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, q.shape[-2], k_cache.shape[1],
                        q.shape[-1], k_cache.shape[2], seq_len_q, qo_indptr, max_seq_len_q, q.dtype, k_cache.dtype,
                        V.resolve_out_dtype(out_dtype, out, q), mask_type, window_left, None, one_shot=True)
    if plan.max_page >= k_cache.shape[0]:
        V.fail(f"paged_kv_indices: page ID {plan.max_page} is outside [0, {k_cache.shape[0]}); entries must index "
               "the physical page pool")
    return _checked_launch(plan, q, paged_kv_cache, V.fast_scale("bmm1_scale", bmm1_scale, plan.default_scale),
                           V.fast_scale("bmm2_scale", bmm2_scale, None), out)
