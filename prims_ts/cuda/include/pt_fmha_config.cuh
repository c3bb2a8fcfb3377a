// The FMHA core's configuration: the tile shape, warp roles, pipeline depth and the
// shared-memory map of one kernel (FmhaConfig), and the PT_PROBE measurement switch.
#pragma once
#include "pt_sm80.cuh"
#include "pt_sm90.cuh"

// PT_PROBE: a measurement aid, 0 in every kernel the library launches (Tuning.probe,
// set by benchmarks/gpu_session.sh `probe`, defines it in the sm_90a prefill keys and the
// twin MLA keys, whose names then end in _probe<n>). It splits a kernel's time between its
// data path and its math; the results are wrong under either. 1: the producer copies the
// first STAGES tiles of a CTA and afterwards only hands the stages over (the MMA warps' speed
// without the K/V data path; the twin: no refill and no panel wait after the first tiles).
// 2: the MMA warps load Q, then only take and hand back each stage (the K/V data path's
// speed, no math, no output; one item per CTA only; the twin: each pair's barriers, refills
// and panel waits alone).
#ifndef PT_PROBE
#define PT_PROBE 0
#endif

namespace pt {

template <bool C, class A, class B> struct Select { using type = A; };
template <class A, class B> struct Select<false, A, B> { using type = B; };

// Round a shared-memory pointer up to 1024 bytes (wgmma's swizzle-atom alignment);
// kernels using it reserve 1024 bytes of slack.
__device__ __forceinline__ char* align_smem_1024(char* p) {
  const u32 a = smem_addr(p);
  return p + (((a + 1023u) & ~1023u) - a);
}

template <class T_, int D_, int BM_, int BN_, bool Q_IN_REGS_, int ARCH_ = 80, int WARPS_N_ = 1,
          int STAGES_ = 2, bool SPLIT_O_ = false, int DV_ = D_, bool SHARED_KV_ = false, bool PRODUCER_ = false,
          int LOOP_ = 0, int COPY_TPR_ = 4, bool LEAN_ = false, bool LAZY_ = false, bool UNDER_PV_ = false,
          int V_PAGE_ = 0, bool K_IL_ = false>
struct FmhaConfig {
  using T = T_;
  static constexpr bool SWAP = false;    // the swapped-operand tile is SwapConfig (pt_fmha_swap.cuh)
  static constexpr bool TWIN = false;    // the twin MLA tile is TwinConfig (pt_fmha_twin.cuh)
  static constexpr int ARCH = ARCH_;
  static constexpr int D = D_;    // Q/K width (the QK^T reduction)
  static constexpr int DV = DV_;  // V/O width
  // V row j is the first DV values of K row j (MLA latents): one tile per stage serves
  // both products, loaded once
  static constexpr bool SHARED_KV = SHARED_KV_;
  static constexpr int BM = BM_;
  static constexpr int BN = BN_;
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;
  // Warps along the rows (16 each) and along the keys: with WARPS_N > 1 each warp
  // scores BN / WARPS_N keys of every tile. Without SPLIT_O each such warp keeps its
  // own (m, l, O) over all D columns, merged once at the end. With SPLIT_O the warps of
  // a row band share one running max per tile and exchange P through shared memory;
  // each then multiplies all BN keys of P into its D / WARPS_N columns of O (wide heads:
  // O's registers are divided, not repeated). Both on the portable engine only: the wgmma
  // engine's warpgroups own whole rows (MLA's sm_90a tiles are SwapConfig and TwinConfig).
  static constexpr int WARPS_M = BM / 16;
  static constexpr int WARPS_N = WARPS_N_;
  static constexpr bool SPLIT_O = SPLIT_O_;
  static constexpr int BNW = BN / WARPS_N;  // keys of a tile per warp
  static constexpr int DTW = SPLIT_O ? DV / 8 / WARPS_N : DV / 8;  // O n-tiles (8 columns) per warp
  static constexpr int WARPS = WARPS_M * WARPS_N;
  static constexpr int THREADS = WARPS * 32;  // the MMA (consumer) threads
  static constexpr int STAGES = STAGES_;
  // PRODUCER (wgmma engine): one more warpgroup issues every K/V copy; the ring's stages
  // are handed over through mbarriers (full: copies landed; empty: every MMA warp is done
  // with it) instead of CTA-wide barriers, so the MMA warpgroups never wait for each
  // other and spend no issue slots on addresses.
  static constexpr bool PRODUCER = PRODUCER_;
  static constexpr int PRODUCER_THREADS = PRODUCER ? 128 : 0;
  static constexpr int LAUNCH_THREADS = THREADS + PRODUCER_THREADS;
  // Register shares: at 384 threads the launch gives each thread 168 registers; the
  // producer gives back down to 40 and the two MMA warpgroups take 232. At 256 threads
  // every thread already has plenty, and the shares stay as launched.
  static constexpr bool REBALANCE_REGS = PRODUCER && LAUNCH_THREADS == 384;
  // The consumer loop of the producer ring (whole-row warpgroups only). LOOP 1 (OVERLAP):
  // QK^T of tile it and PV of tile it - 1 in flight together, the softmax of tile it under
  // the PV. LOOP 2 adds PINGPONG (two MMA warpgroups): they take turns issuing their
  // GEMMs (named barriers 3 and 4), so that one's softmax runs under the other's GEMMs.
  // (Named barriers: 1 the MMA warps, 3 / 4 the turns, 5 the producer, 6 + w warpgroup w's vote.)
  static constexpr bool OVERLAP = LOOP_ >= 1;
  static constexpr bool PINGPONG = LOOP_ == 2 && THREADS == 256;
  // UNDER_PV (Tuning.softmax_under_pv; the overlapped loops): the softmax of tile it runs
  // while PV(it - 1) is in flight (PV lands after it, past a branch: ptxas otherwise hoists the
  // wait), and the producer copies V a tile behind K (KvRing V_LAG). Otherwise PV(it - 1) lands
  // before the softmax, where ptxas puts the wait.
  static constexpr bool UNDER_PV = UNDER_PV_ && OVERLAP;
  // the producer's threads per K/V row (load_kv_tiles PAIRED): 4 or 8
  static constexpr int COPY_TPR = COPY_TPR_;
  // LEAN (Tuning.lean_mma; the wgmma engine): row maxima by fmax, and each tile's wgmma
  // descriptors built once and advanced by one add a k-step
  static constexpr bool LEAN = LEAN_;
  // LAZY (Tuning.lazy_rescale): a row's running maximum moves only when a tile's exceeds it
  // by more than RowSoftmax's LAZY_SLACK in the exponent; O is rescaled only when one did
  static constexpr bool LAZY = LAZY_;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  using QTile = typename Select<ARCH_ == 90, SmemTileW<BM, D>, SmemTile<BM, D>>::type;
  using KVTile = typename Select<ARCH_ == 90, SmemTileW<BN, D>, SmemTile<BN, D>>::type;
  // V_PAGE (Tuning.page_major_v; paged K/V in TMA boxes, pages shorter than BN): the V tile
  // page-major, groups of V_PAGE rows (a page) each filled by one box of all its panels
  // (SmemTileP), half the boxes of V's panel-major tile; K keeps KVTile. 0: V is a KVTile too.
  static constexpr int V_PAGE = V_PAGE_;
  using VTile = typename Select<(V_PAGE_ > 0), SmemTileP<BN, DV_, (V_PAGE_ > 0 ? V_PAGE_ : BN)>, KVTile>::type;
  // K_IL (Tuning.page_major_k; paged K in TMA boxes, pages shorter than BN): the K tile
  // row-group interleaved (SmemTileI), one box a page of all its panels instead of a box a
  // page and panel. false: K is a KVTile.
  static constexpr bool K_IL = K_IL_;
  using KTile = typename Select<K_IL_, SmemTileI<BN, D_>, KVTile>::type;
  static_assert(!K_IL_ || (ARCH_ == 90 && PRODUCER_ && !SHARED_KV_),
                "an interleaved K tile: the sm_90a producer ring (its copies and S read KTile), K its own tile");
  static constexpr int SMEM_Q = QTile::BYTES;
  static constexpr int SMEM_KV = KVTile::BYTES;
  static constexpr int KV_TILES = SHARED_KV ? 1 : 2;  // tiles per stage
  static constexpr int SMEM_RING = KV_TILES * STAGES * SMEM_KV;
  // SPLIT_O exchange, after the pipeline: one float per warp row (row maxima, then
  // sums), then P of the tile as A fragments [WARPS_M][BN / 16][32 lanes] x 16 bytes
  static constexpr int SMEM_XCHG_RED = WARPS * 16 * 4;
  static constexpr int SMEM_XCHG = SPLIT_O ? SMEM_XCHG_RED + WARPS_M * (BN / 16) * 32 * 16 : 0;
  // a full and an empty barrier per stage and tile (KvRing), then q_full / q_empty (persistent
  // CTAs: Q copied by the producer)
  static constexpr int SMEM_BARS = PRODUCER ? 2 * KV_TILES * STAGES * 8 + 16 : 0;
  static constexpr int SMEM_PIPE = SMEM_Q + SMEM_RING + SMEM_XCHG + SMEM_BARS;
  // key-split merge (reuses the pipeline's bytes): (m, l) per warp and row, then
  // the O fragments of the WARPS_N - 1 warps that hand theirs over
  static constexpr int SMEM_MERGE = WARPS_N > 1 && !SPLIT_O ? WARPS * 16 * 2 * 4 + (WARPS_N - 1) * BM * DV * 4 : 0;
  static constexpr int SMEM_BYTES = SMEM_PIPE > SMEM_MERGE ? SMEM_PIPE : SMEM_MERGE;
  static_assert(ARCH_ == 80 || (BM % 64 == 0 && !Q_IN_REGS_ && WARPS_N_ == 1 && !SPLIT_O_ && !SHARED_KV_),
                "wgmma engine: warpgroups of 64 whole rows, Q in smem, K and V tiles of their own "
                "(no key or O split, no shared tile: MLA's sm_90a tiles are SwapConfig / TwinConfig)");
  static_assert(BN % (16 * WARPS_N) == 0 && D % 64 == 0 && STAGES >= 2, "tile shape");
  static_assert(!SPLIT_O || (WARPS_N > 1 && DTW % 2 == 0), "SPLIT_O: column pairs per warp");
  static_assert(!PRODUCER || (ARCH_ == 90 && BM % 64 == 0), "producer warpgroup: the wgmma engine");
  static_assert(PRODUCER || COPY_TPR_ == 4, "COPY_TPR: the producer's copy (4 elsewhere)");
  static_assert(LOOP_ == 0 || (PRODUCER && WARPS_N_ == 1 && !SPLIT_O_ && LOOP_ <= 2),
                "overlapped loops: the producer ring, whole rows");
  static_assert(DV % 16 == 0 && DV <= D && (DV == D || SHARED_KV), "V width: D, or a prefix of the K row");
  static_assert(V_PAGE_ == 0 || (PRODUCER_ && !SPLIT_O_ && !SHARED_KV_ && WARPS_N_ == 1 && DV_ == D_ &&
                                 V_PAGE_ >= 16 && BN_ % V_PAGE_ == 0),
                "page-major V: the producer ring's whole-row tiles, V its own D-wide tile");
};

}  // namespace pt
