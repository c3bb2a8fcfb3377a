"""batch_prefill: contiguous (fixed or packed-ragged) context attention.

Public: ``BatchPrefillTSWrapper`` (plan/run) and ``batch_prefill`` (its plan + run).
Ops:    ``torch.ops.prims_ts.batch_prefill`` (functional) and
        ``torch.ops.prims_ts.batch_prefill_out`` (writes ``out``).
Fakes:  ``prims_ts/meta/prefill.py``; CPU kernel: ``prims_ts.reference``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from .. import reference
from ..cuda import prefill as K
from ..cuda.keys import DEFAULT_TUNING, Tuning, device_limits
from . import _dispatch
from . import _validate as V

MASKS = ("dense", "causal", "variable_window")
HEAD_DIMS = (128, 256)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _static(q, k, out, packed: bool, batch: int, work, mask_type, window_left, sm_scale, output_scale, max_q_len,
            tuning: Tuning):
    """The prepared launch's key: what a plan knows, rebuilt from an op's arguments."""
    return K.PrefillStatic(q.dtype, q.shape[-1], q.shape[-2], k.shape[-2], mask_type, window_left, sm_scale,
                           output_scale, out.dtype, batch, max_q_len, work.shape[0] if work is not None else None,
                           packed, sq=0 if packed else q.shape[1], sk=0 if packed else k.shape[1], tuning=tuning)


def _run(q, k, v, out, qo_indptr, kv_indptr, win_starts, win_ends, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len, tuning) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        packed = qo_indptr is not None
        batch = qo_indptr.shape[0] - 1 if packed else q.shape[0]
        static = _static(q, k, out, packed, batch, work, mask_type, window_left, sm_scale, output_scale, max_q_len,
                         Tuning.decode(tuning))
        K.prepared(static, q.device.index).run(q, k, v, out, qo_indptr, kv_indptr, win_starts, win_ends, work)
    else:
        out.copy_(reference.batch_prefill(
            q, k, v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type=mask_type, window_left=window_left,
            window_starts=win_starts, window_ends=win_ends, sm_scale=sm_scale, output_scale=output_scale,
            compute_dtype=torch.float32))


@torch.library.custom_op("prims_ts::batch_prefill_out", mutates_args=("out",))
def batch_prefill_out_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    kv_indptr: Optional[torch.Tensor],
    window_starts: Optional[torch.Tensor],
    window_ends: Optional[torch.Tensor],
    work: Optional[torch.Tensor],
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
    tuning: str = "",
) -> None:
    """Writes attention into ``out``. Arguments are trusted: validate first."""
    _run(q, k, v, out, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len, tuning)


@torch.library.custom_op("prims_ts::batch_prefill", mutates_args=())
def batch_prefill_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    kv_indptr: Optional[torch.Tensor],
    window_starts: Optional[torch.Tensor],
    window_ends: Optional[torch.Tensor],
    work: Optional[torch.Tensor],
    mask_type: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
    out_dtype: int,
    tuning: str = "",
) -> torch.Tensor:
    """Functional form of ``batch_prefill_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run(q, k, v, out, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len, tuning)
    return out


# ----------------------------------------------------------------------------
# Planning helpers (shared with the paged form)
# ----------------------------------------------------------------------------


def work_list(q_lens, kv_lens, mask_type: str, window_left: int, tile_m: int) -> np.ndarray:
    """(request, q tile) items, int32 ``[n, 2]`` on the host, ordered by decreasing cost (K/V
    rows visited), then request, then tile: whole-array arithmetic over host arrays (or
    tensors) of lengths; the items are made in (request, tile) order, so one stable sort by
    cost gives the order."""
    q_lens, kv_lens = np.asarray(q_lens, dtype=np.int64), np.asarray(kv_lens, dtype=np.int64)
    tiles = (q_lens + tile_m - 1) // tile_m
    b = np.repeat(np.arange(q_lens.shape[0]), tiles)
    if b.size == 0:
        return np.zeros((0, 2), dtype=np.int32)
    t = np.arange(b.shape[0]) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    if mask_type == "causal":
        sq, sk = q_lens[b], kv_lens[b]
        end = np.clip(sk - sq + np.minimum(sq, (t + 1) * tile_m), 0, sk)
        begin = np.maximum(sk - sq + t * tile_m - window_left, 0) if window_left >= 0 else 0
        key = np.minimum(begin - end, 0)  # minus the K/V rows visited
    else:
        key = -kv_lens[b]
    order = np.argsort(key, kind="stable")
    items = np.empty((b.shape[0], 2), dtype=np.int32)
    items[:, 0] = b[order]
    items[:, 1] = t[order]
    return items


def plan_work(device: torch.device, q_lens: np.ndarray, kv_lens: np.ndarray, max_q_len: int, exact: bool,
              mask_type: str, window_left: int, dtype: torch.dtype, head_dim: int,
              tuning: Tuning = DEFAULT_TUNING, paged: bool = False) -> Optional[torch.Tensor]:
    """A CUDA plan's work list on the device (``[n, 2]``), or None: the kernel's implicit order.
    `exact`: the items of each request's query count (a one-shot); else of the longest,
    `max_q_len` (a wrapper plan, whose query offsets are read live). A causal problem without a left window
    whose requests all have the same query bound and K/V length gets no list: the kernel's
    implicit order (the highest q tiles first, requests in order within a tile) is the list's
    order then, item for item."""
    if device.type != "cuda":
        return None
    bounds = q_lens if exact else np.full_like(q_lens, max_q_len)
    if mask_type == "causal" and window_left < 0 and (bounds == bounds[0]).all() and (kv_lens == kv_lens[0]).all():
        return None
    items = work_list(bounds, kv_lens, mask_type, window_left, tile_m(dtype, head_dim, mask_type, device, tuning, paged))
    return V.to_device(device, items)[0].view(-1, 2)


def tile_m(dtype: torch.dtype, head_dim: int, mask_type: str, device: torch.device,
           tuning: Tuning = DEFAULT_TUNING, paged: bool = False) -> int:
    """The q tile height of the prefill kernel that runs on `device` under `tuning` (work lists
    count its tiles)."""
    return K.prefill_tile_m(dtype, head_dim, mask_type, device_limits(device)[0], paged, tuning)


def check_causal_lengths(q_lens: np.ndarray, kv_lens: np.ndarray, name: str) -> None:
    bad = q_lens > kv_lens
    if bad.any():
        b = V.first(bad)
        V.fail(f"{name}: bottom-right causal context requires Sq <= Sk for each request; got batch {b}: "
               f"Sq={int(q_lens[b])}, Sk={int(kv_lens[b])}")


# ----------------------------------------------------------------------------
# The plan and its wrapper
# ----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PrefillPlan:
    """A planned batch_prefill: the static facts, the bound metadata and the prepared launch."""

    static: Optional[object]  # cuda.prefill.PrefillStatic (None while traced: the op builds its own)
    scalars: tuple  # the op's scalar arguments: mask, window_left, sm_scale, output_scale, max_q_len
    packed: bool
    device: torch.device
    dtype: torch.dtype
    out_dtype: torch.dtype
    q_shape: torch.Size
    k_shape: torch.Size
    qo_indptr: Optional[torch.Tensor]
    kv_indptr: Optional[torch.Tensor]
    window_starts: Optional[torch.Tensor]
    window_ends: Optional[torch.Tensor]
    work: Optional[torch.Tensor]
    launch: Optional[object]  # cuda.prefill.PreparedPrefill (None off CUDA or while tracing)
    tuning_code: str  # the op argument of the plan's Tuning

    @property
    def bound(self) -> tuple:
        """The metadata tensors the plan binds, named (an output must not overlap them)."""
        return (("qo_indptr", self.qo_indptr), ("kv_indptr", self.kv_indptr),
                ("variable_window_token_starts", self.window_starts), ("variable_window_token_ends", self.window_ends))

    def op_args(self) -> tuple:
        return (self.qo_indptr, self.kv_indptr, self.window_starts, self.window_ends, self.work) + self.scalars


def _check_qkv(q, k, v, packed: bool) -> Tuple[int, int, int]:
    rank = 3 if packed else 4
    layout = "[total_tokens, H, D]" if packed else "[B, S, H, D]"
    for name, t in (("q", q), ("k", k), ("v", v)):
        V.tensor(name, t, dtypes=V.INPUT_DTYPES, inner_contiguous=True, vector_aligned=True)
        if t.dim() != rank:
            V.fail(f"{name}: expected {layout} ({'packed' if packed else 'fixed'} storage), "
                   f"got shape {tuple(t.shape)}")
    V.same_dtype([("q", q), ("k", k), ("v", v)])
    d = V.head_dim("q", q.shape[-1], HEAD_DIMS)
    if k.shape[-1] != d or v.shape[-1] != d:
        V.fail(f"k/v: head dim must equal q's ({d}), got k {k.shape[-1]}, v {v.shape[-1]}")
    if k.shape != v.shape:
        V.fail(f"v: shape {tuple(v.shape)} must equal k's {tuple(k.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        V.fail(f"k: batch size {k.shape[0]} differs from q's {q.shape[0]}")
    group = V.heads(q.shape[-2], k.shape[-2])
    return d, group, q.shape[-2]


def _check_varwin(starts, ends, q: torch.Tensor, sk: int) -> None:
    B, Sq = q.shape[0], q.shape[1]
    for name, t in (("variable_window_token_starts", starts), ("variable_window_token_ends", ends)):
        if t is None:
            V.fail(f"{name}: required for mask_type='variable_window'")
        V.tensor(name, t, dtypes=(torch.int32,), ndim=2, inner_contiguous=True)
        if tuple(t.shape) != (B, Sq):
            V.fail(f"{name}: expected shape [B, Sq] = [{B}, {Sq}], got {tuple(t.shape)}")
        if t.device != q.device:
            V.fail(f"{name}: is on {t.device}, expected q's device {q.device}")
    if starts.stride() != ends.stride():
        V.fail("variable_window_token_ends: must have the same strides as variable_window_token_starts")
    if not V.tracing():
        s, e = V.host_values(starts, ends)
        s, e = s.reshape(B, Sq), e.reshape(B, Sq)
        if (s < 0).any():
            V.fail("variable_window_token_starts: must be >= 0")
        if (s > e).any():
            b, i = V.first(s > e)
            V.fail(f"variable_window_token_starts: start > end at [{b}, {i}] ({int(s[b, i])} > {int(e[b, i])})")
        if (e >= sk).any():
            V.fail(f"variable_window_token_ends: every end must be < Sk = {sk}")


class BatchPrefillTSWrapper:
    """Plan once, run many times (``run`` is CUDA-graph capturable).

    ``plan(q, k, v, ...)`` validates the problem (fixed ``[B, S, H, D]``, or packed
    ``[T, H, D]`` with ``qo_indptr`` and ``kv_indptr``, whose values it reads once on the
    host), builds the heavy-first work list, chooses and loads the kernel and prepares its
    launch. It binds the offset tensors (and a variable window's bound tensors): ``run``
    reads their values on the device, so a replay may use changed values in place as long
    as the batch, the totals and each request's query length bound stay as planned and,
    for causal masks, every request keeps ``Sq <= Sk``.

    ``run(q, k, v, out=...)`` checks its tensors against the plan (shapes, dtypes,
    device), does no host synchronisation and allocates nothing when ``out`` is given.
    ``tuning`` selects kernel variants (tests and A/B runs; the default is the measured one).
    """

    def __init__(self, *, tuning: Optional[Tuning] = None):
        self.tuning, self._tuning_code = V.tuning(tuning)
        self._plan: Optional[PrefillPlan] = None

    def plan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
        mask_type: str = "dense",
        window_left: int = -1,
        sm_scale: Optional[float] = None,
        output_scale: float = 1.0,
        out_dtype: Optional[torch.dtype] = None,
        variable_window_token_starts: Optional[torch.Tensor] = None,
        variable_window_token_ends: Optional[torch.Tensor] = None,
    ) -> None:
        self._plan = self._make_plan(q, k, v, qo_indptr, kv_indptr, mask_type, window_left, sm_scale, output_scale,
                                     out_dtype, variable_window_token_starts, variable_window_token_ends,
                                     exact=False)

    def _make_plan(self, q, k, v, qo_indptr, kv_indptr, mask_type, window_left, sm_scale, output_scale, out_dtype,
                   starts, ends, exact: bool) -> PrefillPlan:
        """The plan; `exact`: the work list covers each request's planned query tiles only (a
        one-shot, whose values cannot change), else every request up to the longest (a replay
        may move queries between requests within that bound)."""
        if (qo_indptr is None) != (kv_indptr is None):
            V.fail("qo_indptr/kv_indptr: packed-ragged storage needs both offset tensors (qo_indptr and kv_indptr "
                   "must be provided together); got only " + ("qo_indptr" if qo_indptr is not None else "kv_indptr"))
        packed = qo_indptr is not None
        d, group, hq = _check_qkv(q, k, v, packed)
        mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
        device = V.same_device([("q", q), ("k", k), ("v", v), ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                                ("variable_window_token_starts", starts), ("variable_window_token_ends", ends)])
        sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(d))
        output_scale = V.scale("output_scale", output_scale)
        odt = V.out_dtype(out_dtype, None, q.dtype)
        work = None
        if packed:
            if mask_type == "variable_window":
                V.fail("mask_type: 'variable_window' is supported only for fixed [B, S, H, D] storage, not packed")
            if starts is not None or ends is not None:
                V.fail("variable_window_token_starts: only valid with mask_type='variable_window'")
            V.int32_vector("qo_indptr", qo_indptr)
            V.int32_vector("kv_indptr", kv_indptr)
            if qo_indptr.shape[0] != kv_indptr.shape[0] or qo_indptr.shape[0] < 2:
                V.fail(f"qo_indptr/kv_indptr: expected two [B+1] tensors with B >= 1, got shapes "
                       f"{tuple(qo_indptr.shape)} and {tuple(kv_indptr.shape)}")
            batch = V.batch_size("qo_indptr", qo_indptr.shape[0] - 1)
            if V.tracing():
                max_q_len = q.shape[0]  # traced: values unreadable; a safe bound and the implicit tile order
            else:
                qo, kvo = V.host_values(qo_indptr, kv_indptr)
                V.values_indptr("qo_indptr", qo, q.shape[0], "q.shape[0]")
                V.values_indptr("kv_indptr", kvo, k.shape[0], "k.shape[0]")
                q_lens, kv_lens = qo[1:] - qo[:-1], kvo[1:] - kvo[:-1]
                if mask_type == "causal":
                    check_causal_lengths(q_lens, kv_lens, "qo_indptr")
                max_q_len = int(q_lens.max())
                work = plan_work(device, q_lens, kv_lens, max_q_len, exact, mask_type, window_left, q.dtype, d,
                                 self.tuning)
        else:
            batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
            V.batch_size("q", batch)
            if sk < 1:
                V.fail(f"k: needs at least one key per request, got shape {tuple(k.shape)}")
            if mask_type == "causal" and sq > sk:
                V.fail(f"q: bottom-right causal context requires Sq <= Sk; got Sq={sq}, Sk={sk}")
            if mask_type == "variable_window":
                if window_left != -1:
                    V.fail("window_left: must be -1 with mask_type='variable_window'")
                _check_varwin(starts, ends, q, sk)
            elif starts is not None or ends is not None:
                V.fail("variable_window_token_starts: only valid with mask_type='variable_window'")
            max_q_len = sq
        static = launch = None
        if not V.tracing():
            static = K.PrefillStatic(q.dtype, d, hq, hq // group, mask_type, window_left, sm_scale, output_scale, odt,
                                     batch, max_q_len, work.shape[0] if work is not None else None, packed,
                                     sq=0 if packed else q.shape[1], sk=0 if packed else k.shape[1], tuning=self.tuning)
            launch = _prepare(static, device, (qo_indptr, kv_indptr, starts, ends, work), own=not exact)
        return PrefillPlan(static, (mask_type, window_left, sm_scale, output_scale, max_q_len), packed, device,
                           q.dtype, odt, q.shape, k.shape, qo_indptr, kv_indptr, starts, ends, work, launch,
                           self._tuning_code)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("plan() must be called before run()")
        o = _dispatch.fast_output(plan.launch, out, plan.q_shape, plan.out_dtype, plan.device)
        if o is not None and plan.launch.again(q, k, v, o):
            return o
        dev, dt = plan.device, plan.dtype
        fast = (V.matches(q, plan.q_shape, dt, dev) and V.matches(k, plan.k_shape, dt, dev)
                and V.matches(v, plan.k_shape, dt, dev))
        if not fast:
            _check_against_plan(plan, q, k, v)
        return _launch(plan, q, k, v, out, fast)


def _launch(plan: PrefillPlan, q, k, v, out, fast: bool = True) -> torch.Tensor:
    """A run's (or a one-shot's) launch of tensors checked against the plan (`fast`: laid out
    as planned): `out` checked, then the prepared kernel, or the op where a tracer, a mode or
    a subclass must see the call."""
    dev = plan.device
    if out is not None:
        V.out_tensor(out, plan.q_shape, plan.out_dtype, dev, (("q", q), ("k", k), ("v", v)) + plan.bound)
    if fast and plan.launch is not None and _dispatch.plain_eager(out):
        if out is None:
            out = torch.empty(plan.q_shape, dtype=plan.out_dtype, device=dev)
        plan.launch.run(q, k, v, out, plan.qo_indptr, plan.kv_indptr, plan.window_starts, plan.window_ends,
                        plan.work)
        return out
    V.run_layout((("q", q), ("k", k), ("v", v)))
    return _dispatch.call(torch.ops.prims_ts.batch_prefill, torch.ops.prims_ts.batch_prefill_out, _run,
                          (q, k, v), plan.op_args(), out, plan.out_dtype, plan.tuning_code)


def _prepare(static, device: torch.device, bound, own: bool = True):
    """The prepared launch of a plan, loaded now (None on the CPU, or while traced or captured:
    the first op call prepares it then): the plan's own copy (`bound`: the plan's tensors), or
    for a one-shot, whose plan runs once, the shared one (``own`` False)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    shared = K.prepared(static, device.index)
    return _dispatch.plan_launch(shared, bound) if own else shared


def _check_against_plan(plan: PrefillPlan, q, k, v) -> None:
    """The run's q, k and v against the plan (a precise error; nothing when they match)."""
    _check_qkv(q, k, v, plan.packed)
    for name, t, shape in (("q", q, plan.q_shape), ("k", k, plan.k_shape), ("v", v, plan.k_shape)):
        if t.shape != shape:
            V.fail(f"{name} must have shape {tuple(shape)} (the plan's), got {tuple(t.shape)}")
        if t.dtype != plan.dtype:
            V.fail(f"{name}: dtype {V._dtype_name(t.dtype)} differs from the planned {V._dtype_name(plan.dtype)}")
        if t.device != plan.device:
            V.fail(f"{name} must be on the planned device {plan.device}, got {t.device}")


def batch_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qo_indptr: Optional[torch.Tensor] = None,
    kv_indptr: Optional[torch.Tensor] = None,
    mask_type: str = "dense",
    window_left: int = -1,
    variable_window_token_starts: Optional[torch.Tensor] = None,
    variable_window_token_ends: Optional[torch.Tensor] = None,
    sm_scale: Optional[float] = None,
    output_scale: float = 1.0,
    out_dtype: Optional[torch.dtype] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One-shot fixed ``[B, S, H, D]`` or packed-ragged ``[T, H, D]`` context attention: a
    :class:`BatchPrefillTSWrapper`'s plan and launch (over the shared prepared kernel: a plan
    used once needs no copy of its own).

    Packed storage reads ``qo_indptr``/``kv_indptr`` on the host to validate them and build
    the heavy-first work list, so this function is not CUDA-graph capturable; plan a wrapper
    for that. Fixed storage reads nothing on the host except the variable-window bounds it
    validates.
    """
    plan = BatchPrefillTSWrapper()._make_plan(q, k, v, qo_indptr, kv_indptr, mask_type, window_left, sm_scale,
                                              output_scale, V.resolve_out_dtype(out_dtype, out, q),
                                              variable_window_token_starts, variable_window_token_ends, exact=True)
    return _launch(plan, q, k, v, out)  # the plan checked q, k and v
