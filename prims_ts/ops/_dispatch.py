"""How a public function reaches its custom op: one shared rule for every API.

Traced calls (torch.compile, torch.export), fake or functional tensors, tensor
subclasses and active torch-function / dispatch modes go through
``torch.ops.prims_ts.*`` so that the op, its fake and its mutation contract are what
the tracer sees. A plain eager call on CUDA tensors runs the op's CUDA implementation
directly instead: the dispatcher's Python custom-op layer (argument defaults,
autograd and in-place/view redispatch) costs about as much host time as a whole
decode kernel takes on the GPU, and does nothing for such a call.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch._C import _is_torch_function_mode_enabled, _len_torch_dispatch_stack

from ..cuda.keys import Accepted
from . import _validate as V


def plain_eager(out: Optional[torch.Tensor] = None, traced: Optional[bool] = None) -> bool:
    """Nothing traces or intercepts this call (and ``out``, if given, is a plain tensor): a run
    whose other tensors already matched its plan may launch its prepared kernel directly.
    ``traced``: the caller's ``V.tracing()``, if it has it."""
    return ((out is None or type(out) is torch.Tensor) and not (V.tracing() if traced is None else traced)
            and not _is_torch_function_mode_enabled() and not _len_torch_dispatch_stack())


def launchable(query: torch.Tensor, out: Optional[torch.Tensor], traced: Optional[bool] = None) -> bool:
    """A standalone call whose static checks passed may launch its prepared kernel directly: a
    plain eager call (see ``plain_eager``) on a plain CUDA ``query``."""
    return type(query) is torch.Tensor and query.is_cuda and plain_eager(out, traced)


def eager_direct(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """True when an eager call on these tensors may skip the dispatcher."""
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or not t.is_cuda):
            return False
    return plain_eager()


def call(functional_op: Callable, out_op: Callable, run: Callable, inputs: tuple, args: tuple,
         out: Optional[torch.Tensor], out_dtype: torch.dtype, tuning: str = "",
         out_shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``out_op(*inputs, out, *args, tuning)`` or ``functional_op(*inputs, *args, dtype_code(out_dtype),
    tuning)``.

    `run(*inputs, out, *args, tuning)` is the implementation both ops call; the functional op
    allocates ``out`` as ``empty(out_shape, out_dtype)`` first (``out_shape`` defaults to
    ``inputs[0].shape``, and must be what the functional op allocates).
    """
    if eager_direct(inputs + (out,) + tuple(a for a in args if isinstance(a, torch.Tensor))):
        if out is None:
            shape = inputs[0].shape if out_shape is None else out_shape
            out = torch.empty(shape, dtype=out_dtype, device=inputs[0].device)
        run(*inputs, out, *args, tuning)
        return out
    if out is None:
        return functional_op(*inputs, *args, V.dtype_code(out_dtype), tuning)
    out_op(*inputs, out, *args, tuning)
    return out


def plan_launch(prepared, bound: Sequence[Optional[torch.Tensor]], aligned: int = 4, loose: Sequence[int] = ()):
    """A plan's own copy of a prepared launch (``cuda.keys.Prepared.for_plan``), whose fast runs
    keep their output clear of ``bound``, the tensors the plan holds (see ``cuda.keys.Accepted``
    for ``aligned`` and ``loose``)."""
    return prepared.for_plan(Accepted(aligned, [V.span(t) for t in bound if t is not None], loose))


def fast_output(launch, out: Optional[torch.Tensor], shape, dtype: torch.dtype,
                device: torch.device) -> Optional[torch.Tensor]:
    """Where a plan's run may try its fast path (``launch.again``): ``out``, or a new output; None
    when the plan has no prepared launch or the call is not plain eager (``plain_eager``)."""
    if launch is None or not plain_eager(out):
        return None
    return torch.empty(shape, dtype=dtype, device=device) if out is None else out
