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
// ring), pt_fmha_softmax.cuh (the online softmax, shared with the swapped-operand tile),
// pt_fmha_store.cuh (the wgmma engine's output rows through shared memory), this file (one item's loops and epilogue, a CTA's items).
#pragma once
#include "pt_fmha_ring.cuh"
#include "pt_fmha_softmax.cuh"
#include "pt_fmha_store.cuh"

namespace pt {

// One work item (a BM-row tile over its key range). Producer-ring configs: the MMA
// threads only (the ring is set up and fed by fmha_items), from where `pos` stands.
// Portable configs: the whole CTA, `pos` unused.
// Q_BY_PRODUCER (persistent CTAs, whole-row warpgroups): the producer copies each item's Q;
// the MMA warps wait for it (q_full) and hand it back after their last S^T (q_empty): in
// the overlapped loops that is S^T of the last tile, landed while the previous PV may run.
template <class Cfg, bool Q_BY_PRODUCER = false, class Problem>
__device__ __forceinline__ void fmha_tile_body(const Problem& pb, char* smem, float scale_log2, float out_scale,
                                               RingPos& pos) {
  static_assert(!Q_BY_PRODUCER || (Cfg::PRODUCER && !Cfg::SPLIT_O && Cfg::WARPS_N == 1),
                "Q from the producer: whole-row warpgroups");
  static_assert(!Q_BY_PRODUCER || PT_PROBE != 2, "PT_PROBE 2 times one item per CTA (PERSISTENT off)");
  using T = typename Cfg::T;
  constexpr int D = Cfg::D, BN = Cfg::BN, THREADS = Cfg::THREADS, STAGES = Cfg::STAGES;
  constexpr int BNW = Cfg::BNW;  // keys of a tile this warp scores
  constexpr int NT = BNW / 8;    // S n-tiles (8 keys each)
  constexpr int KD = D / 16;     // k-steps over the head dim
  constexpr int DT = Cfg::DTW;   // O n-tiles (8 columns each) this warp accumulates
  constexpr bool SPLIT_O = Cfg::SPLIT_O;
  using QTile = typename Cfg::QTile;
  using KVTile = typename Cfg::KVTile;
  using VTile = typename Cfg::VTile;  // V's layout when it is its own tile (page-major under V_PAGE)

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warp_m = warp % Cfg::WARPS_M, warp_n = warp / Cfg::WARPS_M;
  const int key0 = warp_n * BNW;  // this warp's first key within a tile
  const int g = lane >> 2, t = lane & 3;
  const u32 sQ = smem_addr(smem);
  const u32 sKV = sQ + Cfg::SMEM_Q;  // stage s: K at sKV + KV_TILES*s*SMEM_KV, V right after (or = K)
  // SPLIT_O exchange area (after the ring)
  float* xred = reinterpret_cast<float*>(smem + Cfg::SMEM_Q + Cfg::SMEM_RING);
  uint4* xp = reinterpret_cast<uint4*>(smem + Cfg::SMEM_Q + Cfg::SMEM_RING + Cfg::SMEM_XCHG_RED);
  const int col0 = SPLIT_O ? warp_n * DT : 0;  // this warp's first O n-tile
  auto sK = [&](int s) { return sKV + (u32)(Cfg::KV_TILES * s) * Cfg::SMEM_KV; };
  auto sV = [&](int s) { return sKV + (u32)(Cfg::KV_TILES * s + Cfg::KV_TILES - 1) * Cfg::SMEM_KV; };

  const auto range = pb.range();
  const int n_tiles = range.n_tiles();
  // a barrier among the MMA warps only (the producer warpgroup, if any, never joins)
  auto mma_sync = [&]() {
    if constexpr (Cfg::PRODUCER) {
      named_bar_sync(1, THREADS);
    } else {
      __syncthreads();
    }
  };

  auto issue_kv = [&](int it, int stage) {
    const KeyTile kt = range.tile(it);
    const int k0 = kt.k0, rows = kt.rows;
    if constexpr (Cfg::SHARED_KV) {
      load_tile<KVTile, THREADS>(sK(stage), rows, [&](int r) { return pb.k_row(pb.kv_page(k0 + r), k0 + r); },
                                 threadIdx.x);
    } else {
      load_kv_tiles<KVTile, THREADS, false>(sK(stage), sV(stage), pb, k0, rows, threadIdx.x);
    }
  };

  // the producer pipeline's ring and mbarriers (after the exchange area)
  const auto ring = fmha_ring<Cfg>(smem);
  // Q_BY_PRODUCER: this warp is done with the item's Q (after its last S^T, or at once with no tile)
  auto release_q = [&]() {
    if constexpr (Q_BY_PRODUCER) {
      __syncwarp();
      if (lane == 0) mbar_arrive(fmha_q_empty<Cfg>(smem));
    }
  };
  if constexpr (Q_BY_PRODUCER) {
    mbar_wait(fmha_q_full<Cfg>(smem), pos.q_phase);
    fence_proxy_async();
    pos.q_phase ^= 1u;
    if (n_tiles == 0) release_q();
  } else if constexpr (Cfg::PRODUCER) {
    load_q_for_mma<QTile, THREADS>(sQ, pb);
    if constexpr (PT_PROBE == 2) {  // the data path alone (see PT_PROBE)
      int st = pos.stage;
      u32 ph = pos.phase;
      for (int it = 0; it < n_tiles; ++it) {
        ring.acquire(st, ph);
        ring.release(st);
        ring.advance(st, ph);
      }
      return;
    }
  } else {
    // STAGES tiles in flight from the start; tile it + STAGES refills tile it's stage.
    load_tile<QTile, THREADS>(sQ, pb.q_rows, [&](int r) { return pb.q_row(r); }, threadIdx.x);
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      if (s < n_tiles) issue_kv(s, s);
      cp_async_commit();
    }
  }

  float o[DT][4];
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_row[2] = {neg_inf(), neg_inf()};  // running max of raw scores, rows g and g+8
  float l_row[2] = {0.f, 0.f};              // this thread's share of the running sums
  using Softmax = RowSoftmax<NT, Cfg::LEAN, Cfg::LAZY>;

  constexpr int QF = Cfg::Q_IN_REGS ? KD : 1;
  u32 q_frag[QF][4];
  const int row0 = warp_m * 16;  // this warp's first row in the tile

  auto load_q_frag = [&](int ks, u32 (&a)[4]) {
    int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    int c = 2 * ks + (lane >> 4);
    ldmatrix_x4(a, sQ + QTile::offset(r, c));
  };

  // ---- the steps of one key tile, shared by the loops below ------------------------
  // S = Q K^T on the wgmma engine, issued (not waited): one warpgroup = 64 rows; A = its
  // Q rows, B = its BNW keys of the K tile (rows key0.., 8-row swizzle atoms of 1024
  // bytes), both K-major.
  auto issue_s_wgmma = [&](float (&s)[NT][4], int stage) {
    if constexpr (Cfg::ARCH == 90) {
      const u32 q_wg = sQ + (u32)(warp_m >> 2) * 64 * 128;
      const u32 k_wg = sK(stage) + (u32)key0 * 128;
      const u64 dq = Cfg::LEAN ? desc_kmajor(q_wg) : 0, dk = Cfg::LEAN ? desc_kmajor(k_wg) : 0;  // LEAN's bases
      fence_regs(s);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {
        const u32 koff = (u32)(ks & 3) * 32;  // 16 columns = 32 bytes into the panel
        if constexpr (Cfg::LEAN) {  // a descriptor's address field is addr >> 4: one add a step
          Wgmma<T, BNW>::ss(s, dq + (((ks >> 2) * QTile::PANEL + koff) >> 4),
                            dk + (((ks >> 2) * KVTile::PANEL + koff) >> 4), ks > 0);
        } else {
          Wgmma<T, BNW>::ss(s, desc_kmajor(q_wg + (ks >> 2) * QTile::PANEL + koff),
                            desc_kmajor(k_wg + (ks >> 2) * KVTile::PANEL + koff), ks > 0);
        }
      }
      wgmma_commit();
    }
  };
  // Problems with SHORT_TILES may end a tile before the key bound (a block-sparse
  // block smaller than BN): its rows past kt.rows are masked here, not by visible().
  auto mask_tile = [&](float (&s)[NT][4], const KeyTile& kt) {
    if ((Problem::SHORT_TILES && kt.rows < BN) || pb.tile_needs_mask(kt.k0)) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int r = row0 + g + (e >> 1) * 8;
          int l = key0 + nt * 8 + 2 * t + (e & 1);
          if ((Problem::SHORT_TILES && l >= kt.rows) || !pb.visible(r, kt.k0 + l)) s[nt][e] = neg_inf();
        }
      }
    }
  };
  auto scale_o = [&](const float (&corr)[2]) { scale_rows(o, corr); };
  auto rescale_o = [&](const float (&corr)[2]) {
    if (Softmax::rescales(corr)) scale_o(corr);
  };
  // P as the A fragments of the PV product (the mma.sync C layout is the A layout)
  auto pack_p = [&](const float (&s)[NT][4], u32 (&pf)[BNW / 16][4]) { pack_p_frags<T>(s, pf); };
  // O += P V on the wgmma engine, issued (not waited): A = P from registers, B = V N-major
  auto issue_pv_wgmma = [&](const u32 (&pf)[BNW / 16][4], int stage) {
    if constexpr (Cfg::ARCH == 90 && !SPLIT_O) {
      fence_regs(o);
      wgmma_fence();
      // V's k-step kk: its 16 rows at VTile::kstep(kk), its panels VTile::LBO apart
      if constexpr (Cfg::LEAN) {
        const u64 dv = desc_nmajor(sV(stage), VTile::LBO);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) Wgmma<T, DT * 8>::rs_nmajor(o, pf[kk], dv + (VTile::kstep(kk) >> 4), 1);
      } else {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          Wgmma<T, DT * 8>::rs_nmajor(o, pf[kk], desc_nmajor(sV(stage) + VTile::kstep(kk), VTile::LBO), 1);
      }
      wgmma_commit();
    }
  };

  int stage = Cfg::PRODUCER ? pos.stage : 0;
  u32 phase = pos.phase;  // parity of the current pass over the ring (producer pipeline)
  if constexpr (Cfg::OVERLAP) {
    // One warpgroup's tiles in software pipeline (the producer ring, no key split): QK^T
    // of tile it is issued together with PV of tile it - 1, and the softmax of tile it
    // runs while that PV is in flight; O is rescaled once the PV has landed. Invariant:
    // before PV(it - 1) lands, O holds the tiles < it - 1 scaled to max m_(it-1).
    float s[NT][4];
    u32 pf[BNW / 16][4];
    int prev = 0;
    // PINGPONG turns: warpgroup w issues after waiting on barrier 3 + w and then hands the
    // turn over on 4 - w; warpgroup 0 grants itself the first turn and takes back the last
    // hand-over after the loop, so every barrier phase completes.
    const int wg = warp >> 2;
    if constexpr (Cfg::PINGPONG) {
      if (wg == 0 && n_tiles > 0) named_bar_arrive(3, THREADS);
    }
    // The first tile is peeled off so that every wait is unconditional: ptxas tracks the
    // wgmma groups in flight per path, and a wait under `if (it > 0)` left it a path on
    // which O is read while PV is in flight; it then serialised every wgmma (C7514).
    auto softmax_tile = [&](const KeyTile& kt, float (&corr)[2]) {
      float mx[2];
      fence_regs(s);
      mask_tile(s, kt);
      Softmax::tile_max(m_row, s, mx);
      Softmax::exp_tile(m_row, l_row, s, mx, corr, scale_log2);
    };
    // K of a tile is handed back once its S^T has landed, V once its PV has.
    if (n_tiles > 0) {
      float corr[2];
      u32 prev_phase = phase;
      ring.acquire_k(stage, phase);
      if constexpr (Cfg::PINGPONG) named_bar_sync(3 + wg, THREADS);
      issue_s_wgmma(s, stage);
      if constexpr (Cfg::PINGPONG) named_bar_arrive(4 - wg, THREADS);
      wgmma_wait<0>();
      ring.release_k(stage);
      if (n_tiles == 1) release_q();  // the item's last S^T has landed: Q is free
      softmax_tile(range.tile(0), corr);  // O is still zero: nothing to rescale
      pack_p(s, pf);
      prev = stage;
      ring.advance(stage, phase);
      for (int it = 1; it < n_tiles; ++it) {
        ring.acquire_k(stage, phase);
        ring.acquire_v(prev, prev_phase);  // before the turn: V(it - 1) came ahead of K(it)
        if constexpr (Cfg::PINGPONG) named_bar_sync(3 + wg, THREADS);
        issue_s_wgmma(s, stage);
        issue_pv_wgmma(pf, prev);
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
            scale_o(corr);
          } else {
            wgmma_wait<0>();
            fence_regs(o);
          }
        } else {
          wgmma_wait<0>();
          fence_regs(o);
          rescale_o(corr);
        }
        ring.release_v(prev);  // PV(it - 1) has landed: this warp is done with tile it - 1
        pack_p(s, pf);
        prev = stage;
        prev_phase = phase;
        ring.advance(stage, phase);
      }
      ring.acquire_v(prev, prev_phase);
      if constexpr (Cfg::PINGPONG) {
        if (wg == 0) named_bar_sync(3, THREADS);  // warpgroup 1's last hand-over
      }
      issue_pv_wgmma(pf, prev);
      wgmma_wait<0>();
      fence_regs(o);
      ring.release_v(prev);
    }
  }
  for (int it = 0; !Cfg::OVERLAP && it < n_tiles; ++it) {
    const KeyTile kt = range.tile(it);
    if constexpr (Cfg::PRODUCER) {
      ring.acquire_k(stage, phase);
    } else {
      cp_async_wait<STAGES - 1>();
      if constexpr (Cfg::ARCH == 90) fence_proxy_async();
      __syncthreads();
    }
    if constexpr (Cfg::Q_IN_REGS) {
      if (it == 0) {
#pragma unroll
        for (int ks = 0; ks < KD; ++ks) load_q_frag(ks, q_frag[ks]);
      }
    }

    // ---- S = Q K^T --------------------------------------------------------
    float s[NT][4];
    if constexpr (Cfg::ARCH == 90) {
      issue_s_wgmma(s, stage);
      wgmma_wait<0>();
      fence_regs(s);
      if constexpr (Cfg::PRODUCER) ring.release_k(stage);  // this warp's S^T has landed
      if (it == n_tiles - 1) release_q();  // the item's last S^T has landed: Q is free
    } else {
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KD; ++ks) {
      u32 af[4];
      if constexpr (Cfg::Q_IN_REGS) {
        af[0] = q_frag[ks][0]; af[1] = q_frag[ks][1]; af[2] = q_frag[ks][2]; af[3] = q_frag[ks][3];
      } else {
        load_q_frag(ks, af);
      }
#pragma unroll
      for (int p = 0; p < NT / 2; ++p) {
        u32 b[4];
        int mi = lane >> 3;
        int r = key0 + 16 * p + (lane & 7) + (mi >> 1) * 8;
        int c = 2 * ks + (mi & 1);
        ldmatrix_x4(b, sK(stage) + KVTile::offset(r, c));
        mma_16816<T>(s[2 * p], af, b[0], b[1]);
        mma_16816<T>(s[2 * p + 1], af, b[2], b[3]);
      }
    }
    }

    mask_tile(s, kt);

    // ---- online softmax -----------------------------------------------------
    float mx[2], corr[2];
    Softmax::tile_max(m_row, s, mx);
    if constexpr (SPLIT_O) {  // the band's max over all its warps' keys
      if (t == 0) {
        xred[warp * 16 + g] = mx[0];
        xred[warp * 16 + g + 8] = mx[1];
      }
      mma_sync();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int wn = 0; wn < Cfg::WARPS_N; ++wn)
          mx[h] = max_(mx[h], xred[(wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h]);
      }
    }
    Softmax::exp_tile(m_row, l_row, s, mx, corr, scale_log2);
    rescale_o(corr);

    // ---- O += P V -------------------------------------------------------------
    if constexpr (Cfg::PRODUCER) ring.acquire_v(stage, phase);
    if constexpr (Cfg::ARCH == 90 && SPLIT_O) {
      // hand this warpgroup's P over as A fragments (the RS operand's register layout is
      // the mma.sync one), then multiply all BN keys into its DV / WARPS_N columns
#pragma unroll
      for (int kk = 0; kk < BNW / 16; ++kk)
        xp[(warp_m * (BN / 16) + warp_n * (BNW / 16) + kk) * 32 + lane] =
            make_uint4(pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]));
      mma_sync();
      u32 pf[BN / 16][4];
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb) {
        const uint4 pa = xp[(warp_m * (BN / 16) + kb) * 32 + lane];
        pf[kb][0] = pa.x;
        pf[kb][1] = pa.y;
        pf[kb][2] = pa.z;
        pf[kb][3] = pa.w;
      }
      const u32 v_wg = sV(stage) + (u32)(col0 * 8 / 64) * KVTile::PANEL;  // this warpgroup's first column panel
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb)
        Wgmma<T, DT * 8>::rs_nmajor(o, pf[kb], desc_nmajor(v_wg + kb * 16 * 128, KVTile::PANEL), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
    } else if constexpr (Cfg::ARCH == 90) {
      u32 pf[BNW / 16][4];
      pack_p(s, pf);
      issue_pv_wgmma(pf, stage);
      wgmma_wait<0>();
      fence_regs(o);
    } else if constexpr (SPLIT_O) {
      // hand this warp's P over as A fragments, then multiply all BN keys into this
      // warp's columns
#pragma unroll
      for (int kk = 0; kk < BNW / 16; ++kk)
        xp[(warp_m * (BN / 16) + warp_n * (BNW / 16) + kk) * 32 + lane] =
            make_uint4(pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                       pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]));
      mma_sync();
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb) {
        const uint4 pa = xp[(warp_m * (BN / 16) + kb) * 32 + lane];
        const u32 a[4] = {pa.x, pa.y, pa.z, pa.w};
#pragma unroll
        for (int n = 0; n < DT; n += 2) {
          u32 b[4];
          int mi = lane >> 3;
          int r = 16 * kb + (lane & 7) + (mi & 1) * 8;
          int c = col0 + n + (mi >> 1);
          ldmatrix_x4_trans(b, sV(stage) + KVTile::offset(r, c));
          mma_16816<T>(o[n], a, b[0], b[1]);
          mma_16816<T>(o[n + 1], a, b[2], b[3]);
        }
      }
    } else {
#pragma unroll
    for (int kk = 0; kk < BNW / 16; ++kk) {
      u32 a[4];
      a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < DT; n += 2) {
        u32 b[4];
        int mi = lane >> 3;
        int r = key0 + 16 * kk + (lane & 7) + (mi & 1) * 8;
        int c = n + (mi >> 1);
        ldmatrix_x4_trans(b, sV(stage) + KVTile::offset(r, c));
        mma_16816<T>(o[n], a, b[0], b[1]);
        mma_16816<T>(o[n + 1], a, b[2], b[3]);
      }
    }
    }

    if constexpr (Cfg::PRODUCER) {
      ring.release_v(stage);  // this warp's reads of the stage have completed (waited above)
      ring.advance(stage, phase);
    } else {
      __syncthreads();  // every warp is done with this stage
      if (it + STAGES < n_tiles) issue_kv(it + STAGES, stage);
      cp_async_commit();
      stage = stage + 1 == STAGES ? 0 : stage + 1;
    }
  }
  cp_async_wait<0>();
  pos.stage = stage;
  pos.phase = phase;

  // ---- epilogue ---------------------------------------------------------------
  Softmax::sum_quad(l_row);
  if constexpr (SPLIT_O) {
    // one running max per band already; the sums add up over the band's warps
    mma_sync();
    if (t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) xred[warp * 16 + g + 8 * h] = l_row[h];
    }
    mma_sync();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = 0.f;
#pragma unroll
      for (int wn = 0; wn < Cfg::WARPS_N; ++wn) l += xred[(wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h];
      l_row[h] = l;
    }
  } else if constexpr (Cfg::WARPS_N > 1) {
    // Key-split merge: the warps of one row band rescale to their common max;
    // warps warp_n > 0 hand their O fragments over through shared memory (the
    // pipeline is drained) and warp_n == 0 finishes the epilogue.
    __syncthreads();
    float* ml = reinterpret_cast<float*>(smem);  // [WARPS][16][2]: m, l
    float4* xo = reinterpret_cast<float4*>(smem + Cfg::WARPS * 16 * 2 * 4);  // [WARPS_N-1][WARPS_M][DT][32]
    if (t == 0) {
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
      for (int wn = 0; wn < Cfg::WARPS_N; ++wn)
        mx = max_(mx, ml[((wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h) * 2]);
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
    if (warp_n > 0) return;
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      o[n][0] *= f[0];
      o[n][1] *= f[0];
      o[n][2] *= f[1];
      o[n][3] *= f[1];
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
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    inv[h] = OnlineSoftmax::inverse(l_row[h], out_scale);
    const int r = row0 + g + 8 * h;
    if constexpr (Problem::WANTS_LSE) {
      // log2-domain log-sum-exp of the scaled scores, for merging split-KV partials
      if (r < pb.q_rows && t == 0 && (!SPLIT_O || warp_n == 0))
        pb.store_lse(r, OnlineSoftmax::lse(m_row[h], l_row[h], scale_log2));
    }
  }
  // Whole rows through the warpgroup's Q rows (pt_fmha_store.cuh), where the problem's output
  // allows it; a persistent CTA's producer may already be copying the next item's Q there.
  if constexpr (Cfg::ARCH == 90 && Cfg::PRODUCER && !SPLIT_O && Cfg::WARPS_N == 1 && !Q_BY_PRODUCER &&
                RowStore<Problem>::value) {
    const int kind = pb.row_store();  // the same in every thread: the barrier inside is safe
    if (kind == OUT_BF16) return store_o_rows<QTile, bf16, DT>(pb, sQ, o, inv, warp >> 2, row0);
    if (kind == OUT_F16) return store_o_rows<QTile, f16, DT>(pb, sQ, o, inv, warp >> 2, row0);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    if (r < pb.q_rows) {
#pragma unroll
      for (int n = 0; n < DT; ++n) pb.store2(r, (col0 + n) * 8 + 2 * t, o[n][2 * h] * inv[h], o[n][2 * h + 1] * inv[h]);
    }
  }
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
