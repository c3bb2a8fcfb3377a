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

// The producer pipeline's ring: STAGES stages of KV_TILES tiles each from `base`, and
// full[s] / empty[s] mbarriers at `bars`. The producer warpgroup (NTHREADS threads, `tid`
// its index) copies tile it into stage it % STAGES once the MMA warps released the
// stage's previous tile (all `consumer_warps` arrived on empty[s]); each thread's copies
// arrive on full[s] when they land (a TMA problem: thread 0's boxes, see UsesTma).
template <class KVTile, int STAGES, int KV_TILES, bool SHARED_KV, int COPY_TPR = 4>
struct KvRing {
  u32 base, bars;
  __device__ __forceinline__ u32 k(int s) const { return base + (u32)(KV_TILES * s) * KVTile::BYTES; }
  __device__ __forceinline__ u32 v(int s) const { return base + (u32)(KV_TILES * s + KV_TILES - 1) * KVTile::BYTES; }
  __device__ __forceinline__ u32 full(int s) const { return bars + 8u * s; }
  __device__ __forceinline__ u32 empty(int s) const { return bars + 8u * (STAGES + s); }
  static constexpr int BAR_BYTES = 2 * STAGES * 8;

  // the next tile's stage; the pass parity flips when the ring wraps
  __device__ __forceinline__ static void advance(int& stage, u32& phase) {
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1u;
    }
  }
  // an MMA thread: the tile in `stage` has landed and is visible to wgmma
  __device__ __forceinline__ void acquire(int stage, u32 phase) const {
    mbar_wait(full(stage), phase);
    fence_proxy_async();
  }
  // an MMA warp is done with `stage` (its reads of it, wgmma included, have completed)
  __device__ __forceinline__ void release(int stage) const {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) mbar_arrive(empty(stage));
  }

  // one thread, before the CTA-wide barrier that precedes any use
  template <int NTHREADS>
  __device__ __forceinline__ void init(int consumer_warps) const {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), NTHREADS);
      mbar_init(empty(s), consumer_warps);
    }
  }

  // one work item's tiles, from where `pos` stands (the caller waits its copies at the end)
  template <int NTHREADS, class Problem, class Range>
  __device__ __forceinline__ void produce_item(const Problem& pb, const Range& range, int n_tiles, int tid,
                                               RingPos& pos) const {
    if constexpr (PagedTma<Problem>::value) {
      // Pages: thread 0 issues a box per whole page below the request's end (the bytes it
      // expects); a tile's tail (a page cut by the end, keys past it) is the whole warpgroup's
      // cp.async copy, zero past the end (a page's slots past the length hold anything, and V
      // meets P = 0 there), counted on top of thread 0's one arrival, which comes last.
      for (int it = 0; it < n_tiles; ++it) {
        if (pos.filled >= STAGES) mbar_wait(empty(pos.stage), pos.phase ^ 1u);
        const KeyTile kt = range.tile(it);
        const int whole = pb.tma_rows(kt.k0);
        // thread 0 expects the bytes before it arrives (below); the first warp's lanes share
        // the boxes (a box's bytes may land before the expectation: the phase still waits on
        // thread 0's arrival)
        if (tid == 0) mbar_expect_tx(full(pos.stage), (u32)(2 * whole * (KVTile::BYTES / (KVTile::PANEL / 128))));
        if (tid < 32) pb.template tma_pages<KVTile>(k(pos.stage), v(pos.stage), kt.k0, whole, full(pos.stage), tid, 32);
        if (whole < KVTile::PANEL / 128) {
          load_kv_tiles<KVTile, NTHREADS, true, SHARED_KV, COPY_TPR, true>(k(pos.stage), v(pos.stage), pb, kt.k0,
                                                                          kt.rows, tid, whole);
          cp_async_mbar_arrive_inc(full(pos.stage));
          named_bar_sync(5, NTHREADS);  // every thread's count is in before thread 0 arrives
        }
        if (tid == 0) mbar_arrive(full(pos.stage));
        advance(pos.stage, pos.phase);
        ++pos.filled;
      }
      return;
    } else if constexpr (UsesTma<Problem>::value) {
      if (tid != 0) return;  // TMA: thread 0 alone (its pos is the ring's)
      for (int it = 0; it < n_tiles; ++it) {
        if (pos.filled >= STAGES) mbar_wait(empty(pos.stage), pos.phase ^ 1u);
        const KeyTile kt = range.tile(it);
        mbar_arrive_expect_tx(full(pos.stage), (u32)(KV_TILES * KVTile::BYTES));
        pb.template tma_kv<KVTile>(k(pos.stage), v(pos.stage), kt.k0, full(pos.stage));
        advance(pos.stage, pos.phase);
        ++pos.filled;
      }
    } else {
      for (int it = 0; it < n_tiles; ++it) {
        if (pos.filled >= STAGES) mbar_wait(empty(pos.stage), pos.phase ^ 1u);
        const KeyTile kt = range.tile(it);
        if (PT_PROBE != 1 || pos.filled < STAGES)
          load_kv_tiles<KVTile, NTHREADS, true, SHARED_KV, COPY_TPR>(k(pos.stage), v(pos.stage), pb, kt.k0, kt.rows,
                                                                    tid);
        cp_async_mbar_arrive(full(pos.stage));
        advance(pos.stage, pos.phase);
        ++pos.filled;
      }
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
__device__ __forceinline__ KvRing<typename Cfg::KVTile, Cfg::STAGES, Cfg::KV_TILES, Cfg::SHARED_KV, Cfg::COPY_TPR> fmha_ring(
    char* smem) {
  const u32 sQ = smem_addr(smem);
  return {sQ + Cfg::SMEM_Q, sQ + Cfg::SMEM_Q + Cfg::SMEM_RING + Cfg::SMEM_XCHG};
}
// Q's pair of mbarriers after the ring's (persistent CTAs): q_full, the producer's copy of an
// item's Q has landed; q_empty, every MMA warp is done reading it (its last S^T has landed).
template <class Cfg>
__device__ __forceinline__ u32 fmha_q_full(char* smem) {
  return fmha_ring<Cfg>(smem).bars + 16u * Cfg::STAGES;
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
