"""Shared host-side checks. Every public API validates through these helpers so
that one rule produces one message everywhere.

All checks raise ``ValueError`` (``TypeError`` for a wrong Python type) naming
the argument and what was expected, before any kernel launches. Checks that
read tensor *values* are in ``values_*`` helpers; callers skip them where the
contract says metadata is trusted (capturable run paths, traced graphs).
"""
from __future__ import annotations

import math
import operator
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..cuda import runtime
from ..cuda.keys import DEFAULT_TUNING, MEMO_LIMIT, BoundedMemo, Tuning

INPUT_DTYPES = (torch.float16, torch.bfloat16)
OUTPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fail(msg: str) -> None:
    raise ValueError(msg)


def tracing() -> bool:
    """True while torch.compile / torch.export trace the caller: values are not readable."""
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        return False


def meta(t) -> tuple:
    """A tensor's static facts (type, shape, dtype, strides, device: what static checks read), a
    tuple's or list's (a (K, V) cache), or another value with its type (True is not 1)."""
    if type(t) is torch.Tensor:  # the common case, its type implied (a call's keys are built per call)
        return (t.shape, t.dtype, t.stride(), t.device)
    if isinstance(t, torch.Tensor):
        return (type(t), t.shape, t.dtype, t.stride(), t.device)
    if isinstance(t, (tuple, list)):
        return (type(t),) + tuple(meta(x) for x in t)
    return (type(t), t)


def meta_loose(t) -> tuple:
    """``meta`` of a 1-D metadata tensor whose length may change from call to call (a serving
    loop's ``paged_kv_indices`` slice): its dtype, strides, contiguity and device, not its shape
    (the caller reads its length per call)."""
    if type(t) is torch.Tensor:
        return (None, t.dtype, t.stride(), t.is_contiguous(), t.device)
    return meta(t)


def metas(operands: Sequence[object], loose=()) -> tuple:
    """Each operand's ``meta`` (``meta_loose`` at the positions in ``loose``): a call's static key."""
    return tuple([meta_loose(t) if i in loose else meta(t) for i, t in enumerate(operands)])


try:  # one C-level compare of many tensors' layouts (dynamo's guard of a compiled frame's inputs)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except Exception:  # pragma: no cover - a torch without it: Layouts compares attribute by attribute
    _TensorGuards = None


def _getter(idx: Tuple[int, ...]):
    """``ops -> tuple(ops[i] for i in idx)`` in one C call (itemgetter returns a bare item for one index)."""
    if len(idx) == 1:
        i = idx[0]
        return lambda ops: (ops[i],)
    return operator.itemgetter(*idx)


class Layouts:
    """The layouts of a call's operands (plain tensors or None), recorded once: ``matches`` says
    whether another call's operands are laid out the same, each with the same ``meta`` (at
    ``loose`` positions, 1-D metadata whose length may change from call to call, ``meta_loose``).
    ``key`` is that tuple of metas. Where torch has dynamo's ``TensorGuards``, a match costs one
    C-level check of every tensor (it also compares the tensors' dispatch keys under the current
    mode and ``requires_grad``); when it refuses operands whose metas match (under another
    mode, say ``inference_mode``), the metas decide and the guard is recorded again for the new
    state."""

    __slots__ = ("loose", "key", "guard", "pick", "nones", "want_nones")

    def __init__(self, operands: Sequence[Optional[torch.Tensor]], loose: Sequence[int] = (),
                 key: Optional[tuple] = None):
        self.loose = frozenset(loose)
        self.key = metas(operands, self.loose) if key is None else key
        present = tuple(i for i, t in enumerate(operands) if t is not None)
        nones = tuple(i for i, t in enumerate(operands) if t is None)
        self.pick = _getter(present) if nones and present else None
        self.nones = _getter(nones) if nones else None
        self.want_nones = (None,) * len(nones)
        self._guard(operands)

    @staticmethod
    def of(operands: Sequence[object], loose: Sequence[int] = (), key: Optional[tuple] = None) -> Optional["Layouts"]:
        """The operands' layouts, or None when one is not a plain tensor or None."""
        for t in operands:
            if t is not None and type(t) is not torch.Tensor:
                return None
        return Layouts(operands, loose, key)

    def _guard(self, operands) -> None:
        self.guard = None
        idx = [i for i, t in enumerate(operands) if t is not None]
        # a loose operand's guard leaves its length open: only a unit stride then implies its contiguity
        if _TensorGuards is None or not idx or any(
                operands[i] is not None and operands[i].stride() != (1,) for i in self.loose):
            return
        present = [operands[i] for i in idx]
        try:
            self.guard = _TensorGuards(
                *present,
                dynamic_dims_sizes=[[None] if i in self.loose else list(t.shape) for i, t in zip(idx, present)],
                dynamic_dims_strides=[list(t.stride()) for t in present])
        except Exception:  # pragma: no cover - another torch's signature: the metas decide
            self.guard = None

    def matches(self, operands: Sequence[Optional[torch.Tensor]]) -> bool:
        g = self.guard
        if g is not None:
            if self.nones is None:
                if g.check(*operands):
                    return True
            elif self.nones(operands) == self.want_nones and (self.pick is None or g.check(*self.pick(operands))):
                return True
        if len(operands) != len(self.key) or metas(operands, self.loose) != self.key:
            return False
        self._guard(operands)  # the same metas, refused by the guard under another state: record it for that
        return True


class StaticMemo(BoundedMemo):
    """``checked_once``'s memo: the results of one call site's static checks under their keys,
    and the last call's key as ``Layouts`` (``last``), which a serving loop's next call matches
    with one compare."""

    def __init__(self, limit: int = MEMO_LIMIT):
        super().__init__(limit)
        self.last = None  # (scalars, their types, Layouts, result)


def cache_operands(kv_cache) -> tuple:
    """A K/V cache argument as operands: its (K, V) pair, or the one combined tensor (whatever
    the caller passed: the checks name a bad one)."""
    return tuple(kv_cache) if isinstance(kv_cache, (tuple, list)) else (kv_cache,)


def launch_memo() -> BoundedMemo:
    """A one-shot static key's memo of the launch keys its plans took, by the values those
    depend on (lengths): small, as a server's lengths vary from call to call."""
    return BoundedMemo(64)


def memo() -> StaticMemo:
    """A memo of static checks (``checked_once``), bounded like the prepared launches'."""
    return StaticMemo(MEMO_LIMIT)


def checked_once(memo: StaticMemo, operands: tuple, scalars: tuple, check, *args, traced: Optional[bool] = None,
                 loose: Sequence[int] = ()):
    """``check(*args)``, the static checks of a call (they read no tensor value or address), once
    per static key: the layouts of ``operands`` (tensors or None, each its ``meta``; at ``loose``
    positions ``meta_loose``) and the other arguments ``scalars``, each with its type (True is
    not 1). Then its memoised result: first against the last call's key (``Layouts``, one
    compare), then the memo of every key. While traced, or with an argument that cannot be a
    key, every time (the checks name a bad one), and nothing is kept. Only a result is kept: a
    call that fails its checks is checked again next time. ``traced``: the caller's
    ``tracing()``, if it has it."""
    if tracing() if traced is None else traced:
        return check(*args)
    last = memo.last
    types = tuple(map(type, scalars))
    if last is not None and last[1] == types and last[0] == scalars and last[2].matches(operands):
        return last[3]
    static = metas(operands, loose)
    try:
        key = static + types + scalars
        got = memo.get(key)
    except TypeError:  # an unhashable argument
        return check(*args)
    if got is None:
        got = memo.put(key, check(*args))
    layouts = Layouts.of(operands, loose, static)
    memo.last = None if layouts is None else (scalars, types, layouts, got)
    return got


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def tensor(
    name: str,
    t,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[Iterable[int] | int] = None,
    inner_contiguous: bool = False,
    contiguous: bool = False,
    vector_aligned: bool = False,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(f"{name}: dtype {_dtype_name(t.dtype)} is not supported; expected one of "
             f"{', '.join(_dtype_name(d) for d in dtypes)}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            fail(f"{name}: expected a tensor of rank {' or '.join(map(str, allowed))}, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        fail(f"{name}: must be contiguous")
    if inner_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(f"{name}: the last dimension must be contiguous (stride 1), got strides {tuple(t.stride())}")
    if vector_aligned and t.dim() > 0 and t.numel() > 0 and not tracing():
        # kernels read rows with 16-byte vectors: row starts must stay 16-byte aligned
        start_aligned(name, t)
        rows_aligned(name, t)
    return t


def rows_aligned(name: str, t: torch.Tensor) -> None:
    """Rows of ``t`` are a multiple of 16 bytes apart: the strides of its outer dimensions
    (those of size > 1) times the element size (with an aligned start, every row is aligned)."""
    esz = t.element_size()
    if any((st * esz) % 16 for n, st in zip(t.shape[:-1], t.stride()[:-1]) if n > 1):
        fail(f"{name}: rows must be 16-byte aligned (strides {tuple(t.stride())}, element size {esz})")


def start_aligned(name: str, t: torch.Tensor, nbytes: int = 16) -> None:
    """``t`` starts at an ``nbytes``-aligned address (a workspace's partials are read in
    16-byte vectors; a slice at an odd offset would fault); not checked while tracing."""
    if t.numel() > 0 and not tracing() and t.data_ptr() % nbytes:
        fail(f"{name}: must start at a {nbytes}-byte aligned address (data_ptr {t.data_ptr():#x})")


def same_device(pairs: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> torch.device:
    dev = None
    first = None
    for name, t in pairs:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            fail(f"{name}: is on {t.device} but {first} is on {dev}; all tensors of one call must share a device")
    return dev


def same_dtype(pairs: Sequence[Tuple[str, torch.Tensor]]) -> torch.dtype:
    (n0, t0) = pairs[0]
    for name, t in pairs[1:]:
        if t.dtype != t0.dtype:
            fail(f"{name}: dtype {_dtype_name(t.dtype)} differs from {n0} ({_dtype_name(t0.dtype)}); "
                 "query, key and value must share one dtype")
    return t0.dtype


def input_dtype(name: str, value) -> torch.dtype:
    """A dtype argument naming the query/key/value dtype (plan's q_data_type)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name}: expected a torch.dtype, got {type(value).__name__}")
    if value not in INPUT_DTYPES:
        fail(f"{name}: {_dtype_name(value)} is not supported; expected float16 or bfloat16")
    return value


def head_dim(name: str, d: int, allowed: Sequence[int]) -> int:
    if d not in allowed:
        fail(f"{name}: head dim {d} is not supported; prims_ts supports head_dim {', '.join(map(str, allowed))}")
    return d


def heads(hq: int, hkv: int, names: Tuple[str, str] = ("q", "k")) -> int:
    """Query heads per K/V head; `names` are the caller's arguments that carry the counts."""
    if hkv < 1 or hq < 1 or hq % hkv != 0:
        fail(f"{names[0]}/{names[1]}: the Q head count ({hq}) must be divisible by the K/V head count ({hkv}) "
             "(a positive multiple of it)")
    return hq // hkv


def scale(name: str, value, default: Optional[float] = None) -> float:
    if value is None:
        if default is None:
            raise TypeError(f"{name}: expected a float, got None")
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    if tracing():
        return value  # may be symbolic under torch.compile(dynamic=True); eager calls check it
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        fail(f"{name}: must be finite and positive, got {value}")
    return v


def fast_scale(name: str, value, default: Optional[float]) -> float:
    """``scale`` for run paths: a plain positive finite float passes with two compares."""
    if value is None and default is not None:
        return default
    if type(value) is float and 0.0 < value < math.inf:
        return value
    return scale(name, value, default)


def integer(name: str, value, *, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        fail(f"{name}: must be >= {minimum}, got {value}")
    return value


def choice(name: str, value, allowed: Sequence[str]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if value not in allowed:
        fail(f"{name}: unknown value {value!r}; expected one of {', '.join(map(repr, allowed))}")
    return value


def mask_and_window(mask_type: str, window_left, allowed: Sequence[str]) -> Tuple[str, int]:
    mask_type = choice("mask_type", mask_type, allowed)
    window_left = integer("window_left", window_left)
    if window_left < -1:
        fail(f"window_left: must be -1 (no window) or >= 0, got {window_left}")
    if window_left >= 0 and mask_type != "causal":
        fail(f"window_left: a window ({window_left}) needs causal masking (a positive window_left requires "
             f"mask_type='causal', as does 0), got {mask_type!r}")
    return mask_type, window_left


def dtype_code(dtype: torch.dtype) -> int:
    """The op argument that carries an output dtype: its index in OUTPUT_DTYPES (pt::OutDtype).

    The functional ops take this int rather than a ``torch.dtype``: AOTInductor's proxy
    executor in torch 2.11 hands a serialised dtype to a Python op under another enum's
    numbering (float32 arrived as float64), an int crosses every path unchanged."""
    return OUTPUT_DTYPES.index(dtype)


def code_dtype(code: int) -> torch.dtype:
    """The output dtype of an op's ``out_dtype`` code (see dtype_code)."""
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < len(OUTPUT_DTYPES):
        fail(f"out_dtype: expected an output dtype code 0..{len(OUTPUT_DTYPES) - 1} "
             f"({', '.join(_dtype_name(d) for d in OUTPUT_DTYPES)}), got {code!r}")
    return OUTPUT_DTYPES[code]


def resolve_out_dtype(requested, out: Optional[torch.Tensor], q: torch.Tensor, name: str = "q") -> torch.dtype:
    """A one-shot's output dtype: ``out_dtype`` (``requested``), else ``out.dtype``, else the
    query's; given both, they must agree."""
    tensor(name, q, dtypes=INPUT_DTYPES)
    odt = out_dtype(requested, out, q.dtype)
    if requested is not None and isinstance(out, torch.Tensor) and out.dtype != requested:
        fail(f"out: dtype {_dtype_name(out.dtype)} disagrees with out_dtype {_dtype_name(requested)}")
    return odt


def out_dtype(out_dtype, out: Optional[torch.Tensor], default: torch.dtype, name: str = "out_dtype") -> torch.dtype:
    """The output dtype: ``out_dtype`` (the argument ``name``), else ``out.dtype``, else ``default``."""
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{name}: expected a torch.dtype, got {type(out_dtype).__name__}")
    if out_dtype is None and isinstance(out, torch.Tensor):
        if out.dtype not in OUTPUT_DTYPES:
            fail(f"out: dtype {_dtype_name(out.dtype)} is not supported; expected float16, bfloat16 or float32")
        return out.dtype
    if out_dtype is None:
        out_dtype = default
    if out_dtype not in OUTPUT_DTYPES:
        fail(f"{name}: {_dtype_name(out_dtype)} is not supported; expected float16, bfloat16 or float32")
    return out_dtype


def tuning(value):
    """A wrapper's ``tuning=``: None (the default) or a prims_ts.Tuning; returns the value and
    its op code (``Tuning.encode()``: "" for the default)."""
    if value is None:
        return DEFAULT_TUNING, ""
    if not isinstance(value, Tuning):
        raise TypeError(f"tuning: expected a prims_ts.Tuning, got {type(value).__name__}")
    return value, value.encode()


def run_layout(named) -> None:
    """What the kernels' vector accesses need of a run's tensors (each (name, tensor)): a
    contiguous last dimension, 16-byte aligned rows and start. A run that launches its prepared
    kernel directly has the launch check this (when the strides change, and the addresses every
    call); every other run (CPU, traced, intercepted) checks here, with the same errors."""
    for name, t in named:
        if t is not None:
            tensor(name, t, inner_contiguous=True, vector_aligned=True)


INT32_MAX = 2**31 - 1


def pool_strides(name: str, t: torch.Tensor, slot_dim: int = 2) -> None:
    """A paged pool [num_pages, Hkv, page_size, D] (``slot_dim`` 2) or [num_pages, page_size, D]
    (``slot_dim`` 1): page and slot strides must fit in int32 (the kernels address a page slot
    with one 32x32->64-bit multiply-add)."""
    for dim, what in ((0, "page"), (slot_dim, "slot")):
        if t.stride(dim) > INT32_MAX:
            fail(f"{name}: {what} stride {t.stride(dim)} elements exceeds int32; use a pool whose pages are "
                 f"less than 2**31 elements apart")


GRID_Z_MAX = 65535
MAX_SEQ_LEN_BOUND = 2_147_483_520  # the padded 128-key tile end of the longest key must fit in int32


def key_length_bound(name: str, value) -> int:
    """A static K/V length bound (max_seq_len, max_kv_len, ...): an int in [1, MAX_SEQ_LEN_BOUND]."""
    integer(name, value, minimum=1)
    if value > MAX_SEQ_LEN_BOUND:
        fail(f"{name}: {value} exceeds {MAX_SEQ_LEN_BOUND} (the padded K/V tile end must fit in int32)")
    return value


def row_tiles(name: str, num_kv_heads: int, rows: int, tile_rows: int) -> None:
    """Decode-shaped kernels put (K/V head, row tile) on the grid's y dimension (at most 65535)."""
    tiles = num_kv_heads * -(-rows // tile_rows)
    if tiles > GRID_Z_MAX:
        fail(f"{name}: {rows} query rows per K/V head (heads x query tokens) in tiles of {tile_rows} make "
             f"{tiles} (K/V head, row tile) blocks, more than {GRID_Z_MAX} per launch")


def batch_size(name: str, batch: int) -> int:
    """Kernels put requests on the grid's z dimension (at most 65535)."""
    if batch > GRID_Z_MAX:
        fail(f"{name}: batch size {batch} exceeds {GRID_Z_MAX} requests per launch; split the batch")
    return batch


def byte_extent(t: Optional[torch.Tensor]) -> int:
    """Bytes from ``t``'s first address to one past its last element (0: None or empty). Under a
    static key (fixed shapes and strides) a tensor's bytes are ``[data_ptr, data_ptr + this)``."""
    if t is None or t.numel() == 0:
        return 0
    if t.is_contiguous():
        return t.numel() * t.element_size()
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def span(t: torch.Tensor) -> Tuple[int, int]:
    """``t``'s bytes as an address range ``[start, end)`` (``(0, 0)`` when empty)."""
    n = byte_extent(t)
    return (t.data_ptr(), t.data_ptr() + n) if n else (0, 0)


def out_tensor(
    out: Optional[torch.Tensor],
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    inputs: Sequence[Tuple[str, Optional[torch.Tensor]]],
    aligned: bool = True,
) -> Optional[torch.Tensor]:
    """``out=``: shape, dtype, device, contiguous, no overlap with any of ``inputs``, and a
    16-byte aligned start (every kernel stores output elements in pairs or wider vectors:
    a misaligned start would fault on the GPU; ``aligned=False`` only for callers that
    never reach a kernel)."""
    if out is None:
        return None
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
    if out.shape != shape:
        fail(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        fail(f"out: expected dtype {_dtype_name(dtype)}, got {_dtype_name(out.dtype)}")
    if out.device != device:
        fail(f"out: is on {out.device}, expected {device}")
    if not out.is_contiguous():
        fail("out: must be contiguous")
    if aligned:
        out_start(out)
    no_overlap("out", out, inputs)
    return out


def out_start(out: Optional[torch.Tensor]) -> None:
    """``out``, when given and not empty, starts at a 16-byte aligned address (see ``out_tensor``)."""
    if out is not None and not tracing() and out.data_ptr() % 16 and out.numel():
        fail(f"out: must start at a 16-byte aligned address, got {out.data_ptr():#x}")


# ----------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------


def block_table(name: str, t, batch: Optional[int] = None) -> Tuple[int, int]:
    """A dense page table ``int32 [B, C]``: rows inner-contiguous and non-overlapping (any row
    stride >= C, so a padded, row-strided view is valid). Returns (B, C)."""
    tensor(name, t, dtypes=(torch.int32,), ndim=2)
    if batch is not None and t.shape[0] != batch:
        fail(f"{name}: expected {batch} rows (one per request), got shape {tuple(t.shape)}")
    rows, cols = t.shape
    if cols < 1:
        fail(f"{name}: needs at least one column")
    if cols > 1 and t.stride(1) != 1:
        fail(f"{name}: rows must be inner-contiguous (stride 1), got strides {tuple(t.stride())}")
    if rows > 1 and t.stride(0) < cols:
        fail(f"{name}: row stride {t.stride(0)} is smaller than the row length {cols}")
    return rows, cols


def int32_vector(name: str, t, length: Optional[int] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    tensor(name, t, dtypes=(torch.int32,), ndim=1, contiguous=True)
    if length is not None and t.shape[0] != length:
        fail(f"{name}: expected shape [{length}], got {tuple(t.shape)}")
    if device is not None and t.device != device:
        fail(f"{name}: is on {t.device}, expected {device}")
    return t


def first(mask: np.ndarray):
    """The index of the first True entry of a host mask: an int (1-D) or a tuple of ints."""
    at = np.argwhere(mask)[0]
    return int(at[0]) if mask.ndim == 1 else tuple(int(x) for x in at)


def diff(a: np.ndarray) -> np.ndarray:
    """``np.diff`` of a 1-D host array (a quarter of its cost on a short one: no argument handling)."""
    return a[1:] - a[:-1]


def values_indptr(name: str, values, end: Optional[int], end_name: str, strict: bool = True) -> None:
    """indptr values (a host array or a list): start at zero, (strictly) increasing, end at
    `end` (None: anywhere). Whole-array checks; the first bad entry is named."""
    t = np.asarray(values, dtype=np.int64)
    if int(t[0]) != 0:
        fail(f"{name}: must start at zero, got {int(t[0])}")
    d = diff(t)
    bad = (d <= 0) if strict else (d < 0)
    if bad.any():
        i = first(bad)
        fail(f"{name}: must be {'strictly ' if strict else ''}increasing"
             + (" (every request holds at least one entry)" if strict else "")
             + f"; entries {i} and {i + 1} are {int(t[i])} and {int(t[i + 1])}")
    if end is not None and int(t[-1]) != end:
        fail(f"{name}: the final {name} offset must equal {end_name} = {end}, got {int(t[-1])}")


def _span(t: torch.Tensor) -> Optional[int]:
    """Elements from a metadata tensor's first to its last (a contiguous tensor, or a
    row-strided int32 table [B, C]); None: another layout."""
    if t.is_contiguous():
        return t.numel()
    if t.dim() == 2 and (t.shape[1] == 1 or t.stride(1) == 1) and t.stride(0) >= t.shape[1]:
        return (t.shape[0] - 1) * t.stride(0) + t.shape[1] if t.numel() else 0
    return None


def host_values(*tensors: torch.Tensor) -> List[np.ndarray]:
    """The values of int32 tensors on the host, flattened, as int64 NumPy arrays, with one
    wait for the device (a one-shot's or a plan's only read of metadata): on CUDA, one launch
    of the read kernel, which writes each tensor's range into host-mapped memory in stream
    order (``runtime.read_int32``); elsewhere one concatenated copy. The checks then run as
    whole-array NumPy operations (a microsecond each, where a small torch op costs several)."""
    if not tensors:
        return []
    t0 = tensors[0]
    spans = None
    if t0.is_cuda and all(t.device == t0.device and t.dtype is torch.int32 for t in tensors) \
            and not torch.cuda.is_current_stream_capturing():
        spans = [_span(t) for t in tensors]
    if spans is None or None in spans:
        flat = torch.cat([t.reshape(-1) for t in tensors]).to("cpu").numpy().astype(np.int64)
        out, at = [], 0
        for t in tensors:  # views of the one copy
            n = t.numel()
            out.append(flat[at:at + n])
            at += n
        return out
    got = runtime.read_int32(t0.device.index, [(t.data_ptr(), n) for t, n in zip(tensors, spans)])
    return values_of_spans(tensors, spans, got)


def values_of_spans(tensors: Sequence[torch.Tensor], spans: Sequence[int], got: np.ndarray) -> List[np.ndarray]:
    """Each tensor's values, flattened, as int64 arrays (views of one copy), from `got`: the int32
    elements of every tensor's span (``_span``) back to back (a row-strided table's span
    holds its rows and the gaps between them)."""
    wide = got.astype(np.int64)  # one copy (the buffer is reused), whose parts are views
    out, at = [], 0
    for t, n in zip(tensors, spans):
        part = wide[at:at + n]
        if n != t.numel():  # a row-strided table: its rows
            part = np.lib.stride_tricks.as_strided(part, t.shape, (8 * t.stride(0), 8)).reshape(-1)
        out.append(part)
        at += n
    return out


def to_device(device: torch.device, *arrays: np.ndarray) -> List[torch.Tensor]:
    """Host arrays as int32 tensors on `device`, with one host-to-device copy (on CUDA, an
    asynchronous one through a pinned buffer)."""
    flat = np.concatenate([np.asarray(a, dtype=np.int32).reshape(-1) for a in arrays]) if len(arrays) > 1 \
        else np.ascontiguousarray(arrays[0], dtype=np.int32).reshape(-1)
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        t = torch.empty(flat.shape[0], dtype=torch.int32, device=device)
        runtime.write_int32(device.index if device.index is not None else torch.cuda.current_device(), flat,
                            t.data_ptr())
    else:
        t = torch.from_numpy(flat).to(device)
    return list(t.split([int(np.size(a)) for a in arrays])) if len(arrays) > 1 else [t]


def matches(t, shape, dtype: torch.dtype, device: torch.device) -> bool:
    """A plain tensor of exactly this shape, dtype and device (a run's cheap check against its plan)."""
    return type(t) is torch.Tensor and t.shape == shape and t.dtype is dtype and t.device == device


def no_overlap(name: str, t: torch.Tensor, others: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    """``t`` shares no byte with any of ``others`` ("out must not overlap q storage"): pointer
    ranges (a contiguous tensor's bytes; a strided one's extent), compared on one device."""
    if tracing() or t.numel() == 0:
        return
    a0 = t.data_ptr()
    a1 = a0 + t.nbytes if t.is_contiguous() else span(t)[1]
    for other, o in others:
        if o is None:
            continue
        b0 = o.data_ptr()
        b1 = b0 + o.nbytes if o.is_contiguous() else span(o)[1]
        if a0 < b1 and b0 < a1 and o.numel() and o.device == t.device:
            fail(f"{name} must not overlap {other} storage")


class Disjoint:
    """The per-call checks of operands whose layouts a static key fixed (``checked_once``'s
    result holds one): ``check(operands)`` reads their start addresses; the first, ``out``,
    must start 16-byte aligned, and each of the ``checked`` positions (``out`` first, then, say,
    a workspace) must share no byte with another operand (``disjoint``). The key fixes every
    extent but the ``loose`` operand's (a length that changes from call to call: read then).
    The addresses (and loose length) of the last call that passed decide a repeat: a serving
    loop's persistent buffers pass with one compare. Eager calls only (they read addresses)."""

    __slots__ = ("names", "extents", "checked", "loose", "passed")

    def __init__(self, names: Sequence[str], tensors: Sequence[Optional[torch.Tensor]], checked: Sequence[int] = (0,),
                 loose: int = -1):
        self.names = tuple(names)
        self.extents = tuple(byte_extent(t) for t in tensors)
        self.checked = tuple(checked)
        self.loose = loose
        self.passed = None

    def check(self, operands: Sequence[Optional[torch.Tensor]]) -> tuple:
        """The operands' start addresses (0: None), after the checks (``ValueError`` naming the
        operand)."""
        starts = tuple([0 if t is None else t.data_ptr() for t in operands])
        i = self.loose
        memo = starts if i < 0 else (starts, operands[i].nbytes)
        if memo == self.passed:
            return starts
        if starts[0] & 15:
            out_start(operands[0])
        extents = self.extents
        if i >= 0:
            extents = extents[:i] + (operands[i].nbytes,) + extents[i + 1:]
        disjoint(self.checked, self.names, starts, extents)
        self.passed = memo
        return starts


def disjoint(checked: Sequence[int], names: Sequence[str], starts: Sequence[Optional[int]],
             extents: Sequence[int]) -> None:
    """Per-call overlap check of tensors on one device whose extents (``byte_extent``) a static
    key fixed, given their first addresses (``data_ptr``; None: no tensor): each ``i``-th, ``i``
    in ``checked``, shares no byte with any other (in order, so ``out`` before
    ``workspace_buffer`` names the pair as ``no_overlap`` would). Eager calls only."""
    for i in checked:
        a0, n = starts[i], extents[i]
        if not n:
            continue
        for j, b0 in enumerate(starts):
            if j != i and extents[j] and a0 < b0 + extents[j] and b0 < a0 + n:
                fail(f"{names[i]} must not overlap {names[j]} storage")


def values_block_table(name: str, table: np.ndarray, lens: np.ndarray, page_size: int,
                       num_pages: Optional[int]) -> int:
    """The used entries of a page table (row b's first ceil(lens[b] / page_size)) are page IDs in
    ``[0, num_pages)`` (``num_pages`` None: only ``>= 0``). ``table`` ``[B, C]`` and ``lens`` are
    host arrays, the lengths already checked against the row capacity. Returns a bound of the
    used page IDs: the largest entry of the table when every entry is a valid ID (two
    reductions), else the largest used one."""
    hi = num_pages if num_pages is not None else INT32_MAX + 1
    top = int(table.max()) if table.size else -1
    if top < hi and table.size and table.min() >= 0:
        return top
    need = (np.asarray(lens, dtype=np.int64) + page_size - 1) // page_size
    used = np.arange(table.shape[1])[None, :] < need[:, None]  # [B, C]
    bad = used & ((table < 0) | (table >= hi))
    if bad.any():
        b, c = first(bad)
        fail(f"{name}: request {b} uses page ID {int(table[b, c])} (column {c}), outside "
             f"[0, {num_pages if num_pages is not None else 'P'})")
    return int(table[used].max()) if used.any() else -1
