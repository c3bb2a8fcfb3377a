"""MLA decode: ``batch_mla_decode_with_paged_kv_cache`` and its companions (SPEC §4, seed 004).

Public: ``batch_mla_decode_with_paged_kv_cache`` (one-shot: reads metadata on the host,
        not capturable), ``BatchMLADecodePagedTSWrapper`` (plan/run; ``run(validate=False)``
        is capturable), ``prims_ts_batch_decode_with_kv_cache_mla`` (standalone, caller
        workspace, no host synchronisation, capturable) and
        ``get_prims_ts_batch_decode_mla_workspace_size``.
Ops:    ``torch.ops.prims_ts.batch_mla_decode`` (functional) and
        ``torch.ops.prims_ts.batch_mla_decode_out`` (writes ``out``); both use the workspace.
Fakes:  ``prims_ts/meta/mla.py``; CPU kernel: ``prims_ts.reference.batch_mla_decode``.

Layout: queries ``[B, SQ, H, 576]`` (fixed) or ``[total_q, H, 576]`` (packed, with
``qo_indptr``); a latent cache ``[P, page_size, 576]`` or ``[P, 1, page_size, 576]`` holding one
row per token shared by all H heads (K = the 576-wide row, V = its first 512 values); a dense
page table ``block_tables int32 [B, C]``; ``seq_lens int32 [B]``; output ``[..., 512]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .. import reference
from . import _dispatch
from . import _validate as V
from .decode import WORKSPACE_DTYPES
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


def _run(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len, mask_type,
         sm_scale, output_scale) -> None:
    if out.numel() == 0:
        return
    if query.device.type == "cuda":
        from ..cuda import kernels

        seq_len_q = 1 if qo_indptr is not None else query.shape[1]
        kernels.launch_mla(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, seq_len_q,
                           max_seq_len_q, max_seq_len, mask_type == "causal", sm_scale, output_scale)
    else:
        out.copy_(reference.batch_mla_decode(
            query, kv_cache, block_tables, seq_lens, qo_indptr=qo_indptr, mask_type=mask_type, sm_scale=sm_scale,
            output_scale=output_scale, compute_dtype=torch.float32))


def out_shape(query: torch.Tensor) -> Tuple[int, ...]:
    """``[B, SQ, H, 512]`` / ``[total_q, H, 512]`` for a ``[..., 576]`` query."""
    return tuple(query.shape[:-1]) + (DIM_V,)


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
) -> None:
    """Writes MLA decode attention into ``out`` ``[..., 512]`` (split-KV partials go through
    ``workspace``). ``kv_cache`` is the 3-D ``[P, page_size, 576]`` pool. Trusted arguments."""
    _run(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len, mask_type,
         sm_scale, output_scale)


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
) -> torch.Tensor:
    """``batch_mla_decode_out`` returning a new ``[..., 512]`` output tensor."""
    out = torch.empty(out_shape(query), dtype=V.code_dtype(out_dtype), device=query.device)
    _run(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, max_seq_len_q, max_seq_len, mask_type,
         sm_scale, output_scale)
    return out


# ----------------------------------------------------------------------------
# Workspace
# ----------------------------------------------------------------------------


def _check_num_heads(name: str, h) -> int:
    if h not in NUM_HEADS:
        V.fail(f"{name}: {h} heads are not supported; expected one of {', '.join(map(str, NUM_HEADS))}")
    return h


def get_prims_ts_batch_decode_mla_workspace_size(
    batch_size: int,
    num_heads: int,
    max_seq_len: int,
    max_seq_len_q: int = 1,
    device: Optional[Union[torch.device, str]] = None,
) -> int:
    """Bytes of ``workspace_buffer`` that ``prims_ts_batch_decode_with_kv_cache_mla`` needs for
    these static arguments on ``device`` (default: the current CUDA device, or the CPU).

    Depends only on static arguments and the device's SM count (the split-KV policy is
    chosen from them, never from metadata values); never shrinks as ``max_seq_len`` or
    ``max_seq_len_q`` grows. At least 256.
    """
    from ..cuda.kernels import decode_policy, device_limits, mla_workspace_bytes

    V.integer("batch_size", batch_size, minimum=1)
    _check_num_heads("num_heads", V.integer("num_heads", num_heads))
    V.key_length_bound("max_seq_len", max_seq_len)
    V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
    sms, limit = device_limits(device)
    pol = decode_policy(batch_size, 1, num_heads, max_seq_len_q, DIM_QK, max_seq_len, sms, limit)
    V.row_tiles("max_seq_len_q", 1, pol.rows_max, pol.bm)
    return max(256, int(mla_workspace_bytes(batch_size, num_heads, max_seq_len_q, max_seq_len, sms, limit)))


# ----------------------------------------------------------------------------
# Static validation (no tensor values are read)
# ----------------------------------------------------------------------------


def _check_ranks(kv_lora_rank, qk_rope_head_dim) -> None:
    V.integer("kv_lora_rank", kv_lora_rank)
    V.integer("qk_rope_head_dim", qk_rope_head_dim)
    if kv_lora_rank != KV_LORA_RANK:
        V.fail(f"kv_lora_rank: only {KV_LORA_RANK} is supported (with qk_rope_head_dim {QK_ROPE_HEAD_DIM}), "
               f"got {kv_lora_rank}")
    if qk_rope_head_dim != QK_ROPE_HEAD_DIM:
        V.fail(f"qk_rope_head_dim: only {QK_ROPE_HEAD_DIM} is supported (with kv_lora_rank {KV_LORA_RANK}), "
               f"got {qk_rope_head_dim}")


def _query_mode(query, qo_indptr, max_seq_len_q, require_max_seq_len_q: bool) -> Tuple[int, Optional[int], bool]:
    """(batch, max_seq_len_q, packed) of a fixed ``[B, SQ, H, 576]`` or packed ``[T, H, 576]`` query.

    Packed: ``max_seq_len_q`` is returned as given (None allowed unless required). Fixed: it
    defaults to SQ and, when given, must equal it."""
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
                V.fail("max_seq_len_q: required with qo_indptr (the static bound of every request's query count)")
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
        V.fail(f"{name}: page size {cache.shape[1]} is not supported; expected one of "
               f"{', '.join(map(str, PAGE_SIZES))}")
    V.tensor(name, kv_cache, vector_aligned=True)  # after the shape checks: their message comes first
    if cache.shape[0] < 1:
        V.fail(f"{name}: the cache holds no page")
    V.pool_strides(name, cache, slot_dim=1)
    return cache


def _resolve_out_dtype(out_dtype, out) -> torch.dtype:
    """The output dtype. ``out_dtype`` defaults to bfloat16 (the seed's signature), so with ``out``
    given and ``out_dtype`` left at bfloat16 (or None), ``out.dtype`` decides; any other
    ``out_dtype`` must agree with ``out.dtype``."""
    if out_dtype is None or (isinstance(out, torch.Tensor) and out_dtype == DEFAULT_OUT_DTYPE):
        return V.out_dtype(None, out, DEFAULT_OUT_DTYPE)
    odt = V.out_dtype(out_dtype, None, DEFAULT_OUT_DTYPE)
    if isinstance(out, torch.Tensor) and out.dtype != odt:
        V.fail(f"out: dtype {out.dtype} disagrees with out_dtype {odt}")
    return odt


@dataclass
class _Call:
    """A statically validated standalone call, ready to dispatch."""

    query: torch.Tensor
    cache: torch.Tensor  # 3-D [P, page_size, 576]
    workspace: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: Optional[torch.Tensor]
    max_seq_len_q: int
    max_seq_len: int
    mask_type: str
    sm_scale: float
    output_scale: float
    out: Optional[torch.Tensor]
    out_dtype: torch.dtype

    def launch(self) -> torch.Tensor:
        args = (self.block_tables, self.seq_lens, self.qo_indptr, self.max_seq_len_q, self.max_seq_len,
                self.mask_type, self.sm_scale, self.output_scale)
        return _dispatch.call(torch.ops.prims_ts.batch_mla_decode, torch.ops.prims_ts.batch_mla_decode_out, _run,
                              (self.query, self.cache, self.workspace), args, self.out, self.out_dtype,
                              out_shape=out_shape(self.query))


def _prepare(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, qo_indptr, max_seq_len_q,
             kv_lora_rank, qk_rope_head_dim, mask_type, bmm1_scale, bmm2_scale, out, out_dtype) -> _Call:
    """Every static check of the standalone call (shapes, dtypes, devices, workspace, scalars, out)."""
    _check_ranks(kv_lora_rank, qk_rope_head_dim)
    batch, max_sq, _ = _query_mode(query, qo_indptr, max_seq_len_q, require_max_seq_len_q=True)
    h = _query_heads(query)
    cache = latent_cache(kv_cache)
    if query.dtype != cache.dtype:
        V.fail(f"query: dtype {query.dtype} differs from the kv_cache's {cache.dtype}")
    V.block_table("block_tables", block_tables, batch)
    V.int32_vector("seq_lens", seq_lens, length=batch)
    V.key_length_bound("max_seq_len", max_seq_len)
    mask_type = V.choice("mask_type", mask_type, MASKS)
    sm_scale = V.scale("bmm1_scale", bmm1_scale)
    output_scale = V.scale("bmm2_scale", bmm2_scale)
    metadata = [("block_tables", block_tables), ("seq_lens", seq_lens), ("qo_indptr", qo_indptr)]
    device = V.same_device([("query", query), ("kv_cache", cache), ("workspace_buffer", workspace_buffer)]
                           + metadata)
    V.tensor("workspace_buffer", workspace_buffer, dtypes=WORKSPACE_DTYPES, contiguous=True)
    V.start_aligned("workspace_buffer", workspace_buffer)
    need = get_prims_ts_batch_decode_mla_workspace_size(batch, h, max_seq_len, max_sq, device=device)
    have = workspace_buffer.numel() * workspace_buffer.element_size()
    if have < need:
        V.fail(f"workspace_buffer: {have} bytes are too few; this key needs {need} "
               "(get_prims_ts_batch_decode_mla_workspace_size)")
    odt = _resolve_out_dtype(out_dtype, out)
    inputs = [("query", query), ("kv_cache", cache), ("workspace_buffer", workspace_buffer)] + metadata
    V.out_tensor(out, out_shape(query), odt, device, inputs, aligned=True)
    if not V.tracing():
        V.disjoint("workspace_buffer", workspace_buffer, [i for i in inputs if i[0] != "workspace_buffer"])
    return _Call(query, cache, workspace_buffer, block_tables, seq_lens, qo_indptr, max_sq, max_seq_len, mask_type,
                 sm_scale, output_scale, out, odt)


def prims_ts_batch_decode_with_kv_cache_mla(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    max_seq_len_q: Optional[int] = None,
    kv_lora_rank: int = KV_LORA_RANK,
    qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
    mask_type: str = "causal",
    bmm1_scale: float = 1.0,
    bmm2_scale: float = 1.0,
    out: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = DEFAULT_OUT_DTYPE,
) -> torch.Tensor:
    """Fixed ``[B, SQ, H, 576]`` or packed ``[total_q, H, 576]`` (+ ``qo_indptr`` and a required
    ``max_seq_len_q``) MLA decode over a paged latent cache with caller-owned workspace.

    No device-to-host synchronisation: shapes, dtypes, devices, the workspace size and scalar
    arguments are checked here; metadata *values* are trusted (the caller keeps
    ``1 <= seq_lens[b] <= min(max_seq_len, block_tables.shape[1] * page_size)``, the used page
    IDs inside the cache, ``qo_indptr`` starting at 0, increasing by at most ``max_seq_len_q``
    and ending at ``total_q``, and, for causal masks, each request's query count <= its
    length). ``workspace_buffer`` (uint8/int8, contiguous, at least
    ``get_prims_ts_batch_decode_mla_workspace_size(B, H, max_seq_len, max_seq_len_q)`` bytes)
    is zeroed before its first use and left reusable for the next launch of the same key.
    Capturable in a CUDA graph once this static key has run once.

    ``kv_cache`` is ``[P, page_size, 576]`` or ``[P, 1, page_size, 576]``; the output is
    ``query.shape[:-1] + (512,)`` in ``out.dtype`` when ``out`` is given (an ``out_dtype`` other
    than the default bfloat16 must agree with it), else in ``out_dtype``.
    """
    return _prepare(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, qo_indptr, max_seq_len_q,
                    kv_lora_rank, qk_rope_head_dim, mask_type, bmm1_scale, bmm2_scale, out, out_dtype).launch()


# ----------------------------------------------------------------------------
# Host checks of metadata values (plan, run(validate=True), the one-shot)
# ----------------------------------------------------------------------------


def _values_qo(qo: List[int], end: Optional[int]) -> List[int]:
    """Per-request query counts of a packed ``qo_indptr``: starts at 0, strictly increasing,
    ends at ``end`` (the query's row count) when given."""
    V.values_indptr("qo_indptr", qo, qo[-1] if end is None else end, "query.shape[0]")
    return [qo[i + 1] - qo[i] for i in range(len(qo) - 1)]


def _values_lens(lens: List[int], bound: int, bound_name: str) -> None:
    for b, sk in enumerate(lens):
        if sk < 1 or sk > bound:
            V.fail(f"seq_lens: request {b} has length {sk}; expected 1 <= length <= {bound_name} = {bound}")


def _values_causal(q_lens: Sequence[int], lens: Sequence[int]) -> None:
    for b, (sq, sk) in enumerate(zip(q_lens, lens)):
        if sq > sk:
            V.fail(f"seq_lens: request {b} has length {sk}, shorter than its {sq} queries; mask_type='causal' "
                   "needs each request's query count <= its length")


# ----------------------------------------------------------------------------
# Wrapper and one-shot
# ----------------------------------------------------------------------------


@dataclass
class _Plan:
    batch: int
    num_heads: int
    page_size: int
    packed: bool
    max_seq_len_q: int
    max_kv_len: int
    mask_type: str
    sm_scale: float
    output_scale: float
    dtype: torch.dtype
    out_dtype: torch.dtype


class BatchMLADecodePagedTSWrapper:
    """Plan/run MLA decode over a paged latent cache.

    ``workspace_buffer`` (optional, uint8/int8, contiguous): scratch for split-KV partials,
    as FlashInfer wrappers take it. Without one the wrapper allocates and owns its own.
    ``plan`` checks that the buffer is large enough for the planned key and zeroes the bytes
    it needs (the buffer must not be used by anything else while the plan is live).

    ``plan`` reads ``seq_lens`` (and ``qo_indptr``) once on the host, validates them and fixes
    the bounds: batch, heads, page size, query mode and ``max_seq_len_q``, ``max_kv_len``, the
    mask, the scales and the dtypes. It binds no tensor: the metadata it reads may live on the
    host when the wrapper's device is known (``workspace_buffer`` or ``device=``); otherwise the
    wrapper's own workspace goes to the metadata's device. ``run`` takes the live metadata tensors:

    * ``validate=True`` (default) reads them on the host and checks them against the plan and
      the cache: ``1 <= seq_lens[b] <= min(max_kv_len, block_tables.shape[1] * page_size)``,
      every used page ID in ``[0, P)``, ``qo_indptr`` well formed with counts <= ``max_seq_len_q``
      and ending at the query's row count, and (causal) each query count <= its length. It
      synchronises with the device (not capturable); under torch.compile tracing the values
      cannot be read and are trusted.
    * ``validate=False`` trusts them: no host synchronisation, no allocation when ``out`` is
      given, CUDA-graph capturable after one warm-up run; replays may change lengths, page IDs
      and (packed) query offsets in place within the planned bounds.
    """

    def __init__(self, workspace_buffer: Optional[torch.Tensor] = None, *,
                 device: Optional[Union[torch.device, str]] = None):
        if workspace_buffer is not None:
            V.tensor("workspace_buffer", workspace_buffer, dtypes=WORKSPACE_DTYPES, contiguous=True)
            V.start_aligned("workspace_buffer", workspace_buffer)
            if device is not None and torch.device(device) != workspace_buffer.device:
                V.fail(f"device: {device} differs from workspace_buffer's device {workspace_buffer.device}")
            device = workspace_buffer.device
        self.device = torch.device(device) if device is not None else None
        self._user_workspace = workspace_buffer
        self._workspace: Optional[torch.Tensor] = None
        self._plan: Optional[_Plan] = None

    @property
    def workspace_buffer(self) -> Optional[torch.Tensor]:
        """The buffer ``run`` uses (the caller's, or the one the wrapper allocated at plan)."""
        return self._workspace if self._workspace is not None else self._user_workspace

    def plan(
        self,
        seq_lens: torch.Tensor,
        num_heads: int,
        page_size: int,
        *,
        qo_indptr: Optional[torch.Tensor] = None,
        max_seq_len_q: Optional[int] = None,
        max_kv_len: Optional[int] = None,
        kv_lora_rank: int = KV_LORA_RANK,
        qk_rope_head_dim: int = QK_ROPE_HEAD_DIM,
        mask_type: str = "causal",
        bmm1_scale: float = 1.0,
        bmm2_scale: float = 1.0,
        q_data_type: torch.dtype = torch.bfloat16,
        out_dtype: torch.dtype = DEFAULT_OUT_DTYPE,
    ) -> None:
        """Fixed queries ``[B, SQ, H, 576]`` (``qo_indptr`` None; SQ = ``max_seq_len_q``, default 1)
        or packed ``[total_q, H, 576]`` (``qo_indptr`` given; ``max_seq_len_q`` defaults to its
        largest delta and may be larger). ``max_kv_len`` defaults to ``max(seq_lens)`` and may be
        larger (room for growing requests between replays)."""
        _check_ranks(kv_lora_rank, qk_rope_head_dim)
        V.int32_vector("seq_lens", seq_lens)
        batch = seq_lens.shape[0]
        if batch < 1:
            V.fail("seq_lens: expected at least one request, got shape [0]")
        packed = qo_indptr is not None
        if packed:
            V.int32_vector("qo_indptr", qo_indptr, length=batch + 1)
        device = V.same_device([("seq_lens", seq_lens), ("qo_indptr", qo_indptr)])
        if device.type == "meta":
            V.fail("seq_lens: plan reads the metadata values; got tensors on the meta device")
        _check_num_heads("num_heads", V.integer("num_heads", num_heads))
        V.integer("page_size", page_size)
        if page_size not in PAGE_SIZES:
            V.fail(f"page_size: {page_size} is not supported; expected one of {', '.join(map(str, PAGE_SIZES))}")
        mask_type = V.choice("mask_type", mask_type, MASKS)
        sm_scale = V.scale("bmm1_scale", bmm1_scale)
        output_scale = V.scale("bmm2_scale", bmm2_scale)
        V.input_dtype("q_data_type", q_data_type)
        odt = _resolve_out_dtype(out_dtype, None)
        if max_kv_len is not None:
            V.key_length_bound("max_kv_len", max_kv_len)
        if max_seq_len_q is not None:
            V.integer("max_seq_len_q", max_seq_len_q, minimum=1)
        # metadata values: read once
        lens = seq_lens.tolist()
        if max_kv_len is None:
            _values_lens(lens, V.MAX_SEQ_LEN_BOUND, "the supported bound")
            max_kv_len = max(lens)
        else:
            _values_lens(lens, max_kv_len, "max_kv_len")
        if packed:
            q_lens = _values_qo(qo_indptr.tolist(), None)
            if max_seq_len_q is None:
                max_seq_len_q = max(q_lens)
            elif max_seq_len_q < max(q_lens):
                V.fail(f"max_seq_len_q: {max_seq_len_q} is below the largest query count in qo_indptr "
                       f"({max(q_lens)})")
        else:
            max_seq_len_q = 1 if max_seq_len_q is None else max_seq_len_q
            q_lens = [max_seq_len_q] * batch
        if mask_type == "causal":
            _values_causal(q_lens, lens)
        from ..cuda import kernels

        # the kernel compiled and loaded now, not in run (before any state changes)
        kernels.warm_decode(self.device or device, q_data_type, DIM_QK, mask_type == "causal", batch, 1, num_heads,
                            max_seq_len_q, max_kv_len)
        self._allocate(batch, num_heads, max_kv_len, max_seq_len_q, self.device or device)
        self._plan = _Plan(batch, num_heads, page_size, packed, max_seq_len_q, max_kv_len, mask_type, sm_scale,
                           output_scale, q_data_type, odt)

    def _allocate(self, batch: int, num_heads: int, max_kv_len: int, max_seq_len_q: int,
                  device: torch.device) -> None:
        need = get_prims_ts_batch_decode_mla_workspace_size(batch, num_heads, max_kv_len, max_seq_len_q,
                                                            device=device)
        ws = self._user_workspace
        if ws is not None:
            have = ws.numel() * ws.element_size()
            if have < need:
                V.fail(f"workspace_buffer: {have} bytes are too few for this plan; it needs {need} "
                       "(get_prims_ts_batch_decode_mla_workspace_size)")
            ws.view(-1).view(torch.uint8)[:need].zero_()
            self._workspace = ws
            return
        ws = self._workspace
        if ws is not None and ws.device == device and ws.numel() >= need:
            ws.zero_()
        else:
            self._workspace = torch.zeros(need, dtype=torch.uint8, device=device)

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        qo_indptr: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        validate: bool = True,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchMLADecodePagedTSWrapper.run: call plan(...) first")
        if not isinstance(validate, bool):
            raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
        if plan.packed and qo_indptr is None:
            V.fail("qo_indptr: the plan is for packed queries [total_q, H, 576]; pass the live qo_indptr")
        if not plan.packed and qo_indptr is not None:
            V.fail("qo_indptr: the plan is for fixed queries [B, SQ, H, 576]; qo_indptr must be None")
        V.tensor("query", query, dtypes=V.INPUT_DTYPES)
        ws = self.workspace_buffer
        if query.device != ws.device:
            V.fail(f"query: is on {query.device} but the wrapper's workspace is on {ws.device} (plan with metadata "
                   "on the query's device, or construct the wrapper with device= or workspace_buffer=)")
        if query.dtype != plan.dtype:
            V.fail(f"query: dtype {query.dtype} differs from the planned q_data_type {plan.dtype}")
        if query.dim() >= 2 and query.shape[-2] != plan.num_heads:
            V.fail(f"query: {query.shape[-2]} heads differ from the planned num_heads {plan.num_heads}")
        if not plan.packed and query.dim() == 4 and query.shape[1] != plan.max_seq_len_q:
            V.fail(f"query: SQ = {query.shape[1]} differs from the planned max_seq_len_q {plan.max_seq_len_q}")
        cache = latent_cache(kv_cache)
        if cache.shape[1] != plan.page_size:
            V.fail(f"kv_cache: page size {cache.shape[1]} differs from the planned page_size {plan.page_size}")
        V.int32_vector("seq_lens", seq_lens, length=plan.batch)
        if isinstance(out, torch.Tensor) and out.dtype != plan.out_dtype:
            V.fail(f"out: dtype {out.dtype} differs from the planned out_dtype {plan.out_dtype}")
        call = _prepare(query, kv_cache, ws, block_tables, seq_lens, plan.max_kv_len, qo_indptr,
                        plan.max_seq_len_q if plan.packed else None, KV_LORA_RANK, QK_ROPE_HEAD_DIM, plan.mask_type,
                        plan.sm_scale, plan.output_scale, out, plan.out_dtype)
        if validate and not V.tracing():
            self._check_live_values(query, cache, block_tables, seq_lens, qo_indptr)
        return call.launch()

    def _check_live_values(self, query, cache, block_tables, seq_lens, qo_indptr) -> None:
        plan = self._plan
        lens = seq_lens.tolist()
        cap = block_tables.shape[1] * plan.page_size
        bound, name = (plan.max_kv_len, "max_kv_len") if plan.max_kv_len <= cap else (
            cap, "block_tables.shape[1] * page_size")
        _values_lens(lens, bound, name)
        if plan.packed:
            q_lens = _values_qo(qo_indptr.tolist(), query.shape[0])
            for b, n in enumerate(q_lens):
                if n > plan.max_seq_len_q:
                    V.fail(f"qo_indptr: request {b} has {n} queries, more than the planned max_seq_len_q "
                           f"{plan.max_seq_len_q}")
        else:
            q_lens = [query.shape[1]] * plan.batch
        if plan.mask_type == "causal":
            _values_causal(q_lens, lens)
        V.values_block_table("block_tables", block_tables.cpu(), lens, plan.page_size, cache.shape[0])


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

    Reads ``seq_lens``, ``qo_indptr`` and the used part of ``block_tables`` on the host to
    validate them and derive the plan bounds (``max_seq_len_q``: the query's SQ, or the
    largest delta of ``qo_indptr``; ``max_kv_len``: ``max(seq_lens)``; explicit values may be
    larger, and for a fixed query ``max_seq_len_q`` must equal SQ), then runs a temporary
    :class:`BatchMLADecodePagedTSWrapper`. Not CUDA-graph capturable: plan a wrapper and
    capture ``run(..., validate=False)`` instead.
    """
    _check_ranks(kv_lora_rank, qk_rope_head_dim)
    _, sq, packed = _query_mode(query, qo_indptr, max_seq_len_q, require_max_seq_len_q=False)
    h = _query_heads(query)
    cache = latent_cache(kv_cache)
    if query.dtype != cache.dtype:
        V.fail(f"query: dtype {query.dtype} differs from the kv_cache's {cache.dtype}")
    V.same_device([("query", query), ("kv_cache", cache), ("block_tables", block_tables), ("seq_lens", seq_lens),
                   ("qo_indptr", qo_indptr)])
    odt = _resolve_out_dtype(out_dtype, out)
    w = BatchMLADecodePagedTSWrapper()
    w.plan(seq_lens, h, cache.shape[1], qo_indptr=qo_indptr, max_seq_len_q=sq, max_kv_len=max_kv_len,
           mask_type=mask_type, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, q_data_type=query.dtype,
           out_dtype=odt)
    return w.run(query, kv_cache, block_tables, seq_lens, qo_indptr, out=out, validate=True)
