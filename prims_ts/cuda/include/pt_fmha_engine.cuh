// One warp's place in an FMHA tile (FmhaWarp) and the tile's two products on each engine
// (FmhaEngine<Cfg, ARCH>): S = Q K^T and O += P V, with the key split (WARPS_N) and the
// split-O exchange (SPLIT_O, the portable engine's: wgmma tiles are whole-row warpgroups)
// written once here, so the loops in pt_fmha.cuh read the same on every architecture.
//
// Fragments: each warp owns 16 query rows; S [NT][4] holds its BNW keys of a tile in the
// mma.sync C layout (which wgmma's accumulators share), O [DT][4] its DTW * 8 columns.
#pragma once
#include "pt_fmha_copy.cuh"
#include "pt_fmha_softmax.cuh"

namespace pt {

template <class Cfg>
struct FmhaWarp {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KVTile = typename Cfg::KVTile;
  using VTile = typename Cfg::VTile;  // V's layout when it is its own tile (page-major under V_PAGE)
  using KTile = typename Cfg::KTile;  // K's (row-group interleaved under K_IL)
  static constexpr int BN = Cfg::BN;
  static constexpr int BNW = Cfg::BNW;  // keys of a tile this warp scores
  static constexpr int NT = BNW / 8;    // S n-tiles (8 keys each)
  static constexpr int KD = Cfg::D / 16;  // k-steps over the head dim
  static constexpr int DT = Cfg::DTW;   // O n-tiles (8 columns each) this warp accumulates

  int warp, lane, warp_m, warp_n;
  int key0;  // this warp's first key within a tile
  int g, t;  // the fragment's row (g, g + 8) and column pair (2 t) within a quad
  u32 sQ, sKV;  // stage s: K at sKV + KV_TILES * s * SMEM_KV, V right after (or = K)
  float* xred;  // SPLIT_O exchange area (after the ring): a float per warp row
  uint4* xp;    // ... and P as A fragments
  int col0;  // this warp's first O n-tile (SPLIT_O)
  int row0;  // this warp's first row in the tile

  __device__ __forceinline__ explicit FmhaWarp(char* smem)
      : warp(threadIdx.x >> 5), lane(threadIdx.x & 31), warp_m(warp % Cfg::WARPS_M), warp_n(warp / Cfg::WARPS_M),
        key0(warp_n * BNW), g(lane >> 2), t(lane & 3), sQ(smem_addr(smem)), sKV(sQ + Cfg::SMEM_Q),
        xred(reinterpret_cast<float*>(smem + Cfg::SMEM_Q + Cfg::SMEM_RING)),
        xp(reinterpret_cast<uint4*>(smem + Cfg::SMEM_Q + Cfg::SMEM_RING + Cfg::SMEM_XCHG_RED)),
        col0(Cfg::SPLIT_O ? warp_n * DT : 0), row0(warp_m * 16) {}

  __device__ __forceinline__ u32 sK(int s) const { return sKV + (u32)(Cfg::KV_TILES * s) * Cfg::SMEM_KV; }
  __device__ __forceinline__ u32 sV(int s) const {
    return sKV + (u32)(Cfg::KV_TILES * s + Cfg::KV_TILES - 1) * Cfg::SMEM_KV;
  }
  // a barrier among the MMA warps only (the producer warpgroup, if any, never joins)
  __device__ __forceinline__ static void mma_sync() {
    if constexpr (Cfg::PRODUCER) {
      named_bar_sync(1, Cfg::THREADS);
    } else {
      __syncthreads();
    }
  }
  __device__ __forceinline__ void load_q_frag(int ks, u32 (&a)[4]) const {
    int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    int c = 2 * ks + (lane >> 4);
    ldmatrix_x4(a, sQ + QTile::offset(r, c));
  }
  // Problems with SHORT_TILES may end a tile before the key bound (a block-sparse
  // block smaller than BN): its rows past kt.rows are masked here, not by visible().
  template <class Problem>
  __device__ __forceinline__ void mask(const Problem& pb, float (&s)[NT][4], const KeyTile& kt) const {
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
  }
  // P as the A fragments of the PV product (the mma.sync C layout is the A layout)
  __device__ __forceinline__ static void pack_p(const float (&s)[NT][4], u32 (&pf)[BNW / 16][4]) {
    pack_p_frags<T>(s, pf);
  }
  // SPLIT_O: the band's running-max candidates over all its warps' keys
  __device__ __forceinline__ void band_max(float (&mx)[2]) const {
    if (t == 0) {
      xred[warp * 16 + g] = mx[0];
      xred[warp * 16 + g + 8] = mx[1];
    }
    mma_sync();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int wn = 0; wn < Cfg::WARPS_N; ++wn) mx[h] = max_(mx[h], xred[(wn * Cfg::WARPS_M + warp_m) * 16 + g + 8 * h]);
    }
  }
  // SPLIT_O: this warp's P goes into the exchange area as A fragments (its BNW keys), for
  // every warp of the band to multiply all BN keys into its own columns
  __device__ __forceinline__ void put_p(const float (&s)[NT][4]) const {
#pragma unroll
    for (int kk = 0; kk < BNW / 16; ++kk)
      xp[(warp_m * (BN / 16) + warp_n * (BNW / 16) + kk) * 32 + lane] =
          make_uint4(pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                     pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]));
    mma_sync();
  }
  __device__ __forceinline__ uint4 band_p(int kb) const { return xp[(warp_m * (BN / 16) + kb) * 32 + lane]; }
  // O *= corr, row by row
  __device__ __forceinline__ static void scale(float (&o)[DT][4], const float (&corr)[2]) { scale_rows(o, corr); }
};

template <class Cfg, int ARCH = Cfg::ARCH>
struct FmhaEngine;

// sm_90a: wgmma reading Q and K/V straight from 128-byte-swizzled shared memory, P from
// registers, whole-row warpgroups (no key or O split: FmhaConfig). Each product is issued and
// committed here; the caller waits (the overlapped loops keep one in flight).
template <class Cfg>
struct FmhaEngine<Cfg, 90> {
  using W = FmhaWarp<Cfg>;
  using T = typename W::T;
  static constexpr int NT = W::NT, KD = W::KD, DT = W::DT, BN = W::BN, BNW = W::BNW;

  // S = Q K^T: one warpgroup = 64 rows; A = its Q rows, B = its BNW keys of the K tile (rows
  // key0.., 8-row swizzle atoms of 1024 bytes), both K-major.
  __device__ __forceinline__ static void issue_s(const W& w, float (&s)[NT][4], int stage) {
    const u32 q_wg = w.sQ + (u32)(w.warp_m >> 2) * 64 * 128;
    using KTile = typename W::KTile;
    const u32 k_wg = w.sK(stage) + KTile::row8(w.key0);
    const u64 dq = Cfg::LEAN ? desc_kmajor(q_wg) : 0, dk = Cfg::LEAN ? desc_kmajor(k_wg, KTile::KSBO) : 0;  // LEAN's bases
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KD; ++ks) {
      const u32 koff = (u32)(ks & 3) * 32;  // 16 columns = 32 bytes into the panel
      if constexpr (Cfg::LEAN) {  // a descriptor's address field is addr >> 4: one add a step
        Wgmma<T, BNW>::ss(s, dq + (((ks >> 2) * W::QTile::PANEL + koff) >> 4),
                          dk + (((ks >> 2) * KTile::PSTEP + koff) >> 4), ks > 0);
      } else {
        Wgmma<T, BNW>::ss(s, desc_kmajor(q_wg + (ks >> 2) * W::QTile::PANEL + koff),
                          desc_kmajor(k_wg + (ks >> 2) * KTile::PSTEP + koff, KTile::KSBO), ks > 0);
      }
    }
    wgmma_commit();
  }
  // O += P V: A = P from registers, B = V N-major; V's k-step kk at VTile::kstep(kk), its
  // panels VTile::LBO apart
  __device__ __forceinline__ static void issue_pv(const W& w, float (&o)[DT][4], const u32 (&pf)[BNW / 16][4],
                                                  int stage) {
    using VTile = typename W::VTile;
    fence_regs(o);
    wgmma_fence();
    if constexpr (Cfg::LEAN) {
      const u64 dv = desc_nmajor(w.sV(stage), VTile::LBO);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) Wgmma<T, DT * 8>::rs_nmajor(o, pf[kk], dv + (VTile::kstep(kk) >> 4), 1);
    } else {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<T, DT * 8>::rs_nmajor(o, pf[kk], desc_nmajor(w.sV(stage) + VTile::kstep(kk), VTile::LBO), 1);
    }
    wgmma_commit();
  }
  // the plain loop's products, each waited
  __device__ __forceinline__ static void s_tile(const W& w, float (&s)[NT][4], int stage, const u32 (*)[4]) {
    issue_s(w, s, stage);
    wgmma_wait<0>();
    fence_regs(s);
  }
  __device__ __forceinline__ static void pv_tile(const W& w, float (&o)[DT][4], const float (&s)[NT][4], int stage) {
    u32 pf[BNW / 16][4];
    W::pack_p(s, pf);
    issue_pv(w, o, pf, stage);
    wgmma_wait<0>();
    fence_regs(o);
  }
};

// sm_80 / sm_86 / sm_89 (and sm_90a under Tuning.portable): mma.sync m16n8k16 on ldmatrix
// fragments, Q's from registers (Q_IN_REGS: loaded once by the caller) or shared memory.
template <class Cfg>
struct FmhaEngine<Cfg, 80> {
  using W = FmhaWarp<Cfg>;
  using T = typename W::T;
  static constexpr int NT = W::NT, KD = W::KD, DT = W::DT, BN = W::BN, BNW = W::BNW;

  __device__ __forceinline__ static void s_tile(const W& w, float (&s)[NT][4], int stage, const u32 (*q_frag)[4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KD; ++ks) {
      u32 af[4];
      if constexpr (Cfg::Q_IN_REGS) {
        af[0] = q_frag[ks][0]; af[1] = q_frag[ks][1]; af[2] = q_frag[ks][2]; af[3] = q_frag[ks][3];
      } else {
        w.load_q_frag(ks, af);
      }
#pragma unroll
      for (int p = 0; p < NT / 2; ++p) {
        u32 b[4];
        int mi = w.lane >> 3;
        int r = w.key0 + 16 * p + (w.lane & 7) + (mi >> 1) * 8;
        int c = 2 * ks + (mi & 1);
        ldmatrix_x4(b, w.sK(stage) + W::KVTile::offset(r, c));
        mma_16816<T>(s[2 * p], af, b[0], b[1]);
        mma_16816<T>(s[2 * p + 1], af, b[2], b[3]);
      }
    }
  }
  // O += P V over V's rows `kbase`.. (16 a k-step) into this warp's columns from n-tile c0
  __device__ __forceinline__ static void pv_step(const W& w, float (&o)[DT][4], const u32 (&a)[4], int stage,
                                                 int kbase, int c0) {
#pragma unroll
    for (int n = 0; n < DT; n += 2) {
      u32 b[4];
      int mi = w.lane >> 3;
      int r = kbase + (w.lane & 7) + (mi & 1) * 8;
      int c = c0 + n + (mi >> 1);
      ldmatrix_x4_trans(b, w.sV(stage) + W::KVTile::offset(r, c));
      mma_16816<T>(o[n], a, b[0], b[1]);
      mma_16816<T>(o[n + 1], a, b[2], b[3]);
    }
  }
  __device__ __forceinline__ static void pv_tile(const W& w, float (&o)[DT][4], const float (&s)[NT][4], int stage) {
    if constexpr (Cfg::SPLIT_O) {
      // hand this warp's P over as A fragments, then multiply all BN keys into this
      // warp's columns
      w.put_p(s);
#pragma unroll
      for (int kb = 0; kb < BN / 16; ++kb) {
        const uint4 pa = w.band_p(kb);
        const u32 a[4] = {pa.x, pa.y, pa.z, pa.w};
        pv_step(w, o, a, stage, 16 * kb, w.col0);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < BNW / 16; ++kk) {
        u32 a[4];
        a[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
        a[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
        a[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        pv_step(w, o, a, stage, w.key0 + 16 * kk, 0);
      }
    }
  }
};

}  // namespace pt
