"""batch_prefill: contiguous (fixed or packed-ragged) context attention.

Public: ``batch_prefill`` (one-shot) and ``BatchPrefillTSWrapper`` (plan/run).
Ops:    ``torch.ops.prims_ts.batch_prefill`` (functional) and
        ``torch.ops.prims_ts.batch_prefill_out`` (writes ``out``).
Fakes:  ``prims_ts/meta/prefill.py``; CPU kernel: ``prims_ts.reference``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .. import reference
from . import _dispatch
from . import _validate as V

MASKS = ("dense", "causal", "variable_window")
HEAD_DIMS = (128, 256)


# ----------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------


def _run(q, k, v, out, qo_indptr, kv_indptr, win_starts, win_ends, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len) -> None:
    if out.numel() == 0:
        return
    if q.device.type == "cuda":
        from ..cuda import kernels

        kernels.launch_prefill(q, k, v, out, qo_indptr, kv_indptr, win_starts, win_ends, work, mask_type,
                               window_left, sm_scale, output_scale, max_q_len)
    else:
        res = reference.batch_prefill(
            q, k, v, qo_indptr=qo_indptr, kv_indptr=kv_indptr, mask_type=mask_type, window_left=window_left,
            window_starts=win_starts, window_ends=win_ends, sm_scale=sm_scale, output_scale=output_scale,
            compute_dtype=torch.float32)
        out.copy_(res)


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
) -> None:
    """Writes attention into ``out``. Arguments are trusted: validate first."""
    _run(q, k, v, out, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len)


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
) -> torch.Tensor:
    """Functional form of ``batch_prefill_out``: returns a new output tensor."""
    out = torch.empty(q.shape, dtype=V.code_dtype(out_dtype), device=q.device)
    _run(q, k, v, out, qo_indptr, kv_indptr, window_starts, window_ends, work, mask_type, window_left, sm_scale,
         output_scale, max_q_len)
    return out


# ----------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------


@dataclass
class PrefillPlan:
    """Static facts of one prefill problem: everything the op needs besides tensors."""

    packed: bool
    batch: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    mask_type: str
    window_left: int
    sm_scale: float
    output_scale: float
    out_dtype: torch.dtype
    max_q_len: int
    work: Optional[torch.Tensor]  # int32 [n, 2] (request, q tile), heaviest first; None: implicit order


def work_list(q_lens: Sequence[int], kv_lens: Sequence[int], mask_type: str, window_left: int,
              tile_m: int) -> List[Tuple[int, int]]:
    """(request, q tile) items ordered by decreasing cost (K/V rows visited)."""
    items = []
    for b, (sq, sk) in enumerate(zip(q_lens, kv_lens)):
        for qt in range((sq + tile_m - 1) // tile_m):
            q0, q1 = qt * tile_m, min(sq, (qt + 1) * tile_m)
            if mask_type == "causal":
                end = max(0, min(sk, sk - sq + q1))
                begin = max(0, sk - sq + q0 - window_left) if window_left >= 0 else 0
                cost = max(0, end - begin)
            else:
                cost = sk
            items.append((cost, b, qt))
    items.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(b, qt) for _, b, qt in items]


def _work_tensor(items: List[Tuple[int, int]], device: torch.device) -> torch.Tensor:
    if not items:
        return torch.zeros((0, 2), dtype=torch.int32, device=device)
    return torch.tensor(items, dtype=torch.int32).to(device)


def _tile_m(dtype: torch.dtype, head_dim: int, mask_type: str, device: torch.device) -> int:
    """The q tile height of the kernel that will run on `device` (work lists count its tiles)."""
    from ..cuda.kernels import prefill_tile_m

    return prefill_tile_m(dtype, head_dim, mask_type, device)


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


def _check_varwin(starts, ends, q: torch.Tensor, sk: int, read_values: bool) -> None:
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
    if read_values:
        s, e = starts.cpu(), ends.cpu()
        if bool((s < 0).any()):
            V.fail("variable_window_token_starts: must be >= 0")
        if bool((s > e).any()):
            b, i = (s > e).nonzero()[0].tolist()
            V.fail(f"variable_window_token_starts: start > end at [{b}, {i}] ({int(s[b, i])} > {int(e[b, i])})")
        if bool((e >= sk).any()):
            V.fail(f"variable_window_token_ends: every end must be < Sk = {sk}")


def plan_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr,
    kv_indptr,
    mask_type,
    window_left,
    starts,
    ends,
    sm_scale,
    output_scale,
    out_dtype,
    out,
) -> PrefillPlan:
    """Full host validation of a one-shot call and the plan it runs with."""
    if (qo_indptr is None) != (kv_indptr is None):
        V.fail("qo_indptr/kv_indptr: packed-ragged storage needs both offset tensors; got only "
               + ("qo_indptr" if qo_indptr is not None else "kv_indptr"))
    packed = qo_indptr is not None
    d, group, hq = _check_qkv(q, k, v, packed)
    mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
    device = V.same_device([("q", q), ("k", k), ("v", v), ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                            ("variable_window_token_starts", starts), ("variable_window_token_ends", ends)])
    sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(d))
    output_scale = V.scale("output_scale", output_scale)
    odt = V.out_dtype(out_dtype, out, q.dtype)
    if out_dtype is not None and out is not None and out.dtype != out_dtype:
        V.fail(f"out: dtype {out.dtype} disagrees with out_dtype {out_dtype}")
    V.out_tensor(out, q.shape, odt, device, [("q", q), ("k", k), ("v", v), ("qo_indptr", qo_indptr),
                                             ("kv_indptr", kv_indptr), ("variable_window_token_starts", starts),
                                             ("variable_window_token_ends", ends)])
    read = not V.tracing()
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
        batch = qo_indptr.shape[0] - 1
        if read:
            qo = qo_indptr.tolist()
            kvo = kv_indptr.tolist()
            V.values_indptr("qo_indptr", qo, q.shape[0], "q.shape[0]")
            V.values_indptr("kv_indptr", kvo, k.shape[0], "k.shape[0]")
            q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
            kv_lens = [kvo[i + 1] - kvo[i] for i in range(batch)]
            if mask_type == "causal":
                for b, (sq, sk) in enumerate(zip(q_lens, kv_lens)):
                    if sq > sk:
                        V.fail(f"qo_indptr: causal masking needs Sq <= Sk, but request {b} has Sq={sq} > Sk={sk}")
            max_q_len = max(q_lens)
            if q.is_cuda:
                work = _work_tensor(work_list(q_lens, kv_lens, mask_type, window_left,
                                              _tile_m(q.dtype, d, mask_type, device)), device)
        else:
            max_q_len = q.shape[0]  # traced: a safe bound, implicit tile order
    else:
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        if sk < 1:  # as packed storage (strictly increasing kv_indptr) and the wrapper's kv_len
            V.fail(f"k: needs at least one key per request, got shape {tuple(k.shape)}")
        if mask_type == "causal" and sq > sk:
            V.fail(f"q: causal masking needs Sq <= Sk, got Sq={sq} > Sk={sk}")
        if mask_type == "variable_window":
            if window_left != -1:
                V.fail("window_left: must be -1 with mask_type='variable_window'")
            _check_varwin(starts, ends, q, sk, read)
        elif starts is not None or ends is not None:
            V.fail("variable_window_token_starts: only valid with mask_type='variable_window'")
        max_q_len = sq
    return PrefillPlan(packed, batch, hq, hq // group, d, mask_type, window_left, sm_scale, output_scale, odt,
                       max_q_len, work)


def _call(plan: PrefillPlan, q, k, v, qo_indptr, kv_indptr, starts, ends, out):
    args = (qo_indptr, kv_indptr, starts, ends, plan.work, plan.mask_type, plan.window_left, plan.sm_scale,
            plan.output_scale, plan.max_q_len)
    return _dispatch.call(torch.ops.prims_ts.batch_prefill, torch.ops.prims_ts.batch_prefill_out, _run, (q, k, v),
                          args, out, plan.out_dtype)


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
    """One-shot fixed ``[B, S, H, D]`` or packed-ragged ``[T, H, D]`` context attention.

    Packed storage reads ``qo_indptr``/``kv_indptr`` on the host to validate them
    and build the heavy-first work list, so this function is not CUDA-graph
    capturable; plan a :class:`BatchPrefillTSWrapper` for that. Fixed storage
    reads nothing on the host except the variable-window bounds it validates.
    """
    plan = plan_prefill(q, k, v, qo_indptr, kv_indptr, mask_type, window_left, variable_window_token_starts,
                        variable_window_token_ends, sm_scale, output_scale, out_dtype, out)
    return _call(plan, q, k, v, qo_indptr, kv_indptr, variable_window_token_starts, variable_window_token_ends,
                 out)


class BatchPrefillTSWrapper:
    """Plan once, run many times (CUDA-graph capturable run).

    ``plan`` takes either packed offsets (``qo_indptr``/``kv_indptr``; their values
    are read now, and the same tensors are bound to every ``run``) or a fixed
    shape (``batch_size``, ``q_len``, ``kv_len``). ``run`` does no host
    synchronisation and allocates nothing when ``out`` is given. A replay may use
    changed offset *values* as long as every request's query length stays within
    its planned length (or ``max_q_len`` when given), the totals stay equal to the
    planned ones and, for causal masks, each request keeps ``Sq <= Sk``.
    """

    def __init__(self, device: Optional[torch.device | str] = None):
        self.device = torch.device(device) if device is not None else None
        self._plan: Optional[PrefillPlan] = None

    def plan(
        self,
        qo_indptr: Optional[torch.Tensor] = None,
        kv_indptr: Optional[torch.Tensor] = None,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        batch_size: Optional[int] = None,
        q_len: Optional[int] = None,
        kv_len: Optional[int] = None,
        max_q_len: Optional[int] = None,
        mask_type: str = "dense",
        window_left: int = -1,
        sm_scale: Optional[float] = None,
        output_scale: float = 1.0,
        q_data_type: torch.dtype = torch.bfloat16,
        out_dtype: Optional[torch.dtype] = None,
    ) -> None:
        if (qo_indptr is None) != (kv_indptr is None):
            V.fail("qo_indptr/kv_indptr: packed-ragged storage needs both offset tensors")
        packed = qo_indptr is not None
        V.integer("num_qo_heads", num_qo_heads, minimum=1)
        V.integer("num_kv_heads", num_kv_heads, minimum=1)
        V.heads(num_qo_heads, num_kv_heads, ("num_qo_heads", "num_kv_heads"))
        d = V.head_dim("head_dim", V.integer("head_dim", head_dim), HEAD_DIMS)
        V.input_dtype("q_data_type", q_data_type)
        mask_type, window_left = V.mask_and_window(mask_type, window_left, MASKS)
        sm_scale = V.scale("sm_scale", sm_scale, default=1.0 / math.sqrt(d))
        output_scale = V.scale("output_scale", output_scale)
        odt = V.out_dtype(out_dtype, None, q_data_type)
        if packed:
            if mask_type == "variable_window":
                V.fail("mask_type: 'variable_window' is supported only for fixed storage, not packed")
            V.int32_vector("qo_indptr", qo_indptr)
            V.int32_vector("kv_indptr", kv_indptr, length=qo_indptr.shape[0])
            if qo_indptr.shape[0] < 2:
                V.fail("qo_indptr: expected [B+1] with B >= 1")
            V.same_device([("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)])
            device = self.device or qo_indptr.device
            qo, kvo = qo_indptr.tolist(), kv_indptr.tolist()
            V.values_indptr("qo_indptr", qo, qo[-1], "its last entry")
            V.values_indptr("kv_indptr", kvo, kvo[-1], "its last entry")
            batch = len(qo) - 1
            q_lens = [qo[i + 1] - qo[i] for i in range(batch)]
            kv_lens = [kvo[i + 1] - kvo[i] for i in range(batch)]
            if mask_type == "causal":
                for b, (sq, sk) in enumerate(zip(q_lens, kv_lens)):
                    if sq > sk:
                        V.fail(f"qo_indptr: causal masking needs Sq <= Sk, but request {b} has Sq={sq} > Sk={sk}")
            if max_q_len is not None:
                V.integer("max_q_len", max_q_len, minimum=max(q_lens))
                bound_q = [max_q_len] * batch
            else:
                bound_q = q_lens
            work = _work_tensor(work_list(bound_q, kv_lens, mask_type, window_left,
                                          _tile_m(q_data_type, d, mask_type, device)), device)
            totals, indptr_pair = (qo[-1], kvo[-1]), (qo_indptr, kv_indptr)
            max_len = max(bound_q)
        else:
            for name, val in (("batch_size", batch_size), ("q_len", q_len), ("kv_len", kv_len)):
                if val is None:
                    V.fail(f"{name}: required when planning fixed storage (no qo_indptr/kv_indptr)")
                V.integer(name, val, minimum=1)
            if mask_type == "causal" and q_len > kv_len:
                V.fail(f"q_len: causal masking needs Sq <= Sk, got {q_len} > {kv_len}")
            if max_q_len is not None and max_q_len != q_len:
                V.fail(f"max_q_len: fixed storage has q_len={q_len} queries per request; leave max_q_len unset "
                       f"or equal to it, got {max_q_len}")
            batch, max_len, work = batch_size, q_len, None
            totals, indptr_pair = (batch_size, q_len, kv_len), (None, None)
        from ..cuda import kernels

        # the kernel compiled and loaded now, not in run (no device named: the current CUDA one)
        kernels.warm_prefill(self.device or (qo_indptr.device if packed else None), q_data_type, d, mask_type)
        self._plan = PrefillPlan(packed, batch, num_qo_heads, num_kv_heads, d, mask_type, window_left, sm_scale,
                                 output_scale, odt, max_len, work)
        self._totals, self._indptr = totals, indptr_pair
        self._dtype = q_data_type

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        out: Optional[torch.Tensor] = None,
        variable_window_token_starts: Optional[torch.Tensor] = None,
        variable_window_token_ends: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("BatchPrefillTSWrapper.run: call plan(...) first")
        d, group, hq = _check_qkv(q, k, v, plan.packed)
        if q.dtype != self._dtype:
            V.fail(f"q: dtype {q.dtype} differs from the planned q_data_type {self._dtype}")
        if hq != plan.num_qo_heads or k.shape[-2] != plan.num_kv_heads or d != plan.head_dim:
            V.fail(f"q/k: heads and head dim ({hq}, {k.shape[-2]}, {d}) differ from the plan "
                   f"({plan.num_qo_heads}, {plan.num_kv_heads}, {plan.head_dim})")
        if plan.packed:
            if q.shape[0] != self._totals[0] or k.shape[0] != self._totals[1]:
                V.fail(f"q/k: token counts ({q.shape[0]}, {k.shape[0]}) differ from the planned totals "
                       f"{self._totals}")
        else:
            if (q.shape[0], q.shape[1], k.shape[1]) != self._totals:
                V.fail(f"q/k: (B, Sq, Sk) = {(q.shape[0], q.shape[1], k.shape[1])} differs from the plan "
                       f"{self._totals}")
        qo_indptr, kv_indptr = self._indptr
        starts, ends = variable_window_token_starts, variable_window_token_ends
        device = V.same_device([("q", q), ("k", k), ("v", v), ("qo_indptr", qo_indptr),
                                ("variable_window_token_starts", starts)])
        if plan.mask_type == "variable_window":
            _check_varwin(starts, ends, q, k.shape[1], read_values=False)
        elif starts is not None or ends is not None:
            V.fail("variable_window_token_starts: only valid when the plan's mask_type is 'variable_window'")
        V.out_tensor(out, q.shape, plan.out_dtype, device,
                     [("q", q), ("k", k), ("v", v), ("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                      ("variable_window_token_starts", starts), ("variable_window_token_ends", ends)])
        return _call(plan, q, k, v, qo_indptr, kv_indptr, starts, ends, out)
