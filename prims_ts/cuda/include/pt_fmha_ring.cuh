// The producer ring: STAGES stages of K/V tiles handed between the producer warpgroup and
// the MMA warps through full / empty mbarriers (KvRing), where each role stands in it
// (RingPos), and the Q tile's copy and barriers.
#pragma once
#include "pt_fmha_copy.cuh"

namespace pt {

// Where a role stands in the producer ring: the next stage, its pass parity and (the
// producer) how many tiles it has filled. A persistent CTA keeps one per role across its
// work items: the ring is initialised once and its passes run on from item to item.
struct RingPos {
  int stage = 0;
  u32 phase = 0;
  int filled = 0;
  u32 q_phase = 0;  // the MMA warps: parity of the current item's Q (copied by the producer)
};

// The producer pipeline's ring: STAGES stages of KV_TILES tiles each from `base`, each tile
// handed over through a full and an empty mbarrier at `bars`: K's full[s], K's empty[s],
// then V's (KV_TILES 2). The producer warpgroup (NTHREADS threads, `tid` its index) copies
// tile it's K into stage it % STAGES once the MMA warps released the stage's previous K (all
// `consumer_warps` arrived on its empty barrier), then its V likewise; each thread's copies
// arrive on the tile's full barrier when they land (a TMA problem: thread 0's boxes, see
// UsesTma). The MMA warps hand K back once their S^T has landed and V once their P V has,
// so that the next tile's K loads while this one's V is still read. One tile a stage
// (KV_TILES 1, the swapped MLA tile's: V a prefix of the K row) has one pair: the _k barriers,
// released with V.
// V_LAG (the overlapped consumer loops, which multiply P V of tile it - 1 beside S^T of tile
// it): the producer copies V a tile behind K (K0, K1, V0, K2, V1, ...), so that the K the
// MMA warps wait for first is not queued behind a V whose stage is still being read.
// VTile: V's layout when it is its own tile (FmhaConfig::VTile: page-major under V_PAGE; the
// same bytes as a KVTile).
template <class KVTile, int STAGES, int KV_TILES, int COPY_TPR = 4, bool V_LAG = false, class VTile = KVTile>
struct KvRing {
  static_assert(VTile::BYTES == KVTile::BYTES, "V's tile: K's bytes");
  static_assert(KV_TILES == 1 || KV_TILES == 2, "a K/V tile pair a stage, or one shared tile");
  u32 base, bars;
  __device__ __forceinline__ u32 k(int s) const { return base + (u32)(KV_TILES * s) * KVTile::BYTES; }
  __device__ __forceinline__ u32 v(int s) const { return base + (u32)(KV_TILES * s + KV_TILES - 1) * KVTile::BYTES; }
  __device__ __forceinline__ u32 k_full(int s) const { return bars + 8u * s; }
  __device__ __forceinline__ u32 k_empty(int s) const { return bars + 8u * (STAGES + s); }
  __device__ __forceinline__ u32 v_full(int s) const { return KV_TILES == 2 ? bars + 8u * (2 * STAGES + s) : k_full(s); }
  __device__ __forceinline__ u32 v_empty(int s) const { return KV_TILES == 2 ? bars + 8u * (3 * STAGES + s) : k_empty(s); }
  static constexpr int BAR_BYTES = 2 * KV_TILES * STAGES * 8;

  // the next tile's stage; the pass parity flips when the ring wraps
  __device__ __forceinline__ static void advance(int& stage, u32& phase) {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // an MMA thread: the K tile (the shared tile) in `stage` has landed and is visible to wgmma
  __device__ __forceinline__ void acquire_k(int stage, u32 phase) const {
    mbar_wait(k_full(stage), phase);
    fence_proxy_async();
  }
  // the V tile likewise (nothing more to wait for with a shared tile)
  __device__ __forceinline__ void acquire_v(int stage, u32 phase) const {
    if constexpr (KV_TILES == 2) {
      mbar_wait(v_full(stage), phase);
      fence_proxy_async();
    }
  }
  // an MMA warp is done with the K tile of `stage` (its reads of it, wgmma included, have
  // completed); a shared tile is handed back with V
  __device__ __forceinline__ void release_k(int stage) const {
    if constexpr (KV_TILES == 2) arrive_warp(k_empty(stage));
  }
  __device__ __forceinline__ void release_v(int stage) const { arrive_warp(v_empty(stage)); }
  // the whole stage
  __device__ __forceinline__ void acquire(int stage, u32 phase) const {
    acquire_k(stage, phase);
    acquire_v(stage, phase);
  }
  __device__ __forceinline__ void release(int stage) const {
    release_k(stage);
    release_v(stage);
  }
  __device__ __forceinline__ static void arrive_warp(u32 bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(bar);
  }

  // one thread, before the CTA-wide barrier that precedes any use
  template <int NTHREADS>
  __device__ __forceinline__ void init(int consumer_warps) const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(k_full(s), NTHREADS);
      mbar_init(k_empty(s), consumer_warps);
      if constexpr (KV_TILES == 2) {
        mbar_init(v_full(s), NTHREADS);
        mbar_init(v_empty(s), consumer_warps);
      }
    }
  }

  // one thread, once no thread uses the ring any more (its copies landed, its waits returned)
  __device__ __forceinline__ void inval() const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_inval(k_full(s));
      mbar_inval(k_empty(s));
      if constexpr (KV_TILES == 2) {
        mbar_inval(v_full(s));
        mbar_inval(v_empty(s));
      }
    }
  }

  // One part (KV_K or KV_V) of tile `kt` into the stage where `pos` stands, once the MMA warps
  // released the stage's previous tile of that part (from the ring's second pass on).
  // Paged TMA: thread 0 issues a box per whole page below the request's end (the bytes it
  // expects); a tile's tail (a page cut by the end, keys past it) is the whole warpgroup's
  // cp.async copy, zero past the end (a page's slots past the length hold anything, and V
  // meets P = 0 there), counted on top of thread 0's one arrival, which comes last. TMA:
  // thread 0 alone, the tile's boxes. Otherwise every thread's cp.async copies.
  template <int PART, int NTHREADS, class Problem>
  __device__ __forceinline__ void fill(const Problem& pb, const KeyTile& kt, int tid, const RingPos& pos) const {
    using Tile = typename Select<PART == KV_V, VTile, KVTile>::type;
    const u32 dst = PART == KV_K ? k(pos.stage) : v(pos.stage);
    const u32 full = PART == KV_K ? k_full(pos.stage) : v_full(pos.stage);
    if (pos.filled >= STAGES) mbar_wait(PART == KV_K ? k_empty(pos.stage) : v_empty(pos.stage), pos.phase ^ 1u);
    if constexpr (PagedTma<Problem>::value) {
      const int whole = pb.tma_rows(kt.k0);
      // thread 0 expects the bytes before it arrives (below); the first warp's lanes share the
      // boxes (a box's bytes may land before the expectation: the phase still waits on thread
      // 0's arrival)
      if (tid == 0) mbar_expect_tx(full, (u32)(whole * (KVTile::BYTES / (KVTile::PANEL / 128))));
      if (tid < 32) pb.template tma_pages<Tile>(PART, dst, kt.k0, whole, full, tid, 32);
      if (whole < KVTile::PANEL / 128) {
        load_kv_tiles<Tile, NTHREADS, true, PART, COPY_TPR, true>(dst, dst, pb, kt.k0, kt.rows, tid, whole);
        cp_async_mbar_arrive_inc(full);
        named_bar_sync(5, NTHREADS);  // every thread's count is in before thread 0 arrives
      }
      if (tid == 0) mbar_arrive(full);
    } else if constexpr (UsesTma<Problem>::value) {
      mbar_arrive_expect_tx(full, (u32)KVTile::BYTES);
      pb.template tma_kv<Tile>(PART, dst, kt.k0, full);
    } else {
      if (PT_PROBE != 1 || pos.filled < STAGES)  // PT_PROBE 1: the ring's first pass only
        load_kv_tiles<Tile, NTHREADS, true, PART, COPY_TPR>(dst, dst, pb, kt.k0, kt.rows, tid);
      cp_async_mbar_arrive(full);
    }
  }
  __device__ __forceinline__ static void step(RingPos& pos) {
    advance(pos.stage, pos.phase);
    ++pos.filled;
  }

  // one work item's tiles, from where `pos` stands (the caller waits its copies at the end):
  // each tile's K, then its V (a shared tile: K alone), V a tile behind under V_LAG
  template <int NTHREADS, class Problem, class Range>
  __device__ __forceinline__ void produce_item(const Problem& pb, const Range& range, int n_tiles, int tid,
                                               RingPos& pos) const {
    static_assert(KV_TILES == 2 || !UsesTma<Problem>::value, "TMA: a K/V tile pair");
    static_assert(KV_TILES == 2 || !V_LAG, "V a tile behind K: a K/V tile pair");
    if (UsesTma<Problem>::value && !PagedTma<Problem>::value && tid != 0) return;  // TMA: thread 0's pos is the ring's
    constexpr int LAG = V_LAG ? 1 : 0;
    RingPos vpos = pos;  // V's, LAG tiles behind
    for (int it = 0; it < n_tiles + LAG; ++it) {
      if (it < n_tiles) fill<KV_K, NTHREADS>(pb, range.tile(it), tid, pos);
      if constexpr (KV_TILES == 2) {
        if (it >= LAG) {
          fill<KV_V, NTHREADS>(pb, range.tile(it - LAG), tid, vpos);
          step(vpos);
        }
      }
      if (it < n_tiles) step(pos);
    }
  }
  template <int NTHREADS, class Problem, class Range>
  __device__ __forceinline__ void produce(const Problem& pb, const Range& range, int n_tiles, int tid) const {
    RingPos pos;
    produce_item<NTHREADS>(pb, range, n_tiles, tid, pos);
    cp_async_wait<0>();
  }
};

// The ring of a producer-ring FmhaConfig: stages after Q, mbarriers after the exchange area.
template <class Cfg>
__device__ __forceinline__ KvRing<typename Cfg::KTile, Cfg::STAGES, Cfg::KV_TILES, Cfg::COPY_TPR, Cfg::UNDER_PV,
                                  typename Cfg::VTile>
fmha_ring(char* smem) {
  const u32 sQ = smem_addr(smem);
  return {sQ + Cfg::SMEM_Q, sQ + Cfg::SMEM_Q + Cfg::SMEM_RING + Cfg::SMEM_XCHG};
}
// Q's pair of mbarriers after the ring's (persistent CTAs): q_full, the producer's copy of an
// item's Q has landed; q_empty, every MMA warp is done reading it (its last S^T has landed).
template <class Cfg>
__device__ __forceinline__ u32 fmha_q_full(char* smem) {
  const auto ring = fmha_ring<Cfg>(smem);
  return ring.bars + (u32)decltype(ring)::BAR_BYTES;
}
template <class Cfg>
__device__ __forceinline__ u32 fmha_q_empty(char* smem) {
  return fmha_q_full<Cfg>(smem) + 8u;
}

// The MMA threads of a producer-ring CTA copy the Q tile themselves and wait for it
// (named barrier 1: the producer warpgroup never joins).
template <class QTile, int THREADS, class Problem>
__device__ __forceinline__ void load_q_for_mma(u32 sQ, const Problem& pb) {
  load_tile<QTile, THREADS>(sQ, pb.q_rows, [&](int r) { return pb.q_row(r); }, threadIdx.x);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();
  named_bar_sync(1, THREADS);
}

}  // namespace pt
