"""Kernel keys: which source, which template arguments, which launch geometry.

A key names one cubin. ``all_keys()`` lists every specialisation that the
public APIs can ask for (``python -m prims_ts warmup`` compiles them all).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from . import runtime

HERE = Path(__file__).resolve().parent

DTYPE_CODES = {torch.float16: "f16", torch.bfloat16: "bf16"}
OUT_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # pt::OutDtype
MASK_CODES = {"dense": 0, "causal": 1, "variable_window": 2}  # pt::MaskKind


@functools.lru_cache(maxsize=None)
def _read(name: str) -> str:
    """A kernel source file (read once per process: keys build their source on every launch)."""
    return (HERE / name).read_text()


def fmha_smem_bytes(bm: int, bn: int, head_dim: int, stages: int = 2, warps_n: int = 1,
                    split_o: bool = False, dv: Optional[int] = None, shared_kv: bool = False,
                    producer: bool = False) -> int:
    """Dynamic shared memory of one FMHA core CTA: pt::FmhaConfig<...>::SMEM_BYTES (pt_fmha.cuh).

    The Q tile and `stages` K/V tile pairs (one tile per stage when V is a prefix of the
    K row); split_o adds its exchange area (a float per warp row, P as A fragments);
    otherwise, with warps_n > 1, the key-split merge reuses the pipeline's bytes for
    (m, l) per warp row and the O fragments (dv wide) of warps_n - 1 warps. A producer
    warpgroup adds the ring's mbarriers (full and empty per stage).
    """
    dv = head_dim if dv is None else dv
    warps_m = bm // 16
    xchg = warps_m * warps_n * 16 * 4 + warps_m * (bn // 16) * 32 * 16 if split_o else 0
    pipe = bm * head_dim * 2 + (1 if shared_kv else 2) * stages * bn * head_dim * 2 + xchg
    pipe += 2 * stages * 8 + 16 if producer else 0  # the ring's mbarriers and Q's pair
    merge = (warps_m * warps_n * 16 * 2 * 4 + (warps_n - 1) * bm * dv * 4) if warps_n > 1 and not split_o else 0
    return max(pipe, merge)


SM90_SMEM_LIMIT = 232448  # per-block opt-in shared memory on sm_90
WGMMA_ALIGN_SLACK = 1024  # the wgmma tiles are 1024-byte aligned inside the dynamic buffer
# the alignment slack plus a kernel's static shared memory (a few words)
SMEM_MARGIN = WGMMA_ALIGN_SLACK + 1024
PRODUCER_THREADS = 128  # the copy warpgroup of the producer pipeline (pt_fmha.cuh)
MAX_PRODUCER_STAGES = 4


def producer_stages(bm: int, bn: int, head_dim: int, extra: int = 0) -> int:
    """K/V stages of a producer-pipeline tile (wgmma engine): as many as fit the sm_90
    per-block limit, 2 to 4 (more in flight hides the copies' latency)."""
    for stages in range(MAX_PRODUCER_STAGES, 2, -1):
        if fmha_smem_bytes(bm, bn, head_dim, stages, producer=True) + extra + SMEM_MARGIN <= SM90_SMEM_LIMIT:
            return stages
    return 2


def fmha_config(dtype: str, head_dim: int, bm: int, bn: int, q_in_regs: bool, arch: int, warps_n: int = 1,
                stages: int = 2, split_o: bool = False, dv: Optional[int] = None, shared_kv: bool = False,
                producer: bool = False, loop: int = 0, copy_tpr: int = 4) -> str:
    """The pt::FmhaConfig<...> type of a kernel key (pt_fmha.cuh), every parameter spelled out."""
    b = lambda x: str(bool(x)).lower()  # noqa: E731
    return (f"pt::FmhaConfig<pt::{dtype}, {head_dim}, {bm}, {bn}, {b(q_in_regs)}, {arch}, {warps_n}, {stages}, "
            f"{b(split_o)}, {head_dim if dv is None else dv}, {b(shared_kv)}, {b(producer)}, {loop}, {copy_tpr}>")


# The consumer loop of the producer ring for prefill, paged prefill and block-sparse
# (pt_fmha.cuh, FmhaConfig LOOP): 0 plain; 1 overlapped (QK^T of tile j+1 and PV of tile
# j in flight under the softmax); 2 overlapped with the two MMA warpgroups taking turns
# (pingpong). None takes the measured choice (fmha_loop: benchmarks/NOTES.md, "Consumer
# loops"); 0/1/2 force one loop everywhere (tests, benchmarks/gpu_session.sh ab).
FMHA_LOOP: Optional[int] = None
FMHA_LOOPS = (0, 1, 2)

# The producer warpgroup's K/V copy (pt_fmha.cuh: load_kv_tiles PAIRED): threads per key
# row, 4 (8 rows x 64 bytes a warp instruction) or 8 (4 rows x a whole 128-byte line: half
# the L2 requests for the same bytes). None takes the measured choice (kv_copy_tpr:
# benchmarks/NOTES.md, "Producer copy"); 4/8 force one copy everywhere. KV_COPY_FLIP takes
# the copy the choice above does not (tests and A/B runs). Every producer-ring key:
# prefill, paged prefill, block-sparse, MLA (both wgmma tiles).
KV_COPY_TPR: Optional[int] = None
KV_COPY_TPRS = (4, 8)
KV_COPY_FLIP = False


def kv_copy_tpr(head_dim: int) -> int:
    """The producer copy of a sm_90a producer-ring key of `head_dim` (the K row's width).
    Measured in one A/B run: 8 threads a row took MLA B64 L8192 H16 (rows of 16) 1.12x and
    H128 (rows of 64) 1.04x, D256 contiguous prefill 1.04x, but D128 prefill, paged prefill
    and block-sparse 0.94-0.99x: rows wider than 256 bytes take 8, D128 rows keep 4. D256
    paged prefill and block-sparse and MLA rows of 32 follow the row width unmeasured."""
    tpr = KV_COPY_TPR if KV_COPY_TPR is not None else (8 if head_dim > 128 else 4)
    return next(t for t in KV_COPY_TPRS if t != tpr) if KV_COPY_FLIP else tpr


def fmha_loop(head_dim: int) -> int:
    """The consumer loop of a sm_90a producer-ring key: FMHA_LOOP when set, else the
    measured choice. Pingpong (2) measured 1.03-1.05x loop 0 at D128 prefill and block-sparse
    (paged 0.99-1.01x), but 0.79x/0.85x at D256, whose 128x256 fp32 accumulator leaves the
    overlapped loops no registers: D256 keeps the plain loop."""
    if FMHA_LOOP is not None:
        return FMHA_LOOP
    return 2 if head_dim <= 128 else 0


# ----------------------------------------------------------------------------
# batch_prefill (contiguous / packed-ragged)
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillKey:
    dtype: str  # "bf16" | "f16"
    head_dim: int  # 128 | 256
    mask: str  # "dense" | "causal" | "variable_window"
    bm: int = 128
    bn: int = 64
    q_in_regs: bool = True
    min_blocks: int = 1
    arch: int = 80  # tile engine: 80 = mma.sync (any sm_80+), 90 = wgmma (sm_90a)
    paged: bool = False  # K/V address policy: contiguous rows, or HND page pools + block tables
    stages: int = 2  # K/V tiles in flight
    loop: int = 0  # the producer ring's consumer loop (FMHA_LOOP)
    persistent: bool = False  # CTAs walk several work items (PERSISTENT)
    copy_tpr: int = 4  # the producer's threads per K/V row (KV_COPY_TPR)
    probe: int = 0  # PT_PROBE of the producer ring (PREFILL_PROBE): a measurement aid, wrong results

    @staticmethod
    def choose(dtype: torch.dtype, head_dim: int, mask: str, arch: str = "sm_80", paged: bool = False) -> "PrefillKey":
        dt = DTYPE_CODES[dtype]
        if arch == "sm_90a":
            # the wgmma engine with a producer warpgroup: BN 128 at D128, 64 at D256
            bn = 128 if head_dim == 128 else 64
            extra = 2 * 128 * 4 if mask == "variable_window" else 0
            return PrefillKey(dt, head_dim, mask, bm=128, bn=bn, q_in_regs=False, arch=90, paged=paged,
                              stages=producer_stages(128, bn, head_dim, extra), loop=fmha_loop(head_dim),
                              persistent=PERSISTENT and mask != "variable_window",
                              copy_tpr=kv_copy_tpr(head_dim), probe=PREFILL_PROBE)
        # the portable engine (sm_80/86/89): tiles that fit 99 KB of shared memory per block
        if head_dim == 128:
            return PrefillKey(dt, 128, mask, bm=128, bn=64, q_in_regs=True, paged=paged)
        return PrefillKey(dt, head_dim, mask, bm=64, bn=32, q_in_regs=False, paged=paged)

    @property
    def producer(self) -> bool:
        return self.arch == 90

    @property
    def threads(self) -> int:
        return self.bm // 16 * 32 + (PRODUCER_THREADS if self.producer else 0)

    @property
    def smem(self) -> int:
        extra = 2 * self.bm * 4 if self.mask == "variable_window" else 0
        align = WGMMA_ALIGN_SLACK if self.arch == 90 else 0
        return fmha_smem_bytes(self.bm, self.bn, self.head_dim, self.stages, producer=self.producer) + extra + align

    @property
    def name(self) -> str:
        return (
            f"pt_prefill_{self.dtype}_d{self.head_dim}_m{MASK_CODES[self.mask]}"
            f"_bm{self.bm}_bn{self.bn}_q{int(self.q_in_regs)}_mb{self.min_blocks}_sm{self.arch}"
            + (f"_s{self.stages}" if self.stages != 2 else "") + ("_ws" if self.producer else "")
            + (f"_l{self.loop}" if self.loop else "") + ("_pk" if self.persistent else "")
            + (f"_cp{self.copy_tpr}" if self.copy_tpr != 4 else "") + ("_paged" if self.paged else "")
            + (f"_probe{self.probe}" if self.probe else "")
        )

    def source(self) -> runtime.KernelSource:
        cfg = fmha_config(self.dtype, self.head_dim, self.bm, self.bn, self.q_in_regs, self.arch, stages=self.stages,
                          producer=self.producer, loop=self.loop, copy_tpr=self.copy_tpr)
        entry = (
            f'\nextern "C" __global__ void __launch_bounds__({self.threads}, {self.min_blocks})\n'
            f"{self.name}(const __grid_constant__ pt::PrefillParams p) {{\n"
            f"  pt::prefill_kernel<{cfg}, {MASK_CODES[self.mask]}, {str(self.paged).lower()}, "
            f"{str(self.persistent).lower()}>(p);\n}}\n"
        )
        probe = f"#define PT_PROBE {self.probe}\n" if self.probe else ""
        return runtime.KernelSource(key=self.name, name=self.name, source=probe + _read("fmha_prefill.cu") + entry)


class PrefillParams(ctypes.Structure):
    """Mirror of pt::PrefillParams (prims_ts/cuda/fmha_prefill.cu)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("qo_indptr", ctypes.c_void_p),
        ("kv_indptr", ctypes.c_void_p),
        ("win_starts", ctypes.c_void_p),
        ("win_ends", ctypes.c_void_p),
        ("work", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("seq_lens", ctypes.c_void_p),
        ("q_sb", ctypes.c_int64),
        ("q_st", ctypes.c_int64),
        ("q_sh", ctypes.c_int64),
        ("k_sb", ctypes.c_int64),
        ("k_st", ctypes.c_int64),
        ("k_sh", ctypes.c_int64),
        ("v_sb", ctypes.c_int64),
        ("v_st", ctypes.c_int64),
        ("v_sh", ctypes.c_int64),
        ("o_sb", ctypes.c_int64),
        ("o_st", ctypes.c_int64),
        ("o_sh", ctypes.c_int64),
        ("win_stride", ctypes.c_int64),
        ("bt_stride", ctypes.c_int64),
        ("page_shift", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("sq", ctypes.c_int32),
        ("sk", ctypes.c_int32),
        ("num_q_tiles", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("window_left", ctypes.c_int32),
        ("out_dtype", ctypes.c_int32),
        ("n_items", ctypes.c_int32),
        ("heads", ctypes.c_int32),
        ("scale_log2", ctypes.c_float),
        ("out_scale", ctypes.c_float),
    ]


_LOADED: Dict[Tuple[int, object, str], runtime.LoadedKernel] = {}
_DEVICES: Dict[int, Tuple[str, int, int]] = {}


def _kernel(dev: int, key, which: str = "source", smem: Optional[int] = None,
            threads: Optional[int] = None) -> runtime.LoadedKernel:
    """The loaded kernel `key.<which>()` on device `dev`, looked up by the (hashable) key
    itself: a launch neither rebuilds the source text nor hashes it once loaded."""
    k = _LOADED.get((dev, key, which))
    if k is None:
        k = runtime.get_kernel(dev, getattr(key, which)(), key.smem if smem is None else smem,
                               key.threads if threads is None else threads)
        _LOADED[(dev, key, which)] = k
    return k


def _device(dev: int) -> Tuple[str, int, int]:
    """(arch, SM count, per-block shared memory limit) of a CUDA device, read once."""
    info = _DEVICES.get(dev)
    if info is None:
        arch = runtime.device_arch(dev)
        info = (arch, torch.cuda.get_device_properties(dev).multi_processor_count, smem_limit(arch))
        _DEVICES[dev] = info
    return info


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_limits(device) -> Tuple[int, int]:
    """(SM count, per-block shared memory) that sizes the decode policies on `device`
    (a torch.device or its name; None: the current CUDA device if there is one; the CPU,
    or no GPU at all: the nominal H200)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    else:
        device = torch.device(device)
    if device is None or device.type != "cuda":
        return DECODE_NOMINAL_SMS, NOMINAL_SMEM_LIMIT
    _, sms, limit = _device(_device_index(device))
    return sms, limit


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _strides(t: torch.Tensor, packed: bool):
    """(request, token, head) element strides of a [B,S,H,D] or packed [T,H,D] tensor."""
    if packed:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


LOG2E = 1.4426950408889634


def launch_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: Optional[torch.Tensor],
    kv_indptr: Optional[torch.Tensor],
    win_starts: Optional[torch.Tensor],
    win_ends: Optional[torch.Tensor],
    work: Optional[torch.Tensor],
    mask: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
) -> None:
    """batch_prefill: contiguous K/V, fixed [B,S,H,D] or packed [T,H,D] storage."""
    packed = qo_indptr is not None
    p = PrefillParams()
    p.kv_indptr = _ptr(kv_indptr)
    p.win_starts, p.win_ends = _ptr(win_starts), _ptr(win_ends)
    p.k_sb, p.k_st, p.k_sh = _strides(k, packed)
    p.v_sb, p.v_st, p.v_sh = _strides(v, packed)
    p.win_stride = win_starts.stride(0) if win_starts is not None else 0
    p.sq = 0 if packed else q.shape[1]
    p.sk = 0 if packed else k.shape[1]
    _launch(p, False, q, k, v, out, qo_indptr, work, mask, window_left, sm_scale, output_scale, max_q_len)


def launch_prefill_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    work: Optional[torch.Tensor],
    mask: str,
    window_left: int,
    sm_scale: float,
    output_scale: float,
    max_q_len: int,
) -> None:
    """batch_prefill_with_paged_kv_cache: packed Q over HND pools [P, Hkv, page_size, D]."""
    page_size = k_cache.shape[2]
    p = PrefillParams()
    p.block_tables, p.seq_lens = block_tables.data_ptr(), seq_lens.data_ptr()
    p.bt_stride = block_tables.stride(0)
    p.page_shift = page_size.bit_length() - 1
    p.k_sb, p.k_sh, p.k_st = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    p.v_sb, p.v_sh, p.v_st = v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)
    _launch(p, True, q, k_cache, v_cache, out, qo_indptr, work, mask, window_left, sm_scale, output_scale,
            max_q_len)


def prefill_key(dtype: torch.dtype, head_dim: int, mask: str, dev: int, paged: bool = False) -> "PrefillKey":
    """The prefill kernel (contiguous or paged) on CUDA device `dev`."""
    return PrefillKey.choose(dtype, head_dim, mask, _device(dev)[0], paged=paged)


def preload(device, keys) -> None:
    """Load these kernels on `device` now (compiled by NVRTC first unless the disk cache has
    them): what a wrapper's plan does, so that its runs (and a CUDA graph captured around
    them) find every module loaded. Nothing to do off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return  # traced or captured: the first run outside loads them (as before plans loaded)
    dev = _device_index(device)
    with torch.cuda.device(dev):
        for key in keys:
            _kernel(dev, key)


def _cuda_index(device) -> Optional[int]:
    """The CUDA device index of `device`; None: the current CUDA device if there is one (a
    plan that names no device runs there), else None for the CPU and meta devices."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    device = torch.device(device)
    return _device_index(device) if device.type == "cuda" else None


def _warm(device, key_on) -> None:
    """Plan-time: load the kernel `key_on(dev)` that the runs on `device` will launch (no-op off CUDA)."""
    dev = _cuda_index(device)
    if dev is not None:
        preload(torch.device("cuda", dev), [key_on(dev)])


def warm_prefill(device, dtype: torch.dtype, head_dim: int, mask: str, paged: bool = False) -> None:
    """Plan-time: load the prefill kernel (contiguous or paged)."""
    _warm(device, lambda dev: prefill_key(dtype, head_dim, mask, dev, paged))


def warm_decode(device, dtype: torch.dtype, head_dim: int, causal: bool, batch: int, num_kv_heads: int, group: int,
                max_seq_len_q: int, max_seq_len: int) -> None:
    """Plan-time: load the decode-shaped kernel (paged decode, MLA) of these static arguments."""
    _warm(device, lambda dev: decode_key(dtype, head_dim, causal, batch, num_kv_heads, group, max_seq_len_q,
                                         max_seq_len, dev)[1])


def warm_block_sparse(device, dtype: torch.dtype, head_dim: int, causal: bool, kv_block_size: int, rows: int) -> None:
    """Plan-time: load the block-sparse kernel for route rows of `rows` M rows."""
    _warm(device, lambda dev: block_sparse_key(dtype, head_dim, causal, kv_block_size, rows, dev))


def _launch(p: PrefillParams, paged: bool, q, k, v, out, qo_indptr, work, mask, window_left, sm_scale,
            output_scale, max_q_len) -> None:
    """Fill the fields every prefill launch shares, pick the kernel, launch it."""
    packed = qo_indptr is not None
    hq, hkv = q.shape[-2], k.shape[1] if paged else k.shape[-2]
    dev = _device_index(q.device)
    key = prefill_key(q.dtype, q.shape[-1], mask, dev, paged)
    with torch.cuda.device(dev):
        kern = _kernel(dev, key)
        p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        p.qo_indptr = _ptr(qo_indptr)
        p.work = _ptr(work)
        p.q_sb, p.q_st, p.q_sh = _strides(q, packed)
        p.o_sb, p.o_st, p.o_sh = _strides(out, packed)
        batch = qo_indptr.shape[0] - 1 if packed else q.shape[0]
        p.batch = batch
        p.num_q_tiles = (max_q_len + key.bm - 1) // key.bm
        p.group = hq // hkv
        p.window_left = window_left
        p.out_dtype = OUT_DTYPE_CODES[out.dtype]
        p.scale_log2 = sm_scale * LOG2E
        p.out_scale = output_scale
        p.n_items = work.shape[0] if work is not None else batch * p.num_q_tiles
        p.heads = hq
        ctas = work_grid(p.n_items * hq, key.persistent, _device(dev)[1])
        if ctas == 0:  # no q tile to compute (an empty plan)
            return
        stream = torch.cuda.current_stream(dev).cuda_stream
        runtime.launch(dev, kern, key.name, (ctas, 1, 1), p, stream)


# Persistent CTAs for the producer-ring kernels (prefill, paged prefill, block-sparse on
# sm_90a): at most one CTA per SM, each walking work items c, c + grid, ... with one ring,
# so the producer copies the next item's first tiles while the MMA warps finish the
# current one (the short rows: B8 S1024, block-sparse at 10%). The kernels take either
# grid; False launches one CTA per item. Measured against the default (NOTES, fifth and
# sixth sessions): with loop 0, 1.04-1.10x on B8 S1024 but 0.95-0.98x on the long causal
# rows and 0.94-0.99x on block-sparse; keeping each key's loop (pingpong at D128),
# 0.91-1.02x on prefill, 0.93-0.96x on block-sparse, 0.97-1.05x on paged prefill: off.
PERSISTENT = False
PERSISTENT_CTAS: Optional[int] = None  # the persistent grid's cap (None: the SM count); tests use a few

# PT_PROBE (pt_fmha.cuh) in the sm_90a prefill keys (benchmarks/gpu_session.sh `probe`): 1
# times the MMA warps without the K/V copies, 2 the copies without the math. A measurement
# aid whose results are wrong; 0 (the library's only value) builds the real kernels.
PREFILL_PROBE = 0


def work_grid(items: int, persistent: bool, sm_count: int) -> int:
    """CTAs for `items` work items: one each, or (a persistent key) no more than the SMs,
    which then walk the items in launch order (one CTA fits an SM)."""
    if persistent:
        return min(items, PERSISTENT_CTAS or sm_count)
    return items


def prefill_tile_m(dtype: torch.dtype, head_dim: int, mask: str, device: Optional[torch.device] = None) -> int:
    """The q tile height of the prefill kernel for `device` (its arch's key; CPU: sm_80's)."""
    device = torch.device(device) if device is not None else None
    arch = _device(_device_index(device))[0] if device is not None and device.type == "cuda" else "sm_80"
    return PrefillKey.choose(dtype, head_dim, mask, arch).bm


def _both_loops(key):
    """A producer-ring key with each consumer loop (whichever fmha_loop chooses),
    persistent with the plain loop, the key's own (default) loop and pingpong (loop 1 on
    one MMA warpgroup; whichever PERSISTENT and FMHA_LOOP choose), and the key as chosen
    with each producer copy (whichever kv_copy_tpr chooses)."""
    for loop in FMHA_LOOPS if key.producer else (key.loop,):
        if loop < 2 or key.bm == 128:  # pingpong takes two MMA warpgroups
            yield replace(key, loop=loop, persistent=False)
    if key.producer and getattr(key, "mask", "") != "variable_window":
        for loop in sorted({0, key.loop, 2 if key.bm == 128 else 1}):
            yield replace(key, loop=loop, persistent=True)
    yield from _other_copies(key)


def _other_copies(key):
    """A producer-ring key with the producer copies it does not have (none for the others)."""
    if key.producer:
        for tpr in KV_COPY_TPRS:
            if tpr != key.copy_tpr:
                yield replace(key, copy_tpr=tpr)


def all_keys(arch: str = "sm_90a") -> Iterator[runtime.KernelSource]:
    """Every kernel the public APIs can launch on a device of `arch` (and the variants a
    switch in this module selects)."""
    for dtype in DTYPE_CODES:
        for d in (128, 256):
            for mask in MASK_CODES:
                for key in _both_loops(PrefillKey.choose(dtype, d, mask, arch)):
                    yield key.source()
            for mask in ("dense", "causal"):
                for key in _both_loops(PrefillKey.choose(dtype, d, mask, arch, paged=True)):
                    yield key.source()
    for dtype in DTYPE_CODES:
        for d in DECODE_HEAD_DIMS:
            for group in (1, 32, 64):  # one policy per row-tile height (BM 16, 32, 64)
                pol = decode_policy(1, 1, group, 1, d, 1, DECODE_NOMINAL_SMS, smem_limit(arch))
                for causal in (False, True):
                    yield DecodeKey.of(DTYPE_CODES[dtype], d, causal, pol).source()
    for dtype in DTYPE_CODES:
        for heads in (16, 32, 64):  # MLA: one policy per row-tile height (BM 16, 32, 64)
            pol = decode_policy(1, 1, heads, 1, MLA_DIM_QK, 1, DECODE_NOMINAL_SMS, smem_limit(arch))
            for causal in (False, True):
                if arch == "sm_90a" and pol.bm < 64:  # both engines of rows of 16/32
                    swapped = DecodeKey.swapped(DTYPE_CODES[dtype], causal, pol)
                    yield swapped.source()
                    for k in _other_copies(swapped):
                        yield k.source()
                    yield DecodeKey.of(DTYPE_CODES[dtype], MLA_DIM_QK, causal, pol, "sm_80").source()
                else:
                    key = DecodeKey.of(DTYPE_CODES[dtype], MLA_DIM_QK, causal, pol, arch)
                    yield key.source()
                    for k in _other_copies(key):
                        yield k.source()
    for key in block_sparse_keys(arch):
        for k in _both_loops(key):
            yield k.source()


def keys_list(arch: str = "sm_90a") -> List[runtime.KernelSource]:
    return list(all_keys(arch))


# ----------------------------------------------------------------------------
# paged decode (prims_ts_batch_decode_with_kv_cache)
# ----------------------------------------------------------------------------

DECODE_HEAD_DIMS = (64, 128, 256)
DECODE_NOMINAL_SMS = 132  # CPU tensors: sizes are computed as for an H200


# Per head dim: K/V tile keys, pipeline depth (32 KB of K+V per stage, three stages) and
# whether the warps split O's columns (D256: o[] would not fit in registers otherwise)
DECODE_TILE = {64: (128, 3, False), 128: (64, 3, False), 256: (32, 3, True)}
# MLA decode runs on the same kernel: one latent head (Hkv = 1, group = H) of 576-wide
# K rows whose first 512 values are V (one shared tile per stage, O split across warps);
# per row-tile height BM: (keys per tile, stages, warps splitting the keys and O)
MLA_DIM_QK = 576
MLA_DIM_V = 512
MLA_TILE = {16: (64, 2, 4), 32: (64, 2, 4), 64: (64, 2, 2)}  # BM 64: the wgmma engine on sm_90a
DECODE_MIN_KEYS_PER_SPLIT = 128
DECODE_MAX_SPLITS = 128
# The split merge (fmha_decode.cu, merge_if_last): False = register work units over split
# lanes (measured: B1 L131072 3.71 TB/s); True = the splits' partial rows staged through
# shared memory with cp.async, a chunk of splits per round trip (tested; measured 0.4-1.3 us
# slower on the latency rows: benchmarks/NOTES.md, fifth session). Both are in every decode
# kernel; the launch picks.
DECODE_MERGE_STAGED = False
SM_SMEM_BYTES = 228 * 1024  # per SM on sm_80 / sm_90 (the CTA-count estimate only)
NOMINAL_SMEM_LIMIT = SM90_SMEM_LIMIT  # per-block shared memory of the H200 (CPU tensors size as for it)


def smem_limit(arch: str) -> int:
    """Per-block opt-in shared memory: 227 KB on sm_90, 163 KB on sm_80/87, 99 KB on sm_86/89."""
    return {"sm_90a": SM90_SMEM_LIMIT, "sm_90": SM90_SMEM_LIMIT, "sm_80": 166912, "sm_87": 166912}.get(arch, 101376)


@dataclass(frozen=True)
class DecodePolicy:
    """Static launch shape of one decode key: tile, warps, row tiles, split-KV."""

    bm: int  # M rows per CTA (GQA group x query tokens, padded to 16)
    bn: int  # keys per K/V tile
    warps_n: int  # warps splitting each K/V tile's keys (merged in the CTA)
    stages: int  # K/V tiles in flight
    split_o: bool  # the warps_n warps also split O's columns (P shared through smem)
    row_tiles: int  # CTAs along the M rows of one (request, K/V head)
    rows_max: int  # group * max query tokens
    splits: int  # K/V chunks per (request, K/V head), merged through the workspace
    chunk: int  # keys per split (multiple of bn)


def _split_target(ctas: int, slots: int) -> int:
    """Splits per (request, K/V head) that fill the resident CTA slots best (fewest on ties)."""
    if ctas >= slots:
        return 1
    best, best_eff = 1, 0.0
    for s in range(1, min(DECODE_MAX_SPLITS, -(-4 * slots // ctas)) + 1):
        total = ctas * s
        eff = total / (-(-total // slots) * slots)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def value_dim(head_dim: int) -> int:
    """V/O width of a decode key: the head dim, or 512 for MLA's 576-wide latents."""
    return MLA_DIM_V if head_dim == MLA_DIM_QK else head_dim


def _decode_tiles(head_dim: int, bm: int):
    """Tile shapes (bm, bn, stages, warps_n, split_o) for rows that want row tiles of `bm`,
    the preferred (the H200's) first, then ones that fit smaller shared memories:
    fewer stages, then shorter row tiles (more of them), then (MLA) shorter key tiles."""
    mla = head_dim == MLA_DIM_QK
    for b in (64, 32, 16):
        if b > bm:
            continue
        if mla:
            bn, stages, warps_n = MLA_TILE[b]
            yield b, bn, stages, warps_n, True
            yield b, 32, 2, 2, True
            continue
        bn, stages, split_o = DECODE_TILE[head_dim]
        # four warps per CTA where the rows leave room: the extra ones split the keys
        warps_n = max(1, min(4 // (b // 16), bn // 16))
        if split_o:
            warps_n = max(2, warps_n)
        yield b, bn, stages, warps_n, split_o
        yield b, bn, 2, warps_n, split_o


# The swapped-operand MLA tile (pt_fmha_swap.cuh) for rows of 16/32 on sm_90a (keys as
# wgmma's M): B64 L8192 H16 1.94 -> 3.32 TB/s over the mma.sync tile (benchmarks/NOTES.md,
# mla-v1). False selects the mma.sync tile (sm_80's) on sm_90a too.
MLA_SWAPPED_TILE = True
SWAP_BN = 64  # keys per tile = wgmma's M
SWAP_THREADS = 256  # one MMA warpgroup + the producer warpgroup


def swap_smem_bytes(bm: int, bn: int, head_dim: int, stages: int) -> int:
    """pt::SwapConfig<...>::SMEM_BYTES: Q, the ring (`stages` shared K/V tiles), Pᵀ, the
    per-warp row reductions and the ring's mbarriers."""
    return bm * head_dim * 2 + stages * bn * head_dim * 2 + bm * bn * 2 + 4 * bm * 4 + 2 * stages * 8


def _decode_wgmma(head_dim: int, bm: int) -> bool:
    """Decode tiles the wgmma engine takes on sm_90a: MLA row tiles of 64."""
    return head_dim == MLA_DIM_QK and bm == 64


def decode_tile_smem(head_dim: int, bm: int, bn: int, stages: int, warps_n: int, split_o: bool) -> int:
    """Shared memory of a decode tile, with the wgmma engine's alignment slack where it may apply."""
    wgmma = _decode_wgmma(head_dim, bm)  # then also the producer's barriers
    return fmha_smem_bytes(bm, bn, head_dim, stages, warps_n, split_o, value_dim(head_dim),
                           head_dim == MLA_DIM_QK, wgmma) + (WGMMA_ALIGN_SLACK if wgmma else 0)


@functools.lru_cache(maxsize=4096)  # a pure function of ints, called on every launch
def decode_policy(batch: int, num_kv_heads: int, group: int, max_seq_len_q: int, head_dim: int,
                  max_seq_len: int, sm_count: int, smem_limit: int = NOMINAL_SMEM_LIMIT) -> DecodePolicy:
    """Tile and split-KV choice from the static arguments only (no metadata values): the
    first tile of `_decode_tiles` whose shared memory fits the device's per-block limit."""
    rows_max = group * max_seq_len_q
    bm = 16 if rows_max <= 16 else (32 if rows_max <= 32 else 64)
    for bm, bn, stages, warps_n, split_o in _decode_tiles(head_dim, bm):
        if decode_tile_smem(head_dim, bm, bn, stages, warps_n, split_o) <= smem_limit:
            break
    else:
        raise ValueError(f"head_dim {head_dim}: no decode tile fits {smem_limit} bytes of shared memory per block")
    row_tiles = (rows_max + bm - 1) // bm
    ctas = batch * num_kv_heads * row_tiles
    threads = bm // 16 * warps_n * 32
    smem = decode_tile_smem(head_dim, bm, bn, stages, warps_n, split_o)
    per_sm = max(1, min(SM_SMEM_BYTES // (smem + 1024), 2048 // threads))
    tiles = (max_seq_len + bn - 1) // bn
    # The split count fills the SMs' resident slots (wave quantisation included) and
    # is capped by the key count only (at least 128 keys per split), so it, and the
    # workspace, never shrink as max_seq_len grows: a workspace sized for the longest
    # key serves all shorter ones; a trailing split may then be empty (merged as nothing).
    splits = max(1, min(_split_target(ctas, sm_count * per_sm), tiles // max(1, DECODE_MIN_KEYS_PER_SPLIT // bn)))
    chunk = ((tiles + splits - 1) // splits) * bn
    return DecodePolicy(bm, bn, warps_n, stages, split_o, row_tiles, rows_max, splits, chunk)


@dataclass(frozen=True)
class DecodeKey:
    dtype: str
    head_dim: int
    causal: bool
    bm: int
    bn: int
    warps_n: int = 1
    stages: int = 2
    split_o: bool = False
    arch: int = 80  # tile engine: 80 = mma.sync; 90 = wgmma (MLA row tiles of 64 on sm_90a)
    swap: bool = False  # the swapped-operand wgmma tile (MLA rows of 16/32 on sm_90a): keys as M
    copy_tpr: int = 4  # the tile ring producer's threads per K/V row (KV_COPY_TPR)

    @staticmethod
    def of(dtype: str, head_dim: int, causal: bool, pol: DecodePolicy, arch: str = "sm_80") -> "DecodeKey":
        if arch == "sm_90a" and MLA_SWAPPED_TILE and head_dim == MLA_DIM_QK and pol.bm < 64:
            return DecodeKey.swapped(dtype, causal, pol)
        engine = 90 if arch == "sm_90a" and _decode_wgmma(head_dim, pol.bm) else 80
        return DecodeKey(dtype, head_dim, causal, pol.bm, pol.bn, pol.warps_n, pol.stages, pol.split_o, engine,
                         copy_tpr=kv_copy_tpr(head_dim) if engine == 90 else 4)

    @staticmethod
    def swapped(dtype: str, causal: bool, pol: DecodePolicy) -> "DecodeKey":
        """The swapped-operand MLA tile for the policy's row tile of 16 or 32 (BN 64: the
        policy's split chunks stay whole tiles): two stages of 72 KB tiles."""
        assert pol.bm in (16, 32) and pol.bn == SWAP_BN, pol
        return DecodeKey(dtype, MLA_DIM_QK, causal, pol.bm, SWAP_BN, 1, 2, False, 90, True,
                         kv_copy_tpr(MLA_DIM_QK))

    @property
    def producer(self) -> bool:  # the wgmma engines take a producer warpgroup
        return self.arch == 90

    @property
    def threads(self) -> int:
        if self.swap:
            return SWAP_THREADS
        return self.bm // 16 * self.warps_n * 32 + (PRODUCER_THREADS if self.producer else 0)

    @property
    def dv(self) -> int:
        return value_dim(self.head_dim)

    @property
    def shared_kv(self) -> bool:
        return self.head_dim == MLA_DIM_QK

    @property
    def smem(self) -> int:
        if self.swap:
            return swap_smem_bytes(self.bm, self.bn, self.head_dim, self.stages) + WGMMA_ALIGN_SLACK
        return fmha_smem_bytes(self.bm, self.bn, self.head_dim, self.stages, self.warps_n, self.split_o, self.dv,
                               self.shared_kv, self.producer) + (WGMMA_ALIGN_SLACK if self.arch == 90 else 0)

    @property
    def name(self) -> str:
        return (f"pt_decode_{self.dtype}_d{self.head_dim}_c{int(self.causal)}_bm{self.bm}_bn{self.bn}"
                f"_wn{self.warps_n}_s{self.stages}" + ("_so" if self.split_o else "") +
                ("_sm90_ws" if self.arch == 90 else "") + ("_swap" if self.swap else "") +
                (f"_cp{self.copy_tpr}" if self.copy_tpr != 4 else ""))

    def source(self) -> runtime.KernelSource:
        q_regs = self.head_dim <= 128 and self.arch != 90
        cfg = fmha_config(self.dtype, self.head_dim, self.bm, self.bn, q_regs, self.arch, self.warps_n,
                          self.stages, self.split_o, self.dv, self.shared_kv, self.producer, copy_tpr=self.copy_tpr)
        if self.swap:
            cfg = f"pt::SwapConfig<pt::{self.dtype}, {self.head_dim}, {self.dv}, {self.bm}, {self.stages}, {self.copy_tpr}>"
        entry = (
            f'\nextern "C" __global__ void __launch_bounds__({self.threads}, 1)\n'
            f"{self.name}(const __grid_constant__ pt::DecodeParams p) {{\n"
            f"  pt::decode_kernel<{cfg}, {str(self.causal).lower()}>(p);\n}}\n"
        )
        return runtime.KernelSource(key=self.name, name=self.name, source=_read("fmha_decode.cu") + entry)


class DecodeParams(ctypes.Structure):
    """Mirror of pt::DecodeParams (prims_ts/cuda/fmha_decode.cu)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "o", "ws_o", "ws_lse", "ws_count", "qo_indptr", "kv_indptr", "kv_indices", "seq_lens")] + [
        (n, ctypes.c_int64) for n in (
            "q_sb", "q_st", "q_sh", "o_sb", "o_st", "o_sh", "k_sp", "k_sh", "k_ss", "v_sp", "v_sh", "v_ss",
            "bt_stride")] + [
        (n, ctypes.c_int32) for n in (
            "sq", "rows_max", "row_tiles", "splits", "chunk", "group", "hkv", "page_shift", "window_left",
            "out_dtype", "merge_staged")] + [
        ("scale_log2", ctypes.c_float),
        ("out_scale", ctypes.c_float),
    ]


def _decode_q_strides(t: torch.Tensor, packed: bool):
    """(request, token, head) strides of [B,Hq,D], [B,SQ,Hq,D] or packed [T,Hq,D]."""
    if packed:
        return 0, t.stride(0), t.stride(1)
    if t.dim() == 3:
        return t.stride(0), 0, t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def launch_decode(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr,
                  seq_len_q: int, max_seq_len_q: int, max_seq_len: int, mask: str, window_left: int,
                  sm_scale: float, output_scale: float) -> None:
    """Paged decode over CSR pages. Trusted arguments (validated by prims_ts.ops.decode)."""
    _launch_decode_kernel(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, 0, seq_lens, qo_indptr,
                          seq_len_q, max_seq_len_q, max_seq_len, mask == "causal", window_left, sm_scale,
                          output_scale)


def _fill_gqa_rows(p: "DecodeParams", query, k_cache, v_cache, out, packed: bool, group: int, window_left: int,
                   sm_scale: float, output_scale: float) -> None:
    """The DecodeParams fields every decode-shaped launch (decode, MLA, block-sparse) sets the
    same way: tensors, strides, the GQA row mapping, pages, mask window, output and scales."""
    p.q, p.k, p.v, p.o = query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
    p.q_sb, p.q_st, p.q_sh = _decode_q_strides(query, packed)
    p.o_sb, p.o_st, p.o_sh = _decode_q_strides(out, packed)
    p.k_sp, p.k_sh, p.k_ss = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    p.v_sp, p.v_sh, p.v_ss = v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)
    p.group, p.hkv = group, k_cache.shape[1]
    p.page_shift = k_cache.shape[2].bit_length() - 1
    p.window_left = window_left
    p.out_dtype = OUT_DTYPE_CODES[out.dtype]
    p.merge_staged = int(DECODE_MERGE_STAGED)
    p.scale_log2 = sm_scale * LOG2E
    p.out_scale = output_scale


def decode_key(dtype: torch.dtype, head_dim: int, causal: bool, batch: int, num_kv_heads: int, group: int,
               max_seq_len_q: int, max_seq_len: int, dev: int) -> Tuple[DecodePolicy, "DecodeKey"]:
    """The policy and kernel of a decode-shaped launch (paged decode; MLA with one latent head)
    on CUDA device `dev`, from the static arguments alone (what a plan knows)."""
    arch, sms, limit = _device(dev)
    pol = decode_policy(batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sms, limit)
    return pol, DecodeKey.of(DTYPE_CODES[dtype], head_dim, causal, pol, arch)


def _launch_decode_kernel(query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, bt_stride: int, seq_lens,
                          qo_indptr, seq_len_q: int, max_seq_len_q: int, max_seq_len: int, causal: bool,
                          window_left: int, sm_scale: float, output_scale: float) -> None:
    """The decode kernel (split-KV merged in-kernel) on pools [P, Hkv, ps, D]; pages from CSR
    (kv_indptr, kv_indices) or, with kv_indptr None, a block table of row stride bt_stride."""
    packed = qo_indptr is not None
    hq, hkv, d = query.shape[-2], k_cache.shape[1], query.shape[-1]
    group = hq // hkv
    batch = qo_indptr.shape[0] - 1 if packed else query.shape[0]
    dev = _device_index(query.device)
    pol, key = decode_key(query.dtype, d, causal, batch, hkv, group, max_seq_len_q, max_seq_len, dev)
    with torch.cuda.device(dev):
        kern = _kernel(dev, key)
        p = DecodeParams()
        _fill_gqa_rows(p, query, k_cache, v_cache, out, packed, group, window_left, sm_scale, output_scale)
        if pol.splits > 1:
            ws = workspace.data_ptr()
            lse_off, o_off, count_off, _ = _decode_partial_layout(batch, hkv, pol, key.dv)
            p.ws_lse, p.ws_o, p.ws_count = ws + lse_off, ws + o_off, ws + count_off
        p.qo_indptr = _ptr(qo_indptr)
        p.kv_indptr, p.kv_indices, p.seq_lens = _ptr(kv_indptr), kv_indices.data_ptr(), seq_lens.data_ptr()
        p.bt_stride = bt_stride
        p.sq = seq_len_q
        p.rows_max, p.row_tiles, p.splits, p.chunk = pol.rows_max, pol.row_tiles, pol.splits, pol.chunk
        stream = torch.cuda.current_stream(dev).cuda_stream
        runtime.launch(dev, kern, key.name, (pol.splits, hkv * pol.row_tiles, batch), p, stream)


def launch_mla(query, kv_cache, workspace, out, block_tables, seq_lens, qo_indptr, seq_len_q: int,
               max_seq_len_q: int, max_seq_len: int, causal: bool, sm_scale: float, output_scale: float) -> None:
    """MLA decode: the decode kernel with one latent head (Hkv = 1, group = H), 576-wide K
    rows whose first 512 values are V, pages from a dense block table. Trusted arguments:
    query [B, SQ, H, 576] or packed [T, H, 576]; kv_cache [P, ps, 576]; out [..., 512]."""
    kv = kv_cache.unsqueeze(1)  # [P, 1, ps, 576]: the decode kernel's one-head pool (a view)
    _launch_decode_kernel(query, kv, kv, workspace, out, None, block_tables, block_tables.stride(0), seq_lens,
                          qo_indptr, seq_len_q, max_seq_len_q, max_seq_len, causal, -1, sm_scale, output_scale)


def mla_workspace_bytes(batch: int, num_heads: int, max_seq_len_q: int, max_seq_len: int, sm_count: int,
                        smem_limit: int = NOMINAL_SMEM_LIMIT) -> int:
    """Workspace bytes of MLA decode (never shrinks as max_seq_len or max_seq_len_q grows)."""
    return decode_workspace_bytes(batch, 1, num_heads, max_seq_len_q, MLA_DIM_QK, max_seq_len, sm_count, smem_limit)


def _decode_partial_layout(batch: int, num_kv_heads: int, pol: DecodePolicy, dv: int) -> Tuple[int, int, int, int]:
    """Workspace layout of a split launch, byte offsets of: lse rows, partial outputs, the
    per-row-tile arrival counters (sections 256-byte aligned), and the end."""
    rows = batch * num_kv_heads * pol.splits * pol.rows_max
    align = lambda n: (n + 255) // 256 * 256  # noqa: E731
    o = align(rows * 4)
    count = o + align(rows * dv * 4)
    return 0, o, count, count + batch * num_kv_heads * pol.row_tiles * 4


def _decode_partial_bytes(batch: int, num_kv_heads: int, pol: DecodePolicy, head_dim: int) -> int:
    """Workspace bytes of one launch (0 without split-KV)."""
    return 0 if pol.splits == 1 else _decode_partial_layout(batch, num_kv_heads, pol, value_dim(head_dim))[3]


@functools.lru_cache(maxsize=4096)  # a pure function of ints, called on every launch
def decode_workspace_bytes(batch: int, num_kv_heads: int, group: int, max_seq_len_q: int, head_dim: int,
                           max_seq_len: int, sm_count: int, smem_limit: int = NOMINAL_SMEM_LIMIT) -> int:
    """Workspace bytes for these static arguments.

    Taller row tiles mean more CTAs and so fewer splits; the size is the largest over
    every query length up to max_seq_len_q (the last one of each row-tile shape is
    enough), so that it never shrinks as max_seq_len_q or max_seq_len grows.
    """
    def need(sq: int) -> int:
        pol = decode_policy(batch, num_kv_heads, group, sq, head_dim, max_seq_len, sm_count, smem_limit)
        return _decode_partial_bytes(batch, num_kv_heads, pol, head_dim)

    # the last sq of each (bm, row_tiles) shape: group * sq just below each multiple of 16
    # (row tiles are 16, 32 or 64 rows)
    edges = {max_seq_len_q} | {16 * k // group for k in range(1, (group * max_seq_len_q) // 16 + 1)}
    return max(need(sq) for sq in edges if 1 <= sq <= max_seq_len_q)


# ----------------------------------------------------------------------------
# paged block-sparse attention (block_sparse_attention_with_paged_kv_cache)
# ----------------------------------------------------------------------------

BLOCK_SPARSE_HEAD_DIMS = (128, 256)


@dataclass(frozen=True)
class BlockSparseKey:
    """One block-sparse kernel: the decode problem's GQA rows over a route's KV blocks.

    KV blocks of 64+ keys on sm_90a take the wgmma engine (BM 64 for short rows at D128,
    else 128; BN 128 when the block size allows at D128, else 64); smaller blocks (8/16/32: one short tile of BN
    16/32 per block) and other archs the mma.sync engine with BM 64 (BN 32 at D256, to fit 99 KB).
    """

    dtype: str
    head_dim: int
    causal: bool
    bm: int
    bn: int
    arch: int
    stages: int = 2
    loop: int = 0  # the producer ring's consumer loop (FMHA_LOOP)
    persistent: bool = False  # CTAs walk several work items (PERSISTENT)
    copy_tpr: int = 4  # the producer's threads per K/V row (KV_COPY_TPR)

    @staticmethod
    def choose(dtype: str, head_dim: int, causal: bool, kv_block_size: int, rows: int,
               arch: str) -> "BlockSparseKey":
        """`rows`: the M rows of one route row, q_block_size (or Sq if smaller) x group."""
        if arch == "sm_90a" and kv_block_size % 64 == 0:
            bn = 128 if head_dim == 128 and kv_block_size % 128 == 0 else 64
            bm = 64 if rows <= 64 and head_dim == 128 else 128  # D256 at BM 64 spills
            return BlockSparseKey(dtype, head_dim, causal, bm, bn, 90, producer_stages(bm, bn, head_dim),
                                  fmha_loop(head_dim) if bm == 128 else min(fmha_loop(head_dim), 1),  # pingpong: two warpgroups
                                  PERSISTENT, kv_copy_tpr(head_dim))
        # the portable engine: tiles that fit 99 KB of shared memory per block (sm_86/89)
        if head_dim == 256:
            return BlockSparseKey(dtype, head_dim, causal, 64, 32 if kv_block_size >= 32 else 16, 80)
        bn = 64 if kv_block_size % 64 == 0 else max(16, kv_block_size)
        return BlockSparseKey(dtype, head_dim, causal, 64, bn, 80)

    @property
    def producer(self) -> bool:
        return self.arch == 90

    @property
    def threads(self) -> int:
        return self.bm // 16 * 32 + (PRODUCER_THREADS if self.producer else 0)

    @property
    def smem(self) -> int:
        return (fmha_smem_bytes(self.bm, self.bn, self.head_dim, self.stages, producer=self.producer) +
                (WGMMA_ALIGN_SLACK if self.arch == 90 else 0))

    @property
    def name(self) -> str:
        return (f"pt_bsr_{self.dtype}_d{self.head_dim}_c{int(self.causal)}_bm{self.bm}_bn{self.bn}_sm{self.arch}"
                + (f"_s{self.stages}" if self.stages != 2 else "") + ("_ws" if self.producer else "")
                + (f"_l{self.loop}" if self.loop else "") + ("_pk" if self.persistent else "")
                + (f"_cp{self.copy_tpr}" if self.copy_tpr != 4 else ""))

    def source(self) -> runtime.KernelSource:
        cfg = fmha_config(self.dtype, self.head_dim, self.bm, self.bn, self.arch == 80 and self.head_dim <= 128,
                          self.arch, stages=self.stages, producer=self.producer, loop=self.loop,
                          copy_tpr=self.copy_tpr)
        entry = (
            f'\nextern "C" __global__ void __launch_bounds__({self.threads}, 1)\n'
            f"{self.name}(const __grid_constant__ pt::BlockSparseParams p) {{\n"
            f"  pt::block_sparse_kernel<{cfg}, {str(self.causal).lower()}, {str(self.persistent).lower()}>(p);\n}}\n"
        )
        return runtime.KernelSource(key=self.name, name=self.name, source=_read("fmha_block_sparse.cu") + entry)


def block_sparse_keys(arch: str) -> Iterator[BlockSparseKey]:
    for dtype in DTYPE_CODES.values():
        for d in BLOCK_SPARSE_HEAD_DIMS:
            for causal in (False, True):
                shapes = {(kvb, rows) for kvb in (8, 32, 64, 128) for rows in (64, 128)}
                for key in sorted({BlockSparseKey.choose(dtype, d, causal, kvb, rows, arch) for kvb, rows in shapes},
                                  key=lambda k: k.name):
                    yield key


class BlockSparseParams(ctypes.Structure):
    """Mirror of pt::BlockSparseParams (prims_ts/cuda/fmha_block_sparse.cu)."""

    _fields_ = [
        ("d", DecodeParams),
        ("block_indptr", ctypes.c_void_p),
        ("block_indices", ctypes.c_void_p),
        ("valid_bits", ctypes.c_void_p),
    ] + [(n, ctypes.c_int32) for n in ("rows_r", "q_block", "kv_block", "row_tiles", "valid_words", "batch")]


def block_sparse_key(dtype: torch.dtype, head_dim: int, causal: bool, kv_block_size: int, rows: int,
                     dev: int) -> "BlockSparseKey":
    """The block-sparse kernel on CUDA device `dev` for route rows of `rows` M rows
    (min(q_block_size, Sq) x group)."""
    return BlockSparseKey.choose(DTYPE_CODES[dtype], head_dim, causal, kv_block_size, rows, _device(dev)[0])


def launch_block_sparse(q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices,
                        q_block_size: int, kv_block_size: int, seq_lens, valid_bits, causal: bool,
                        sm_scale: float) -> None:
    """Block-sparse attention over CSR-paged pools [P, Hkv, ps, D]. Trusted arguments: q and
    out [B, Sq, Hq, D] (out contiguous), block_indptr [B, Hkv, R + 1], valid_bits
    [B, words] (uint32 or int32 bits) or None. No host synchronisation."""
    batch, sq, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    rows_r = -(-sq // q_block_size)
    rows = min(q_block_size, sq) * group
    dev = _device_index(q.device)
    key = block_sparse_key(q.dtype, d, causal, kv_block_size, rows, dev)
    row_tiles = -(-rows // key.bm)  # rows: the tallest route row (q_block_size, or Sq if shorter)
    with torch.cuda.device(dev):
        kern = _kernel(dev, key)
        bp = BlockSparseParams()
        p = bp.d
        _fill_gqa_rows(p, q, k_cache, v_cache, out, False, group, -1, sm_scale, 1.0)
        p.kv_indptr, p.kv_indices, p.seq_lens = kv_indptr.data_ptr(), kv_indices.data_ptr(), seq_lens.data_ptr()
        p.sq, p.rows_max, p.row_tiles, p.splits, p.chunk = sq, rows, row_tiles, 1, 0
        bp.block_indptr, bp.block_indices = block_indptr.data_ptr(), block_indices.data_ptr()
        bp.valid_bits = _ptr(valid_bits)
        bp.rows_r, bp.q_block, bp.kv_block, bp.row_tiles = rows_r, q_block_size, kv_block_size, row_tiles
        bp.valid_words = valid_bits.shape[1] if valid_bits is not None else 0
        bp.batch = batch
        ctas = work_grid(batch * hkv * rows_r * row_tiles, key.persistent, _device(dev)[1])
        stream = torch.cuda.current_stream(dev).cuda_stream
        runtime.launch(dev, kern, key.name, (ctas, 1, 1), bp, stream)
