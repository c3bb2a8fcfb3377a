"""Kernel keys: which source, which template arguments, which launch geometry.

A key names one cubin. ``all_keys()`` lists every specialisation that the
public APIs can ask for (``python -m prims_ts warmup`` compiles them all).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional

import torch

from . import runtime

HERE = Path(__file__).resolve().parent

DTYPE_CODES = {torch.float16: "f16", torch.bfloat16: "bf16"}
OUT_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}  # pt::OutDtype
MASK_CODES = {"dense": 0, "causal": 1, "variable_window": 2}  # pt::MaskKind


def _read(name: str) -> str:
    return (HERE / name).read_text()


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

    @staticmethod
    def choose(dtype: torch.dtype, head_dim: int, mask: str, arch: str = "sm_80", paged: bool = False) -> "PrefillKey":
        dt = DTYPE_CODES[dtype]
        if arch == "sm_90a":
            if head_dim == 128:
                return PrefillKey(dt, 128, mask, bm=128, bn=128, q_in_regs=False, arch=90, paged=paged)
            return PrefillKey(dt, head_dim, mask, bm=128, bn=64, q_in_regs=False, arch=90, paged=paged)
        if head_dim == 128:
            return PrefillKey(dt, 128, mask, bm=128, bn=64, q_in_regs=True, paged=paged)
        return PrefillKey(dt, head_dim, mask, bm=128, bn=64, q_in_regs=False, paged=paged)

    @property
    def threads(self) -> int:
        return self.bm // 16 * 32

    @property
    def smem(self) -> int:
        q = self.bm * self.head_dim * 2
        kv = self.bn * self.head_dim * 2
        extra = 2 * self.bm * 4 if self.mask == "variable_window" else 0
        align = 1024 if self.arch == 90 else 0  # slack to 1024-align the wgmma tiles
        return q + 4 * kv + extra + align

    @property
    def name(self) -> str:
        return (
            f"pt_prefill_{self.dtype}_d{self.head_dim}_m{MASK_CODES[self.mask]}"
            f"_bm{self.bm}_bn{self.bn}_q{int(self.q_in_regs)}_mb{self.min_blocks}_sm{self.arch}"
            + ("_paged" if self.paged else "")
        )

    def source(self) -> runtime.KernelSource:
        cfg = (f"pt::FmhaConfig<pt::{self.dtype}, {self.head_dim}, {self.bm}, {self.bn}, "
               f"{str(self.q_in_regs).lower()}, {self.arch}>")
        entry = (
            f'\nextern "C" __global__ void __launch_bounds__({self.threads}, {self.min_blocks})\n'
            f"{self.name}(const pt::PrefillParams p) {{\n"
            f"  pt::prefill_kernel<{cfg}, {MASK_CODES[self.mask]}, {str(self.paged).lower()}>(p);\n}}\n"
        )
        return runtime.KernelSource(key=self.name, name=self.name, source=_read("fmha_prefill.cu") + entry)


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
        ("scale_log2", ctypes.c_float),
        ("out_scale", ctypes.c_float),
    ]


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


def _launch(p: PrefillParams, paged: bool, q, k, v, out, qo_indptr, work, mask, window_left, sm_scale,
            output_scale, max_q_len) -> None:
    """Fill the fields every prefill launch shares, pick the kernel, launch it."""
    packed = qo_indptr is not None
    hq, hkv = q.shape[-2], k.shape[1] if paged else k.shape[-2]
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    key = PrefillKey.choose(q.dtype, q.shape[-1], mask, runtime.device_arch(dev), paged=paged)
    with torch.cuda.device(dev):
        kern = runtime.get_kernel(dev, key.source(), key.smem, key.threads)
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
        n_items = work.shape[0] if work is not None else batch * p.num_q_tiles
        stream = torch.cuda.current_stream(dev).cuda_stream
        runtime.launch(dev, kern, key.name, (n_items, hq, 1), p, stream)


def prefill_tile_m(dtype: torch.dtype, head_dim: int, mask: str, device: Optional[torch.device] = None) -> int:
    arch = runtime.device_arch(device.index or 0) if device is not None and device.type == "cuda" else "sm_80"
    return PrefillKey.choose(dtype, head_dim, mask, arch).bm


def all_keys(arch: str = "sm_90a") -> Iterator[runtime.KernelSource]:
    """Every kernel the public APIs can launch on a device of `arch`."""
    for dtype in DTYPE_CODES:
        for d in (128, 256):
            for mask in MASK_CODES:
                yield PrefillKey.choose(dtype, d, mask, arch).source()
            for mask in ("dense", "causal"):
                yield PrefillKey.choose(dtype, d, mask, arch, paged=True).source()


def keys_list(arch: str = "sm_90a") -> List[runtime.KernelSource]:
    return list(all_keys(arch))
