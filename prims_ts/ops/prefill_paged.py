"""Paged prefill: packed Q over separate HND K/V page pools.

Public: ``BatchPrefillPagedTSWrapper`` (plan over FlashInfer's CSR page metadata, run)
        and ``batch_prefill_with_paged_kv_cache`` (the seed's one-shot over a row-strided
        block table; its plan + run).
Ops:    ``torch.ops.prims_ts.batch_prefill_paged`` (functional) and
        ``torch.ops.prims_ts.batch_prefill_paged_out`` (writes ``out``).
Fakes:  ``prims_ts/meta/prefill_paged.py``; CPU kernel: ``prims_ts.reference``.

The CUDA kernel is batch_prefill's FMHA core with the paged address policy
(``prims_ts/cuda/fmha_prefill.cu``, ``PAGED``): K/V tiles are copied straight from the
pages a block table names, never gathered into a copy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .. import reference
from ..cuda import prefill as K
from ..cuda.keys import DEFAULT_TUNING, BoundedMemo, Tuning
from . import _dispatch
from . import _validate as V
from .prefill import HEAD_DIMS, check_causal_lengths, plan_work

MASKS = ("dense", "causal")
PAGE_SIZES = K.PAGE_SIZES


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _run(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len, tuning) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        static = K.PrefillStatic(q.dtype, q.shape[-1], q.shape[-2], k_cache.shape[1], mask_type, window_left,
                                 sm_scale, output_scale, out.dtype, qo_indptr.shape[0] - 1, max_q_len,
                                 work.shape[0] if work is not None else None, True, paged=True,
                                 page_size=k_cache.shape[2], tuning=Tuning.decode(tuning))
        K.prepared(static, q.device.index).run(q, k_cache, v_cache, out, qo_indptr, work=work,
                                               block_tables=block_tables, seq_lens=seq_lens_kv)
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
    tuning: str = "",
) -> None:
    """Writes paged prefill attention into ``out``. Arguments are trusted: validate first."""
    _run(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len, tuning)


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
    tuning: str = "",
) -> torch.Tensor:
    """Functional form of ``batch_prefill_paged_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run(q, k_cache, v_cache, out, qo_indptr, block_tables, seq_lens_kv, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len, tuning)
    return out


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def check_page_size(page_size, kv_layout="HND") -> int:
    V.integer("page_size", page_size)
    if page_size not in PAGE_SIZES:
        V.fail(f"page_size: {page_size} is not supported; prims_ts supports page_size "
               f"{', '.join(map(str, PAGE_SIZES))}")
    check_layout(kv_layout)
    return page_size


def check_layout(kv_layout) -> None:
    if not isinstance(kv_layout, str):
        raise TypeError(f"kv_layout: expected a str, got {type(kv_layout).__name__}")
    if kv_layout != "HND":
        V.fail(f"kv_layout: only 'HND' ([num_pages, Hkv, page_size, D] pools) is supported, got {kv_layout!r}")


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


def _common_args(mask_type, window_left, sm_scale, output_scale, head_dim):
    mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
    sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(head_dim))
    output_scale = V.scale("output_scale", output_scale)
    return mask_type, window_left, sm_scale, output_scale


def check_csr_values(indptr: np.ndarray, indices_len: int, last: np.ndarray, page_size: int,
                     names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")) -> np.ndarray:
    """FlashInfer's CSR page metadata on the host: indptr starts at zero, increases strictly
    (every request holds a page), ends at the indices' length; every last page holds 1 to
    page_size keys. Returns the K/V lengths, (pages - 1) * page_size + last_page_len."""
    V.values_indptr(names[0], indptr, indices_len, f"{names[1]}.numel()")
    bad = (last < 1) | (last > page_size)
    if bad.any():
        b = V.first(bad)
        V.fail(f"{names[2]}: request {b} has {int(last[b])}; values must be in [1, {page_size}] (page_size)")
    return (V.diff(indptr) - 1) * page_size + last


def check_page_ids(name: str, ids: np.ndarray, num_pages: Optional[int]) -> None:
    """Used page IDs (a host array) inside ``[0, num_pages)`` (None: only >= 0)."""
    hi = num_pages if num_pages is not None else V.INT32_MAX + 1
    bad = (ids < 0) | (ids >= hi)
    if bad.any():
        i = V.first(bad)
        V.fail(f"{name}: entry {i} is page ID {int(ids[i])}; entries must index the physical page pool "
               f"[0, {num_pages if num_pages is not None else 'P'})")


# ----------------------------------------------------------------------------
# The plan and its wrapper
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PagedPrefillPlan:
    """A planned paged prefill: static facts, the metadata it runs with, the prepared launch."""

    static: Optional[object]  # cuda.prefill.PrefillStatic (None while traced)
    scalars: tuple  # the op's scalars: mask, window_left, sm_scale, output_scale, max_q_len
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype
    q_shape: torch.Size
    pool_geometry: tuple  # (Hkv, page_size, D) of the pools
    max_page: int  # the largest page ID the plan reads
    qo_indptr: torch.Tensor  # bound: read live
    block_tables: torch.Tensor  # [B, C]: the plan's own copy (a wrapper plan) or the caller's (a one-shot)
    seq_lens_kv: torch.Tensor
    work: Optional[torch.Tensor]
    launch: Optional[object]  # cuda.prefill.PreparedPrefill
    tuning_code: str

    @property
    def bound(self) -> tuple:
        return (("qo_indptr", self.qo_indptr), ("block_tables", self.block_tables),
                ("seq_lens_kv", self.seq_lens_kv))

    def op_args(self) -> tuple:
        return (self.qo_indptr, self.block_tables, self.seq_lens_kv, self.work) + self.scalars


@dataclass(frozen=True)
class _Problem:
    """What the static checks of a paged prefill derive (no tensor value read)."""

    hq: int
    hkv: int
    head_dim: int
    num_pages: int
    batch: int
    device: torch.device
    mask_type: str
    window_left: int
    sm_scale: float
    output_scale: float
    out_dtype: torch.dtype


def _check_problem(q, k_cache, v_cache, qo_indptr, page_size, mask_type, window_left, sm_scale, output_scale,
                   out_dtype) -> _Problem:
    hq, hkv, d, num_pages = _check_tensors(q, k_cache, v_cache, page_size)
    mask_type, window_left, sm_scale, output_scale = _common_args(mask_type, window_left, sm_scale, output_scale, d)
    V.int32_vector("qo_indptr", qo_indptr)
    if qo_indptr.shape[0] < 2:
        V.fail(f"qo_indptr: expected [B+1] with B >= 1, got shape {tuple(qo_indptr.shape)}")
    batch = V.batch_size("qo_indptr", qo_indptr.shape[0] - 1)
    device = V.same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("qo_indptr", qo_indptr)])
    odt = V.out_dtype(out_dtype, None, q.dtype)
    return _Problem(hq, hkv, d, num_pages, batch, device, mask_type, window_left, sm_scale, output_scale, odt)


def _make_plan(tuning: Tuning, tuning_code: str, q, qo_indptr, page_size, pb: _Problem, tables,
               exact: bool, launches: Optional[BoundedMemo] = None) -> PagedPrefillPlan:
    """The plan of a problem that passed its static checks (`pb`). `tables(device, batch,
    num_pages)` validates the page metadata and returns (block_tables [B, C], seq_lens_kv [B]
    on the device, the K/V lengths and the Q offsets on the host (None while traced), the
    largest used page ID). `launches`: a one-shot key's memo of (static, shared launch) by
    (longest query count, work items)."""
    hq, hkv, d, batch, device, odt = pb.hq, pb.hkv, pb.head_dim, pb.batch, pb.device, pb.out_dtype
    mask_type, window_left, sm_scale, output_scale = pb.mask_type, pb.window_left, pb.sm_scale, pb.output_scale
    table, lens_dev, lens, qo, max_page = tables(device, batch, pb.num_pages)
    work = None
    if qo is None:
        max_q_len = q.shape[0]  # traced: a safe bound, the implicit tile order
    else:
        V.values_indptr("qo_indptr", qo, q.shape[0], "q.shape[0]")
        q_lens = V.diff(qo)
        if mask_type == "causal":
            check_causal_lengths(q_lens, lens, "qo_indptr")
        max_q_len = int(q_lens.max())
        work = plan_work(device, q_lens, lens, max_q_len, exact, mask_type, window_left, q.dtype, d, tuning,
                         paged=True)
    static = launch = None
    if not V.tracing():
        n_items = work.shape[0] if work is not None else None
        got = launches.get((max_q_len, n_items)) if launches is not None else None
        if got is None:
            static = K.PrefillStatic(q.dtype, d, hq, hkv, mask_type, window_left, sm_scale, output_scale, odt, batch,
                                     max_q_len, n_items, True, paged=True, page_size=page_size, tuning=tuning)
            if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
                launch = K.prepared(static, device.index)  # a one-shot (`exact`) runs the shared launch once
                if launches is not None:
                    launches.put((max_q_len, n_items), (static, launch))
        else:
            static, launch = got
        if launch is not None and not exact:
            launch = _dispatch.plan_launch(launch, (qo_indptr, table, lens_dev, work))
    return PagedPrefillPlan(static, (mask_type, window_left, sm_scale, output_scale, max_q_len), device, q.dtype, odt,
                            q.shape, (hkv, page_size, d), max_page, qo_indptr, table, lens_dev, work, launch,
                            tuning_code)


class BatchPrefillPagedTSWrapper:
    """Plan once outside capture; ``run`` is CUDA-graph capturable.

    ``plan`` takes FlashInfer's CSR page metadata (``paged_kv_indptr``, ``paged_kv_indices``,
    ``paged_kv_last_page_len``: request b's K/V length is ``(pages - 1) * page_size +
    last_page_len[b]``), reads it once on the host with ``qo_indptr``, validates it and
    snapshots the pages and lengths into the plan's own device tensors (a later change to the
    caller's page metadata needs a new plan). ``qo_indptr`` stays bound: ``run`` reads it on
    the device, so replays may move queries between requests in place within the planned
    total, each request's count within the planned longest, and (causal) ``Sq <= Sk``.
    ``run`` checks its tensors against the plan, does no host synchronisation and allocates
    nothing when ``out`` is given.
    """

    def __init__(self, kv_layout: str = "HND", *, tuning: Optional[Tuning] = None):
        check_layout(kv_layout)
        self.kv_layout = kv_layout
        self.tuning, self._tuning_code = V.tuning(tuning)
        self._plan: Optional[PagedPrefillPlan] = None

    def plan(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        *,
        page_size: int = 32,
        mask_type: str = "dense",
        window_left: int = -1,
        sm_scale: Optional[float] = None,
        output_scale: float = 1.0,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        page_size = check_page_size(page_size)

        def tables(device, batch, num_pages):
            V.int32_vector("paged_kv_indptr", paged_kv_indptr, length=batch + 1)
            V.int32_vector("paged_kv_indices", paged_kv_indices)
            V.int32_vector("paged_kv_last_page_len", paged_kv_last_page_len, length=batch)
            V.same_device([("qo_indptr", qo_indptr), ("paged_kv_indptr", paged_kv_indptr),
                           ("paged_kv_indices", paged_kv_indices), ("paged_kv_last_page_len", paged_kv_last_page_len)])
            if paged_kv_indptr.device != device:
                V.fail(f"paged_kv_indptr: is on {paged_kv_indptr.device}, expected q's device {device}")
            if V.tracing():
                raise RuntimeError("BatchPrefillPagedTSWrapper.plan reads its metadata on the host and cannot be "
                                   "traced; plan outside the compiled region and compile run")
            qo, ip, ids, last = V.host_values(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
            lens = check_csr_values(ip, ids.shape[0], last, page_size)
            check_page_ids("paged_kv_indices", ids, num_pages)
            counts = V.diff(ip)
            cols = int(counts.max())
            # the block table [B, C]: request b's pages, padded by repeating its last page
            pos = ip[:-1, None] + np.minimum(np.arange(cols)[None, :], (counts - 1)[:, None])
            lens_dev, table = V.to_device(device, lens, ids[pos])
            return table.view(batch, cols), lens_dev, lens, qo, int(ids.max())

        pb = _check_problem(q, k_cache, v_cache, qo_indptr, page_size, mask_type, window_left, sm_scale, output_scale,
                            out_dtype)
        self._plan = _make_plan(self.tuning, self._tuning_code, q, qo_indptr, page_size, pb, tables, exact=False)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        o = _dispatch.fast_output(plan.launch, out, plan.q_shape, plan.out_dtype, plan.device)
        if o is not None and plan.launch.again(q, k_cache, v_cache, o):
            return o
        dev, dt = plan.device, plan.dtype
        fast = (V.matches(q, plan.q_shape, dt, dev) and type(k_cache) is torch.Tensor and type(v_cache) is torch.Tensor
                and k_cache.shape[1:] == plan.pool_geometry and v_cache.shape == k_cache.shape
                and k_cache.dtype is dt and v_cache.dtype is dt and k_cache.device == dev and v_cache.device == dev
                and plan.max_page < k_cache.shape[0])
        if not fast:
            _check_against_plan(plan, q, k_cache, v_cache)
        return _launch(plan, q, k_cache, v_cache, out, fast)


def _launch(plan: PagedPrefillPlan, q, k_cache, v_cache, out, fast: bool = True,
            out_checked: bool = False) -> torch.Tensor:
    """A run's (or a one-shot's) launch of tensors checked against the plan (`fast`: laid out
    as planned): `out` checked (unless `out_checked`: the one-shot's checks did), then the
    prepared kernel, or the op where a tracer, a mode or a subclass must see the call."""
    dev = plan.device
    if out is not None and not out_checked:
        V.out_tensor(out, plan.q_shape, plan.out_dtype, dev,
                     (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) + plan.bound)
    if fast and plan.launch is not None and _dispatch.plain_eager(out):
        if out is None:
            out = torch.empty(plan.q_shape, dtype=plan.out_dtype, device=dev)
        plan.launch.run(q, k_cache, v_cache, out, plan.qo_indptr, work=plan.work, block_tables=plan.block_tables,
                        seq_lens=plan.seq_lens_kv)
        return out
    V.run_layout((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
    return _dispatch.call(torch.ops.prims_ts.batch_prefill_paged, torch.ops.prims_ts.batch_prefill_paged_out,
                          _run, (q, k_cache, v_cache), plan.op_args(), out, plan.out_dtype, plan.tuning_code)


def _check_against_plan(plan: PagedPrefillPlan, q, k_cache, v_cache) -> None:
    hq, hkv, d, num_pages = _check_tensors(q, k_cache, v_cache, plan.pool_geometry[1])
    if q.shape != plan.q_shape:
        V.fail(f"q must have shape {tuple(plan.q_shape)} (the plan's), got {tuple(q.shape)}")
    if q.dtype != plan.dtype:
        V.fail(f"q: dtype {V._dtype_name(q.dtype)} differs from the planned {V._dtype_name(plan.dtype)}")
    if (hkv, k_cache.shape[2], d) != plan.pool_geometry:
        V.fail(f"k_cache: (Hkv, page_size, D) = {(hkv, k_cache.shape[2], d)} differs from the plan's "
               f"{plan.pool_geometry}")
    V.same_device([("q", q), ("k_cache", k_cache), ("v_cache", v_cache)])
    if q.device != plan.device:
        V.fail(f"q must be on the planned device {plan.device}, got {q.device}")
    if plan.max_page >= num_pages:
        V.fail(f"k_cache: the plan reads page ID {plan.max_page} but the pools hold {num_pages} pages")


_ONESHOT_CHECKED = V.memo()


@dataclass(frozen=True, eq=False)
class _OneShot:
    """What the one-shot's static checks derived for one key: the problem, the per-call checks of
    ``out``'s start and overlaps (``V.Disjoint``: out, q, k_cache, v_cache, qo_indptr,
    block_tables, seq_lens_kv) and the launch keys its plans took, by (longest query count,
    work items)."""

    problem: _Problem
    checks: Optional[V.Disjoint]  # None while traced
    launches: BoundedMemo


def _oneshot_checks(q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, page_size, kv_layout, mask_type,
                    window_left, sm_scale, output_scale, out_dtype, out) -> _OneShot:
    """The one-shot's static checks: the problem's, its block table's and lengths' shapes, and
    ``out``'s shape, dtype and device."""
    page_size = check_page_size(page_size, kv_layout)
    pb = _check_problem(q, k_cache, v_cache, qo_indptr, page_size, mask_type, window_left, sm_scale, output_scale,
                        V.resolve_out_dtype(out_dtype, out, q))
    V.block_table("block_tables", block_tables, pb.batch)
    V.int32_vector("seq_lens_kv", seq_lens_kv, length=pb.batch)
    V.same_device([("qo_indptr", qo_indptr), ("block_tables", block_tables), ("seq_lens_kv", seq_lens_kv)])
    if block_tables.device != pb.device:
        V.fail(f"block_tables: is on {block_tables.device}, expected q's device {pb.device}")
    V.out_tensor(out, q.shape, pb.out_dtype, pb.device, ())
    checks = None if V.tracing() else V.Disjoint(
        ("out", "q", "k_cache", "v_cache", "qo_indptr", "block_tables", "seq_lens_kv"),
        (out, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv))
    return _OneShot(pb, checks, V.launch_memo())


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
    """One-shot packed-Q attention over separate HND page pools ``[P, Hkv, page_size, D]``
    with one row-strided block table: the plan of a :class:`BatchPrefillPagedTSWrapper` over
    these tables, launched once (over the shared prepared kernel).

    Reads ``qo_indptr``, ``seq_lens_kv`` and ``block_tables`` on the host (one copy) to
    validate them (page IDs in ``[0, P)``, lengths within the table row, causal
    ``Sq <= Sk``) and to build the heavy-first work list, so it is not CUDA-graph
    capturable; plan a wrapper for that.
    """
    traced = V.tracing()
    operands = (out, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv)
    one = V.checked_once(
        _ONESHOT_CHECKED, operands, (page_size, kv_layout, mask_type, window_left, sm_scale, output_scale, out_dtype),
        _oneshot_checks, q, k_cache, v_cache, qo_indptr, block_tables, seq_lens_kv, page_size, kv_layout, mask_type,
        window_left, sm_scale, output_scale, out_dtype, out, traced=traced)
    if not traced:
        one.checks.check(operands)  # out's start and overlaps (its shape, dtype, device: under the key)

    def tables(device, batch, num_pages):
        if traced:
            return block_tables, seq_lens_kv, None, None, num_pages - 1  # traced: the values are trusted
        qo, lens, table = V.host_values(qo_indptr, seq_lens_kv, block_tables)
        cols = block_tables.shape[1]
        table = table.reshape(batch, cols)
        bad = (lens < 1) | (lens > cols * page_size)
        if bad.any():
            b = V.first(bad)
            V.fail(f"seq_lens_kv: request {b} has length {int(lens[b])}; expected 1 <= length <= "
                   f"block_tables.shape[1] * page_size = {cols * page_size}")
        max_page = V.values_block_table("block_tables", table, lens, page_size, num_pages)
        return block_tables, seq_lens_kv, lens, qo, max_page

    plan = _make_plan(DEFAULT_TUNING, "", q, qo_indptr, page_size, one.problem, tables, exact=True,
                      launches=one.launches)
    return _launch(plan, q, k_cache, v_cache, out, out_checked=True)  # the plan checked q and the pools
