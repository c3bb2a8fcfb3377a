// The seesaw MLA tile (sm_90a; Tuning.mla_seesaw): 64 query rows (heads x query tokens) over
// 64-key tiles of 576-wide latent rows, V the first 512 columns of each row. Two MMA
// warpgroups take the key tiles in turn for S (warpgroup 0 the even tiles, 1 the odd ones:
// m64n64 over all 576 columns, so its shared-memory operands stream at the rate the tensor
// pipe takes them) and each owns half of O (256 columns, m64n256 for P V). For a pair of
// tiles (a, b):
//
//   warpgroup 0                               warpgroup 1
//   softmax of S(a), the running max M(a)     .
//   -- M(a), its rescale factor (bar S0) -->   softmax of S(b) from M(a): M(b)
//   O_L += P(a) V(a)_L   (P from registers)   <-- M(b), its factor (bar S1) --
//   P(a) * factor(b) to shared memory (P0)     P(b) to shared memory (P1), O_R += P(b) V(b)_R
//   O_L *= factor(b); O_L += P(b) V(b)_L       O_R += P(a) V(a)_R   (P from shared memory)
//   S(a + 2) issued behind that product        S(b + 2) once its products landed (tile b + 2
//                                              refills b's stage, which they read)
//
// so each warpgroup's softmax runs under the other's products. The running maximum is one
// chain through both warpgroups (M(b) >= M(a) >= M(b - 2)), shared through shared memory with
// the factor that rescales what was summed before; each warpgroup keeps its O half and its
// own tiles' row sums relative to the last maximum it has seen, and the epilogue adds the two
// sums. Each P goes to shared memory in its own tile's last 64-column panel (the rope
// columns: K's part there is read by S alone, which is done; V is the first DV columns), so
// Q and two 72 KB stages are all the shared memory holds. The producer warpgroup and its ring are the
// core's (pt_fmha_ring.cuh: KvRing, one shared tile a stage, released by all eight MMA warps).
// The problem policies are the decode problem's (pt_decode.cuh).
#pragma once
#include "pt_fmha.cuh"

namespace pt {

template <class T_, int D_, int DV_, int STAGES_, int COPY_TPR_ = 4>
struct SeesawConfig {
  using T = T_;
  static constexpr bool SWAP = false;
  static constexpr bool SEESAW = true;
  static constexpr int ARCH = 90;
  static constexpr int D = D_, DV = DV_, BM = 64, BN = 64, STAGES = STAGES_;
  static constexpr int THREADS = 256;  // the two MMA warpgroups
  static constexpr int WARPS = 8;
  static constexpr int PRODUCER_THREADS = 128;
  static constexpr int LAUNCH_THREADS = THREADS + PRODUCER_THREADS;
  static constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
  static constexpr int COPY_TPR = COPY_TPR_;
  using QTile = SmemTileW<BM, D>;
  using KVTile = SmemTileW<BN, D>;
  using PTile = SmemTileW<BM, BN>;  // P: [query row][key] in a tile's last panel, A of the other's P V
  using Ring = KvRing<KVTile, STAGES, 1, COPY_TPR>;
  static constexpr int QP = D / 64;       // 64-column panels of a row; P lives in a tile's last
  static constexpr int DVH = DV / 2;      // O columns a warpgroup
  static constexpr int SMEM_Q = QTile::BYTES;
  static constexpr int SMEM_RING = STAGES * KVTile::BYTES;
  static constexpr int SMEM_ROWS = 5 * BM * 4;  // a row's M, the two factors, the two sums
  static constexpr int SMEM_BARS = Ring::BAR_BYTES;
  static constexpr int SMEM_BYTES = SMEM_Q + SMEM_RING + SMEM_ROWS + SMEM_BARS;
  static_assert(D % 64 == 0 && DV % 128 == 0 && DV <= (QP - 1) * 64, "V a prefix of the K row, before its last panel");
  static_assert(PTile::BYTES == KVTile::PANEL && QTile::PANEL == KVTile::PANEL, "P fills a tile's panel; Q's panels as K's");
  static_assert(DVH == 256 && STAGES >= 2, "m64n256 halves of O; two tiles in flight");
};

// Named barriers (256 threads: one warpgroup arrives, the other waits); 1 and 2 are the MMA
// threads' own (Q's copy, the split merge).
enum SeesawBar { SEESAW_S0 = 7, SEESAW_S1 = 8, SEESAW_P0 = 9, SEESAW_P1 = 10 };

template <class Cfg, class Problem>
__device__ __forceinline__ void fmha_tile_seesaw(const Problem& pb, char* smem, float scale_log2, float out_scale) {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KVTile = typename Cfg::KVTile;
  using PTile = typename Cfg::PTile;
  using Softmax = RowSoftmax<8>;
  static_assert(!Problem::SHORT_TILES, "whole 64-key tiles (the decode problem's)");
  constexpr int BN = Cfg::BN, STAGES = Cfg::STAGES, THREADS = Cfg::THREADS, QP = Cfg::QP;
  constexpr int KS = QP * 4;       // S's k-steps
  constexpr int DT = Cfg::DVH / 8;  // O n-tiles a thread

  const u32 sQ = smem_addr(smem);
  const u32 sKV = sQ + Cfg::SMEM_Q;
  float* rows = reinterpret_cast<float*>(smem + Cfg::SMEM_Q + Cfg::SMEM_RING);
  float* sM = rows;            // [BM] the running max after the pair's last tile so far
  float* sF0 = rows + 64;      // [BM] the factor of tile a (from M before a to M(a))
  float* sF1 = rows + 128;     // [BM] the factor of tile b (from M(a) to M(b))
  float* sL = rows + 192;      // [2][BM] the warpgroups' row sums
  const typename Cfg::Ring ring{sKV, sKV + Cfg::SMEM_RING + Cfg::SMEM_ROWS};
  const auto range = pb.range();
  const int n_tiles = range.n_tiles();

  if (threadIdx.x == 0) ring.template init<Cfg::PRODUCER_THREADS>(Cfg::WARPS);
  __syncthreads();
  if (threadIdx.x >= THREADS) {  // the producer warpgroup
    setmaxnreg_dec<Cfg::PRODUCER_REGS>();
    ring.template produce<Cfg::PRODUCER_THREADS>(pb, range, n_tiles, threadIdx.x - THREADS);
    return;
  }
  setmaxnreg_inc<Cfg::CONSUMER_REGS>();
  load_q_for_mma<QTile, THREADS>(sQ, pb);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 0: even tiles and O's left half; 1: odd tiles, right half. Broadcast from lane 0 so that
  // ptxas sees a warp-uniform value: the wgmma paths below branch on it (else C7520, every
  // wgmma serialised)
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int row0 = (warp & 3) * 16;   // this warp's rows (the same in both warpgroups)
  const int g = lane >> 2, t = lane & 3;

  float s[8][4];     // S, then P, of this warpgroup's current tile
  float o[DT][4];    // this warpgroup's half of O
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {neg_inf(), neg_inf()};  // the running max this warpgroup's O and sums are relative to
  float l[2] = {0.f, 0.f};              // this thread's share of its own tiles' row sums

  auto stage_of = [](int it) { return it % STAGES; };
  auto phase_of = [](int it) { return (u32)((it / STAGES) & 1); };
  // S of tile it (this warpgroup's), issued and committed
  // (the descriptors: a base each and one add a k-step, the address field being addr >> 4; Q's
  // base made opaque here, else its 36 loop-invariant descriptors are hoisted and spilled)
  auto issue_s = [&](int it) {
    u64 dq = desc_kmajor(sQ);
    asm volatile("" : "+l"(dq));
    const u64 dk = desc_kmajor(ring.k(stage_of(it)));
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const u32 off = (u32)(ks >> 2) * QTile::PANEL + (u32)(ks & 3) * 32;  // QTile::PANEL == KVTile::PANEL
      Wgmma<T, 64>::ss(s, dq + (off >> 4), dk + (off >> 4), ks > 0);
    }
    wgmma_commit();
  };
  auto mask = [&](int it) {
    const KeyTile kt = range.tile(it);
    if (pb.tile_needs_mask(kt.k0)) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!pb.visible(row0 + g + (e >> 1) * 8, kt.k0 + nt * 8 + 2 * t + (e & 1))) s[nt][e] = neg_inf();
    }
  };
  // tile it's P: its stage's last panel (shared-memory and generic addresses)
  auto p_smem = [&](int it) { return ring.k(stage_of(it)) + (u32)(QP - 1) * KVTile::PANEL; };
  auto p_ptr = [&](int it) { return smem + (p_smem(it) - sQ); };
  // this warpgroup's half of V in tile it's stage
  auto v_half = [&](int it) { return ring.k(stage_of(it)) + (u32)(wg * Cfg::DVH / 64) * KVTile::PANEL; };
  // O += P V with P from registers (this warpgroup's tile); the caller fences and commits
  auto pv_own = [&](int it, const u32 (&pf)[4][4]) {
    const u32 vb = v_half(it);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, Cfg::DVH>::rs_nmajor(o, pf[kk], desc_nmajor(vb + KVTile::kstep(kk), KVTile::PANEL), 1);
  };
  // O += P V with P from shared memory at sp (the other warpgroup's tile)
  auto pv_other = [&](int it, u32 sp) {
    const u32 vb = v_half(it);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, Cfg::DVH>::ss_nmajor(o, desc_kmajor(sp + kk * 32), desc_nmajor(vb + KVTile::kstep(kk), KVTile::PANEL),
                                    1);
  };
  auto pv_fence = [&]() {
    fence_regs(o);
    wgmma_fence();
  };
  // this warpgroup's running max and a factor (sF0 or sF1) for the other warpgroup, a row each
  auto publish = [&](float* sF, const float (&f)[2]) {
    if (t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sM[row0 + g + 8 * h] = m[h];
        sF[row0 + g + 8 * h] = f[h];
      }
    }
  };
  // P (times f, row by row) as 16-bit values into a PTile
  auto store_p = [&](char* dst, const float (&f)[2]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<u32*>(dst + PTile::offset(row0 + g + 8 * h, nt) + 4 * t) =
            pack2<T>(s[nt][2 * h] * f[h], s[nt][2 * h + 1] * f[h]);
    fence_proxy_async();
  };

  // each warpgroup's first tile
  if (wg < n_tiles) {
    ring.acquire_k(stage_of(wg), phase_of(wg));
    issue_s(wg);
    wgmma_wait<0>();
    fence_regs(s);
  }
  for (int a = 0; a < n_tiles; a += 2) {
    const int b = a + 1;
    const bool has_b = b < n_tiles;
    const int next = a + 2 + wg;  // this warpgroup's next tile
    if (wg == 0) {
      float mx[2], f0[2], f1[2];
      mask(a);
      Softmax::tile_max(m, s, mx);
      Softmax::exp_tile(m, l, s, mx, f0, scale_log2);  // m = M(a); l: its sums from M(a)
      scale_rows(o, f0);
      publish(sF0, f0);
      named_bar_arrive(SEESAW_S0, THREADS);
      u32 pf[4][4];
      pack_p_frags<T>(s, pf);  // before the wgmma fence that orders them
      fence_regs(pf);
      pv_fence();
      pv_own(a, pf);
      wgmma_commit();
      named_bar_sync(SEESAW_S1, THREADS);  // M(b) and its factor (1 without a tile b)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f1[h] = sF1[row0 + g + 8 * h];
        m[h] = sM[row0 + g + 8 * h];
      }
      store_p(p_ptr(a), f1);  // P(a) relative to M(b), for warpgroup 1
      named_bar_arrive(SEESAW_P0, THREADS);
      wgmma_wait<0>();  // P(a) V(a) has landed: O_L moves on to M(b)
      fence_regs(o);
      scale_rows(o, f1);
      l[0] *= f1[0];
      l[1] *= f1[1];
      if (has_b) {
        named_bar_sync(SEESAW_P1, THREADS);
        pv_fence();
        pv_other(b, p_smem(b));
        wgmma_commit();
      }
      ring.release_v(stage_of(a));  // this warpgroup's reads of tile a are done
      if (next < n_tiles) {
        ring.acquire_k(stage_of(next), phase_of(next));
        issue_s(next);  // behind P(b) V(b)_L
      }
      // one unconditional wait (a wait under a branch leaves ptxas a path with wgmma in flight)
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(s);
      if (has_b) ring.release_v(stage_of(b));
    } else {
      float f[2], f1[2] = {1.f, 1.f};
      named_bar_sync(SEESAW_S0, THREADS);  // M(a) and its factor
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f[h] = sF0[row0 + g + 8 * h];
        m[h] = sM[row0 + g + 8 * h];
        l[h] *= f[h];
      }
      if (has_b) {
        float mx[2];
        mask(b);
        Softmax::tile_max(m, s, mx);
        Softmax::exp_tile(m, l, s, mx, f1, scale_log2);  // m = M(b)
      }
      __syncwarp();  // the quad's reads of sM above before its lane 0 writes it
      publish(sF1, f1);
      named_bar_arrive(SEESAW_S1, THREADS);
      f[0] *= f1[0];
      f[1] *= f1[1];
      scale_rows(o, f);  // O_R from the max before a to M(b)
      if (has_b) {
        const float one[2] = {1.f, 1.f};
        store_p(p_ptr(b), one);
        named_bar_arrive(SEESAW_P1, THREADS);
      }
      if (has_b) {
        u32 pf[4][4];
        pack_p_frags<T>(s, pf);  // before the wgmma fence that orders them
        fence_regs(pf);
        pv_fence();
        pv_own(b, pf);
        wgmma_commit();
        named_bar_sync(SEESAW_P0, THREADS);  // P(a), written and fenced by warpgroup 0
        pv_other(a, p_smem(a));              // the same accumulators, after the group above
        wgmma_commit();
      } else {
        named_bar_sync(SEESAW_P0, THREADS);
        pv_fence();
        pv_other(a, p_smem(a));
        wgmma_commit();
      }
      wgmma_wait<0>();
      fence_regs(o);
      ring.release_v(stage_of(a));
      if (has_b) ring.release_v(stage_of(b));
      if (next < n_tiles) {
        ring.acquire_k(stage_of(next), phase_of(next));
        issue_s(next);
        wgmma_wait<0>();
        fence_regs(s);
      }
    }
  }

  // ---- epilogue: the two warpgroups' sums, O / l, each warpgroup its half ----------------
  Softmax::sum_quad(l);
  if (t == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) sL[wg * 64 + row0 + g + 8 * h] = l[h];
  }
  named_bar_sync(1, THREADS);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = row0 + g + 8 * h;
    const float sum = sL[r] + sL[64 + r];
    if constexpr (Problem::WANTS_LSE) {
      if (wg == 0 && t == 0 && r < pb.q_rows) pb.store_lse(r, OnlineSoftmax::lse(m[h], sum, scale_log2));
    }
    const float inv = OnlineSoftmax::inverse(sum, out_scale);
    if (r < pb.q_rows) {
#pragma unroll
      for (int n = 0; n < DT; ++n)
        pb.store2(r, wg * Cfg::DVH + n * 8 + 2 * t, o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
  }
}

}  // namespace pt
