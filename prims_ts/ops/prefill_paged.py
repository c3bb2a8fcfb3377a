"""batch_prefill_with_paged_kv_cache: packed Q over separate HND K/V page pools.

Public: ``batch_prefill_with_paged_kv_cache`` (one-shot) and
        ``BatchPrefillPagedTSWrapper`` (plan/run).
Ops:    ``torch.ops.prims_ts.batch_prefill_paged`` (functional) and
        ``torch.ops.prims_ts.batch_prefill_paged_out`` (writes ``out``).
Fakes:  ``prims_ts/meta/prefill_paged.py``; CPU kernel: ``prims_ts.reference``.

The CUDA kernel is batch_prefill's FMHA core with the paged address policy
(``prims_ts/cuda/fmha_prefill.cu``, ``PAGED``): K/V tiles are copied straight
from the pages named by the block table, never gathered into a copy.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from .. import reference
from . import _dispatch
from . import _validate as V
from .prefill import HEAD_DIMS, PrefillPlan, _tile_m, _work_tensor, work_list

MASKS = ("dense", "causal")
PAGE_SIZES = (16, 32, 64, 128)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _run(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        from ..cuda import kernels

        kernels.launch_prefill_paged(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work,
                                     mask_type, window_left, sm_scale, output_scale, max_q_len)
    else:
        out.copy_(reference.batch_prefill_paged(
            q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, mask_type=mask_type,
            window_left=window_left, sm_scale=sm_scale, output_scale=output_scale, compute_dtype=torch.float32))


@torch.library.custom_op("prims_ts::batch_prefill_paged_out", mutates_args=("out",))
def batch_prefill_paged_out_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    work: Optional[torch.Tensor],
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
) -> None:
    """Writes paged prefill attention into ``out``. Arguments are trusted: validate first."""
    _run(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len)


@torch.library.custom_op("prims_ts::batch_prefill_paged", mutates_args=())
def batch_prefill_paged_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    work: Optional[torch.Tensor],
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
    out_dtype: int,
) -> torch.Tensor:
    """Functional form of ``batch_prefill_paged_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len)
    return out


# ----------------------------------------------------------------------------
# Validation and planning
# ----------------------------------------------------------------------------


def _check_page_size(page_size, kv_layout) -> int:
    V.integer("page_size", page_size)
    if page_size not in PAGE_SIZES:
        V.fail(f"page_size: {page_size} is not supported; expected one of {', '.join(map(str, PAGE_SIZES))}")
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout: expected a str, got {type(kv_layout).__name__}")
    if kv_layout != "HND":
        V.fail(f"kv_layout: only 'HND' ([num_pages, Hkv, page_size, D] pools) is supported, got {kv_layout!r}")
    return page_size


def _check_tensors(q, k_cache, v_cache, page_size: int):
    """Shapes, dtypes and strides of q and the two pools; returns (Hq, Hkv, D, num_pages)."""
    V.tensor("q", q, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
    if q.dim() != 3:
        V.fail(f"q: expected packed [total_q, Hq, D], got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        V.tensor(name, t, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
        if t.dim() != 4:
            V.fail(f"{name}: expected an HND pool [num_pages, Hkv, page_size, D], got shape {tuple(t.shape)}")
        V.pool_strides(name, t)
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        V.fail(f"v_cache: shape {tuple(v_cache.shape)} must equal k_cache's {tuple(k_cache.shape)}")
    V.same_dtype([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)])
    num_pages, hkv, ps, d = k_cache.shape
    if ps != page_size:
        V.fail(f"page_size: {page_size} differs from the pools' page size k_cache.shape[2] = {ps}")
    V.head_dim("q", q.shape[-1], HEAD_DIMS)
    if d != q.shape[-1]:
        V.fail(f"k_cache: head dim {d} differs from q's {q.shape[-1]}")
    V.heads(q.shape[1], hkv, ("q", "k_cache"))
    if num_pages < 1:
        V.fail("k_cache: the pools hold no page")
    return q.shape[1], hkv, d, num_pages


def _check_metadata(qo_indptr, block_tables, seq_lens_kv):
    """Dtypes, ranks and strides of the metadata; returns (B, C)."""
    V.int32_vector("qo_indptr", qo_indptr)
    if qo_indptr.shape[0] < 2:
        V.fail(f"qo_indptr: expected [B+1] with B >= 1, got shape {tuple(qo_indptr.shape)}")
    batch = qo_indptr.shape[0] - 1
    _, cols = V.block_table("block_tables", block_tables, batch)
    V.int32_vector("seq_lens_kv", seq_lens_kv, length=batch)
    return batch, cols


def _check_values(qo: List[int], lens: List[int], table: torch.Tensor, total_q: int, page_size: int,
                  num_pages: Optional[int], mask_type: str) -> int:
    """Host checks of metadata values; returns the largest used page ID."""
    V.values_indptr("qo_indptr", qo, total_q, "q.shape[0]")
    cols = table.shape[1]
    max_page = -1
    for b, sk in enumerate(lens):
        if sk < 1 or sk > cols * page_size:
            V.fail(f"seq_lens_kv: request {b} has length {sk}; expected 1 <= length <= "
                   f"block_tables.shape[1] * page_size = {cols * page_size}")
        sq = qo[b + 1] - qo[b]
        if mask_type == "causal" and sq > sk:
            V.fail(f"qo_indptr: causal masking needs Sq <= Sk, but request {b} has Sq={sq} > Sk={sk}")
        used = table[b, : (sk + page_size - 1) // page_size]
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or (num_pages is not None and hi >= num_pages):
            bad = lo if lo < 0 else hi
            V.fail(f"block_tables: request {b} uses page ID {bad}, outside [0, {num_pages if num_pages else 'P'})")
        max_page = max(max_page, hi)
    return max_page


def _common_args(mask_type, window_left, sm_scale, output_scale, head_dim):
    mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
    sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(head_dim))
    output_scale = V.scale("output_scale", output_scale)
    return mask_type, window_left, sm_scale, output_scale


def _metadata_inputs(qo_indptr, block_tables, seq_lens_kv):
    return [("qo_indptr", qo_indptr), ("block_tables", block_tables), ("seq_lens_kv", seq_lens_kv)]


def _call(plan: PrefillPlan, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, out):
    args = (qo_indptr, block_tables, seq_lens_kv, plan.work, plan.mask_type, plan.window_left, plan.sm_scale,
            plan.output_scale, plan.max_q_len)
    return _dispatch.call(torch.ops.prims_ts.batch_prefill_paged, torch.ops.prims_ts.batch_prefill_paged_out, _run,
                          (q, k_cache, v_cache), args, out, plan.out_dtype)


def batch_prefill_with_paged_kv_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    *,
    page_size: int = 32,
    kv_layout: str = "HND",
    mask_type: str = "dense",
    window_left: int = -1,
    sm_scale: Optional[float] = None,
    output_scale: float = 1.0,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One-shot packed-Q attention over separate HND page pools ``[P, Hkv, page_size, D]``.

    Reads ``qo_indptr``, ``seq_lens_kv`` and the used part of ``block_tables`` on the
    host to validate them (page IDs in ``[0, P)``, lengths within the table row,
    causal ``Sq <= Sk``) and to build the heavy-first work list, so it is not
    CUDA-graph capturable; plan a :class:`BatchPrefillPagedTSWrapper` for that.
    """
    page_size = _check_page_size(page_size, kv_layout)
    hq, hkv, d, num_pages = _check_tensors(q, k_cache, v_cache, page_size)
    batch, _ = _check_metadata(qo_indptr, block_tables, seq_lens_kv)
    mask_type, window_left, sm_scale, output_scale = _common_args(mask_type, window_left, sm_scale, output_scale, d)
    device = V.same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
                           + _metadata_inputs(qo_indptr, block_tables, seq_lens_kv))
    odt = V.out_dtype(out_dtype, out, q.dtype)
    if out_dtype is not None and out is not None and out.dtype != out_dtype:
        V.fail(f"out: dtype {out.dtype} disagrees with out_dtype {out_dtype}")
    V.out_tensor(out, q.shape, odt, device, [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
                 + _metadata_inputs(qo_indptr, block_tables, seq_lens_kv))
    work = None
    if V.tracing():
        max_q_len = q.shape[0]  # traced: values unreadable; a safe bound and the implicit tile order
    else:
        qo, lens = qo_indptr.tolist(), seq_lens_kv.tolist()
        _check_values(qo, lens, block_tables.cpu(), q.shape[0], page_size, num_pages, mask_type)
        q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        max_q_len = max(q_lens)
        if q.is_cuda:
            work = _work_tensor(work_list(q_lens, lens, mask_type, window_left,
                                          _tile_m(q.dtype, d, mask_type, device)), device)
    plan = PrefillPlan(True, batch, hq, hkv, d, mask_type, window_left, sm_scale, output_scale, odt, max_q_len, work)
    return _call(plan, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, out)


class BatchPrefillPagedTSWrapper:
    """Plan once outside capture; ``run`` is CUDA-graph capturable.

    ``plan`` reads ``qo_indptr``, ``block_tables`` and ``seq_lens_kv`` once,
    validates them and fixes the bounds: each request's query length (or
    ``max_q_len`` for all), the total query count and the largest page ID.
    ``run`` binds the *same* metadata tensors, does no host synchronisation and
    allocates nothing when ``out`` is given. Between replays the caller may
    rewrite page IDs, Q offsets and K/V lengths in place as long as every request
    keeps its query length within the planned bound, ``1 <= seq_lens_kv[b] <=
    block_tables.shape[1] * page_size``, page IDs in ``[0, P)``, the same total,
    and (causal) ``Sq <= Sk``; these values are then trusted, not re-checked.
    """

    def __init__(self, device: Optional[torch.device | str] = None):
        self.device = torch.device(device) if device is not None else None
        self._plan: Optional[PrefillPlan] = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens_kv: torch.Tensor,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 32,
        kv_layout: str = "HND",
        mask_type: str = "dense",
        window_left: int = -1,
        sm_scale: Optional[float] = None,
        output_scale: float = 1.0,
        max_q_len: Optional[int] = None,
        q_data_type: torch.dtype = torch.bfloat16,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        page_size = _check_page_size(page_size, kv_layout)
        V.integer("num_qo_heads", num_qo_heads, minimum=1)
        V.integer("num_kv_heads", num_kv_heads, minimum=1)
        V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
        d = V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
        V.input_dtype("q_data_type", q_data_type)
        batch, _ = _check_metadata(qo_indptr, block_tables, seq_lens_kv)
        device = V.same_device(_metadata_inputs(qo_indptr, block_tables, seq_lens_kv))
        mask_type, window_left, sm_scale, output_scale = _common_args(mask_type, window_left, sm_scale,
                                                                      output_scale, d)
        odt = V.out_dtype(out_dtype, None, q_data_type)
        qo, lens = qo_indptr.tolist(), seq_lens_kv.tolist()
        max_page = _check_values(qo, lens, block_tables.cpu(), qo[-1], page_size, None, mask_type)
        q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        if max_q_len is not None:
            V.integer("max_q_len", max_q_len, minimum=max(q_lens))
            bounds = [max_q_len] * batch
        else:
            bounds = q_lens
        dev = self.device or device
        work = _work_tensor(work_list(bounds, lens, mask_type, window_left, _tile_m(q_data_type, d, mask_type, dev)),
                            dev)
        from ..cuda import kernels

        # the kernel compiled and loaded now, not in run (before any state changes)
        kernels.warm_prefill(dev, q_data_type, d, mask_type, paged=True)
        self._plan = PrefillPlan(True, batch, num_qo_heads, num_kv_heads, d, mask_type, window_left, sm_scale,
                                 output_scale, odt, max(bounds), work)
        self._meta = (qo_indptr, block_tables, seq_lens_kv)
        self._total_q = qo[-1]
        self._page_size = page_size
        self._max_page = max_page
        self._dtype = q_data_type

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchPrefillPagedTSWrapper.run: call plan(...) first")
        hq, hkv, d, num_pages = _check_tensors(q, k_cache, v_cache, self._page_size)
        if q.dtype != self._dtype:
            V.fail(f"q: dtype {q.dtype} differs from the planned q_data_type {self._dtype}")
        if (hq, hkv, d) != (plan.num_qo_heads, plan.num_kv_heads, plan.head_dim):
            V.fail(f"q/k_cache: heads and head dim ({hq}, {hkv}, {d}) differ from the plan "
                   f"({plan.num_qo_heads}, {plan.num_kv_heads}, {plan.head_dim})")
        if q.shape[0] != self._total_q:
            V.fail(f"q: {q.shape[0]} tokens differ from the planned total {self._total_q}")
        if self._max_page >= num_pages:
            V.fail(f"k_cache: the plan uses page ID {self._max_page} but the pools hold {num_pages} pages")
        qo_indptr, block_tables, seq_lens_kv = self._meta
        device = V.same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
                               + _metadata_inputs(qo_indptr, block_tables, seq_lens_kv))
        V.out_tensor(out, q.shape, plan.out_dtype, device, [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
                     + _metadata_inputs(qo_indptr, block_tables, seq_lens_kv))
        return _call(plan, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, out)
