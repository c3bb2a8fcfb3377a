// The FMHA core: one Q tile meets a stream of K/V tiles.
//
//   S = Q K^T (fp32)  ->  mask  ->  online softmax (exp2, scale*log2e folded)
//   ->  O += P V  ->  epilogue (1/l, output scale, cast)
//
// Everything that differs between the APIs is a *policy* supplied by the caller
// through the `Problem` type (prefill: fmha_prefill.cu; decode-shaped: pt_decode.cuh):
//   address  q_row(r): where query row r lives; kv_page(j), then k_row(page, j) and
//            v_row(page, j): where K/V row j lives (a paged policy resolves the page
//            once per row for both; a contiguous one ignores it);
//   range    range(): which key tiles the Q tile visits, as n_tiles() tiles of at
//            most BN consecutive keys, tile(it) = {first key, valid rows}
//            (BandRange below: one band of keys; block-sparse: a route's blocks);
//   mask     tile_needs_mask(k0) and visible(r, j): the per-element predicate
//            (SHORT_TILES: tiles may also end early, see the mask step);
//   output   store2(r, d, x, y): where and how results are written; problems with
//            WANTS_LSE also get store_lse(r, lse) (split-KV partials).
// The work policy (which Q tile, request and head this CTA owns) is decided by
// the kernel entry before it builds the Problem.
//
// Engines (Cfg::ARCH): the portable sm_80 one (mma.sync + ldmatrix) and the
// Hopper one (sm_90a wgmma reading Q and K/V straight from 128-byte-swizzled
// shared memory, P from registers). Either way each warp owns 16 query rows (and,
// with WARPS_N > 1, a share of each tile's keys) with the same fragment layout, so
// masking, softmax and epilogue are shared; K/V tiles of BN keys stream through a
// STAGES-deep ring.
//
// The headers: pt_fmha_config.cuh (FmhaConfig: tile, warps, shared-memory map),
// pt_fmha_copy.cuh (key tiles, cp.async and TMA copies), pt_fmha_ring.cuh (the producer
// ring), pt_fmha_engine.cuh (a warp's place in the tile; S = Q K^T and O += P V on each
// engine), pt_fmha_softmax.cuh (the online softmax, shared with the swapped-operand tile),
// pt_fmha_store.cuh (the wgmma engine's output rows through shared memory), this file (the
// two loops, the epilogue, one item, a CTA's items).
#pragma once
#include "pt_fmha_engine.cuh"
#include "pt_fmha_ring.cuh"
#include "pt_fmha_softmax.cuh"
#include "pt_fmha_store.cuh"

namespace pt {

// The overlapped loop (Cfg::OVERLAP: the producer ring, whole-row warpgroups on wgmma): one
// warpgroup's tiles in software pipeline. QK^T of tile it is issued together with PV of tile
// it - 1, and the softmax of tile it runs while that PV is in flight; O is rescaled once the
// PV has landed. Invariant: before PV(it - 1) lands, O holds the tiles < it - 1 scaled to max
// m_(it-1). K of a tile is handed back once its S^T has landed, V once its PV has.
// PINGPONG turns: warpgroup w issues after waiting on barrier 3 + w and then hands the turn
// over on 4 - w; warpgroup 0 grants itself the first turn and takes back the last hand-over
// after the loop, so every barrier phase completes. The first tile is peeled off so that
// every wait is unconditional: ptxas tracks the wgmma groups in flight per path, and a wait
// under `if (it > 0)` left it a path on which O is read while PV is in flight; it then
// serialised every wgmma (C7514).
template <class Cfg, class Problem, class Range, class Ring, class ReleaseQ>
__device__ __forceinline__ void fmha_overlap_loop(const Problem& pb, const FmhaWarp<Cfg>& w, const Range& range,
                                                  int n_tiles, const Ring& ring, int& stage_io, u32& phase_io,
                                                  float (&o)[Cfg::DTW][4], float (&m_row)[2], float (&l_row)[2],
                                                  float scale_log2, const ReleaseQ& release_q) {
  using W = FmhaWarp<Cfg>;
  using E = FmhaEngine<Cfg>;
  using Softmax = RowSoftmax<W::NT, Cfg::LEAN, Cfg::LAZY>;
  constexpr int THREADS = Cfg::THREADS;
  float s[W::NT][4];
  u32 pf[W::BNW / 16][4];
  int prev = 0;
  const int wg = w.warp >> 2;
  if constexpr (Cfg::PINGPONG) {
    if (wg == 0 && n_tiles > 0) named_bar_arrive(3, THREADS);
  }
  auto softmax_tile = [&](const KeyTile& kt, float (&corr)[2]) {
    float mx[2];
    fence_regs(s);
    w.mask(pb, s, kt);
    Softmax::tile_max(m_row, s, mx);
    Softmax::exp_tile(m_row, l_row, s, mx, corr, scale_log2);
  };
  if (n_tiles > 0) {
    int stage = stage_io;
    u32 phase = phase_io;
    float corr[2];
    u32 prev_phase = phase;
    ring.acquire_k(stage, phase);
    if constexpr (Cfg::PINGPONG) named_bar_sync(3 + wg, THREADS);
    E::issue_s(w, s, stage);
    if constexpr (Cfg::PINGPONG) named_bar_arrive(4 - wg, THREADS);
    wgmma_wait<0>();
    ring.release_k(stage);
    if (n_tiles == 1) release_q();  // the item's last S^T has landed: Q is free
    softmax_tile(range.tile(0), corr);  // O is still zero: nothing to rescale
    W::pack_p(s, pf);
    prev = stage;
    ring.advance(stage, phase);
    for (int it = 1; it < n_tiles; ++it) {
      ring.acquire_k(stage, phase);
      ring.acquire_v(prev, prev_phase);  // before the turn: V(it - 1) came ahead of K(it)
      if constexpr (Cfg::PINGPONG) named_bar_sync(3 + wg, THREADS);
      E::issue_s(w, s, stage);
      E::issue_pv(w, o, pf, prev);
      if constexpr (Cfg::PINGPONG) named_bar_arrive(4 - wg, THREADS);
      wgmma_wait<1>();  // S(it) has landed; PV(it - 1) may still run
      ring.release_k(stage);
      if (it == n_tiles - 1) release_q();
      softmax_tile(range.tile(it), corr);
      if constexpr (Cfg::UNDER_PV) {
        // PV(it - 1) lands in both arms of a branch on the warpgroup's vote (whether any of
        // its rows moved its maximum; named barrier 6 + wg): the branch ends the softmax's
        // basic block. ptxas schedules within a block, and there it hoists the wait above
        // the softmax (the SASS: every exp2 after it), so that nothing runs under the PV;
        // across the block boundary the softmax stays ahead of the wait. The vote is the
        // warpgroup's, not a warp's: its four warps must execute the same (.aligned) wait.
        if (named_bar_any(6 + wg, 128, corr[0] != 1.f || corr[1] != 1.f)) {
          wgmma_wait<0>();
          fence_regs(o);
          W::scale(o, corr);
        } else {
          wgmma_wait<0>();
          fence_regs(o);
        }
      } else {
        wgmma_wait<0>();
        fence_regs(o);
        if (Softmax::rescales(corr)) W::scale(o, corr);
      }
      ring.release_v(prev);  // PV(it - 1) has landed: this warp is done with tile it - 1
      W::pack_p(s, pf);
      prev = stage;
      prev_phase = phase;
      ring.advance(stage, phase);
    }
    ring.acquire_v(prev, prev_phase);
    if constexpr (Cfg::PINGPONG) {
      if (wg == 0) named_bar_sync(3, THREADS);  // warpgroup 1's last hand-over
    }
    E::issue_pv(w, o, pf, prev);
    wgmma_wait<0>();
    fence_regs(o);
    ring.release_v(prev);
    stage_io = stage;
    phase_io = phase;
  }
}

// The plain loop, one tile after another: S, mask, softmax, PV, each waited. The producer
// ring's stages (Cfg::PRODUCER) or the CTA's own cp.async pipeline (portable configs: STAGES
// tiles in flight from the start, tile it + STAGES refills tile it's stage: issue_kv).
template <class Cfg, class Problem, class Range, class Ring, class ReleaseQ, class IssueKv>
__device__ __forceinline__ void fmha_plain_loop(const Problem& pb, const FmhaWarp<Cfg>& w, const Range& range,
                                                int n_tiles, const Ring& ring, int& stage_io, u32& phase_io,
                                                float (&o)[Cfg::DTW][4], float (&m_row)[2], float (&l_row)[2],
                                                float scale_log2, const ReleaseQ& release_q, const IssueKv& issue_kv) {
  using W = FmhaWarp<Cfg>;
  using E = FmhaEngine<Cfg>;
  using Softmax = RowSoftmax<W::NT, Cfg::LEAN, Cfg::LAZY>;
  constexpr int QF = Cfg::Q_IN_REGS ? W::KD : 1;
  u32 q_frag[QF][4];
  int stage = stage_io;
  u32 phase = phase_io;
  for (int it = 0; it < n_tiles; ++it) {
    const KeyTile kt = range.tile(it);
    if constexpr (Cfg::PRODUCER) {
      ring.acquire_k(stage, phase);
    } else {
      cp_async_wait<Cfg::STAGES - 1>();
      if constexpr (Cfg::ARCH == 90) fence_proxy_async();
      __syncthreads();
    }
    if constexpr (Cfg::Q_IN_REGS) {
      if (it == 0) {
#pragma unroll
        for (int ks = 0; ks < W::KD; ++ks) w.load_q_frag(ks, q_frag[ks]);
      }
    }
    float s[W::NT][4];
    E::s_tile(w, s, stage, q_frag);
    if constexpr (Cfg::PRODUCER) ring.release_k(stage);  // this warp's S^T has landed
    if (it == n_tiles - 1) release_q();  // the item's last S^T has landed: Q is free
    w.mask(pb, s, kt);
    float mx[2], corr[2];
    Softmax::tile_max(m_row, s, mx);
    if constexpr (Cfg::SPLIT_O) w.band_max(mx);
    Softmax::exp_tile(m_row, l_row, s, mx, corr, scale_log2);
    if (Softmax::rescales(corr)) W::scale(o, corr);
    if constexpr (Cfg::PRODUCER) ring.acquire_v(stage, phase);
    E::pv_tile(w, o, s, stage);
    if constexpr (Cfg::PRODUCER) {
      ring.release_v(stage);  // this warp's reads of the stage have completed (waited above)
      ring.advance(stage, phase);
    } else {
      __syncthreads();  // every warp is done with this stage
      if (it + Cfg::STAGES < n_tiles) issue_kv(it + Cfg::STAGES, stage);
      cp_async_commit();
      stage = stage + 1 == Cfg::STAGES ? 0 : stage + 1;
    }
  }
  stage_io = stage;
  phase_io = phase;
}

// The epilogue's row sums over the warps that share a row band: SPLIT_O adds the band's
// warps' sums (one running maximum per band already); a key split (WARPS_N > 1) rescales the
// band's warps to their common maximum, and warps warp_n > 0 hand their O fragments over
// through shared memory (the pipeline is drained): false for them, warp_n == 0 finishes.
template <class Cfg>
__device__ __forceinline__ bool fmha_merge_band(const FmhaWarp<Cfg>& w, char* smem, float (&o)[Cfg::DTW][4],
                                                float (&m_row)[2], float (&l_row)[2], float scale_log2) {
  using W = FmhaWarp<Cfg>;
  constexpr int DT = W::DT;
  const int warp = w.warp, warp_m = w.warp_m, warp_n = w.warp_n, g = w.g, lane = w.lane;
  if constexpr (Cfg::SPLIT_O) {
    W::mma_sync();
    if (w.t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) w.xred[warp * 16 + g + 8 * h] = l_row[h];
    }
    W::mma_sync();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = 0.f;
#pragma unroll
      for (int wn = 0; wn < Cfg::WARPS_N; ++wn) l += w.xred[(wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h];
      l_row[h] = l;
    }
  } else if constexpr (Cfg::WARPS_N > 1) {
    __syncthreads();
    float* ml = reinterpret_cast<float*>(smem);  // [WARPS][16][2]: m, l
    float4* xo = reinterpret_cast<float4*>(smem + Cfg::WARPS * 16 * 2 * 4);  // [WARPS_N-1][WARPS_M][DT][32]
    if (w.t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ml[(warp * 16 + g + 8 * h) * 2] = m_row[h];
        ml[(warp * 16 + g + 8 * h) * 2 + 1] = l_row[h];
      }
    }
    __syncthreads();
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = neg_inf();
#pragma unroll
      for (int wn = 0; wn < Cfg::WARPS_N; ++wn) mx = max_(mx, ml[((wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h) * 2]);
      const float base = mx == neg_inf() ? 0.f : mx * scale_log2;
      float l = 0.f;
#pragma unroll
      for (int wn = 0; wn < Cfg::WARPS_N; ++wn) {
        const int i = ((wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h) * 2;
        l += ml[i + 1] * fast_exp2(ml[i] * scale_log2 - base);
      }
      f[h] = fast_exp2(m_row[h] * scale_log2 - base);
      m_row[h] = mx;
      l_row[h] = l;
    }
    if (warp_n > 0) {
#pragma unroll
      for (int n = 0; n < DT; ++n)
        xo[(((warp_n - 1) * Cfg::WARPS_M + warp_m) * DT + n) * 32 + lane] =
            make_float4(o[n][0] * f[0], o[n][1] * f[0], o[n][2] * f[1], o[n][3] * f[1]);
    }
    __syncthreads();
    if (warp_n > 0) return false;
    scale_rows(o, f);
#pragma unroll
    for (int n = 0; n < DT; ++n) {
#pragma unroll
      for (int wn = 1; wn < Cfg::WARPS_N; ++wn) {
        const float4 x = xo[(((wn - 1) * Cfg::WARPS_M + warp_m) * DT + n) * 32 + lane];
        o[n][0] += x.x;
        o[n][1] += x.y;
        o[n][2] += x.z;
        o[n][3] += x.w;
      }
    }
  }
  return true;
}

// The end of a work item: the rows' sums over the quad (and the key-split warps' or O-split
// bands' merge), the log-sum-exp, O / sum to the output; whole rows through the warpgroup's Q
// rows (pt_fmha_store.cuh) where the problem's output allows it.
template <class Cfg, bool Q_BY_PRODUCER, class Problem>
__device__ __forceinline__ void fmha_epilogue(const Problem& pb, const FmhaWarp<Cfg>& w, char* smem,
                                              float (&o)[FmhaWarp<Cfg>::DT][4], float (&m_row)[2],
                                              float (&l_row)[2], float scale_log2, float out_scale) {
  using W = FmhaWarp<Cfg>;
  using QTile = typename Cfg::QTile;
  constexpr int DT = W::DT;
  RowSoftmax<W::NT, Cfg::LEAN, Cfg::LAZY>::sum_quad(l_row);
  if (!fmha_merge_band<Cfg>(w, smem, o, m_row, l_row, scale_log2)) return;
  const int row0 = w.row0, g = w.g, t = w.t;
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    inv[h] = OnlineSoftmax::inverse(l_row[h], out_scale);
    const int r = row0 + g + 8 * h;
    if constexpr (Problem::WANTS_LSE) {
      // log2-domain log-sum-exp of the scaled scores, for merging split-KV partials
      if (r < pb.q_rows && t == 0 && (!Cfg::SPLIT_O || w.warp_n == 0))
        pb.store_lse(r, OnlineSoftmax::lse(m_row[h], l_row[h], scale_log2));
    }
  }
  // not under Q_BY_PRODUCER: a persistent CTA's producer may be copying the next item's Q there
  if constexpr (Cfg::ARCH == 90 && Cfg::PRODUCER && !Q_BY_PRODUCER && RowStore<Problem>::value) {
    const int kind = pb.row_store();  // the same in every thread: the barrier inside is safe
    if (kind == OUT_BF16) return store_o_rows<QTile, bf16, DT>(pb, w.sQ, o, inv, w.warp >> 2, row0);
    if (kind == OUT_F16) return store_o_rows<QTile, f16, DT>(pb, w.sQ, o, inv, w.warp >> 2, row0);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    if (r < pb.q_rows) {
#pragma unroll
      for (int n = 0; n < DT; ++n) pb.store2(r, (w.col0 + n) * 8 + 2 * t, o[n][2 * h] * inv[h], o[n][2 * h + 1] * inv[h]);
    }
  }
}

// The start of a work item: its Q, from the producer (Q_BY_PRODUCER: waited for) or copied by
// the MMA warps themselves; the portable pipeline's first STAGES tiles. False under PT_PROBE 2,
// which times the ring's passes here instead of the item.
template <class Cfg, bool Q_BY_PRODUCER, class Problem, class Ring, class ReleaseQ, class IssueKv>
__device__ __forceinline__ bool fmha_item_start(const Problem& pb, const FmhaWarp<Cfg>& w, char* smem, const Ring& ring,
                                                int n_tiles, RingPos& pos, const ReleaseQ& release_q,
                                                const IssueKv& issue_kv) {
  constexpr int THREADS = Cfg::THREADS, STAGES = Cfg::STAGES;
  using QTile = typename Cfg::QTile;
  if constexpr (Q_BY_PRODUCER) {
    mbar_wait(fmha_q_full<Cfg>(smem), pos.q_phase);
    fence_proxy_async();
    pos.q_phase ^= 1u;
    if (n_tiles == 0) release_q();
  } else if constexpr (Cfg::PRODUCER) {
    load_q_for_mma<QTile, THREADS>(w.sQ, pb);
    if constexpr (PT_PROBE == 2) {  // the data path alone (see PT_PROBE)
      int st = pos.stage;
      u32 ph = pos.phase;
      for (int it = 0; it < n_tiles; ++it) {
        ring.acquire(st, ph);
        ring.release(st);
        ring.advance(st, ph);
      }
      return false;
    }
  } else {
    // STAGES tiles in flight from the start; tile it + STAGES refills tile it's stage.
    load_tile<QTile, THREADS>(w.sQ, pb.q_rows, [&](int r) { return pb.q_row(r); }, threadIdx.x);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if (s < n_tiles) issue_kv(s, s);
      cp_async_commit();
    }
  }
  return true;
}

// One work item (a BM-row tile over its key range). Producer-ring configs: the MMA
// threads only (the ring is set up and fed by fmha_items), from where `pos` stands.
// Portable configs: the whole CTA, `pos` unused.
// Q_BY_PRODUCER (persistent CTAs, whole-row warpgroups): the producer copies each item's Q;
// the MMA warps wait for it (q_full) and hand it back after their last S^T (q_empty): in
// the overlapped loops that is S^T of the last tile, landed while the previous PV may run.
template <class Cfg, bool Q_BY_PRODUCER = false, class Problem>
__device__ __forceinline__ void fmha_tile_body(const Problem& pb, char* smem, float scale_log2, float out_scale,
                                               RingPos& pos) {
  static_assert(!Q_BY_PRODUCER || Cfg::PRODUCER, "Q from the producer: the producer ring (whole-row warpgroups)");
  static_assert(!Q_BY_PRODUCER || PT_PROBE != 2, "PT_PROBE 2 times one item per CTA (PERSISTENT off)");
  using W = FmhaWarp<Cfg>;
  using KVTile = typename Cfg::KVTile;
  constexpr int THREADS = Cfg::THREADS, DT = W::DT;
  const W w(smem);

  const auto range = pb.range();
  const int n_tiles = range.n_tiles();
  // the portable pipeline's copy of tile `it` into `stage`
  auto issue_kv = [&](int it, int stage) {
    const KeyTile kt = range.tile(it);
    const int k0 = kt.k0, rows = kt.rows;
    if constexpr (Cfg::SHARED_KV) {
      load_tile<KVTile, THREADS>(w.sK(stage), rows, [&](int r) { return pb.k_row(pb.kv_page(k0 + r), k0 + r); },
                                 threadIdx.x);
    } else {
      load_kv_tiles<KVTile, THREADS, false>(w.sK(stage), w.sV(stage), pb, k0, rows, threadIdx.x);
    }
  };
  // the producer pipeline's ring and mbarriers (after the exchange area)
  const auto ring = fmha_ring<Cfg>(smem);
  // Q_BY_PRODUCER: this warp is done with the item's Q (after its last S^T, or at once with no tile)
  auto release_q = [&]() {
    if constexpr (Q_BY_PRODUCER) {
      __syncwarp();
      if (w.lane == 0) mbar_arrive(fmha_q_empty<Cfg>(smem));
    }
  };
  if (!fmha_item_start<Cfg, Q_BY_PRODUCER>(pb, w, smem, ring, n_tiles, pos, release_q, issue_kv)) return;

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_row[2] = {neg_inf(), neg_inf()};  // running max of raw scores, rows g and g+8
  float l_row[2] = {0.f, 0.f};              // this thread's share of the running sums

  int stage = Cfg::PRODUCER ? pos.stage : 0;
  u32 phase = pos.phase;  // parity of the current pass over the ring (producer pipeline)
  if constexpr (Cfg::OVERLAP) {
    fmha_overlap_loop<Cfg>(pb, w, range, n_tiles, ring, stage, phase, o, m_row, l_row, scale_log2, release_q);
  } else {
    fmha_plain_loop<Cfg>(pb, w, range, n_tiles, ring, stage, phase, o, m_row, l_row, scale_log2, release_q,
                         issue_kv);
  }
  cp_async_wait<0>();
  pos.stage = stage;
  pos.phase = phase;
  fmha_epilogue<Cfg, Q_BY_PRODUCER>(pb, w, smem, o, m_row, l_row, scale_log2, out_scale);
}

// The work items of a CTA: items.get(w, pb) builds item w's problem (false: nothing to
// do). Items::PERSIST: the CTA walks w = first, first + stride, ... < count (a persistent
// grid: at most one CTA per SM); otherwise it takes item first() alone (one CTA per item).
template <class Problem_>
struct OneItem {
  using Problem = Problem_;
  static constexpr bool PERSIST = false;
  Problem pb;
  __device__ __forceinline__ int first() const { return 0; }
  __device__ __forceinline__ bool get(int, Problem& out) const {
    out = pb;
    return true;
  }
};

// A CTA over its work items. One item: its problem is built once by every thread, then
// the producer warpgroup (if any) copies its tiles and the MMA warps compute them. A
// persistent CTA (producer ring only): the ring is initialised once; the producer copies
// item after item, its Q (once the MMA warps' last S^T of the previous item has landed:
// q_empty) then its K/V tiles, so the next item's Q and first tiles land while the MMA
// warps finish the current one and store it; they compute the items in the same order.
template <class Cfg, class Items>
__device__ __forceinline__ void fmha_items(const Items& items, char* smem, float scale_log2, float out_scale) {
  using Problem = typename Items::Problem;
  constexpr int THREADS = Cfg::THREADS;
  RingPos pos;
  if constexpr (!Items::PERSIST) {
    Problem pb;
    if (!items.get(items.first(), pb)) return;  // the whole CTA: nothing to do
    if constexpr (Cfg::PRODUCER) {
      const auto ring = fmha_ring<Cfg>(smem);
      if (threadIdx.x == 0) {
        ring.template init<UsesTma<Problem>::value ? 1 : Cfg::PRODUCER_THREADS>(Cfg::WARPS);
        if constexpr (UsesTma<Problem>::value) fence_mbar_init();
      }
      __syncthreads();
      if (threadIdx.x >= THREADS) {  // the producer warpgroup
        if constexpr (Cfg::REBALANCE_REGS) setmaxnreg_dec<Cfg::PRODUCER_REGS>();
        ring.template produce<Cfg::PRODUCER_THREADS>(pb, pb.range(), pb.range().n_tiles(), threadIdx.x - THREADS);
        return;
      }
      if constexpr (Cfg::REBALANCE_REGS) setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    }
    fmha_tile_body<Cfg>(pb, smem, scale_log2, out_scale, pos);
  } else {
    static_assert(Cfg::PRODUCER, "persistent CTAs: the producer ring");
    const auto ring = fmha_ring<Cfg>(smem);
    if (threadIdx.x == 0) {
      ring.template init<UsesTma<Problem>::value ? 1 : Cfg::PRODUCER_THREADS>(Cfg::WARPS);
      mbar_init(fmha_q_full<Cfg>(smem), Cfg::PRODUCER_THREADS);
      mbar_init(fmha_q_empty<Cfg>(smem), Cfg::WARPS);
      if constexpr (UsesTma<Problem>::value) fence_mbar_init();
    }
    __syncthreads();
    if (threadIdx.x >= THREADS) {  // the producer warpgroup: each item's Q, then its K/V tiles
      if constexpr (Cfg::REBALANCE_REGS) setmaxnreg_dec<Cfg::PRODUCER_REGS>();
      const int tid = threadIdx.x - THREADS;
      int k = 0;  // items begun
      for (int w = items.first(); w < items.count(); w += items.stride()) {
        Problem pb;
        if (!items.get(w, pb)) continue;
        // Q of item k replaces item k - 1's once every MMA warp has read it for the last time
        if (k > 0) mbar_wait(fmha_q_empty<Cfg>(smem), (u32)(k - 1) & 1u);
        ++k;
        auto q_row = [&](int r) { return pb.q_row(r); };
        load_tile<typename Cfg::QTile, Cfg::PRODUCER_THREADS, decltype(q_row), true>(smem_addr(smem), pb.q_rows,
                                                                                    q_row, tid);
        cp_async_mbar_arrive(fmha_q_full<Cfg>(smem));
        const auto range = pb.range();
        ring.template produce_item<Cfg::PRODUCER_THREADS>(pb, range, range.n_tiles(), tid, pos);
      }
      cp_async_wait<0>();
      return;
    }
    if constexpr (Cfg::REBALANCE_REGS) setmaxnreg_inc<Cfg::CONSUMER_REGS>();
    for (int w = items.first(); w < items.count(); w += items.stride()) {
      Problem pb;
      if (!items.get(w, pb)) continue;
      fmha_tile_body<Cfg, true>(pb, smem, scale_log2, out_scale, pos);
    }
  }
}

// One work item on the whole CTA (the producer warpgroup, if any, returns when it has
// issued every copy).
template <class Cfg, class Problem>
__device__ __forceinline__ void fmha_tile(const Problem& pb, char* smem, float scale_log2, float out_scale) {
  fmha_items<Cfg>(OneItem<Problem>{pb}, smem, scale_log2, out_scale);
}

}  // namespace pt
