"""Block-sparse kernels: the decode problem's GQA rows over a BSR route's KV blocks.

``prims_ts/cuda/fmha_block_sparse.cu``: one (request, K/V head, route row, row tile) item
per CTA, or persistent CTAs walking them (Tuning.persistent).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from . import runtime
from .decode import DecodeParams, _ptr, write_bounds, write_rows
from .keys import (DEFAULT_TUNING, DTYPE_CODES, LOG2E, OUT_DTYPE_CODES, PRODUCER_THREADS, WGMMA_ALIGN_SLACK,
                   KernelKey, Prepared, Tuning, cpp_bool, device_info, fmha_config,
                   fmha_smem_bytes, load, producer_stages, tag, work_grid)

HEAD_DIMS = (128, 256)


@dataclass(frozen=True)
class BlockSparseKey(KernelKey):
    """KV blocks of 64+ keys on sm_90a take the wgmma engine (BM 64 for short rows at D128,
    else 128; BN 128 when the block size allows at D128, else 64); smaller blocks (8/16/32:
    one short tile of BN 16/32 per block) and other archs (sm_90a too under Tuning.portable)
    the mma.sync engine with BM 64 (BN 32 at D256, to fit 99 KB). sm_90a keys take their key
    tiles as TMA boxes: contiguous K/V under Tuning.tma, pages under Tuning.paged_tma."""

    PREFIX = "pt_bsr"
    SOURCE = "fmha_block_sparse.cu"
    PARAMS = property(lambda self: "BlockSparseTmaParams" if self.tma else "BlockSparseParams")

    dtype: str = tag("", always=True)
    head_dim: int = tag("d", always=True)
    causal: bool = tag("c", always=True)
    bm: int = tag("bm", always=True)
    bn: int = tag("bn", always=True)
    arch: int = tag("sm", always=True)
    stages: int = tag("s", 2)
    loop: int = tag("l", 0)  # the producer ring's consumer loop (Tuning.loop)
    persistent: bool = tag("pk", False)  # CTAs walk several work items (Tuning.persistent)
    copy_tpr: int = tag("cp", 4)  # the producer's threads per K/V row (Tuning.copy_tpr)
    contiguous: bool = tag("ct", False)  # K/V address policy: CSR pages, or contiguous [B, Skv, Hkv, D]
    tma: bool = tag("tma", False)  # key tiles as TMA boxes (Tuning.tma / Tuning.paged_tma)
    lean: bool = tag("ln", False)  # the MMA warps' fewer instructions (Tuning.lean_mma)
    lazy: bool = tag("lz", False)  # the running maxima kept within 2^8 (Tuning.lazy_rescale)
    under_pv: bool = tag("up", False)  # the softmax under the previous PV (Tuning.softmax_under_pv)

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # a key per problem class: plans and one-shots look it up
    def choose(dtype: str, head_dim: int, causal: bool, kv_block_size: int, rows: int, arch: str,
               tuning: Tuning = DEFAULT_TUNING, contiguous: bool = False) -> "BlockSparseKey":
        """`rows`: the M rows of one route row, q_block_size (or Sq if smaller) x group."""
        if arch == "sm_90a" and kv_block_size % 64 == 0 and not tuning.portable:
            bn = 128 if head_dim == 128 and kv_block_size % 128 == 0 else 64
            bm = 64 if rows <= 64 and head_dim == 128 else 128  # D256 at BM 64 spills
            loop = tuning.loop_for(head_dim)
            tma = tuning.tma if contiguous else tuning.paged_tma
            return BlockSparseKey(dtype, head_dim, causal, bm, bn, 90, producer_stages(bm, bn, head_dim),
                                  loop if bm == 128 else min(loop, 1),  # pingpong: two MMA warpgroups
                                  tuning.persistent, tuning.copy_for(head_dim), contiguous, tma,
                                  tuning.lean_for(head_dim), tuning.lazy_rescale,
                                  loop >= 1 and tuning.under_pv_for(False))
        if head_dim == 256:
            return BlockSparseKey(dtype, head_dim, causal, 64, 32 if kv_block_size >= 32 else 16, 80,
                                  contiguous=contiguous)
        bn = 64 if kv_block_size % 64 == 0 else max(16, kv_block_size)
        return BlockSparseKey(dtype, head_dim, causal, 64, bn, 80, contiguous=contiguous)

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

    def call(self) -> str:
        cfg = fmha_config(self.dtype, self.head_dim, self.bm, self.bn, self.arch == 80 and self.head_dim <= 128,
                          self.arch, stages=self.stages, producer=self.producer, loop=self.loop,
                          copy_tpr=self.copy_tpr, lean=self.lean, lazy=self.lazy, under_pv=self.under_pv)
        return (f"pt::block_sparse_kernel<{cfg}, {cpp_bool(self.causal)}, {cpp_bool(self.persistent)}, "
                f"{cpp_bool(self.contiguous)}, {cpp_bool(self.tma)}>")


def block_sparse_keys(arch: str, tuning: Tuning = DEFAULT_TUNING) -> Iterator[BlockSparseKey]:
    """The keys the public API can choose on `arch` (every dtype, head dim, mask, tile and K/V
    address policy)."""
    for dtype in DTYPE_CODES.values():
        for d in HEAD_DIMS:
            for causal in (False, True):
                shapes = {(kvb, rows, ct) for kvb in (8, 32, 64, 128) for rows in (64, 128) for ct in (False, True)}
                keys = {BlockSparseKey.choose(dtype, d, causal, kvb, rows, arch, tuning, ct)
                        for kvb, rows, ct in shapes}
                yield from sorted(keys, key=lambda k: k.name)


class BlockSparseParams(ctypes.Structure):
    """Mirror of pt::BlockSparseParams (prims_ts/cuda/fmha_block_sparse.cu)."""

    _fields_ = [
        ("d", DecodeParams),
        ("block_indptr", ctypes.c_void_p),
        ("block_indices", ctypes.c_void_p),
        ("valid_bits", ctypes.c_void_p),
    ] + [(n, ctypes.c_int32) for n in ("rows_r", "q_block", "kv_block", "row_tiles", "valid_words", "batch",
                                       "seq_len_kv", "num_listed")]


class _BlockSparseTmaParams(ctypes.Structure):
    """Mirror of pt::BlockSparseTmaParams: a TMA key's K and V maps (64-byte aligned, so the
    struct is padded to a multiple of 64 bytes), then its parameters."""

    _fields_ = [("tmap_k", runtime.TensorMap), ("tmap_v", runtime.TensorMap), ("bp", BlockSparseParams)]


BlockSparseTmaParams = runtime.padded_to(_BlockSparseTmaParams, 64)


@dataclass(frozen=True)
class BlockSparseStatic:
    """Everything a block-sparse launch needs besides tensor addresses."""

    dtype: torch.dtype
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    batch: int
    seq_len_q: int
    q_block_size: int
    kv_block_size: int
    valid_words: int  # words per request of kv_valid_bits (0: no bits)
    causal: bool
    out_dtype: torch.dtype
    tuning: Tuning = DEFAULT_TUNING
    contiguous: bool = False  # K/V [B, Skv, Hkv, D] (block_sparse_attention): no pages, page_size 0
    seq_len_kv: int = 0  # contiguous: every request's K/V length


class PreparedBlockSparse(Prepared):
    """The loaded kernel, grid and parameter struct of one BlockSparseStatic on one device."""

    __slots__ = ("bp", "tp", "_v_off", "_maps_layout")
    PARAMS_ATTR = "bp"

    def __init__(self, static: BlockSparseStatic, dev: int):
        arch, sms, _ = device_info(dev)
        group = static.num_qo_heads // static.num_kv_heads
        rows_r = -(-static.seq_len_q // static.q_block_size)
        rows = min(static.q_block_size, static.seq_len_q) * group  # the tallest route row
        key = BlockSparseKey.choose(DTYPE_CODES[static.dtype], static.head_dim, static.causal,
                                    static.kv_block_size, rows, arch, static.tuning, static.contiguous)
        kernel = load(dev, key)
        row_tiles = -(-rows // key.bm)
        self.tp = BlockSparseTmaParams() if key.tma else None  # a TMA key's whole struct (bp: its parameters)
        bp = self.tp.bp if key.tma else BlockSparseParams()
        p = bp.d
        p.group, p.hkv = group, static.num_kv_heads
        p.page_shift = max(static.page_size.bit_length() - 1, 0)
        p.window_left = -1
        p.out_dtype = OUT_DTYPE_CODES[static.out_dtype]
        p.out_scale = 1.0
        p.sq, p.rows_max, p.row_tiles, p.splits, p.chunk = static.seq_len_q, rows, row_tiles, 1, 0
        bp.rows_r, bp.q_block, bp.kv_block, bp.row_tiles = rows_r, static.q_block_size, static.kv_block_size, row_tiles
        bp.valid_words = static.valid_words
        bp.batch = static.batch
        bp.seq_len_kv = static.seq_len_kv
        items = static.batch * static.num_kv_heads * rows_r * row_tiles
        ctas = work_grid(items, key.persistent, sms, static.tuning.persistent_ctas)
        self.static, self.dev, self.key, self.bp = static, dev, key, bp
        self.launch = runtime.PreparedLaunch(kernel, key.name, (ctas, 1, 1), self.tp if key.tma else bp)
        self._strides = None
        self.accepted = None
        self._v_off = 0
        self._maps = self._maps_at = None

    def _tma_views(self, k_cache, v_cache):
        """A TMA key's K and V as 4-D tensors (a combined cache's halves as views), their maps
        set again when their layout (the pools' page count too) changed."""
        layout = (k_cache.shape, k_cache.stride(), None if v_cache is None else (v_cache.shape, v_cache.stride()))
        if self._maps is None or layout != self._maps_layout:
            k, v = (k_cache, v_cache) if v_cache is not None else (k_cache[:, 0], k_cache[:, 1])
            st = self.static
            self._set_maps(k, v, not st.contiguous, self.key.bn if st.contiguous else min(st.page_size, self.key.bn))
            self._maps_layout = layout

    def run(self, q, k_cache, v_cache, out, kv_indptr, kv_indices, block_indptr, block_indices, seq_lens,
            valid_bits, sm_scale: float) -> None:
        """Write the live fields (addresses, strides, the scale) and launch on the current stream.
        The pools: K and V ``[P, Hkv, ps, D]``, or (v_cache None) a combined ``[P, 2, Hkv, ps, D]``;
        a contiguous key: K and V ``[B, Skv, Hkv, D]`` (kv_indptr, kv_indices, seq_lens None)."""
        bp = self.bp
        p = bp.d
        self._strides = write_rows(p, self._strides, q, k_cache, v_cache, out, False,
                                   ("q", "paged_kv_cache"))
        if self.static.contiguous:  # request, token, head: the pool fields' page, slot, head
            ks, vs = self._strides[1], self._strides[2]
            p.k_sp, p.k_sh, p.k_ss = ks[0], ks[2], ks[1]
            p.v_sp, p.v_sh, p.v_ss = vs[0], vs[2], vs[1]
        p.kv_indptr, p.kv_indices, p.seq_lens = _ptr(kv_indptr), _ptr(kv_indices), _ptr(seq_lens)
        write_bounds(p, k_cache, kv_indptr, kv_indices, None)
        bp.block_indptr, bp.block_indices = block_indptr.data_ptr(), block_indices.data_ptr()
        bp.num_listed = block_indices.shape[0]
        bp.valid_bits = _ptr(valid_bits)
        p.scale_log2 = sm_scale * LOG2E
        if self.tp is not None:
            self._tma_views(k_cache, v_cache)
            self._encode_maps(self.tp, p.k, p.v)
        self.launch.launch(runtime.current_stream(self.dev))
        if self.accepted is not None:
            self.accepted.record((q, k_cache, v_cache, out, kv_indices, block_indptr, block_indices, valid_bits))
            self._v_off = (p.v or 0) - (p.k or 0)

    def again(self, q, k_cache, v_cache, out, kv_indices, block_indptr, block_indices, valid_bits,
              sm_scale: float) -> bool:
        """A plan's launch with new addresses (and routes) and scale, when the operands are laid
        out as in its last full ``run`` (``Accepted``, block_indices at any length). False:
        nothing was launched, take the full path."""
        a = self.accepted.admit((q, k_cache, v_cache, out, kv_indices, block_indptr, block_indices, valid_bits))
        if a is None:
            return False
        bp = self.bp
        p = bp.d
        p.q, p.k, p.o = a[0], a[1], a[3]
        p.v = a[2] if v_cache is not None else a[1] + self._v_off
        p.kv_indices, bp.block_indptr, bp.block_indices, bp.valid_bits = a[4], a[5], a[6], a[7] or None
        bp.num_listed = block_indices.shape[0]  # any length (a loose operand)
        p.scale_log2 = sm_scale * LOG2E
        if self.tp is not None:  # the same layout as the last full run: its maps, new addresses
            self._encode_maps(self.tp, p.k, p.v)
        self.launch.launch(runtime.current_stream(self.dev))
        return True


prepared = PreparedBlockSparse.shared  # the shared prepared launch of a static key on a device
