// The Hopper tile engine's instructions (sm_90a): wgmma shared-memory descriptors,
// the warpgroup fence/commit/wait protocol, and the 128-byte-swizzled tile layout
// that wgmma reads.
#pragma once
#include "pt_types.cuh"
#include "pt_wgmma.cuh"

namespace pt {

// A ROWS x COLS tile of 16-bit elements in wgmma's 128-byte-swizzle layout:
// COLS/64 panels of [ROWS][64], each row 128 bytes, 16-byte chunk c of row r
// stored at chunk (c ^ (r & 7)). The tile base must be 1024-byte aligned.
template <int ROWS, int COLS> struct SmemTileW {
  static constexpr int CHUNKS = COLS / 8;
  static constexpr int BYTES = ROWS * COLS * 2;
  static constexpr int PANEL = ROWS * 128;  // bytes per 64-column panel
  static constexpr bool PAGE_MAJOR = false;
  static constexpr bool INTERLEAVED = false;
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "wgmma tile shape");
  __device__ static __forceinline__ u32 offset(int row, int chunk) {
    return (u32)((chunk >> 3) * PANEL + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  }
  // As the K-major operand (rows = M or N): the bytes from one 8-row group to the next (the
  // descriptor's stride offset), from one panel's k-steps to the next's, and where row r
  // (a multiple of 8) starts
  static constexpr u32 KSBO = 1024;
  static constexpr u32 PSTEP = PANEL;
  __device__ static __forceinline__ constexpr u32 row8(int r) { return (u32)r * 128; }
  // As the N-major operand of P V (rows = keys): the bytes from one 64-column panel to the next
  // (the descriptor's leading offset), and where k-step ks's 16 rows start
  static constexpr u32 LBO = PANEL;
  __device__ static __forceinline__ constexpr u32 kstep(int ks) { return (u32)ks * 16 * 128; }
};

// The same tile row-group interleaved (paged K under Tuning.page_major_k): 8-row groups one
// after another, each its COLS / 64 panels of [8][64] back to back (1024 bytes apart), the
// 128-byte swizzle as in SmemTileW, so that one TMA box (64, 8, COLS / 64, G / 8) fills a page
// of G rows with all its panels. The K-major operand reads it with its 8-row groups KSBO apart
// and a panel's k-steps 1024 bytes after the previous panel's. PANEL is ROWS * 128 as in
// SmemTileW (the ring's byte counts take it as the tile's rows), not a stride here.
template <int ROWS, int COLS> struct SmemTileI {
  static constexpr int CHUNKS = COLS / 8;
  static constexpr int BYTES = ROWS * COLS * 2;
  static constexpr int PANEL = ROWS * 128;
  static constexpr bool PAGE_MAJOR = false;
  static constexpr bool INTERLEAVED = true;
  static constexpr u32 KSBO = (u32)(COLS / 64) * 1024;
  static constexpr u32 PSTEP = 1024;
  static_assert(COLS % 64 == 0 && ROWS % 8 == 0, "wgmma tile shape");
  __device__ static __forceinline__ u32 offset(int row, int chunk) {
    return (u32)((row >> 3) * KSBO + (chunk >> 3) * 1024 + (row & 7) * 128 + (((chunk & 7) ^ (row & 7)) << 4));
  }
  __device__ static __forceinline__ constexpr u32 row8(int r) { return (u32)(r >> 3) * KSBO; }
};

// The same tile page-major: groups of G rows (a page) one after another, each its COLS / 64
// panels of [G][64] back to back (G * 128 bytes apart), the 128-byte swizzle as in SmemTileW;
// one TMA box (64, G, COLS / 64) fills a group. Only the N-major (V) operand can be read so:
// a k-step's 16 rows must lie in one group (G >= 16), and then its 8-row halves are 1024 bytes
// apart and its panels G * 128; the K-major operand needs one stride between all 8-row groups.
// G == ROWS is SmemTileW's layout.
template <int ROWS, int COLS, int G> struct SmemTileP {
  static constexpr int CHUNKS = COLS / 8;
  static constexpr int BYTES = ROWS * COLS * 2;
  static constexpr int PANEL = ROWS * 128;  // a whole-tile panel's bytes (the rows a tile holds)
  static constexpr int GROUP = G;
  static constexpr bool PAGE_MAJOR = true;
  static constexpr bool INTERLEAVED = false;
  static_assert(COLS % 64 == 0 && G % 16 == 0 && ROWS % G == 0, "page-major tile shape");
  __device__ static __forceinline__ u32 offset(int row, int chunk) {
    return (u32)((row / G) * (G * COLS * 2) + (chunk >> 3) * (G * 128) + (row % G) * 128 +
                 (((chunk & 7) ^ (row & 7)) << 4));
  }
  static constexpr u32 LBO = G * 128;
  __device__ static __forceinline__ constexpr u32 kstep(int ks) {
    return (u32)((ks * 16 / G) * (G * COLS * 2) + (ks * 16 % G) * 128);
  }
};

__device__ __forceinline__ u64 wgmma_desc(u32 smem_addr, u32 lbo, u32 sbo) {
  return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
         (1ull << 62);  // 128-byte swizzle
}
// K-major operand (rows of the M/N dimension, K contiguous): 8-row groups 1024 B apart (or
// `sbo`: an interleaved tile's, SmemTileI::KSBO).
__device__ __forceinline__ u64 desc_kmajor(u32 addr, u32 sbo = 1024) { return wgmma_desc(addr, 16, sbo); }
// N-major operand (K rows, N contiguous): 64-column panels `panel` bytes apart.
__device__ __forceinline__ u64 desc_nmajor(u32 addr, u32 panel) { return wgmma_desc(addr, panel, 1024); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// wgmma_wait<n> with n a constant only after unrolling (0 <= n <= MAX): the branches fold.
template <int MAX> __device__ __forceinline__ void wgmma_wait_dyn(int n) {
  if constexpr (MAX > 0) {
    if (n >= MAX) {
      wgmma_wait<MAX>();
      return;
    }
    wgmma_wait_dyn<MAX - 1>(n);
  } else {
    wgmma_wait<0>();
  }
}
// Keeps the compiler from moving accumulator reads/writes across the async MMA.
template <int R> __device__ __forceinline__ void fence_regs(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}
// ... and register A fragments: their values computed before a wgmma.fence that follows
template <int R> __device__ __forceinline__ void fence_regs(u32 (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}
// Ordinary (cp.async) shared-memory writes become visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---- the warp-specialised pipeline: mbarriers, named barriers, register shares ----
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Before a barrier's memory serves anything else (or a new barrier): no thread may use it any more.
__device__ __forceinline__ void mbar_inval(u32 bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(bar) : "memory");
}
// The barrier counts one arrival when all of this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// The same on top of the barrier's expected arrivals: the pending count goes up now and back
// down when the copies land (a TMA stage's count-1 barrier waiting for cp.async copies too).
__device__ __forceinline__ void cp_async_mbar_arrive_inc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Expect `bytes` of asynchronous (TMA) writes in the current phase, without an arrival.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Thread block clusters: this CTA's rank, a cluster-wide barrier (every thread of every CTA;
// arrive releases this thread's writes, wait acquires its peers'), and loads from a peer
// CTA's shared memory (the address of `local` in rank `rank`'s window).
__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// CTAs in this CTA's cluster (1 when the launch has no cluster shape; fixed for the launch)
__device__ __forceinline__ u32 cluster_nctarank() {
  u32 r;
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ u32 cluster_map(u32 local, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
  float x;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
  return x;
}
__device__ __forceinline__ void st_cluster_u32(u32 addr, u32 v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ float4 ld_cluster_f32x4(u32 addr) {
  float4 x;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "r"(addr) : "memory");
  return x;
}
// Barrier initialisations visible to the async proxy (TMA copies completing on them).
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival that also expects `bytes` of asynchronous (TMA) writes before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// TMA: the box at coordinates (c0 innermost, .., c3) of `map` into shared memory at `dst`
// (1024-byte aligned for the 128-byte swizzle); its bytes complete on mbarrier `bar`.
// Elements outside the tensor are written as zeros (and counted).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, int c0, int c1, int c2, int c3, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// An L2 policy under which the lines a load brings in are evicted first.
__device__ __forceinline__ u64 l2_evict_first() {
  u64 pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
// tma_load_4d under an L2 policy (l2_evict_first).
__device__ __forceinline__ void tma_load_4d(u32 dst, const TmaMap* map, int c0, int c1, int c2, int c3, u32 bar,
                                            u64 pol) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(pol)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(u32 dst, const TmaMap* map, int c0, int c1, int c2, int c3, int c4,
                                            u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];" ::"r"(dst),
      "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
// Wait until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// bar.sync on a named barrier among `threads` threads (barrier 0 is __syncthreads).
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Whether `p` holds in any of the `threads` threads that meet at named barrier `id` (each
// calling warp whole): one barrier, so its result is the same in every one of them.
__device__ __forceinline__ bool named_bar_any(int id, int threads, bool p) {
  u32 r;
  asm volatile(
      "{\n .reg .pred a, b;\n setp.ne.u32 a, %1, 0;\n bar.red.or.pred b, %2, %3, a;\n selp.u32 %0, 1, 0, b;\n}"
      : "=r"(r)
      : "r"((u32)p), "r"(id), "r"(threads)
      : "memory");
  return r != 0;
}
// Re-divide the register file between warpgroups (all warps of a warpgroup execute it).
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}

}  // namespace pt
