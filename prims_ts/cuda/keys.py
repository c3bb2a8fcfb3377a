"""What every kernel key shares: the tuning value, the key base, the engines' shared-memory
arithmetic, device facts and the per-device cache of loaded kernels.

A key names one cubin. Its fields are the template arguments; its name, thread count,
shared memory and entry point are derived from them (``KernelKey``). Each API's module
(``prefill.py``, ``decode.py``, ``block_sparse.py``) defines its key, the tile choice per
engine in one function, the parameter struct and the prepared launch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Dict, Optional, Sequence, Tuple

import torch

from . import runtime

HERE = Path(__file__).resolve().parent

DTYPE_CODES = {torch.float16: "f16", torch.bfloat16: "bf16"}
OUT_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # pt::OutDtype
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------
# Tuning: one frozen value, the defaults in one place
# ----------------------------------------------------------------------------

FMHA_LOOPS = (0, 1, 2)
KV_COPY_TPRS = (4, 8)
PREFILL_BNS = (64, 80, 128)  # Tuning.prefill_bn (the wgmma n of QK^T: pt_wgmma.cuh)
MERGE_FAN_MAX = 1 << 16  # Tuning.merge_fan's bound (the kernel compares parts with 2 x fan in int)


@dataclass(frozen=True)
class Tuning:
    """The choices a kernel key makes beyond the problem: passed to kernel choice and kept
    by a plan, so that plan and run cannot disagree. ``Tuning()`` is the library's default
    (each default is the measured winner: ``benchmarks/NOTES.md``); tests and A/B runs pass
    another value. Ops carry it as a string (``encode``/``decode``): a primitive argument
    that a compiled or exported graph keeps.
    """

    # The producer ring's consumer loop (prefill, paged prefill, block-sparse on sm_90a):
    # 0 plain; 1 QK^T of tile j+1 and PV of tile j in flight under the softmax; 2 as 1 with
    # the two MMA warpgroups taking turns (pingpong). None: pingpong (at D128 and D256).
    loop: Optional[int] = None
    # The producer's threads per K/V row: 4 (8 rows x 64 bytes a warp instruction) or 8 (4
    # rows x a whole 128-byte line). None: 8 for rows wider than 256 bytes (D256, MLA's 576),
    # 4 at D128. flip_copy takes the copy the choice does not.
    copy_tpr: Optional[int] = None
    flip_copy: bool = False
    # Producer-ring CTAs walk several work items (at most one CTA per SM, or persistent_ctas).
    persistent: bool = False
    persistent_ctas: Optional[int] = None
    # Paged and MLA decode on sm_90a with 2-8 splits: the splits of a row tile are launched as
    # one thread block cluster and merge through distributed shared memory (no workspace pass,
    # ticket or last CTA), where the partials fit the shared memory. False: the ticket merge at
    # every split count.
    cluster_merge: bool = True
    # MLA rows of 16/32 on sm_90a: the swapped-operand wgmma tile (keys as M), else sm_80's.
    # (MLA rows of 64 on sm_90a always take the twin tile, pt_fmha_twin.cuh.)
    mla_swapped: bool = True
    # Decode and MLA split-KV over a persistent grid (the resident CTA slots) sharing the launch's
    # key tiles evenly by the requests' lengths, read on the device (fmha_decode.cu: DecodeWalk),
    # instead of every request split as if it were max_seq_len long; where a launch holds at
    # least 4 key tiles a slot. None: where a plan's lengths are uneven enough that the static
    # split would wait on a few long requests (decode.balanced_by_lengths; a call that reads no
    # lengths: static); True: every launch past that size; False: none (benchmarks/NOTES.md,
    # "Split-KV by the lengths").
    balanced_split: Optional[bool] = None
    # Balanced split-KV over this many CTAs at any launch size instead of the resident slots past
    # the size floor: how the grids run the walk and the merge of many parts on small problems.
    balanced_ctas: Optional[int] = None
    # Balanced split-KV on sm_90a's MLA tiles (twin and swapped): units cut into more than twice
    # this many parts merge in two levels (groups of this many parts, then the groups:
    # fmha_decode.cu, merge_if_last), so that no CTA reads a long request's 16-128 KB parts alone.
    # None: decode.MERGE_FAN. The grids take 2 (every unit of those tiles of 5 parts or more
    # merges in two levels). At most MERGE_FAN_MAX.
    merge_fan: Optional[int] = None
    # PT_PROBE (pt_fmha_config.cuh) in the sm_90a prefill keys and the twin MLA keys, a
    # measurement aid with wrong results: 1 times the MMA warps without the K/V copies, 2 the
    # copies without the math.
    probe: int = 0
    # PT_TWIN_TRACE in the twin MLA keys, a measurement aid with exact results: the grid's first
    # and last 8 CTAs record the clock at each step of their pairs into the module's
    # pt_twin_trace (pt_fmha_twin.cuh), which benchmarks/twin_trace.py reads.
    twin_trace: bool = False
    # PT_CTA_TRACE in the decode and MLA keys, a measurement aid with exact results: each CTA
    # records when it started and ended and on which SM into the module's pt_cta_trace
    # (fmha_decode.cu), which benchmarks/cta_trace.py reads (a launch's edges).
    cta_trace: bool = False
    # K/V tiles as TMA boxes (one producer thread) in the sm_90a keys of contiguous K/V:
    # fixed-storage prefill and block-sparse (persistent CTAs too); packed problems keep the
    # cp.async producer. False: cp.async there too.
    tma: bool = True
    # K/V pages as TMA boxes (a box a page, the first warp's lanes sharing the pages; the tail
    # by cp.async) in the sm_90a paged prefill and block-sparse keys (persistent CTAs too).
    # False: the cp.async producer.
    paged_tma: bool = True
    # The sm_90a prefill and block-sparse keys' MMA warps with fewer instructions: row maxima
    # by fmax, a tile's wgmma descriptors built once and advanced by one add a k-step. None:
    # at D128, where it wins; D256's plain loop, short of registers, loses by it.
    lean_mma: Optional[bool] = None
    # The sm_90a prefill and block-sparse keys' online softmax keeps a row's running maximum
    # until a tile's exceeds it by more than 2^8 in the exponent (P stays <= 256, exact after
    # the final division), so that most tiles rescale neither O nor the sums (page 16 +5-7%,
    # the other rows within drift: benchmarks/NOTES.md). False: rescale on every new maximum.
    lazy_rescale: bool = True
    # The overlapped loops' softmax of tile j under PV of tile j - 1 (the PV wait after the
    # softmax, past a branch that keeps ptxas from hoisting it) and the producer's V a tile
    # behind K. None: in the prefill keys (contiguous and paged K/V), where it wins; the
    # block-sparse keys lost by it (-2 to -6%): there the PV lands before the softmax
    # (benchmarks/NOTES.md).
    softmax_under_pv: Optional[bool] = None
    # The key tile (BN rows) of the sm_90a prefill keys whose K/V tiles are TMA boxes of
    # contiguous K/V (fixed-storage prefill), at the head dims where two stages of it fit.
    # None: prefill.TMA_BN (128 at D128, 80 at D256; 64 at D256 where 80 does not fit).
    prefill_bn: Optional[int] = None
    # The paged prefill keys' V tiles page-major where a page is shorter than the key tile
    # (pt_sm90.cuh: SmemTileP): one TMA box a page of all its 64-column panels instead of a box
    # a page and panel (page 16 at D128: 8 boxes a V tile instead of 16); K keeps its layout.
    # Page 16 +6-11%, pages 32-128 unchanged (benchmarks/NOTES.md).
    page_major_v: bool = True
    # The paged prefill keys' K tiles row-group interleaved where a page is shorter than the key
    # tile (pt_sm90.cuh: SmemTileI; S's K-major descriptors stride 8-row groups by D / 64 KB):
    # one TMA box a page of all its panels instead of a box a page and panel (page 16 at D128:
    # 8 K boxes a tile instead of 16). Page 16 +4-7%, pages 32-64 unchanged (benchmarks/NOTES.md).
    page_major_k: bool = True
    # The prefill-family keys (prefill, paged prefill, block-sparse) on the portable engine
    # (mma.sync, the sm_80 / sm_86 / sm_89 tiles) on an sm_90a device too: how the grids check
    # that engine on a Hopper GPU.
    portable: bool = False

    def __post_init__(self):
        if self.loop is not None and self.loop not in FMHA_LOOPS:
            raise ValueError(f"tuning: loop must be None or one of {FMHA_LOOPS}, got {self.loop!r}")
        if self.copy_tpr is not None and self.copy_tpr not in KV_COPY_TPRS:
            raise ValueError(f"tuning: copy_tpr must be None or one of {KV_COPY_TPRS}, got {self.copy_tpr!r}")
        if self.balanced_ctas is not None and self.balanced_ctas < 1:
            raise ValueError(f"tuning: balanced_ctas must be None or >= 1, got {self.balanced_ctas!r}")
        if self.merge_fan is not None and not 2 <= self.merge_fan <= MERGE_FAN_MAX:
            raise ValueError(f"tuning: merge_fan must be None or in [2, {MERGE_FAN_MAX}], got {self.merge_fan!r}")
        if self.persistent_ctas is not None and self.persistent_ctas < 1:
            raise ValueError(f"tuning: persistent_ctas must be None or >= 1, got {self.persistent_ctas!r}")
        if self.prefill_bn is not None and self.prefill_bn not in PREFILL_BNS:
            raise ValueError(f"tuning: prefill_bn must be None or one of {PREFILL_BNS}, got {self.prefill_bn!r}")
        if self.probe not in (0, 1, 2):
            raise ValueError(f"tuning: probe must be 0, 1 or 2, got {self.probe!r}")

    def loop_for(self, head_dim: int) -> int:
        return self.loop if self.loop is not None else 2

    def under_pv_for(self, prefill: bool) -> bool:
        return self.softmax_under_pv if self.softmax_under_pv is not None else prefill

    def lean_for(self, head_dim: int) -> bool:
        return self.lean_mma if self.lean_mma is not None else head_dim <= 128

    def copy_for(self, head_dim: int) -> int:
        tpr = self.copy_tpr if self.copy_tpr is not None else (8 if head_dim > 128 else 4)
        return next(t for t in KV_COPY_TPRS if t != tpr) if self.flip_copy else tpr

    def encode(self) -> str:
        """The op argument: the fields that differ from the default, ``name=value;...``."""
        return ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                        if getattr(self, f.name) != f.default)

    @staticmethod
    def decode(text: str) -> "Tuning":
        return _decode_tuning(text)


DEFAULT_TUNING = Tuning()


@functools.lru_cache(maxsize=256)
def _decode_tuning(text: str) -> Tuning:
    if not isinstance(text, str):
        raise TypeError(f"tuning: expected a str (Tuning.encode()), got {type(text).__name__}")
    if not text:
        return DEFAULT_TUNING
    kinds = {f.name: f for f in dataclasses.fields(Tuning)}
    values = {}
    for part in text.split(";"):
        name, _, raw = part.partition("=")
        if name not in kinds:
            raise ValueError(f"tuning: unknown field {name!r} in {text!r}; expected one of {', '.join(kinds)}")
        if raw in ("True", "False", "None"):
            values[name] = {"True": True, "False": False, "None": None}[raw]
        else:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"tuning: field {name!r} has the value {raw!r}, not an int, bool or None") from None
    return Tuning(**values)


# ----------------------------------------------------------------------------
# The key base
# ----------------------------------------------------------------------------


def tag(name: str, default=dataclasses.MISSING, always: bool = False):
    """A key field and how it appears in the kernel's name: ``<name><value>`` (``<name>``
    alone for a True flag), always or only when it differs from the default."""
    meta = {"tag": name, "always": always}
    return field(metadata=meta) if default is dataclasses.MISSING else field(default=default, metadata=meta)


@dataclass(frozen=True)
class KernelKey:
    """One kernel: a frozen value whose fields are its template arguments. Subclasses give
    the source file, the parameter struct, the device function and the launch shape."""

    PREFIX: ClassVar[str] = ""
    SOURCE: ClassVar[str] = ""
    PARAMS: ClassVar[str] = ""  # the pt:: parameter struct the entry takes by value

    @property
    def name(self) -> str:
        parts = [self.PREFIX]
        for f in dataclasses.fields(self):
            t = f.metadata.get("tag")
            if t is None:
                continue
            v = getattr(self, f.name)
            if not (f.metadata["always"] or v != f.default):
                continue
            if isinstance(v, bool):
                parts.append(f"{t}{int(v)}" if f.metadata["always"] else (t if v else ""))
            else:
                parts.append(f"{t}{v}")
        return "_".join(p for p in parts if p)

    @property
    def threads(self) -> int:
        raise NotImplementedError

    @property
    def smem(self) -> int:
        raise NotImplementedError

    min_blocks: ClassVar[int] = 1

    def call(self) -> str:
        """The device function the entry point calls, e.g. ``pt::prefill_kernel<...>``."""
        raise NotImplementedError

    def defines(self) -> str:
        return ""

    def source(self) -> runtime.KernelSource:
        entry = (f'\nextern "C" __global__ void __launch_bounds__({self.threads}, {self.min_blocks})\n'
                 f"{self.name}(const __grid_constant__ pt::{self.PARAMS} p) {{\n  {self.call()}(p);\n}}\n")
        return runtime.KernelSource(key=self.name, name=self.name,
                                    source=self.defines() + read_source(self.SOURCE) + entry)


@functools.lru_cache(maxsize=None)
def read_source(name: str) -> str:
    """A kernel source file, read once per process."""
    return (HERE / name).read_text()


def cpp_bool(x) -> str:
    return "true" if x else "false"


# ----------------------------------------------------------------------------
# The FMHA core's shared memory and configuration (pt_fmha.cuh)
# ----------------------------------------------------------------------------

SM90_SMEM_LIMIT = 232448  # per-block opt-in shared memory on sm_90
WGMMA_ALIGN_SLACK = 1024  # the wgmma tiles are 1024-byte aligned inside the dynamic buffer
SMEM_MARGIN = WGMMA_ALIGN_SLACK + 1024  # the alignment slack plus a kernel's static shared memory
PRODUCER_THREADS = 128  # the copy warpgroup of the producer pipeline
MAX_PRODUCER_STAGES = 4
SM_SMEM_BYTES = 228 * 1024  # per SM on sm_80 / sm_90 (the CTA-count estimate only)
NOMINAL_SMS = 132  # CPU tensors and no GPU: sizes are computed as for an H200
NOMINAL_SMEM_LIMIT = SM90_SMEM_LIMIT


def fmha_smem_bytes(bm: int, bn: int, head_dim: int, stages: int = 2, warps_n: int = 1,
                    split_o: bool = False, dv: Optional[int] = None, shared_kv: bool = False,
                    producer: bool = False) -> int:
    """Dynamic shared memory of one FMHA core CTA: pt::FmhaConfig<...>::SMEM_BYTES.

    The Q tile and `stages` K/V tile pairs (one tile per stage when V is a prefix of the
    K row); split_o adds its exchange area (a float per warp row, P as A fragments);
    otherwise, with warps_n > 1, the key-split merge reuses the pipeline's bytes for
    (m, l) per warp row and the O fragments (dv wide) of warps_n - 1 warps. A producer
    warpgroup adds the ring's mbarriers (a full and an empty one per stage and tile) and Q's pair.
    """
    dv = head_dim if dv is None else dv
    warps_m = bm // 16
    xchg = warps_m * warps_n * 16 * 4 + warps_m * (bn // 16) * 32 * 16 if split_o else 0
    pipe = bm * head_dim * 2 + (1 if shared_kv else 2) * stages * bn * head_dim * 2 + xchg
    pipe += 2 * (1 if shared_kv else 2) * stages * 8 + 16 if producer else 0  # the ring's mbarriers, Q's pair
    merge = (warps_m * warps_n * 16 * 2 * 4 + (warps_n - 1) * bm * dv * 4) if warps_n > 1 and not split_o else 0
    return max(pipe, merge)


def producer_fits(bm: int, bn: int, head_dim: int, stages: int, extra: int = 0) -> bool:
    """A producer-ring tile of `stages` K/V stages (and `extra` bytes) fits the sm_90 per-block limit."""
    return fmha_smem_bytes(bm, bn, head_dim, stages, producer=True) + extra + SMEM_MARGIN <= SM90_SMEM_LIMIT


def producer_stages(bm: int, bn: int, head_dim: int, extra: int = 0) -> int:
    """K/V stages of a producer-ring tile: as many as fit the sm_90 per-block limit, 2 to 4."""
    for stages in range(MAX_PRODUCER_STAGES, 2, -1):
        if producer_fits(bm, bn, head_dim, stages, extra):
            return stages
    return 2


def fmha_config(dtype: str, head_dim: int, bm: int, bn: int, q_in_regs: bool, arch: int, warps_n: int = 1,
                stages: int = 2, split_o: bool = False, dv: Optional[int] = None, shared_kv: bool = False,
                producer: bool = False, loop: int = 0, copy_tpr: int = 4, lean: bool = False,
                lazy: bool = False, under_pv: bool = False, v_page: int = 0, k_il: bool = False) -> str:
    """The pt::FmhaConfig<...> type of a kernel key, every parameter spelled out up to the last
    one set (LEAN, LAZY, UNDER_PV, V_PAGE, K_IL: only when set)."""
    b = cpp_bool
    flags = [b(lean), b(lazy), b(under_pv), str(v_page), b(k_il)]
    while flags and flags[-1] in ("false", "0"):
        flags.pop()
    tail = "".join(f", {f}" for f in flags)
    return (f"pt::FmhaConfig<pt::{dtype}, {head_dim}, {bm}, {bn}, {b(q_in_regs)}, {arch}, {warps_n}, {stages}, "
            f"{b(split_o)}, {head_dim if dv is None else dv}, {b(shared_kv)}, {b(producer)}, {loop}, {copy_tpr}"
            f"{tail}>")


def smem_limit(arch: str) -> int:
    """Per-block opt-in shared memory: 227 KB on sm_90, 163 KB on sm_80/87, 99 KB on sm_86/89."""
    return {"sm_90a": SM90_SMEM_LIMIT, "sm_90": SM90_SMEM_LIMIT, "sm_80": 166912, "sm_87": 166912}.get(arch, 101376)


def work_grid(items: int, persistent: bool, sm_count: int, cap: Optional[int] = None) -> int:
    """CTAs for `items` work items: one each, or (a persistent key) no more than the SMs (or
    `cap`), which then walk the items in launch order."""
    if persistent:
        return min(items, cap or sm_count)
    return items


# ----------------------------------------------------------------------------
# Devices and loaded kernels
# ----------------------------------------------------------------------------

_DEVICES: Dict[int, Tuple[str, int, int]] = {}


def device_info(dev: int) -> Tuple[str, int, int]:
    """(arch, SM count, per-block shared memory limit) of CUDA device `dev`, read once."""
    info = _DEVICES.get(dev)
    if info is None:
        arch = runtime.device_arch(dev)
        info = (arch, torch.cuda.get_device_properties(dev).multi_processor_count, smem_limit(arch))
        _DEVICES[dev] = info
    return info


def cuda_index(device) -> Optional[int]:
    """The CUDA device index of `device` (a torch.device or its name); None: the current CUDA
    device if there is one; the CPU and meta devices give None."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_limits(device) -> Tuple[str, int, int]:
    """(arch, SM count, per-block shared memory) that size the policies on `device`; the
    CPU, or no GPU at all: the nominal H200."""
    dev = cuda_index(device)
    if dev is None:
        return "sm_90a", NOMINAL_SMS, NOMINAL_SMEM_LIMIT
    return device_info(dev)


_LOADED: Dict[Tuple[int, KernelKey], runtime.LoadedKernel] = {}


def load(dev: int, key: KernelKey) -> runtime.LoadedKernel:
    """The loaded kernel of `key` on device `dev`, looked up by the key itself (compiled by
    NVRTC first unless the disk cache has it). Not during CUDA-graph capture: plans load."""
    k = _LOADED.get((dev, key))
    if k is None:
        k = runtime.get_kernel(dev, key.source(), key.smem, key.threads)
        _LOADED[(dev, key)] = k
    return k


def check_rows(named) -> None:
    """What the kernels' 16-byte vector accesses need of each (name, tensor): a contiguous
    last dimension and 16-byte aligned rows (a ValueError naming the tensor). Prepared
    launches call it when a call's strides differ from the last call's."""
    from ..ops import _validate as V

    for name, t in named:
        V.tensor(name, t, inner_contiguous=True)
        V.rows_aligned(name, t)


def check_starts(named) -> None:
    """Each (name, tensor) starts at a 16-byte aligned address (a ValueError naming it)."""
    from ..ops import _validate as V

    for name, t in named:
        V.start_aligned(name, t)


# ----------------------------------------------------------------------------
# A plan's accepted operands: what lets its run skip the checks
# ----------------------------------------------------------------------------


class Accepted:
    """The tensor operands of a plan's launch as its last fully checked run passed them: their
    layouts (``ops._validate.Layouts``: shape, strides, dtype and device each, compared in one
    check) and byte extents. A later run whose operands have exactly these layouts passed the
    same checks, and the strides in the plan's
    parameters are already its strides: only the addresses are new, and ``addresses`` checks
    them (16-byte aligned starts of the first ``aligned`` operands, the data the kernels read
    in vectors; the output clear of every other operand and of the plan's own tensors).
    Operands at ``loose`` positions (1-D int32 metadata whose length may change
    between runs) match on dtype, strides, contiguity and device; their extent is read per call.
    The extents follow from the layouts, so the addresses (and loose lengths) of the last run
    that passed decide the outcome again: a serving loop's persistent buffers pass with one
    compare."""

    __slots__ = ("layouts", "extents", "fixed", "loose", "aligned", "passed")

    def __init__(self, aligned: int, fixed: Sequence[Tuple[int, int]] = (), loose: Sequence[int] = ()):
        self.aligned = aligned
        self.layouts = None
        self.extents = ()
        self.fixed = tuple((a, b) for a, b in fixed if b > a)  # [start, end) byte ranges the output must not touch
        self.loose = tuple(sorted(set(loose)))
        self.passed = None  # (addresses, loose lengths) of the last operands that passed ``addresses``

    def record(self, tensors: Sequence[Optional[torch.Tensor]]) -> None:
        from ..ops import _validate as V

        self.layouts = V.Layouts.of(tensors, self.loose)
        self.extents = tuple(V.byte_extent(t) for t in tensors)
        self.passed = None

    def same(self, tensors: Sequence[Optional[torch.Tensor]]) -> bool:
        """Every operand plain and laid out as recorded (None where None was): ``Layouts``."""
        lay = self.layouts
        return lay is not None and lay.matches(tensors)

    def addresses(self, tensors: Sequence[Optional[torch.Tensor]], out_index: int) -> Optional[tuple]:
        """The operands' addresses (0 for None) when the aligned ones start 16-byte aligned and the output
        ``tensors[out_index]`` overlaps no other operand nor a fixed range; else None (the full
        check then names the problem)."""
        ptrs = tuple([0 if t is None else t.data_ptr() for t in tensors])
        loose = self.loose
        memo = (ptrs, tuple([0 if tensors[i] is None else tensors[i].nbytes for i in loose])) if loose else ptrs
        if memo == self.passed:
            return ptrs
        acc = 0
        for a in ptrs[:self.aligned]:
            acc |= a
        if acc & 15:
            return None
        o0 = ptrs[out_index]
        o1 = o0 + self.extents[out_index]
        if o1 > o0:
            for i, b0 in enumerate(ptrs):
                if i == out_index or not b0:
                    continue
                n = tensors[i].nbytes if i in loose else self.extents[i]
                if b0 < o1 and o0 < b0 + n:
                    return None
            for b0, b1 in self.fixed:
                if b0 < o1 and o0 < b1:
                    return None
        self.passed = memo
        return ptrs

    def admit(self, tensors: Sequence[Optional[torch.Tensor]], out_index: int = 3) -> Optional[tuple]:
        """The addresses of operands laid out as recorded (``same``) whose addresses pass
        (``addresses``); None: take the full path."""
        return self.addresses(tensors, out_index) if self.same(tensors) else None


class BoundedMemo(dict):
    """A memo that forgets its oldest entry once it holds `limit` (first in, first out; a hit is a
    plain dict lookup): the caches keyed by per-call facts (shapes, batch sizes, lengths), which
    a long-running server would otherwise grow without end. A forgotten entry is rebuilt on its
    next use; whoever still holds the value keeps it."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        if len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = value
        return value


# the memos of prepared launches and of static checks: ample for every shape a server plans
MEMO_LIMIT = 1024


class Prepared:
    """Base of a prepared launch (``PreparedPrefill``, ``PreparedDecode``, ``PreparedBlockSparse``):
    the loaded kernel, grid and parameter struct of one static key on one device. The shared one
    per (key, device) serves op calls; a plan owns a copy (``for_plan``) with its own struct and
    an ``Accepted`` memo, which its full ``run`` records and ``again`` relaunches from."""

    __slots__ = ("static", "dev", "key", "launch", "_strides", "accepted", "_maps", "_maps_at")
    PARAMS_ATTR = "p"  # the attribute holding the parameter struct
    _SHARED: ClassVar[BoundedMemo] = BoundedMemo(MEMO_LIMIT)

    @classmethod
    def shared(cls, static, dev: int) -> "Prepared":
        """The prepared launch of `static` on device `dev` that op calls share (one per process;
        a plan takes its own copy, ``for_plan``)."""
        pl = Prepared._SHARED.get((cls, dev, static))
        if pl is None:
            pl = Prepared._SHARED.put((cls, dev, static), cls(static, dev))
        return pl

    def for_plan(self, accepted: Accepted) -> "Prepared":
        c = copy.copy(self)
        params = type(self.launch.params).from_buffer_copy(self.launch.params)
        c._own(params)
        c.launch = self.launch.with_params(params)
        c.accepted = accepted
        return c

    def _own(self, params) -> None:
        """Take `params` (a copy of the launch's struct) as this launch's parameters; a TMA key's
        struct is the maps and then its parameters (`tp`, and its field named PARAMS_ATTR)."""
        if getattr(self.key, "tma", False):
            self.tp, params = params, getattr(params, self.PARAMS_ATTR)
        setattr(self, self.PARAMS_ATTR, params)

    # TMA keys (pt_fmha_copy.cuh: TmaKv): the encoders of K's and V's maps for their current layout
    # (_maps), and the addresses this launch's struct holds maps of (_maps_at: a plan's copy
    # encodes into its own struct)
    def _set_maps(self, k: torch.Tensor, v: Optional[torch.Tensor], paged: bool, rows: int,
                  v_page_major: bool = False, k_interleaved: bool = False) -> Tuple[int, int]:
        """K's and V's maps for their layout, innermost dimension first: [B, S, Hkv, D] as (D, Hkv,
        S, B) with boxes of (64, 1, rows, 1); pools [P, Hkv, page_size, D] as (D, page_size, Hkv, P)
        with (64, rows, 1, 1). 64-column panels, the 128-byte swizzle, zeros outside the tensor.
        `v_page_major` (a pool; pt_sm90.cuh: SmemTileP): V as (64, page_size, D / 64, Hkv, P), the
        panel a dimension of its own (strides not increasing: the driver takes them), with boxes
        of (64, rows, D / 64, 1, 1): a page's rows, every panel. `k_interleaved` (a pool;
        pt_sm90.cuh: SmemTileI): K as (64, 8, D / 64, page_size / 8, X), a page's 8-row groups
        and panels dimensions of their own and X the pages and heads folded (entry page * k_xp +
        head * k_xh, striding the two strides' greatest common divisor), with boxes of (64, 8,
        D / 64, rows / 8, 1). `v` None: K's map alone (V the K row's prefix). Returns (k_xp,
        k_xh), (0, 0) without an interleaved K."""
        es = k.element_size()
        box = (64, rows, 1, 1) if paged else (64, 1, rows, 1)
        encoders, k_x = [], (0, 0)
        for t, name in ((k, "k"), (v, "v")) if v is not None else ((k, "k"),):
            dims = tuple(reversed(t.shape))
            strides, inner = [], dims[0] * es
            for n, st in zip(dims[1:], reversed(t.stride()[:3])):
                # a dimension of one element takes any 16-byte multiple: the next after the inner
                strides.append(st * es if n > 1 else inner)
                inner = strides[-1] * n
            if name == "k" and k_interleaved:
                enc, k_x = self._interleaved_map(t, rows, name)
                encoders.append(enc)
            elif name == "v" and v_page_major:
                panels = dims[0] // 64
                dims = (64, dims[1], panels, dims[2], dims[3])
                strides = [strides[0], 64 * es, strides[1], strides[2]]
                encoders.append(runtime.TileMapEncoder(self.key.dtype, dims, strides, (64, rows, panels, 1, 1), name))
            else:
                encoders.append(runtime.TileMapEncoder(self.key.dtype, dims, strides, box, name))
        self._maps = tuple(encoders)
        self._maps_at = (None, None)
        return k_x

    def _interleaved_map(self, t: torch.Tensor, rows: int,
                         name: str) -> Tuple["runtime.TileMapEncoder", Tuple[int, int]]:
        """The row-group interleaved map of pool `t` ([P, Hkv, ps, D], any page and head strides:
        both multiples of 8 elements, so their divisor strides a 16-byte multiple) and its last
        dimension's entries a page and a head."""
        es = t.element_size()
        pages, heads, ps, d = t.shape
        sp, sh, ss = t.stride()[:3]
        sp = sp if pages > 1 else 8  # a dimension of one entry: any 16-byte multiple
        if sp <= 0 or (heads > 1 and sh <= 0):
            raise ValueError(f"{name}_cache: page stride {sp} and head stride {sh} must be positive")
        xs = math.gcd(sp, sh) if heads > 1 else sp
        kxp, kxh = sp // xs, (sh // xs if heads > 1 else 0)
        xn = (pages - 1) * kxp + (heads - 1) * kxh + 1
        dims = (64, 8, d // 64, ps // 8, xn)
        strides = [ss * es, 128, 8 * ss * es, xs * es]
        return runtime.TileMapEncoder(self.key.dtype, dims, strides, (64, 8, d // 64, rows // 8, 1), name), (kxp, kxh)

    def _encode_maps(self, maps, ka: int, va: int) -> None:
        """The maps of K at `ka` and V at `va` into `maps` (a struct with tmap_k, tmap_v), each
        only when its address changed (V only where it has a map of its own)."""
        if ka != self._maps_at[0]:
            self._maps[0].encode(maps.tmap_k, ka)
        if va != self._maps_at[1] and len(self._maps) > 1:
            self._maps[1].encode(maps.tmap_v, va)
        self._maps_at = (ka, va)
