// The twin MLA tile (sm_90a, MLA rows of 64): 64 query rows (heads x query tokens) over
// 64-key tiles of 576-wide latent rows, V the first 512 columns of each row. Two warpgroups
// run the same code on alternate key tiles: warpgroup w computes S of tiles w, w + 2, ...
// (m64n64 over all 576 columns, so its shared-memory operands stream at the rate the tensor
// pipe takes them) and owns half w of O (256 columns, m64n256 for P V).
// For a pair of tiles, each warpgroup with its own tile `own` and the other's `oth`:
//
//   P(own) = exp2(S(own) * scale_log2 - ref), to shared memory for the other warpgroup
//   O_w += P(own) V(own)_w            (P from registers)
//   O_w += P(oth) V(oth)_w            (P from shared memory, once the other has stored it)
//   S(own + 2), its panels as they come back
//
// The exponents subtract a reference fixed for the whole pass, not a running maximum: the two
// warpgroups never wait on each other's maxima and O is never rescaled. The reference is each
// row's maximum over the first two tiles; every tile's row maxima are kept, and at the end a
// row whose maximum lies more than SLACK above it (P would have exceeded 2^SLACK: risky for O
// and the 16-bit P) sends the CTA through the tiles once more with the exact maxima as the
// reference. The sums and both halves of O are relative to the same reference, so O / sum is
// the softmax however far the maximum lies below it; the log-sum-exp is ref + log2(sum).
//
// Each P goes to shared memory in its own tile's last 64-column panel (the rope columns: K's
// part there is read by S alone, which is done; V is the first DV columns). Shared memory
// holds Q and two 72 KB stages (a tile each), so the copies run panel by panel: the latent
// pool is one TMA map (pages of 64-column boxes, a box per page and panel) and every panel
// of a stage has a full barrier of its own. Each warpgroup refills the panels it was the last
// to read once both its P V products have landed: its V half of its own tile, and its V half
// and the rope panel (that tile's P) of the other's tile, so that both copies are in flight
// together. S then starts on the half that went out first and waits for each panel's copy
// just before that panel's k-steps, a wgmma group a panel, so that the first panels' products
// run under the later panels' copies. No producer warpgroup: one lane a box of the
// warpgroup's first warp issues the copies, each box's page ID loaded a pair ahead. Keys past
// the request's end are never copied from a page the request does not list; the rows after
// the last key in the first (partial) tile are zeroed before any P V reads them (a page's
// slots past the length hold anything, P is 0 there and 0 x NaN is not). The problem policies
// are the decode problem's (pt_decode.cuh); one split's 16-bit output rows leave through
// shared memory, and the fp32 partials of 2-8 splits launched as a cluster are written over
// the stages (the last bytes of the dynamic shared memory) for fmha_decode.cu's merge_cluster.
#pragma once
#include "pt_decode.cuh"

#ifdef PT_TWIN_TRACE
// PT_TWIN_TRACE (Tuning.twin_trace, a measurement aid; results unchanged): the grid's first and
// last TWIN_TRACE_CTAS / 2 CTAs (in linear block order) record clock64 at each step of their
// first TWIN_TRACE_PAIRS pairs of the first pass, a warpgroup's first thread each, as
// [slot][warpgroup][pair][event] (TwinEvent), and the item's own steps in row TWIN_TRACE_PAIRS
// (TwinItemEvent). benchmarks/twin_trace.py reads it from the module.
#define TWIN_TRACE_CTAS 16
#define TWIN_TRACE_PAIRS 64
#define TWIN_TRACE_EVENTS 8
extern "C" {
__device__ long long pt_twin_trace[TWIN_TRACE_CTAS][2][TWIN_TRACE_PAIRS + 1][TWIN_TRACE_EVENTS];
}
#endif

namespace pt {

// How far (log2) a row's maximum may lie above the reference before the rerun: P <= 2^SLACK.
// bf16 P keeps fp32's exponent range (O's sums stay finite for |V| < 2^78 over 2^17 keys);
// f16 P stops at 65504.
template <class T> struct TwinSlack;
template <> struct TwinSlack<bf16> { static constexpr float value = 32.f; };
template <> struct TwinSlack<f16> { static constexpr float value = 12.f; };
// a panel count as a type (the S k-steps' unrolled loop)
template <int N> struct TwinPanels { static constexpr int value = N; };

template <class T_, int D_, int DV_>
struct TwinConfig {
  using T = T_;
  static constexpr bool SWAP = false;
  static constexpr bool TWIN = true;
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
  static constexpr int SMEM_ROWS = 6 * BM * 4;  // [2][BM] first-tile maxima, [2][BM] maxima, [2][BM] sums
  static constexpr int SMEM_BARS = STAGES * QP * 8;  // a full barrier a stage and panel
  static constexpr int SMEM_BYTES = SMEM_Q + SMEM_RING + SMEM_ROWS + SMEM_BARS;
  static constexpr float SLACK = TwinSlack<T>::value;
  static_assert(D % 64 == 0 && DV % 128 == 0 && 2 * VH + 1 == QP, "V's two halves, then one rope panel");
  static_assert(PTile::BYTES == KVTile::PANEL && QTile::PANEL == KVTile::PANEL, "P fills a tile's panel; Q's panels as K's");
  static_assert(DVH == 256, "m64n256 halves of O");
};

// Named barriers. 1 is the CTA's (Q's copy, the maxima exchanges, the epilogue; 2 the split
// merge's). P(own) of pair i is published on TWIN_P + 2 (i & 1) + w (256 threads: one
// warpgroup arrives, the other waits), so that a warpgroup's next arrival on one barrier waits
// for the other's wait on it. TWIN_WG + w is warpgroup w's own (128 threads): warpgroup 0's
// zeroed rows of the first tile, and in each warpgroup the place of a wait the other makes and
// it does not (the zeroing's; the P wait of an odd tile count's last pair). Both warpgroups so
// pass the same number of barrier waits, which compute-sanitizer's racecheck takes as the
// CTA's barrier order: with a wait fewer in one warpgroup it reported the next exchange
// through barrier 1 as a race.
enum TwinBar : int { TWIN_P = 4, TWIN_WG = 8 };

// The boxes of one key tile from the latent pool, as one lane of the issuing warp sees them:
// rows a box (a page, or BN rows of a longer one), boxes with a key below the request's end
// (the others are never copied), and this lane's box (lane < live): its page and slot.
struct TwinBoxes {
  int rows, live, page, slot;
};

// The epilogue's 16-bit rows (one split): each warp's O half into an [BM][DV] tile at `base`
// (stage_o_rows: warpgroup w's columns from chunk w * DVH / 8), then, after both warpgroups'
// halves (the CTA's barrier 1), each row's DV * 2 bytes as 16-byte chunks, a warp a row's
// consecutive chunks.
template <class Cfg, class OutT, class Problem>
__device__ __forceinline__ void twin_store_rows(const Problem& pb, u32 base, const float (&o)[Cfg::DVH / 8][4],
                                                const float (&inv)[2], int w, int row0) {
  using OTile = SmemTileW<Cfg::BM, Cfg::DV>;
  constexpr int DT = Cfg::DVH / 8, CHUNKS = Cfg::DV / 8;
  stage_o_rows<OTile, OutT, DT>(base, o, inv, row0, w * DT);
  named_bar_sync(1, Cfg::THREADS);
  const DecodeParams& p = *pb.p;
  for (int i = threadIdx.x; i < pb.q_rows * CHUNKS; i += Cfg::THREADS) {
    const int r = i / CHUNKS, c = i % CHUNKS;
    const uint4 v = ld_shared_u4(base + OTile::offset(r, c));
    *reinterpret_cast<uint4*>(decode_out_row(p, pb.b, pb.hk, pb.q_start, pb.row0 + r) + c * 16) = v;
  }
}

// A pair's steps as PT_TWIN_TRACE records them: its start, P(own) published, P(oth) received, the
// first and the second P V landed, S(own + 2) issued (every panel waited for), S landed
enum TwinEvent : int { TE_START, TE_P_OWN, TE_P_OTH, TE_PV1, TE_PV2, TE_S_ISSUED, TE_S_DONE };
// the item's: its start (barriers set up), S of the first tile landed, the reference taken, the
// first pass's last pair done, the epilogue done; then the SM, the tile count, %globaltimer at
// the start (ns)
enum TwinItemEvent : int { TI_START, TI_FIRST_S, TI_REF, TI_PASS, TI_END, TI_SMID, TI_TILES, TI_GLOBAL_NS };

// The recorder of PT_TWIN_TRACE (nothing without it)
struct TwinTrace {
#ifdef PT_TWIN_TRACE
  long long* rows = nullptr;  // this warpgroup's rows, or null: not traced, or not its first thread
  int pair = 0;
  __device__ __forceinline__ void start(int w, int n_tiles) {
    const int lin = (int)(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
    const int n = (int)(gridDim.x * gridDim.y * gridDim.z), half = TWIN_TRACE_CTAS / 2;
    const int slot = n <= TWIN_TRACE_CTAS ? lin : lin < half ? lin : lin >= n - half ? half + lin - (n - half) : -1;
    if ((threadIdx.x & 127) == 0 && slot >= 0) {
      rows = &pt_twin_trace[slot][w][0][0];
      u32 smid;
      u64 ns;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
      item(TI_SMID, smid);
      item(TI_TILES, n_tiles);
      item(TI_GLOBAL_NS, (long long)ns);
      item(TI_END, 0);  // an earlier item's (balanced split-KV), should this one rerun
      item(TI_START, clock64());
    }
  }
  __device__ __forceinline__ void stop() { rows = nullptr; }
  __device__ __forceinline__ void at(int e) const {
    if (rows && pair < TWIN_TRACE_PAIRS) rows[pair * TWIN_TRACE_EVENTS + e] = clock64();
  }
  __device__ __forceinline__ void item(int e, long long v) const {
    if (rows) rows[TWIN_TRACE_PAIRS * TWIN_TRACE_EVENTS + e] = v;
  }
  __device__ __forceinline__ void item_now(int e) const { item(e, clock64()); }
#else
  __device__ __forceinline__ void start(int, int) {}
  __device__ __forceinline__ void stop() {}
  __device__ __forceinline__ void at(int) const {}
  __device__ __forceinline__ void item_now(int) const {}
#endif
};

// The twin tile of one work item: the state both warpgroups keep (the ring's addresses, this
// thread's role and rows, its registers) and the steps of a pass, each one idea. fmha_tile_twin
// runs it.
template <class Cfg, class Problem>
struct TwinTile {
  using T = typename Cfg::T;
  using QTile = typename Cfg::QTile;
  using KVTile = typename Cfg::KVTile;
  using Softmax = RefSoftmax<8>;
  using Range = decltype(((const Problem*)nullptr)->range());
  using Half = TwinPanels<Cfg::VH>;
  using One = TwinPanels<1>;
  static_assert(!Problem::SHORT_TILES, "whole 64-key tiles (the decode problem's)");
  static constexpr int BN = Cfg::BN, THREADS = Cfg::THREADS, QP = Cfg::QP, VH = Cfg::VH;
  static constexpr int DT = Cfg::DVH / 8;  // O n-tiles a thread

  const Problem& pb;
  char* const smem;
  const TmaMap* const tmk;
  const float scale_log2;
  const u32 sQ, sKV;
  float* const sF;  // [2][BM] each warpgroup's row maxima over its first tile (raw scores)
  float* const sX;  // [2][BM] each warpgroup's row maxima over its tiles
  float* const sL;  // [2][BM] each warpgroup's row sums
  const u32 bars;
  const Range range;
  const int n_tiles;
  const int lane;
  // w: own tiles w, w + 2, ... and O's half w. Broadcast from lane 0 so that ptxas sees a
  // warp-uniform value (the wgmma paths branch on values derived from it; else C7520)
  const int w;
  const bool issuer;  // the warpgroup's first warp issues its copies
  const int row0;     // this warp's rows (the same in both warpgroups)
  const int g, t;
  int pass = 0;  // 1: the rerun with the exact maxima as the reference
  TwinTrace trace;

  // What a thread keeps in registers through the item, held by the caller (fmha_tile_twin): as
  // the tile's own members, NVVM laid out the set-up differently and the pair loop came out 1%
  // longer.
  float (&s)[8][4];   // S, then P, of this warpgroup's current tile
  float (&o)[DT][4];  // this warpgroup's half of O
  float (&ref)[2];    // the pass's reference of rows g and g + 8 (scaled: log2 units)
  float (&mt)[2];     // the rows' maxima over this warpgroup's tiles (raw scores, this thread's keys)
  float (&l)[2];      // this thread's share of the rows' sums over this warpgroup's tiles

  __device__ __forceinline__ TwinTile(const Problem& pb_, char* smem_, float scale_log2_, const TmaMap* tmk_,
                                      float (&s_)[8][4], float (&o_)[DT][4], float (&ref_)[2], float (&mt_)[2],
                                      float (&l_)[2])
      : pb(pb_), smem(smem_), tmk(tmk_), scale_log2(scale_log2_), sQ(smem_addr(smem_)), sKV(sQ + Cfg::SMEM_Q),
        sF(reinterpret_cast<float*>(smem_ + Cfg::SMEM_Q + Cfg::SMEM_RING)), sX(sF + 128), sL(sF + 256),
        bars(sKV + Cfg::SMEM_RING + Cfg::SMEM_ROWS), range(pb_.range()), n_tiles(range.n_tiles()),
        lane(threadIdx.x & 31), w(__shfl_sync(0xffffffffu, (threadIdx.x >> 5) >> 2, 0)),
        issuer(((threadIdx.x >> 5) & 3) == 0), row0(((threadIdx.x >> 5) & 3) * 16), g(lane >> 2), t(lane & 3),
        s(s_), o(o_), ref(ref_), mt(mt_), l(l_) {}

  // ---- the ring: two stages of a tile, a full barrier a stage and panel -------------------

  // a tile's stage, opaque to the compiler: a warpgroup's own tiles all lie in stage w, so their
  // descriptors would be loop-invariant, hoisted out of the pair loop and spilled
  __device__ __forceinline__ u32 stage(int it) const {
    u32 a = sKV + (u32)(it & 1) * KVTile::BYTES;
    asm volatile("" : "+r"(a));
    return a;
  }
  __device__ __forceinline__ u32 full(int it, int panel) const { return bars + 8u * (u32)((it & 1) * QP + panel); }
  // a stage's barriers complete once a tile; the rerun carries on from the phases of the first
  // pass (stage 0 held ceil(n / 2) tiles, stage 1 floor(n / 2))
  __device__ __forceinline__ u32 parity(int it) const {
    const int before = pass ? (n_tiles + 1 - (it & 1)) >> 1 : 0;
    return (u32)(((it >> 1) + before) & 1);
  }
  // tile it's boxes for this lane (its page ID load in flight until the boxes are issued)
  __device__ __forceinline__ TwinBoxes boxes(int it) const {
    TwinBoxes bx{0, 0, 0, 0};
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
  }
  // panels c0 .. c0 + n - 1 (and the rope panel under ROPE) of tile it into its stage: lane 0
  // arrives on each panel's barrier expecting its bytes, each lane below `live` issues its box
  // of each panel (the issuing warp, whole; nothing when it is past the last tile)
  __device__ __forceinline__ void fill(int it, const TwinBoxes& bx, int c0, int n, bool rope) const {
    if (it >= n_tiles) return;
    const u32 bytes = (u32)(bx.live * bx.rows * 128);
    const u32 dst = stage(it) + (u32)(lane * bx.rows * 128);
    const u64 pol = l2_evict_first();  // MLA B16 H128 x1.05 on an H100 (benchmarks/NOTES.md)
    auto panel = [&](int c) {
      if (lane == 0) mbar_arrive_expect_tx(full(it, c), bytes);
      if (lane < bx.live)
        tma_load_4d(dst + (u32)c * KVTile::PANEL, tmk, c * 64, bx.slot, 0, bx.page, full(it, c), pol);
    };
#pragma unroll 1
    for (int c = c0; c < c0 + n; ++c) panel(c);
    if (rope) panel(QP - 1);
  }
  __device__ __forceinline__ void acquire(int it, int c0, int n) const {
#pragma unroll 1
    for (int c = c0; c < c0 + n; ++c) mbar_wait(full(it, c), parity(it));
  }
  __device__ __forceinline__ void init_barriers() const {
    if (threadIdx.x == 0) {
#pragma unroll 1
      for (int i = 0; i < 2 * QP; ++i) mbar_init(bars + 8u * i, 1);
      fence_mbar_init();
    }
    __syncthreads();
  }
  // every tile's copies landed and were waited for: the barriers retired (their memory the
  // split merge's, or the next item's barriers under balanced split-KV)
  __device__ __forceinline__ void retire_barriers() const {
    if (threadIdx.x == 0) {
#pragma unroll 1
      for (int i = 0; i < 2 * QP; ++i) mbar_inval(bars + 8u * i);
    }
  }

  // ---- the products and the softmax --------------------------------------------------------

  // S k-steps of `np` panels from panel c0 (four a panel); the descriptors: a base each and one
  // add a k-step, the address field being addr >> 4. Q's base made opaque, else its
  // loop-invariant descriptors are hoisted and spilled. `wait`: each panel's copy is waited for
  // just before its k-steps, which are then a wgmma group of their own (the caller fences and
  // commits otherwise).
  template <class NP>
  __device__ __forceinline__ void s_steps(int it, int c0, NP, bool first, bool wait = false) {
    u64 dq = desc_kmajor(sQ + (u32)c0 * KVTile::PANEL);
    asm volatile("" : "+l"(dq));
    const u64 dk = desc_kmajor(stage(it) + (u32)c0 * KVTile::PANEL);
#pragma unroll
    for (int c = 0; c < NP::value; ++c) {
      if (wait) {  // the panel's copy, then the fence ptxas would otherwise inject (C7519)
        mbar_wait(full(it, c0 + c), parity(it));
        wgmma_fence();
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const u32 off = (u32)c * KVTile::PANEL + (u32)k * 32;  // QTile::PANEL == KVTile::PANEL
        Wgmma<T, 64>::ss(s, dq + (off >> 4), dk + (off >> 4), (first && c == 0 && k == 0) ? 0 : 1);
      }
      if (wait) wgmma_commit();  // a group a panel: the pair's waits count them
    }
  }
  __device__ __forceinline__ void mask(int it) {
    const KeyTile kt = range.tile(it);
    if (pb.tile_needs_mask(kt.k0)) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!pb.visible(row0 + g + (e >> 1) * 8, kt.k0 + nt * 8 + 2 * t + (e & 1))) s[nt][e] = neg_inf();
    }
  }
  // rows g and g + 8 of [2][BM] from each lane's share: over the quad, lane t == 0 writes
  __device__ __forceinline__ void publish(float* dst, float (&v)[2], bool is_max) const {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        const float y = __shfl_xor_sync(0xffffffffu, v[h], x);
        v[h] = is_max ? fmaxf(v[h], y) : v[h] + y;
      }
      if (t == 0) dst[w * 64 + row0 + g + 8 * h] = v[h];
    }
  }
  // P = exp2(S * scale_log2 - ref) in place, the rows' maxima and sums taking the tile's
  __device__ __forceinline__ void softmax(int it) {
    mask(it);
    Softmax::tile_max(mt, s, mt);
    Softmax::exp_tile(s, ref, scale_log2, l);
  }
  // tile it's P: its stage's last panel (shared-memory and generic addresses)
  __device__ __forceinline__ u32 p_smem(int it) const { return stage(it) + (u32)(QP - 1) * KVTile::PANEL; }
  // this warpgroup's half of V in tile it's stage
  __device__ __forceinline__ u32 v_half(int it) const { return stage(it) + (u32)(w * VH) * KVTile::PANEL; }
  // O += P V with P from registers (this warpgroup's tile); the caller fences and commits
  __device__ __forceinline__ void pv_own(int it, const u32 (&pf)[4][4]) {
    const u32 vb = v_half(it);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, Cfg::DVH>::rs_nmajor(o, pf[kk], desc_nmajor(vb + KVTile::kstep(kk), KVTile::PANEL), 1);
  }
  // O += P V with P from shared memory (the other warpgroup's tile)
  __device__ __forceinline__ void pv_other(int it) {
    const u32 vb = v_half(it), sp = p_smem(it);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      Wgmma<T, Cfg::DVH>::ss_nmajor(o, desc_kmajor(sp + kk * 32), desc_nmajor(vb + KVTile::kstep(kk), KVTile::PANEL),
                                    1);
  }
  // P (packed: pack_p_frags' A fragments, pf[kk][2 j + h] = n-tile 2 kk + j, row g + 8 h) into
  // tile it's P panel, visible to the other warpgroup's wgmma (PTile::offset(r, nt) + 4 t,
  // r = row0 + g + 8 h: r & 7 = g; the row's base opaque, else the 16 loop-invariant offsets
  // are hoisted and kept)
  __device__ __forceinline__ void store_p(int it, const u32 (&pf)[4][4]) const {
    u32 base = p_smem(it) - sQ + (u32)(row0 + g) * 128 + 4 * t;
    asm volatile("" : "+r"(base));
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<u32*>(smem + base + h * 1024 + ((nt ^ g) << 4)) = pf[nt >> 1][2 * (nt & 1) + h];
    fence_proxy_async();
  }

  // ---- a pass -----------------------------------------------------------------------------

  // O, the maxima and the sums cleared; S of this warpgroup's first tile, every panel
  __device__ __forceinline__ void first_tile() {
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    mt[0] = mt[1] = neg_inf();
    l[0] = l[1] = 0.f;
    if (w < n_tiles) {
      acquire(w, 0, QP);
      fence_regs(s);
      wgmma_fence();
      s_steps(w, 0, Half{}, true);
      s_steps(w, VH, Half{}, false);
      s_steps(w, QP - 1, One{}, false);
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_regs(s);
  }
  // the first tile (the range's last keys) cut by the request's end: its rows past the last key
  // zeroed in V's panels by warpgroup 0, whose S has read them, before its P V (warpgroup 1
  // reads them after P(0)'s barrier)
  __device__ __forceinline__ void zero_tail() const {
    if (n_tiles > 0 && range.tile(0).rows < BN) {
      if (w == 0) {
        const int live = range.tile(0).rows;
        for (int i = threadIdx.x; i < (BN - live) * 8 * 2 * VH; i += THREADS / 2) {
          const int c = i / ((BN - live) * 8), r = live + (i / 8) % (BN - live), q = i % 8;
          *reinterpret_cast<uint4*>(smem + (stage(0) - sQ) + c * KVTile::PANEL + r * 128 + q * 16) =
              make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();
      }
      named_bar_sync(TWIN_WG + w, THREADS / 2);
    }
  }
  // the first pass's reference: each row's maximum over the two first tiles
  __device__ __forceinline__ void first_reference() {
    float mx[2] = {neg_inf(), neg_inf()};
    if (w < n_tiles) {
      mask(w);
      Softmax::tile_max(mx, s, mx);
    }
    publish(sF, mx, true);
    named_bar_sync(1, THREADS);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + g + 8 * h;
      ref[h] = Softmax::reference(fmaxf(sF[r], sF[64 + r]), scale_log2);
    }
  }
  // Pair i: this warpgroup's tile own = 2 i + w and the other's oth = 2 i + 1 - w. P(own) to
  // the other, O_w += P(own) V(own)_w and P(oth) V(oth)_w; once both have landed, the V halves
  // and P(oth)'s panel refilled; S(own + 2) panel by panel as its panels come back (half w first).
  __device__ __forceinline__ void pair(int i) {
#ifdef PT_TWIN_TRACE
    trace.pair = i;
#endif
    trace.at(TE_START);
    const int own = 2 * i + w, oth = 2 * i + 1 - w;
    const bool has_own = own < n_tiles, has_oth = oth < n_tiles, more = own + 2 < n_tiles;
    const int bar_own = TWIN_P + 2 * (i & 1) + w, bar_oth = TWIN_P + 2 * (i & 1) + 1 - w;
    // the boxes of the tiles that refill this pair's stages: their page IDs in flight now
    TwinBoxes bx_own{0, 0, 0, 0}, bx_oth{0, 0, 0, 0};
    if (issuer) {
      bx_own = boxes(own + 2);
      bx_oth = boxes(oth + 2);
    }
#if PT_PROBE == 2
    // the data path alone: the P exchange's barriers, the refills and S's panel waits, no math
    if (has_own) named_bar_arrive(bar_own, THREADS);
    if (has_oth) {
      named_bar_sync(bar_oth, THREADS);
    } else {
      named_bar_sync(TWIN_WG + w, THREADS / 2);
    }
    if (issuer && has_own) fill(own + 2, bx_own, w * VH, VH, false);
    if (issuer && has_oth) fill(oth + 2, bx_oth, w * VH, VH, true);
    if (more) acquire(own + 2, 0, QP);
    return;
#endif
    // Each product's commit lies inside its branch, and the waits count the groups that
    // were issued: a commit after the branch would make ptxas close the group on the taken
    // path and issue an empty group after the join, doubling the count the waits see.
    if (has_own) {
      u32 pf[4][4];
      softmax(own);
      pack_p_frags<T>(s, pf);  // before the wgmma fence that orders them
      store_p(own, pf);
      named_bar_arrive(bar_own, THREADS);
      trace.at(TE_P_OWN);
      fence_regs(pf);
      fence_regs(o);
      wgmma_fence();
      pv_own(own, pf);
      wgmma_commit();
    }
    if (has_oth) {
      named_bar_sync(bar_oth, THREADS);  // P(oth), written and fenced by the other warpgroup
      trace.at(TE_P_OTH);
      fence_regs(o);
      wgmma_fence();
      pv_other(oth);  // the same accumulators, after the group above
      wgmma_commit();
    } else {
      named_bar_sync(TWIN_WG + w, THREADS / 2);  // the other warpgroup's P wait, matched
    }
    wgmma_wait_dyn<1>(has_oth ? 1 : 0);  // P(own) V(own)_w has landed: V(own)_w refills
    fence_regs(o);
    trace.at(TE_PV1);
    if (PT_PROBE != 1 && issuer && has_own) fill(own + 2, bx_own, w * VH, VH, false);
    // P(oth) V(oth)_w has landed too: V(oth)_w and P(oth)'s panel refill before S waits for
    // the first copy, so that the two copies' latencies overlap
    wgmma_wait<0>();
    fence_regs(o);
    trace.at(TE_PV2);
    if (PT_PROBE != 1 && issuer && has_oth) fill(oth + 2, bx_oth, w * VH, VH, true);
    // S(own + 2), half w (the first copy) first
    if (more) {
      fence_regs(s);
      wgmma_fence();
      s_steps(own + 2, w * VH, Half{}, true, PT_PROBE != 1);
      s_steps(own + 2, (1 - w) * VH, Half{}, false, PT_PROBE != 1);
      s_steps(own + 2, QP - 1, One{}, false, PT_PROBE != 1);
      if (PT_PROBE == 1) wgmma_commit();
    }
    trace.at(TE_S_ISSUED);
    wgmma_wait<0>();
    fence_regs(o);
    fence_regs(s);
    trace.at(TE_S_DONE);
  }
  // The rows' maxima (mx) and sums over both warpgroups (l becomes each row's whole sum); true
  // where some row's maximum outran the first pass's reference by more than SLACK (every thread
  // agrees): then the pass runs again with the exact maxima as the reference.
  __device__ __forceinline__ bool outran(float (&mx)[2]) {
    bool redo = false;
    publish(sX, mt, true);
    publish(sL, l, false);
    named_bar_sync(1, THREADS);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + g + 8 * h;
      mx[h] = fmaxf(sX[r], sX[64 + r]);
      l[h] = sL[r] + sL[64 + r];  // the row's whole sum
      redo = redo || (pass == 0 && mx[h] != neg_inf() && fabsf(mx[h] * scale_log2 - ref[h]) > Cfg::SLACK);
    }
    // every thread's reads of sX and sL above come before this barrier, so a rerun may write them
    return named_bar_any(1, THREADS, redo);
  }
  // Every tile of the range in pairs; a second pass where a row's maximum outran the reference.
  __device__ __forceinline__ void run() {
    init_barriers();
    trace.start(w, n_tiles);
    // this warpgroup's first tile, every panel, under Q's copy (again at the rerun's start)
    if (issuer) fill(w, boxes(w), 0, QP - 1, true);
    load_q_for_mma<QTile, THREADS>(sQ, pb);
#pragma unroll 1
    for (;; pass = 1) {
      if (pass == 1 && issuer) fill(w, boxes(w), 0, QP - 1, true);
      first_tile();
      if (pass == 0) trace.item_now(TI_FIRST_S);
      zero_tail();
      if (pass == 0) first_reference();
      if (pass == 0) trace.item_now(TI_REF);
#pragma unroll 1
      for (int i = 0; 2 * i < n_tiles; ++i) pair(i);
      if (pass == 0) trace.item_now(TI_PASS);
      float mx[2];
      if (!outran(mx)) {
        retire_barriers();
        break;
      }
      trace.stop();  // the rerun's steps are not recorded: TI_END stays 0
#pragma unroll
      for (int h = 0; h < 2; ++h) ref[h] = Softmax::reference(mx[h], scale_log2);
    }
  }

  // ---- epilogue: O / sum, each warpgroup its half -------------------------------------------
  __device__ __forceinline__ void epilogue(float out_scale) const {
    // a split's partials in a cluster lie over the stages, the rows and the barriers (the last
    // bytes of the dynamic shared memory: decode_cluster_part): every thread past its last read
    // of them and thread 0's retire_barriers first
    if (pb.split >= 0) named_bar_sync(1, THREADS);
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + g + 8 * h;
      if constexpr (Problem::WANTS_LSE) {
        if (w == 0 && t == 0 && r < pb.q_rows) pb.store_lse(r, l[h] > 0.f ? ref[h] + fast_log2(l[h]) : neg_inf());
      }
      inv[h] = OnlineSoftmax::inverse(l[h], out_scale);
    }
    // The output rows (no partials) in 16 bits, 16-byte aligned: the rows through stage 0 (free:
    // every tile was consumed before the last barrier) as whole 16-byte chunks; else store2.
    const DecodeParams& p = *pb.p;
    const int kind = pb.split < 0 && p.out_dtype != OUT_F32 &&
                             ((reinterpret_cast<u64>(p.o) | (u64)(p.o_sb | p.o_st | p.o_sh) * 2) & 15) == 0
                         ? p.out_dtype
                         : -1;
    if (kind == OUT_BF16) return twin_store_rows<Cfg, bf16>(pb, sKV, o, inv, w, row0);
    if (kind == OUT_F16) return twin_store_rows<Cfg, f16>(pb, sKV, o, inv, w, row0);
    if (pb.split >= 0) {  // fp32 partials: each row's base once (the cluster's part or the workspace)
      const bool cl = pb.clustered();
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row0 + g + 8 * h;
        if (r < pb.q_rows) {
          float* dst = (cl ? pb.cluster_part() + r * cluster_part_stride<Cfg::DV>()
                          : p.ws_o + pb.partial_row(r) * Cfg::DV) +
                       w * Cfg::DVH + 2 * t;
#pragma unroll
          for (int n = 0; n < DT; ++n)
            *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * h] * inv[h], o[n][2 * h + 1] * inv[h]);
        }
      }
      return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + g + 8 * h;
      if (r < pb.q_rows) {
#pragma unroll
        for (int n = 0; n < DT; ++n)
          pb.store2(r, w * Cfg::DVH + n * 8 + 2 * t, o[n][2 * h] * inv[h], o[n][2 * h + 1] * inv[h]);
      }
    }
  }
};

template <class Cfg, class Problem>
__device__ __forceinline__ void fmha_tile_twin(const Problem& pb, char* smem, float scale_log2, float out_scale,
                                               const TmaMap* tmk) {
  float s[8][4], o[Cfg::DVH / 8][4], ref[2], mt[2], l[2];
  TwinTile<Cfg, Problem> tile(pb, smem, scale_log2, tmk, s, o, ref, mt, l);
  tile.run();
  tile.epilogue(out_scale);
  tile.trace.item_now(TI_END);
}

}  // namespace pt
