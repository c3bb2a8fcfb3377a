"""Prefill kernels (batch_prefill and the paged form): key, tile choice, parameters, launch.

One kernel serves contiguous K/V (fixed ``[B, S, H, D]`` or packed ``[T, H, D]``) and
paged K/V (HND pools, a block table or CSR page IDs): ``prims_ts/cuda/fmha_prefill.cu``.
A ``PreparedPrefill`` is what a plan owns: the loaded kernel, its grid and a parameter
struct with every static field written; ``run_*`` write the live ones and launch.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import runtime
from .keys import (DEFAULT_TUNING, DTYPE_CODES, LOG2E, OUT_DTYPE_CODES, PRODUCER_THREADS, WGMMA_ALIGN_SLACK,
                   KernelKey, Prepared, Tuning, check_rows, check_starts, cpp_bool, device_info, fmha_config,
                   fmha_smem_bytes, load, producer_fits, producer_stages, tag, work_grid)

MASK_CODES = {"dense": 0, "causal": 1, "variable_window": 2}  # pt::MaskKind
# The sm_90a key tile (BN) of contiguous K/V in TMA boxes, per head dim (Tuning.prefill_bn;
# benchmarks/NOTES.md): D256 takes 80 keys (two stages beside its 64 KB Q tile), D128 128
TMA_BN = {128: 128, 256: 80}
HEAD_DIMS = (128, 256)
PAGE_SIZES = (16, 32, 64, 128)  # paged prefill's pools (the public API's contract)


@dataclass(frozen=True)
class PrefillKey(KernelKey):
    PREFIX = "pt_prefill"
    SOURCE = "fmha_prefill.cu"
    PARAMS = property(lambda self: "PrefillTmaParams" if self.tma else "PrefillParams")

    dtype: str = tag("", always=True)  # "bf16" | "f16"
    head_dim: int = tag("d", always=True)
    mask: str = tag("m", always=True)  # "dense" | "causal" | "variable_window"
    bm: int = tag("bm", 128, always=True)
    bn: int = tag("bn", 64, always=True)
    q_in_regs: bool = tag("q", True, always=True)
    arch: int = tag("sm", 80, always=True)  # tile engine: 80 = mma.sync (any sm_80+), 90 = wgmma (sm_90a)
    paged: bool = tag("paged", False)  # K/V address policy: contiguous rows, or HND page pools
    stages: int = tag("s", 2)  # K/V tiles in flight
    loop: int = tag("l", 0)  # the producer ring's consumer loop (Tuning.loop)
    persistent: bool = tag("pk", False)  # CTAs walk several work items (Tuning.persistent)
    copy_tpr: int = tag("cp", 4)  # the producer's threads per K/V row (Tuning.copy_tpr)
    probe: int = tag("probe", 0)  # PT_PROBE (Tuning.probe): a measurement aid, wrong results
    tma: bool = tag("tma", False)  # K/V tiles as TMA boxes (Tuning.tma / Tuning.paged_tma)
    lean: bool = tag("ln", False)  # the MMA warps' fewer instructions (Tuning.lean_mma)
    lazy: bool = tag("lz", False)  # the running maxima kept within 2^8 (Tuning.lazy_rescale)
    under_pv: bool = tag("up", False)  # the softmax under the previous PV (Tuning.softmax_under_pv)
    vpage: int = tag("vp", 0)  # paged TMA keys: V page-major, a page (this many rows) a group (Tuning.page_major_v)
    kil: bool = tag("ki", False)  # paged TMA keys: the K tile row-group interleaved, a box a page (Tuning.page_major_k)

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # a key per problem class: plans and one-shots look it up
    def choose(dtype: torch.dtype, head_dim: int, mask: str, arch: str, paged: bool = False,
               tuning: Tuning = DEFAULT_TUNING, packed: bool = False, page_size: int = 0) -> "PrefillKey":
        """The tile of each engine: sm_90a takes wgmma with a producer warpgroup (BM 128; BN
        128 at D128, at D256 80 for contiguous K/V in TMA boxes (``TMA_BN``) and 64 otherwise;
        as many stages as fit), other archs (and sm_90a under ``Tuning.portable``) the portable
        engine with tiles that fit 99 KB of shared memory per block. `page_size` (paged):
        ``Tuning.page_major_v`` lays V out a page a group where a page is shorter than BN, and
        ``Tuning.page_major_k`` K's 8-row groups with their panels interleaved there."""
        dt = DTYPE_CODES[dtype]
        if arch == "sm_90a" and not tuning.portable:
            extra = 2 * 128 * 4 if mask == "variable_window" else 0
            persistent = tuning.persistent and mask != "variable_window"
            tma = not tuning.probe and (tuning.paged_tma if paged else tuning.tma and not packed)
            bn = 128 if head_dim == 128 else 64  # pages, packed K/V, and where no two stages of want fit
            want = tuning.prefill_bn if tuning.prefill_bn is not None else TMA_BN[head_dim]
            if tma and not paged and producer_fits(128, want, head_dim, 2, extra):
                bn = want
            return PrefillKey(dt, head_dim, mask, bm=128, bn=bn, q_in_regs=False, arch=90, paged=paged,
                              stages=producer_stages(128, bn, head_dim, extra), loop=tuning.loop_for(head_dim),
                              persistent=persistent, copy_tpr=tuning.copy_for(head_dim), probe=tuning.probe,
                              tma=tma, lean=tuning.lean_for(head_dim), lazy=tuning.lazy_rescale,
                              under_pv=tuning.loop_for(head_dim) >= 1 and tuning.under_pv_for(True),
                              vpage=page_size if paged and tma and tuning.page_major_v and 0 < page_size < bn else 0,
                              kil=paged and tma and tuning.page_major_k and 0 < page_size < bn)
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

    def call(self) -> str:
        cfg = fmha_config(self.dtype, self.head_dim, self.bm, self.bn, self.q_in_regs, self.arch, stages=self.stages,
                          producer=self.producer, loop=self.loop, copy_tpr=self.copy_tpr, lean=self.lean,
                          lazy=self.lazy, under_pv=self.under_pv, v_page=self.vpage, k_il=self.kil)
        return (f"pt::prefill_kernel<{cfg}, {MASK_CODES[self.mask]}, {cpp_bool(self.paged)}, "
                f"{cpp_bool(self.persistent)}, {cpp_bool(self.tma)}>")

    def defines(self) -> str:
        return f"#define PT_PROBE {self.probe}\n" if self.probe else ""


def prefill_tile_m(dtype: torch.dtype, head_dim: int, mask: str, arch: str, paged: bool = False,
                   tuning: Tuning = DEFAULT_TUNING) -> int:
    """The q tile height of the prefill kernel on `arch` under `tuning` (work lists count its tiles)."""
    return PrefillKey.choose(dtype, head_dim, mask, arch, paged, tuning).bm


class PrefillParams(ctypes.Structure):
    """Mirror of pt::PrefillParams (prims_ts/cuda/fmha_prefill.cu)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "o", "qo_indptr", "kv_indptr", "win_starts", "win_ends", "work", "block_tables",
        "seq_lens")] + [
        (n, ctypes.c_int64) for n in (
            "q_sb", "q_st", "q_sh", "k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh", "o_sb", "o_st", "o_sh",
            "win_stride", "bt_stride")] + [
        (n, ctypes.c_int32) for n in (
            "page_shift", "batch", "sq", "sk", "num_q_tiles", "group", "window_left", "out_dtype", "n_items",
            "heads")] + [
        ("scale_log2", ctypes.c_float),
        ("out_scale", ctypes.c_float),
        ("k_xp", ctypes.c_int32),
        ("k_xh", ctypes.c_int32),
    ]


class _PrefillTmaParams(ctypes.Structure):
    """Mirror of pt::PrefillTmaParams: K's and V's tensor maps (64-byte aligned, so the struct
    is a multiple of 64 bytes), then the PrefillParams."""

    _fields_ = [("tmap_k", runtime.TensorMap), ("tmap_v", runtime.TensorMap), ("p", PrefillParams)]


PrefillTmaParams = runtime.padded_to(_PrefillTmaParams, 64)


@dataclass(frozen=True)
class PrefillStatic:
    """Everything a prefill launch needs besides tensor addresses: the prepared launch's key
    (built from a plan, or from an op's scalars and tensor shapes)."""

    dtype: torch.dtype
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    mask: str
    window_left: int
    sm_scale: float
    output_scale: float
    out_dtype: torch.dtype
    batch: int
    max_q_len: int  # packed: the bound of every request's query count; fixed: Sq
    n_items: Optional[int]  # work items per head: the work list's length; None: batch * q tiles (implicit order)
    packed: bool
    paged: bool = False
    page_size: int = 0
    sq: int = 0  # fixed storage
    sk: int = 0
    tuning: Tuning = DEFAULT_TUNING


def _strides3(t: torch.Tensor, packed: bool) -> Tuple[int, int, int]:
    """(request, token, head) element strides of a [B,S,H,D] or packed [T,H,D] tensor."""
    s = t.stride()
    return (0, s[0], s[1]) if packed else (s[0], s[1], s[2])


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class PreparedPrefill(Prepared):
    """The loaded kernel, grid and parameter struct of one PrefillStatic on one device."""

    __slots__ = ("p", "tp")

    def __init__(self, static: PrefillStatic, dev: int):
        arch, sms, _ = device_info(dev)
        key = PrefillKey.choose(static.dtype, static.head_dim, static.mask, arch, static.paged, static.tuning,
                                static.packed, static.page_size)
        kernel = load(dev, key)
        self.tp = PrefillTmaParams() if key.tma else None  # a TMA key's whole struct (p: its PrefillParams)
        p = self.tp.p if key.tma else PrefillParams()
        p.batch = static.batch
        p.sq, p.sk = static.sq, static.sk
        p.num_q_tiles = (static.max_q_len + key.bm - 1) // key.bm
        p.group = static.num_qo_heads // static.num_kv_heads
        p.window_left = static.window_left
        p.out_dtype = OUT_DTYPE_CODES[static.out_dtype]
        n_items = static.n_items if static.n_items is not None else static.batch * p.num_q_tiles
        p.n_items = n_items
        p.heads = static.num_qo_heads
        p.scale_log2 = static.sm_scale * LOG2E
        p.out_scale = static.output_scale
        if static.paged:
            p.page_shift = static.page_size.bit_length() - 1
        ctas = work_grid(n_items * static.num_qo_heads, key.persistent, sms, static.tuning.persistent_ctas)
        self.static, self.dev, self.key, self.p = static, dev, key, p
        self.launch = runtime.PreparedLaunch(kernel, key.name, (ctas, 1, 1), self.tp if key.tma else p)
        self._strides = None
        self.accepted = None
        self._maps = self._maps_at = None

    def _set_strides(self, q, k, v, out) -> None:
        p, st = self.p, self.static
        if self.key.tma:
            rows = min(st.page_size, self.key.bn) if st.paged else self.key.bn
            p.k_xp, p.k_xh = self._set_maps(k, v, st.paged, rows, v_page_major=self.key.vpage > 0,
                                            k_interleaved=self.key.kil)
        if st.paged:  # pools [P, Hkv, page_size, D]: page, slot, head
            ks, vs = k.stride(), v.stride()
            p.k_sb, p.k_sh, p.k_st = ks[0], ks[1], ks[2]
            p.v_sb, p.v_sh, p.v_st = vs[0], vs[1], vs[2]
        else:
            p.k_sb, p.k_st, p.k_sh = _strides3(k, st.packed)
            p.v_sb, p.v_st, p.v_sh = _strides3(v, st.packed)
        p.q_sb, p.q_st, p.q_sh = _strides3(q, st.packed)
        p.o_sb, p.o_st, p.o_sh = _strides3(out, st.packed)

    def run(self, q, k, v, out, qo_indptr=None, kv_indptr=None, win_starts=None, win_ends=None, work=None,
            block_tables=None, seq_lens=None) -> None:
        """Write the live fields and launch on the current stream. Contiguous: kv_indptr and
        the window bounds; paged: the block table and the K/V lengths."""
        # TMA maps hold the shapes too (a pool's page count is in no static key)
        strides = (q.stride(), k.stride(), v.stride(), out.stride(), k.shape if self.key.tma else None)
        if strides != self._strides:
            check_rows((("q", q), ("k", k), ("v", v), ("out", out)))
            self._set_strides(q, k, v, out)
            self._strides = strides
        p = self.p
        p.q, p.k, p.v, p.o = a = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (a[0] | a[1] | a[2] | a[3]) & 15:
            check_starts((("q", q), ("k", k), ("v", v), ("out", out)))
        if self._maps is not None:
            self._encode_maps(self.tp, a[1], a[2])
        p.qo_indptr, p.work = _ptr(qo_indptr), _ptr(work)
        if self.static.paged:
            p.block_tables, p.seq_lens = block_tables.data_ptr(), seq_lens.data_ptr()
            p.bt_stride = block_tables.stride(0)
        else:
            p.kv_indptr = _ptr(kv_indptr)
            if win_starts is not None:
                p.win_starts, p.win_ends = win_starts.data_ptr(), win_ends.data_ptr()
                p.win_stride = win_starts.stride(0)
        self.launch.launch(runtime.current_stream(self.dev))
        if self.accepted is not None:
            self.accepted.record((q, k, v, out))

    def again(self, q, k, v, out) -> bool:
        """A plan's launch with new q, k, v, out addresses, when the four are laid out as in its
        last full ``run`` (``Accepted``; the metadata are the plan's own). False: nothing was
        launched, take the full path."""
        a = self.accepted.admit((q, k, v, out))
        if a is None:
            return False
        p = self.p
        p.q, p.k, p.v, p.o = a
        if self._maps is not None:
            self._encode_maps(self.tp, a[1], a[2])
        self.launch.launch(runtime.current_stream(self.dev))
        return True


prepared = PreparedPrefill.shared  # the shared prepared launch of a static key on a device
