"""Paged decode: ``prims_ts_batch_decode_with_kv_cache`` and its companions.

Public: ``prims_ts_batch_decode_with_kv_cache`` (standalone, caller workspace, no
        host synchronisation, capturable), ``get_prims_ts_batch_decode_workspace_size``,
        ``BatchDecodePagedTSWrapper`` (plan/run, owns its workspace) and the one-shot
        ``batch_decode_with_paged_kv_cache``.
Ops:    ``torch.ops.prims_ts.batch_decode`` (functional) and
        ``torch.ops.prims_ts.batch_decode_out`` (writes ``out``); both use the workspace.
Fakes:  ``prims_ts/meta/decode.py``; CPU kernel: ``prims_ts.reference.batch_decode``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .. import reference
from . import _dispatch
from . import _validate as V
from .prefill_paged import PAGE_SIZES

MASKS = ("dense", "causal")
HEAD_DIMS = (64, 128, 256)
WORKSPACE_DTYPES = (torch.uint8, torch.int8)

KVCache = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
         max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale) -> None:
    if out.numel() == 0:
        return
    if query.device.type == "cuda":
        from ..cuda import kernels

        kernels.launch_decode(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr,
                              seq_len_q, max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale)
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
) -> None:
    """Writes decode attention into ``out`` (split-KV partials go through ``workspace``). Trusted arguments."""
    _run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
         max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale)


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
) -> torch.Tensor:
    """``batch_decode_out`` returning a new output tensor."""
    out = torch.empty(query.shape, dtype=V.code_dtype(out_dtype), device=query.device)
    _run(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr, seq_len_q,
         max_seq_len_q, max_seq_len, mask_type, window_left, sm_scale, output_scale)
    return out


# ----------------------------------------------------------------------------
# Workspace
# ----------------------------------------------------------------------------


def get_prims_ts_batch_decode_workspace_size(
    batch_size: int,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_seq_len: int,
    *,
    max_seq_len_q: int = 1,
    device: Optional[Union[torch.device, str]] = None,
) -> int:
    """Bytes of ``workspace_buffer`` that ``prims_ts_batch_decode_with_kv_cache`` needs for
    these static arguments on ``device`` (default: the current CUDA device, or the CPU).

    The size depends only on static arguments (and the device's SM count): the
    split-KV policy is chosen from them, never from metadata values.
    """
    from ..cuda.kernels import decode_policy, decode_workspace_bytes, device_limits

    for name, val in (("batch_size", batch_size), ("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                      ("max_seq_len_q", max_seq_len_q)):
        V.integer(name, val, minimum=1)
    group = V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
    V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
    V.key_length_bound("max_seq_len", max_seq_len)
    sms, limit = device_limits(device)
    pol = decode_policy(batch_size, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sms, limit)
    V.row_tiles("max_seq_len_q", num_kv_heads, pol.rows_max, pol.bm)
    return max(256, decode_workspace_bytes(batch_size, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len,
                                           sms, limit))


# ----------------------------------------------------------------------------
# Validation
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


def _check_layout(kv_layout) -> None:
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout: expected a str, got {type(kv_layout).__name__}")
    if kv_layout != "HND":
        V.fail(f"kv_layout: only 'HND' is supported, got {kv_layout!r}")


def _query_mode(query: torch.Tensor, qo_indptr, seq_len_q, max_seq_len_q) -> Tuple[int, int, int]:
    """(batch, seq_len_q, max_seq_len_q) of fixed [B,Hq,D] / [B,SQ,Hq,D] or packed [T,Hq,D] queries."""
    V.integer("seq_len_q", seq_len_q, minimum=1)
    if qo_indptr is not None:
        V.int32_vector("qo_indptr", qo_indptr)
        if qo_indptr.shape[0] < 2:
            V.fail(f"qo_indptr: expected [B+1] with B >= 1, got shape {tuple(qo_indptr.shape)}")
        if query.dim() != 3:
            V.fail(f"query: packed queries (qo_indptr given) are [total_q, Hq, D], got shape {tuple(query.shape)}")
        if max_seq_len_q is None:
            V.fail("max_seq_len_q: required with qo_indptr (the static bound of every request's query count)")
        V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        if seq_len_q != 1:
            V.fail(f"seq_len_q: packed queries take their lengths from qo_indptr; leave seq_len_q at 1, got {seq_len_q}")
        return qo_indptr.shape[0] - 1, 1, max_seq_len_q
    if seq_len_q == 1:
        if query.dim() != 3:
            V.fail(f"query: seq_len_q=1 expects [B, Hq, D], got shape {tuple(query.shape)}")
    else:
        if query.dim() != 4 or query.shape[1] != seq_len_q:
            V.fail(f"query: seq_len_q={seq_len_q} expects [B, {seq_len_q}, Hq, D], got shape {tuple(query.shape)}")
    if max_seq_len_q is not None:
        V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        if max_seq_len_q != seq_len_q:
            V.fail(f"max_seq_len_q: {max_seq_len_q} contradicts the fixed query length seq_len_q={seq_len_q}")
    if query.shape[0] < 1:
        V.fail(f"query: needs at least one request, got shape {tuple(query.shape)}")
    return query.shape[0], seq_len_q, seq_len_q


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

    No device-to-host synchronisation: shapes, dtypes, devices, the workspace size
    and scalar arguments are checked here; metadata *values* are trusted (the
    caller keeps ``1 <= seq_lens[b] <= max_seq_len``, enough CSR pages per request,
    page IDs inside the cache, packed offsets within ``max_seq_len_q`` and, for
    causal masks, each request's query count <= its length). Capturable in a CUDA
    graph once this static key has run once.
    """
    _check_layout(kv_layout)
    k_cache, v_cache = split_cache(kv_cache)
    V.tensor("query", query, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if query.dtype != k_cache.dtype:
        V.fail(f"query: dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    batch, sq, max_sq = _query_mode(query, qo_indptr, seq_len_q, max_seq_len_q)
    V.batch_size("qo_indptr" if qo_indptr is not None else "query", batch)
    num_pages, hkv, page_size, d = k_cache.shape
    if page_size not in PAGE_SIZES:
        V.fail(f"kv_cache: page size {page_size} is not supported; expected one of {', '.join(map(str, PAGE_SIZES))}")
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
    sm_scale = V.scale("bmm1_scale", bmm1_scale, default=1.0 / math.sqrt(d))
    output_scale = V.scale("bmm2_scale", bmm2_scale)
    metadata = [("paged_kv_indptr", paged_kv_indptr), ("paged_kv_indices", paged_kv_indices),
                ("seq_lens", seq_lens), ("qo_indptr", qo_indptr)]
    device = V.same_device([("query", query), ("kv_cache", k_cache), ("kv_cache", v_cache),
                            ("workspace_buffer", workspace_buffer)]
                           + metadata)
    V.tensor("workspace_buffer", workspace_buffer, dtypes=WORKSPACE_DTYPES, contiguous=True)
    V.start_aligned("workspace_buffer", workspace_buffer)
    need = get_prims_ts_batch_decode_workspace_size(batch, hq, hkv, d, max_seq_len, max_seq_len_q=max_sq,
                                                    device=device)
    have = workspace_buffer.numel() * workspace_buffer.element_size()
    if have < need:
        V.fail(f"workspace_buffer: {have} bytes are too few; this key needs {need} "
               "(get_prims_ts_batch_decode_workspace_size)")
    odt = V.out_dtype(out_dtype, out, query.dtype)
    if out_dtype is not None and out is not None and out.dtype != out_dtype:
        V.fail(f"out: dtype {out.dtype} disagrees with out_dtype {out_dtype}")
    inputs = [("query", query), ("kv_cache", k_cache), ("kv_cache", v_cache),
              ("workspace_buffer", workspace_buffer)] + metadata
    V.out_tensor(out, query.shape, odt, device, inputs)
    if not V.tracing():
        V.disjoint("workspace_buffer", workspace_buffer, [i for i in inputs if i[0] != "workspace_buffer"])
    args = (paged_kv_indptr, paged_kv_indices, seq_lens, qo_indptr, sq, max_sq, max_seq_len, mask_type, window_left,
            sm_scale, output_scale)
    return _dispatch.call(torch.ops.prims_ts.batch_decode, torch.ops.prims_ts.batch_decode_out, _run,
                          (query, k_cache, v_cache, workspace_buffer), args, out, odt)


# ----------------------------------------------------------------------------
# Wrapper and one-shot
# ----------------------------------------------------------------------------


class BatchDecodePagedTSWrapper:
    """FlashInfer-style plan/run decode over CSR pages; owns its workspace.

    ``plan`` takes the CSR ``indptr``/``indices`` and ``last_page_len`` (the K/V
    length is ``(pages - 1) * page_size + last_page_len``), reads them once to
    validate and fix ``max_seq_len``, and binds the same tensors. ``run`` derives
    the live lengths on the device from the bound tensors (so a replay after the
    caller rewrites them in place, within the planned bounds, is correct), does
    no host synchronisation, and allocates nothing when ``out`` is given.
    """

    def __init__(self, device: Optional[Union[torch.device, str]] = None):
        self.device = torch.device(device) if device is not None else None
        self._plan = None

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        mask_type: str = "dense",
        window_left: int = -1,
        sm_scale: Optional[float] = None,
        output_scale: float = 1.0,
        max_seq_len: Optional[int] = None,
        q_data_type: torch.dtype = torch.bfloat16,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        V.int32_vector("indptr", indptr)
        if indptr.shape[0] < 2:
            V.fail(f"indptr: expected [B+1] with B >= 1, got shape {tuple(indptr.shape)}")
        batch = indptr.shape[0] - 1
        V.int32_vector("indices", indices)
        V.int32_vector("last_page_len", last_page_len, length=batch)
        device = V.same_device([("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)])
        V.integer("page_size", page_size)
        if page_size not in PAGE_SIZES:
            V.fail(f"page_size: {page_size} is not supported; expected one of {', '.join(map(str, PAGE_SIZES))}")
        for name, val in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
            V.integer(name, val, minimum=1)
        V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
        d = V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
        V.input_dtype("q_data_type", q_data_type)
        mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
        sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(d))
        output_scale = V.scale("output_scale", output_scale)
        odt = V.out_dtype(out_dtype, None, q_data_type)
        ip, last = indptr.tolist(), last_page_len.tolist()
        V.values_indptr("indptr", ip, indices.shape[0], "indices.numel()")
        lens = []
        for b in range(batch):
            if not 1 <= last[b] <= page_size:
                V.fail(f"last_page_len: request {b} has {last[b]}; expected 1 <= last_page_len <= page_size")
            lens.append((ip[b + 1] - ip[b] - 1) * page_size + last[b])
        if indices.numel() and int(indices.min()) < 0:
            V.fail("indices: page IDs must be >= 0")
        if mask_type == "causal" and min(lens) < 1:
            V.fail("last_page_len: every request needs at least one key")
        longest = max(lens)
        if max_seq_len is None:
            max_seq_len = longest
        V.key_length_bound("max_seq_len", max_seq_len)
        if max_seq_len < longest:
            V.fail(f"max_seq_len: {max_seq_len} is below the longest planned request ({longest})")
        dev = self.device or device
        from ..cuda import kernels

        # the kernel compiled and loaded now, not in run (before any state changes: a failed plan
        # leaves the previous one whole)
        kernels.warm_decode(dev, q_data_type, d, mask_type == "causal", batch, num_kv_heads,
                            num_qo_heads // num_kv_heads, 1, max_seq_len)
        ws = torch.zeros(get_prims_ts_batch_decode_workspace_size(batch, num_qo_heads, num_kv_heads, d, max_seq_len,
                                                                  device=dev), dtype=torch.uint8, device=dev)
        self._plan = dict(batch=batch, hq=num_qo_heads, hkv=num_kv_heads, d=d, page_size=page_size,
                          mask_type=mask_type, window_left=window_left, sm_scale=sm_scale,
                          output_scale=output_scale, max_seq_len=max_seq_len, dtype=q_data_type, out_dtype=odt,
                          max_page=int(indices.max()) if indices.numel() else -1)
        self._meta = (indptr, indices, last_page_len)
        self._seq_lens = torch.empty(batch, dtype=torch.int32, device=dev)
        self._workspace = ws

    def _live_seq_lens(self) -> torch.Tensor:
        """(pages - 1) * page_size + last_page_len, computed on the device into a planned buffer."""
        indptr, _, last = self._meta
        s = self._seq_lens
        torch.sub(indptr[1:], indptr[:-1], out=s)
        s.sub_(1).mul_(self._plan["page_size"]).add_(last)
        return s

    def run(self, q: torch.Tensor, paged_kv_cache: KVCache, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchDecodePagedTSWrapper.run: call plan(...) first")
        k_cache, _ = split_cache(paged_kv_cache, "paged_kv_cache")
        if q.dim() != 3 or tuple(q.shape) != (plan["batch"], plan["hq"], plan["d"]):
            V.fail(f"q: expected [B, Hq, D] = {(plan['batch'], plan['hq'], plan['d'])}, got {tuple(q.shape)}")
        if q.dtype != plan["dtype"]:
            V.fail(f"q: dtype {q.dtype} differs from the planned q_data_type {plan['dtype']}")
        if k_cache.shape[2] != plan["page_size"] or k_cache.shape[1] != plan["hkv"]:
            V.fail(f"paged_kv_cache: page size / heads {tuple(k_cache.shape[1:3])} differ from the plan "
                   f"({plan['hkv']}, {plan['page_size']})")
        if plan["max_page"] >= k_cache.shape[0]:
            V.fail(f"paged_kv_cache: the plan uses page ID {plan['max_page']} but the cache holds "
                   f"{k_cache.shape[0]} pages")
        indptr, indices, last = self._meta
        if out is not None and not V.tracing():
            V.disjoint("out", out, [("indptr", indptr), ("indices", indices), ("last_page_len", last)])
        return prims_ts_batch_decode_with_kv_cache(
            q, paged_kv_cache, self._workspace, indptr, indices, self._live_seq_lens(), plan["max_seq_len"],
            bmm1_scale=plan["sm_scale"], bmm2_scale=plan["output_scale"], out=out, out_dtype=plan["out_dtype"],
            mask_type=plan["mask_type"], window_left=plan["window_left"])


def batch_decode_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache: KVCache,
    paged_kv_indptr: torch.Tensor,
    paged_kv_indices: torch.Tensor,
    paged_kv_last_page_len: torch.Tensor,
    *,
    mask_type: str = "dense",
    window_left: int = -1,
    sm_scale: Optional[float] = None,
    output_scale: float = 1.0,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One-shot decode (``q`` ``[B, Hq, D]``): plans a temporary wrapper (reads and validates
    the metadata on the host, including every page ID against the cache) and runs it.
    Not CUDA-graph capturable; plan a :class:`BatchDecodePagedTSWrapper` for that."""
    k_cache, _ = split_cache(paged_kv_cache, "paged_kv_cache")
    V.tensor("q", q, dtypes=V.INPUT_DTYPES, ndim=3)
    for name, t in (("paged_kv_indptr", paged_kv_indptr), ("paged_kv_indices", paged_kv_indices),
                    ("paged_kv_last_page_len", paged_kv_last_page_len)):
        V.tensor(name, t)  # named as this function's arguments (plan checks dtypes and shapes)
    w = BatchDecodePagedTSWrapper(q.device)
    w.plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, q.shape[1], k_cache.shape[1], q.shape[2],
           k_cache.shape[2], mask_type=mask_type, window_left=window_left, sm_scale=sm_scale,
           output_scale=output_scale, q_data_type=q.dtype, out_dtype=out_dtype if out_dtype is not None else (
               out.dtype if isinstance(out, torch.Tensor) else None))
    # the metadata are int32 tensors now (plan checked them); their page IDs against this cache
    if paged_kv_indices.numel() and not V.tracing():
        hi = int(paged_kv_indices.max())
        if hi >= k_cache.shape[0]:
            V.fail(f"paged_kv_indices: page ID {hi} is outside [0, {k_cache.shape[0]})")
    return w.run(q, paged_kv_cache, out=out)
