// The seesaw MLA tile (sm_90a; Tuning.mla_seesaw): 64 query rows (heads x query tokens) over
// 64-key tiles of 576-wide latent rows, V the first 512 columns of each row. Two warpgroups
// take the key tiles in turn for S (warpgroup 0 the even tiles, 1 the odd ones: m64n64 over
// all 576 columns, so its shared-memory operands stream at the rate the tensor pipe takes
// them) and each owns half of O (256 columns, m64n256 for P V). For a pair of tiles (a, b):
//
//   warpgroup 0                               warpgroup 1
//   softmax of S(a), the running max M(a)     .
//   -- M(a), its rescale factor (bar S0) -->   softmax of S(b) from M(a): M(b)
//   O_L += P(a) V(a)_L   (P from registers)   <-- M(b), its factor (bar S1) --
//   P(a) * factor(b) to shared memory (P0)     P(b) to shared memory (P1), O_R += P(b) V(b)_R
//   O_L *= factor(b); O_L += P(b) V(b)_L       O_R += P(a) V(a)_R   (P from shared memory)
//   S(a + 2) behind that product               S(b + 2) once its products landed
//
// so each warpgroup's softmax runs under the other's products. The running maximum is one
// chain through both warpgroups (M(b) >= M(a) >= M(b - 2)), shared through shared memory with
// the factor that rescales what was summed before; each warpgroup keeps its O half and its
// own tiles' row sums relative to the last maximum it has seen, and the epilogue adds the two
// sums. Each P goes to shared memory in its own tile's last 64-column panel (the rope
// columns: K's part there is read by S alone, which is done; V is the first DV columns).
//
// Shared memory holds Q and two 72 KB stages (a tile each) and nothing else, so the copies
// run panel by panel: the latent pool is one TMA map (pages of 64-column boxes, a box per
// page and panel) and every panel of a stage has a full barrier of its own. Each warpgroup
// refills the panels it was the last to read as soon as its product over them has landed:
// its V half of the tile it multiplied with P from registers (its own tile), its V half and
// the rope panel (that tile's P) of the other's tile. The next S then starts on the panels
// that came back first (the warpgroup's own half) while the rest still streams in. No
// producer warpgroup: one lane a box of the warpgroup's first warp issues the copies, each
// box's page ID loaded a pair ahead. Keys past the request's end are never copied from a
// page the request does not list; the rows after the last key in the first (partial) tile
// are zeroed before any P V reads them (a page's slots past the length hold anything, P is
// 0 there and 0 x NaN is not). The problem policies are the decode problem's (pt_decode.cuh).
#pragma once
#include "pt_fmha.cuh"

namespace pt {

template <class T_, int D_, int DV_>
struct SeesawConfig {
  using T = T_;
  static constexpr bool SWAP = false;
  static constexpr bool SEESAW = true;
  static constexpr int ARCH = 90;
  static constexpr int D = D_, DV = DV_, BM = 64, BN = 64, STAGES = 2;
  static constexpr int THREADS = 256;  // the two warpgroups, which also issue the copies
  static constexpr int WARPS = 8;
  static constexpr int LAUNCH_THREADS = THREADS;
  using QTile = SmemTileW<BM, D>;
  using KVTile = SmemTileW<BN, D>;
  using PTile = SmemTileW<BM, BN>;  // P: [query row][key] in a tile's last panel, A of the other's P V
  static constexpr int QP = D / 64;    // 64-column panels of a row: V's two halves, then the rope panel
  static constexpr int VH = DV / 128;  // V panels a warpgroup
  static constexpr int DVH = DV / 2;   // O columns a warpgroup
  static constexpr int SMEM_Q = QTile::BYTES;
  static constexpr int SMEM_RING = STAGES * KVTile::BYTES;
  static constexpr int SMEM_ROWS = 5 * BM * 4;  // a row's M, the two factors, the two sums
  static constexpr int SMEM_BARS = STAGES * QP * 8;  // a full barrier a stage and panel
  static constexpr int SMEM_BYTES = SMEM_Q + SMEM_RING + SMEM_ROWS + SMEM_BARS;
  static_assert(D % 64 == 0 && DV % 128 == 0 && 2 * VH + 1 == QP, "V's two halves, then one rope panel");
  static_assert(PTile::BYTES == KVTile::PANEL && QTile::PANEL == KVTile::PANEL, "P fills a tile's panel; Q's panels as K's");
  static_assert(DVH == 256, "m64n256 halves of O");
};

// Named barriers (256 threads: one warpgroup arrives, the other waits); 1 and 2 are the CTA's
// (Q's copy and the epilogue, the split merge), 3 warpgroup 0's (the first tile's zeroed rows).
enum SeesawBar { SEESAW_S0 = 7, SEESAW_S1 = 8, SEESAW_P0 = 9, SEESAW_P1 = 10 };

// The boxes of one key tile from the latent pool, as one lane of the issuing warp sees them:
// rows a box (a page, or BN rows of a longer one), boxes with a key below the request's end
// (the others are never copied), and this lane's box (lane < live): its page and slot.
struct SeesawBoxes {
  int rows, live, page, slot;
};

template <class Cfg, class Problem>
__device__ __forceinline__ void fmha_tile_seesaw(const Problem& pb, char* smem, float scale_log2, float out_scale,
                                                 const TmaMap* tmk) {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KVTile = typename Cfg::KVTile;
  using PTile = typename Cfg::PTile;
  using Softmax = RowSoftmax<8>;
  static_assert(!Problem::SHORT_TILES, "whole 64-key tiles (the decode problem's)");
  constexpr int BN = Cfg::BN, THREADS = Cfg::THREADS, QP = Cfg::QP, VH = Cfg::VH;
  constexpr int DT = Cfg::DVH / 8;  // O n-tiles a thread

  const u32 sQ = smem_addr(smem);
  const u32 sKV = sQ + Cfg::SMEM_Q;
  float* rows = reinterpret_cast<float*>(smem + Cfg::SMEM_Q + Cfg::SMEM_RING);
  float* sM = rows;            // [BM] the running max after the pair's last tile so far
  float* sF0 = rows + 64;      // [BM] the factor of tile a (from M before a to M(a))
  float* sF1 = rows + 128;     // [BM] the factor of tile b (from M(a) to M(b))
  float* sL = rows + 192;      // [2][BM] the warpgroups' row sums
  const u32 bars = sKV + Cfg::SMEM_RING + Cfg::SMEM_ROWS;
  const auto range = pb.range();
  const int n_tiles = range.n_tiles();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // 0: even tiles and O's left half; 1: odd tiles, right half. Broadcast from lane 0 so that
  // ptxas sees a warp-uniform value: the wgmma paths below branch on it (else C7520, every
  // wgmma serialised)
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const bool issuer = (warp & 3) == 0;  // the warpgroup's first warp issues its copies
  const int row0 = (warp & 3) * 16;     // this warp's rows (the same in both warpgroups)
  const int g = lane >> 2, t = lane & 3;

  auto stage = [&](int it) { return sKV + (u32)(it & 1) * KVTile::BYTES; };
  auto full = [&](int it, int panel) { return bars + 8u * (u32)((it & 1) * QP + panel); };
  auto parity = [](int it) { return (u32)((it >> 1) & 1); };
  // tile it's boxes for this lane (its page ID load in flight until the boxes are issued)
  auto boxes = [&](int it) {
    SeesawBoxes bx{0, 0, 0, 0};
    if (it < n_tiles) {
      const KeyTile kt = range.tile(it);
      const int shift = pb.p->page_shift;
      bx.rows = min_(1 << shift, BN);
      bx.live = (kt.rows + bx.rows - 1) / bx.rows;
      if (lane < bx.live) {
        const int j = kt.k0 + lane * bx.rows;
        bx.page = pb.kv_page(j);
        bx.slot = j & ((1 << shift) - 1);
      }
    }
    return bx;
  };
  // panels P0 .. P1 - 1 (and the rope panel under ROPE) of tile it into its stage: lane 0
  // arrives on each panel's barrier expecting its bytes, each lane below `live` issues its box
  // of each panel (the issuing warp, whole; nothing when it is past the last tile)
  auto fill = [&](int it, const SeesawBoxes& bx, int p0, int p1, bool rope) {
    if (it >= n_tiles) return;
    const u32 bytes = (u32)(bx.live * bx.rows * 128);
    const u32 dst = stage(it) + (u32)(lane * bx.rows * 128);
    auto panel = [&](int c) {
      if (lane == 0) mbar_arrive_expect_tx(full(it, c), bytes);
      if (lane < bx.live) tma_load_4d(dst + (u32)c * KVTile::PANEL, tmk, c * 64, bx.slot, 0, bx.page, full(it, c));
    };
    for (int c = p0; c < p1; ++c) panel(c);
    if (rope) panel(QP - 1);
  };
  auto acquire = [&](int it, int p0, int p1) {
    for (int c = p0; c < p1; ++c) mbar_wait(full(it, c), parity(it));
  };

  if (threadIdx.x == 0) {
#pragma unroll 1
    for (int i = 0; i < 2 * QP; ++i) mbar_init(bars + 8u * i, 1);
    fence_mbar_init();
  }
  __syncthreads();
  // each warpgroup's first tile, every panel, under Q's copy
  if (issuer) fill(wg, boxes(wg), 0, QP, false);
  load_q_for_mma<QTile, THREADS>(sQ, pb);

  float s[8][4];     // S, then P, of this warpgroup's current tile
  float o[DT][4];    // this warpgroup's half of O
#pragma unroll
  for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m[2] = {neg_inf(), neg_inf()};  // the running max this warpgroup's O and sums are relative to
  float l[2] = {0.f, 0.f};              // this thread's share of its own tiles' row sums

  // S k-steps of panels c0 .. c1 - 1 (four a panel); the descriptors: a base each and one add
  // a k-step, the address field being addr >> 4. Q's base made opaque, else its loop-invariant
  // descriptors are hoisted and spilled.
  auto s_steps = [&](int it, int c0, int c1, bool first) {
    u64 dq = desc_kmajor(sQ);
    asm volatile("" : "+l"(dq));
    const u64 dk = desc_kmajor(stage(it));
#pragma unroll
    for (int c = c0; c < c1; ++c) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const u32 off = (u32)c * KVTile::PANEL + (u32)k * 32;  // QTile::PANEL == KVTile::PANEL
        Wgmma<T, 64>::ss(s, dq + (off >> 4), dk + (off >> 4), (first && c == c0 && k == 0) ? 0 : 1);
      }
    }
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
  auto p_smem = [&](int it) { return stage(it) + (u32)(QP - 1) * KVTile::PANEL; };
  auto p_ptr = [&](int it) { return smem + (p_smem(it) - sQ); };
  // this warpgroup's half of V in tile it's stage
  auto v_half = [&](int it) { return stage(it) + (u32)(wg * VH) * KVTile::PANEL; };
  // O += P V with P from registers (this warpgroup's tile); the caller fences and commits
  auto pv_own = [&](int it, const u32 (&pf)[4][4]) {
    const u32 vb = v_half(it);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, Cfg::DVH>::rs_nmajor(o, pf[kk], desc_nmajor(vb + KVTile::kstep(kk), KVTile::PANEL), 1);
  };
  // O += P V with P from shared memory (the other warpgroup's tile)
  auto pv_other = [&](int it) {
    const u32 vb = v_half(it), sp = p_smem(it);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, Cfg::DVH>::ss_nmajor(o, desc_kmajor(sp + kk * 32), desc_nmajor(vb + KVTile::kstep(kk), KVTile::PANEL),
                                    1);
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

  // each warpgroup's first S
  if (wg < n_tiles) {
    acquire(wg, 0, QP);
    fence_regs(s);
    wgmma_fence();
    s_steps(wg, 0, QP, true);
    wgmma_commit();
  }
  wgmma_wait<0>();
  fence_regs(s);
  // the first tile (the range's last keys) cut by the request's end: its rows past the last key
  // zeroed in V's panels by warpgroup 0, whose S has read them, before its P V (warpgroup 1
  // reads them after barrier P0)
  if (wg == 0 && n_tiles > 0 && range.tile(0).rows < BN) {
    const int live = range.tile(0).rows;
    for (int i = threadIdx.x; i < (BN - live) * 8 * 2 * VH; i += THREADS / 2) {
      const int c = i / ((BN - live) * 8), r = live + (i / 8) % (BN - live), q = i % 8;
      *reinterpret_cast<uint4*>(smem + (stage(0) - sQ) + c * KVTile::PANEL + r * 128 + q * 16) = make_uint4(0, 0, 0, 0);
    }
    fence_proxy_async();
    named_bar_sync(3, THREADS / 2);
  }

  for (int a = 0; a < n_tiles; a += 2) {
    const int b = a + 1, a2 = a + 2, b2 = a + 3;
    const bool has_b = b < n_tiles, more_a = a2 < n_tiles, more_b = b2 < n_tiles;
    // the boxes of the tiles that refill this pair's stages: their page IDs in flight now
    SeesawBoxes bx_a2{0, 0, 0, 0}, bx_b2{0, 0, 0, 0};
    if (issuer) {
      bx_a2 = boxes(a2);
      bx_b2 = boxes(b2);
    }
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
      fence_regs(o);
      wgmma_fence();
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
      wgmma_wait<0>();  // P(a) V(a)_L has landed: O_L moves on to M(b), V(a)_L refills
      fence_regs(o);
      if (issuer) fill(a2, bx_a2, 0, VH, false);
      scale_rows(o, f1);
      l[0] *= f1[0];
      l[1] *= f1[1];
      if (has_b) named_bar_sync(SEESAW_P1, THREADS);
      wgmma_fence();
      if (has_b) pv_other(b);
      wgmma_commit();
      // S(a + 2) over V(a + 2)_L, which came back first, behind P(b) V(b)_L
      if (more_a) {
        acquire(a2, 0, VH);
        s_steps(a2, 0, VH, true);
      }
      wgmma_commit();
      wgmma_wait<1>();  // P(b) V(b)_L has landed: V(b)_L and P(b)'s panel refill
      fence_regs(o);
      if (issuer && has_b) fill(b2, bx_b2, 0, VH, true);
      if (more_a) {
        acquire(a2, VH, QP);
        s_steps(a2, VH, QP, false);
      }
      wgmma_commit();
      // one unconditional wait (a wait under a branch leaves ptxas a path with wgmma in flight)
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(s);
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
      u32 pf[4][4];
      pack_p_frags<T>(s, pf);  // before the wgmma fence that orders them
      fence_regs(pf);
      fence_regs(o);
      wgmma_fence();
      if (has_b) pv_own(b, pf);
      wgmma_commit();
      named_bar_sync(SEESAW_P0, THREADS);  // P(a), written and fenced by warpgroup 0
      pv_other(a);                         // the same accumulators, after the group above
      wgmma_commit();
      wgmma_wait<1>();  // P(b) V(b)_R has landed: V(b)_R refills
      fence_regs(o);
      if (issuer && has_b) fill(b2, bx_b2, VH, 2 * VH, false);
      wgmma_wait<0>();  // P(a) V(a)_R has landed: V(a)_R and P(a)'s panel refill
      fence_regs(o);
      if (issuer) fill(a2, bx_a2, VH, 2 * VH, true);
      // S(b + 2) over V(b + 2)_R, which came back first, then the panels warpgroup 0 refills
      if (more_b) {
        fence_regs(s);
        wgmma_fence();
        acquire(b2, VH, 2 * VH);
        s_steps(b2, VH, 2 * VH, true);
        acquire(b2, 0, VH);
        acquire(b2, QP - 1, QP);
        s_steps(b2, 0, VH, false);
        s_steps(b2, QP - 1, QP, false);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(s);
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
