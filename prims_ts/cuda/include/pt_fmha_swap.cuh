// The swapped-operand wgmma tile (sm_90a) for decode-shaped problems with few M rows
// (16 or 32 query rows: MLA with H x SQ <= 32), where a 64-row wgmma tile would waste
// most of its work and the mma.sync tile is issue-bound. The keys become wgmma's M:
//
//   S^T = K Q^T      m64 x BM, k = D: A = the K tile (K-major), B = Q (K-major)
//   softmax over M   per query column (pt_fmha_softmax.cuh: OnlineSoftmax): a shuffle over
//                    the warp's row groups, one shared-memory exchange over the 4 warps
//   O^T += V^T P^T   m64 x BM per 64-column panel of V, k = 16 keys: A = the V panel read
//                    M-major (transposed), B = P^T written to shared memory (K-major)
//
// One MMA warpgroup (128 threads, O^T in DV / 64 x BM / 8 x 4 registers a thread) and a
// producer warpgroup. V is the first DV columns of the K row (SHARED_KV). The core's tile
// ring (pt_fmha_ring.cuh: KvRing) feeds it: STAGES whole 64 x D tiles (72 KB at D 576, so two
// fit beside Q), acquired and released a tile at a time. (A ring of 64-column panel slots,
// acquired and released panel by panel to copy further ahead, measured 1-2% slower at
// BM 16 and 29% at BM 32, and was retired: benchmarks/NOTES.md, MLA, the panel ring.)
// The problem policies are the core's (range, q_row/k_row/kv_page, tile_needs_mask/
// visible, store2/store_lse).
#pragma once
#include "pt_fmha.cuh"

namespace pt {

// Where the current tile lives in a ring: its (first) slot and that slot's pass parity.
struct RingCursor {
  int slot;
  u32 pass;
};

// The tile ring as the swapped tile sees it: panel p of a tile lives in the tile's stage.
template <class KVTile, int STAGES, int COPY_TPR>
struct SwapTileRing {
  using Ring = KvRing<KVTile, STAGES, 1, COPY_TPR>;
  Ring ring;
  static constexpr int BYTES = STAGES * KVTile::BYTES;
  static constexpr int BAR_BYTES = Ring::BAR_BYTES;
  __device__ __forceinline__ SwapTileRing(u32 base, u32 bars) : ring{base, bars} {}
  __device__ __forceinline__ u32 panel(const RingCursor& c, int p) const {
    return ring.k(c.slot) + (u32)p * KVTile::PANEL;
  }
  __device__ __forceinline__ void acquire(const RingCursor& c) const { ring.acquire(c.slot, c.pass); }
  __device__ __forceinline__ void release(const RingCursor& c) const { ring.release(c.slot); }
  __device__ __forceinline__ static void next(RingCursor& c) { Ring::advance(c.slot, c.pass); }
  template <int NTHREADS> __device__ __forceinline__ void init(int consumer_warps) const {
    ring.template init<NTHREADS>(consumer_warps);
  }
  template <int NTHREADS, class Problem, class Range>
  __device__ __forceinline__ void produce(const Problem& pb, const Range& range, int n_tiles, int tid) const {
    ring.template produce<NTHREADS>(pb, range, n_tiles, tid);
  }
};

// STAGES: whole tiles in the ring. COPY_TPR: the ring producer's threads per key row
// (FmhaConfig's).
template <class T_, int D_, int DV_, int BM_, int STAGES_, int COPY_TPR_ = 4>
struct SwapConfig {
  using T = T_;
  static constexpr bool SWAP = true;
  static constexpr bool TWIN = false;
  static constexpr int ARCH = 90;
  static constexpr int D = D_, DV = DV_, BM = BM_, BN = 64, STAGES = STAGES_;
  static constexpr int THREADS = 128;  // the MMA warpgroup
  static constexpr int WARPS = 4;
  static constexpr int PRODUCER_THREADS = 128;
  static constexpr int LAUNCH_THREADS = THREADS + PRODUCER_THREADS;
  using QTile = SmemTileW<BM, D>;
  using KVTile = SmemTileW<BN, D>;
  using PTile = SmemTileW<BM, BN>;  // P^T: [query row][key]
  static constexpr int COPY_TPR = COPY_TPR_;
  using Ring = SwapTileRing<KVTile, STAGES, COPY_TPR>;
  static constexpr int SMEM_Q = QTile::BYTES;
  static constexpr int SMEM_RING = Ring::BYTES;
  static constexpr int SMEM_P = PTile::BYTES;
  static constexpr int SMEM_RED = WARPS * BM * 4;  // per warp and query row: maxima, then sums
  static constexpr int SMEM_BARS = Ring::BAR_BYTES;
  static constexpr int SMEM_BYTES = SMEM_Q + SMEM_RING + SMEM_P + SMEM_RED + SMEM_BARS;
  // the epilogue stages O (float, rows padded by 4 against bank conflicts) in the ring
  static constexpr int O_STRIDE = DV + 4;
  static_assert(BM == 16 || BM == 32, "swapped tile: 16 or 32 query rows");
  static_assert(D % 64 == 0 && DV % 64 == 0 && DV <= D, "panels of 64 columns; V a prefix of the K row");
  static_assert(BM * O_STRIDE * 4 <= SMEM_RING && STAGES >= 2, "ring");
};

// The swapped tile of one work item, as its MMA warpgroup runs it: the state (shared-memory
// addresses, this thread's keys, O^T and the per-query statistics) and the steps of a key tile.
// The registers live in the caller (fmha_tile_swap) and the tile refers to them, as the twin
// tile's do.
template <class Cfg, class Problem>
struct SwapTile {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KVTile = typename Cfg::KVTile;
  using PTile = typename Cfg::PTile;
  using Range = decltype(((const Problem*)nullptr)->range());
  static constexpr int D = Cfg::D, DV = Cfg::DV, BM = Cfg::BM, BN = Cfg::BN;
  static constexpr int THREADS = Cfg::THREADS;
  static constexpr int KD = D / 16;   // k-steps of S^T
  static constexpr int NJ = BM / 8;   // 8-column groups of an accumulator (query rows)
  static constexpr int MP = DV / 64;  // 64-column panels of V: the M blocks of O^T
  static constexpr int PV_GROUPS = MP % 4 == 0 ? 4 : (MP % 2 == 0 ? 2 : 1);  // O^T's commit groups
  static constexpr int PER_GROUP = MP / PV_GROUPS;

  const Problem& pb;
  char* const smem;
  const float scale_log2;
  const int warp, lane, g, t;
  const int key_r0;  // this thread's keys of a tile: key_r0, key_r0 + 8
  const u32 sQ, sKV, sP;
  char* const pP;
  float* const red;  // [warp][query row]: the warps' maxima, then their sums
  const typename Cfg::Ring ring;
  const Range range;
  const int n_tiles;
  // Accumulator element [j][e] of this thread: key (M row) 16 * warp + g + 8 * (e >> 1),
  // query row (N column) 8 * j + 2 * t + (e & 1).
  float (&o)[MP][NJ][4];
  float (&m_q)[NJ][2];  // per query column: running max (raw)
  float (&l_q)[NJ][2];  // per query column: this thread's share of the sum

  __device__ __forceinline__ SwapTile(const Problem& pb_, char* smem_, float scale_log2_, float (&o_)[MP][NJ][4],
                                      float (&m_q_)[NJ][2], float (&l_q_)[NJ][2])
      : pb(pb_), smem(smem_), scale_log2(scale_log2_), warp(threadIdx.x >> 5), lane(threadIdx.x & 31), g(lane >> 2),
        t(lane & 3), sQ(smem_addr(smem_)), sKV(sQ + Cfg::SMEM_Q), sP(sKV + Cfg::SMEM_RING),
        pP(smem_ + Cfg::SMEM_Q + Cfg::SMEM_RING), red(reinterpret_cast<float*>(pP + Cfg::SMEM_P)),
        ring(sKV, sP + Cfg::SMEM_P + Cfg::SMEM_RED), range(pb_.range()), n_tiles(range.n_tiles()),
        key_r0(warp * 16 + g), o(o_), m_q(m_q_), l_q(l_q_) {}

  // S^T = K Q^T of the ring's current tile, once it has landed
  __device__ __forceinline__ void s_tile(const RingCursor& cur, float (&s)[NJ][4]) const {
    ring.acquire(cur);
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KD; ++ks) {
      const u32 koff = (u32)(ks & 3) * 32;
      Wgmma<T, BM>::ss(s, desc_kmajor(ring.panel(cur, ks >> 2) + koff),
                       desc_kmajor(sQ + (ks >> 2) * QTile::PANEL + koff), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
  }
  // keys past a short tile's end or outside a query row's band to -inf
  __device__ __forceinline__ void mask(const KeyTile& kt, float (&s)[NJ][4]) const {
    const int k0 = kt.k0;
    if ((Problem::SHORT_TILES && kt.rows < BN) || pb.tile_needs_mask(k0)) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kr = key_r0 + 8 * (e >> 1), q = 8 * j + 2 * t + (e & 1);
          if ((Problem::SHORT_TILES && kr >= kt.rows) || !pb.visible(q, k0 + kr)) s[j][e] = neg_inf();
        }
    }
  }
  // The online softmax over the keys (M): each query column's tile maximum over the warp's
  // row groups (shuffles) and the 4 warps (shared memory), P in place, the sums and O^T rescaled.
  __device__ __forceinline__ void softmax(float (&s)[NJ][4]) {
    float mx[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float v = max_(s[j][c], s[j][c + 2]);
        v = max_(v, __shfl_xor_sync(0xffffffffu, v, 4));
        v = max_(v, __shfl_xor_sync(0xffffffffu, v, 8));
        v = max_(v, __shfl_xor_sync(0xffffffffu, v, 16));
        mx[j][c] = v;
        if (g == 0) red[warp * BM + 8 * j + 2 * t + c] = v;
      }
    named_bar_sync(1, THREADS);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float v = m_q[j][c];
#pragma unroll
        for (int w = 0; w < Cfg::WARPS; ++w) v = max_(v, red[w * BM + 8 * j + 2 * t + c]);
        float corr;
        const float base = OnlineSoftmax::rebase(m_q[j][c], v, scale_log2, corr);
        s[j][c] = OnlineSoftmax::p(s[j][c], scale_log2, base);
        s[j][c + 2] = OnlineSoftmax::p(s[j][c + 2], scale_log2, base);
        l_q[j][c] = l_q[j][c] * corr + s[j][c] + s[j][c + 2];
        mx[j][c] = corr;
      }
#pragma unroll
    for (int mp = 0; mp < MP; ++mp)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[mp][j][e] *= mx[j][e & 1];
  }
  // P^T to shared memory: B of the second product, [query row][key]
  __device__ __forceinline__ void store_pt(const float (&s)[NJ][4]) const {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int kr = key_r0 + 8 * (e >> 1), q = 8 * j + 2 * t + (e & 1);
        *reinterpret_cast<u16*>(pP + PTile::offset(q, kr >> 3) + (kr & 7) * 2) =
            (u16)(pack2<T>(s[j][e], 0.f) & 0xffffu);
      }
    fence_proxy_async();
    named_bar_sync(1, THREADS);
  }
  // O^T += V^T P^T in PV_GROUPS commit groups of V panels; the tile goes back to the ring
  __device__ __forceinline__ void pv(const RingCursor& cur) {
#pragma unroll
    for (int mp = 0; mp < MP; ++mp) fence_regs(o[mp]);
    wgmma_fence();
#pragma unroll
    for (int mp = 0; mp < MP; ++mp) {
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb)
        Wgmma<T, BM>::ss_ta(o[mp], desc_nmajor(ring.panel(cur, mp) + kb * 16 * 128, KVTile::PANEL),
                            desc_kmajor(sP + kb * 32), 1);
      if ((mp + 1) % PER_GROUP == 0) wgmma_commit();
    }
#pragma unroll
    for (int grp = 0; grp < PV_GROUPS; ++grp) {
      wgmma_wait_dyn<PV_GROUPS - 1>(PV_GROUPS - 1 - grp);  // group grp has landed
#pragma unroll
      for (int mp = grp * PER_GROUP; mp < (grp + 1) * PER_GROUP; ++mp) fence_regs(o[mp]);
    }
    ring.release(cur);  // this warp's reads of the tile are done (waited above)
  }
  // The MMA warpgroup's key tiles (the producer warpgroup fills the ring meanwhile).
  __device__ __forceinline__ void run() {
    load_q_for_mma<QTile, THREADS>(sQ, pb);
#pragma unroll
    for (int mp = 0; mp < MP; ++mp)
#pragma unroll
      for (int j = 0; j < NJ; ++j) o[mp][j][0] = o[mp][j][1] = o[mp][j][2] = o[mp][j][3] = 0.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      m_q[j][0] = m_q[j][1] = neg_inf();
      l_q[j][0] = l_q[j][1] = 0.f;
    }
    RingCursor cur{0, 0u};  // the current tile in the ring
    for (int it = 0; it < n_tiles; ++it, Cfg::Ring::next(cur)) {
      const KeyTile kt = range.tile(it);
      float s[NJ][4];
      s_tile(cur, s);
      mask(kt, s);
      softmax(s);
      store_pt(s);
      pv(cur);
    }
  }
  // The sums over the keys; O through shared memory to store2.
  __device__ __forceinline__ void epilogue(float out_scale) const {
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        float v = l_q[j][c];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (g == 0) red[warp * BM + 8 * j + 2 * t + c] = v;
      }
    named_bar_sync(1, THREADS);  // the ring is drained too: every copied tile was consumed
    // its barriers retired (the producer's last wait returned before the last tile's copies were
    // issued): their memory is the split merge's, or the next item's ring (balanced split-KV)
    if (threadIdx.x == 0) ring.ring.inval();
    float* obuf = reinterpret_cast<float*>(smem + Cfg::SMEM_Q);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int q = 8 * j + 2 * t + c;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < Cfg::WARPS; ++w) l += red[w * BM + q];
        if constexpr (Problem::WANTS_LSE) {
          if (warp == 0 && g == 0 && q < pb.q_rows) pb.store_lse(q, OnlineSoftmax::lse(m_q[j][c], l, scale_log2));
        }
        const float inv = OnlineSoftmax::inverse(l, out_scale);
#pragma unroll
        for (int mp = 0; mp < MP; ++mp)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            obuf[q * Cfg::O_STRIDE + mp * 64 + key_r0 + 8 * h] = o[mp][j][c + 2 * h] * inv;
      }
    named_bar_sync(1, THREADS);
    constexpr int PAIRS = DV / 2;
    for (int i = threadIdx.x; i < pb.q_rows * PAIRS; i += THREADS) {
      const int r = i / PAIRS, c = 2 * (i % PAIRS);
      pb.store2(r, c, obuf[r * Cfg::O_STRIDE + c], obuf[r * Cfg::O_STRIDE + c + 1]);
    }
  }
};

template <class Cfg, class Problem>
__device__ __forceinline__ void fmha_tile_swap(const Problem& pb, char* smem, float scale_log2, float out_scale) {
  using Tile = SwapTile<Cfg, Problem>;
  float o[Tile::MP][Tile::NJ][4], m_q[Tile::NJ][2], l_q[Tile::NJ][2];
  Tile tile(pb, smem, scale_log2, o, m_q, l_q);
  if (threadIdx.x == 0) tile.ring.template init<Cfg::PRODUCER_THREADS>(Cfg::WARPS);
  __syncthreads();
  if (threadIdx.x >= Cfg::THREADS) {  // the producer warpgroup
    tile.ring.template produce<Cfg::PRODUCER_THREADS>(pb, tile.range, tile.n_tiles, threadIdx.x - Cfg::THREADS);
    return;
  }
  tile.run();
  tile.epilogue(out_scale);
}

}  // namespace pt
