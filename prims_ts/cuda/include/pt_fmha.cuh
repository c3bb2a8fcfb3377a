// The FMHA core: one Q tile meets a stream of K/V tiles.
//
//   S = Q K^T (fp32)  ->  mask  ->  online softmax (exp2, scale*log2e folded)
//   ->  O += P V  ->  epilogue (1/l, output scale, cast)
//
// Everything that differs between the APIs is a *policy* supplied by the caller
// through the `Problem` type (see pt_policies.cuh):
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
// STAGES-deep cp.async ring.
#pragma once
#include "pt_sm80.cuh"
#include "pt_sm90.cuh"

// PT_PROBE: a measurement aid, 0 in every kernel the library launches (Tuning.probe,
// set by benchmarks/gpu_session.sh `probe`, defines it in the sm_90a prefill keys, whose
// names then end in _probe<n>). It splits a producer-ring kernel's time between its two
// sides; the results are wrong under either. 1: the producer copies the first STAGES tiles
// of a CTA and afterwards only hands the stages over (the MMA warps' speed without the K/V
// data path). 2: the MMA warps load Q, then only take and hand back each stage (the K/V
// data path's speed, no math, no output; one item per CTA only).
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
          int LOOP_ = 0, int COPY_TPR_ = 4>
struct FmhaConfig {
  using T = T_;
  static constexpr bool SWAP = false;  // the swapped-operand tile is SwapConfig (pt_fmha_swap.cuh)
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
  // O's registers are divided, not repeated).
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
  static constexpr bool OVERLAP = LOOP_ >= 1;
  static constexpr bool PINGPONG = LOOP_ == 2 && THREADS == 256;
  // the producer's threads per K/V row (load_kv_tiles PAIRED): 4 or 8
  static constexpr int COPY_TPR = COPY_TPR_;
  static constexpr int PRODUCER_REGS = 40;
  static constexpr int CONSUMER_REGS = 232;
  using QTile = typename Select<ARCH_ == 90, SmemTileW<BM, D>, SmemTile<BM, D>>::type;
  using KVTile = typename Select<ARCH_ == 90, SmemTileW<BN, D>, SmemTile<BN, D>>::type;
  static constexpr int SMEM_Q = QTile::BYTES;
  static constexpr int SMEM_KV = KVTile::BYTES;
  static constexpr int KV_TILES = SHARED_KV ? 1 : 2;  // tiles per stage
  static constexpr int SMEM_RING = KV_TILES * STAGES * SMEM_KV;
  // SPLIT_O exchange, after the pipeline: one float per warp row (row maxima, then
  // sums), then P of the tile as A fragments [WARPS_M][BN / 16][32 lanes] x 16 bytes
  static constexpr int SMEM_XCHG_RED = WARPS * 16 * 4;
  static constexpr int SMEM_XCHG = SPLIT_O ? SMEM_XCHG_RED + WARPS_M * (BN / 16) * 32 * 16 : 0;
  // full[STAGES], empty[STAGES], then q_full / q_empty (persistent CTAs: Q copied by the producer)
  static constexpr int SMEM_BARS = PRODUCER ? 2 * STAGES * 8 + 16 : 0;
  static constexpr int SMEM_PIPE = SMEM_Q + SMEM_RING + SMEM_XCHG + SMEM_BARS;
  // key-split merge (reuses the pipeline's bytes): (m, l) per warp and row, then
  // the O fragments of the WARPS_N - 1 warps that hand theirs over
  static constexpr int SMEM_MERGE = WARPS_N > 1 && !SPLIT_O ? WARPS * 16 * 2 * 4 + (WARPS_N - 1) * BM * DV * 4 : 0;
  static constexpr int SMEM_BYTES = SMEM_PIPE > SMEM_MERGE ? SMEM_PIPE : SMEM_MERGE;
  static_assert(ARCH_ == 80 || (BM % 64 == 0 && !Q_IN_REGS_ && (WARPS_N_ == 1 || SPLIT_O_)),
                "wgmma engine: warpgroups of 64 rows, Q in smem, keys split only with O split");
  static_assert(BN % (16 * WARPS_N) == 0 && D % 64 == 0 && STAGES >= 2, "tile shape");
  static_assert(!SPLIT_O || (WARPS_N > 1 && DTW % 2 == 0 && (ARCH_ == 80 || (DTW * 8) % 64 == 0)),
                "SPLIT_O: column pairs per warp (whole 64-column panels per warpgroup on wgmma)");
  static_assert(!PRODUCER || (ARCH_ == 90 && BM % 64 == 0), "producer warpgroup: the wgmma engine");
  static_assert(PRODUCER || COPY_TPR_ == 4, "COPY_TPR: the producer's copy (4 elsewhere)");
  static_assert(LOOP_ == 0 || (PRODUCER && WARPS_N_ == 1 && !SPLIT_O_ && LOOP_ <= 2),
                "overlapped loops: the producer ring, whole rows");
  static_assert(DV % 16 == 0 && DV <= D && (DV == D || SHARED_KV), "V width: D, or a prefix of the K row");
};

// Copy `rows` valid rows (of at most ROWS) into a swizzled tile; zero-fill the rest.
// `tid`: this thread's index among the THREADS copying threads.
// ROLLED: a loop, not unrolled (the producer warpgroup's small register share).
template <class Tile, int THREADS, class RowFn, bool ROLLED = false>
__device__ __forceinline__ void load_tile(u32 smem_base, int rows, RowFn row_ptr, int tid) {
  constexpr int TOTAL = Tile::BYTES / 16;
  static_assert(TOTAL % THREADS == 0, "tile not divisible among threads");
#pragma unroll(ROLLED ? 1 : TOTAL / THREADS)
  for (int i = 0; i < TOTAL / THREADS; ++i) {
    int idx = tid + i * THREADS;
    int r = idx / Tile::CHUNKS;
    int c = idx % Tile::CHUNKS;
    bool valid = r < rows;
    const char* src = reinterpret_cast<const char*>(row_ptr(valid ? r : 0)) + c * 16;
    cp_async_16(smem_base + Tile::offset(r, c), src, valid);
  }
}

// A tile of the range policy: keys k0 .. k0 + rows - 1 (rows <= BN; the rest of the
// tile is zero-filled and masked).
struct KeyTile {
  int k0, rows;
};

// The range policy of the contiguous problems: keys [begin, end) of a request with sk
// keys, in BN-aligned tiles, walked from the last (the masked diagonal of causal
// problems) to the first.
template <int BN> struct BandRange {
  int nb_last, count, sk;
  __device__ __forceinline__ BandRange(int begin, int end, int sk_) : sk(sk_) {
    const int nb_first = begin / BN;
    nb_last = end > begin ? (end - 1) / BN : nb_first - 1;
    count = nb_last - nb_first + 1;
  }
  __device__ __forceinline__ int n_tiles() const { return count; }
  __device__ __forceinline__ KeyTile tile(int it) const {
    const int k0 = (nb_last - it) * BN;
    return {k0, min_(BN, sk - k0)};
  }
};

// Copy K/V rows k0 .. k0 + rows - 1 into two tiles (same layout); zero-fill the rest.
// PAIRED (the producer warpgroup, short on registers): TPR (4 or 8) threads per row, each
// looks the row's page up once and copies every TPR-th 16-byte chunk of its K and V rows
// (16 * TPR contiguous bytes per row and copy instruction: 8 rows x 64 bytes a warp at 4,
// 4 rows x one 128-byte line at 8; FmhaConfig COPY_TPR). Otherwise K first, then V, each pass
// keeping only its pointers live; the page of each row is looked up once, in the K
// pass, and kept (an int per copied chunk) for the V pass.
// SHARED_KV (PAIRED only): V is a prefix of the K row, and only the K tile is copied.
// FROM_ROW (PAIRED): tile rows below r_begin are left alone (a paged TMA tile's whole pages).
template <class Tile, int THREADS, bool PAIRED, bool SHARED_KV = false, int TPR = 4, bool FROM_ROW = false,
          class Problem>
__device__ __forceinline__ void load_kv_tiles(u32 sk, u32 sv, const Problem& pb, int k0, int rows, int tid,
                                              int r_begin = 0) {
  constexpr int N = Tile::BYTES / 16 / THREADS;
  static_assert((Tile::BYTES / 16) % THREADS == 0, "tile not divisible among threads");
  if constexpr (PAIRED) {
    constexpr int ROWS = Tile::BYTES / (Tile::CHUNKS * 16);
    constexpr int RSTEP = THREADS / TPR;
    static_assert((TPR == 4 || TPR == 8) && ROWS % RSTEP == 0 && Tile::CHUNKS % TPR == 0, "paired copy shape");
    const int c0 = tid % TPR;
#pragma unroll 1
    for (int i = 0; i < ROWS / RSTEP; ++i) {
      const int r = tid / TPR + i * RSTEP;
      if (FROM_ROW && r < r_begin) continue;
      const bool valid = r < rows;
      const int j = k0 + (valid ? r : 0);
      const int page = pb.kv_page(j);
      auto copy_row = [&](u32 dst, const void* src) {  // every TPR-th chunk of row r
#pragma unroll
        for (int k = 0; k < Tile::CHUNKS / TPR; ++k) {
          const int c = c0 + k * TPR;
          cp_async_16(dst + Tile::offset(r, c), reinterpret_cast<const char*>(src) + c * 16, valid);
        }
      };
      copy_row(sk, pb.k_row(page, j));
      if constexpr (!SHARED_KV) copy_row(sv, pb.v_row(page, j));
    }
  } else {
    // chunk i of this thread: row r, 16-byte chunk c, key j (row 0's key past `rows`)
    auto chunk = [&](int i, int& r, int& c, int& j) {
      const int idx = tid + i * THREADS;
      r = idx / Tile::CHUNKS;
      c = idx % Tile::CHUNKS;
      j = k0 + (r < rows ? r : 0);
    };
    int page[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      int r, c, j;
      chunk(i, r, c, j);
      page[i] = pb.kv_page(j);
      cp_async_16(sk + Tile::offset(r, c), reinterpret_cast<const char*>(pb.k_row(page[i], j)) + c * 16, r < rows);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      int r, c, j;
      chunk(i, r, c, j);
      cp_async_16(sv + Tile::offset(r, c), reinterpret_cast<const char*>(pb.v_row(page[i], j)) + c * 16, r < rows);
    }
  }
}

// Where a role stands in the producer ring: the next stage, its pass parity and (the
// producer) how many tiles it has filled. A persistent CTA keeps one per role across its
// work items: the ring is initialised once and its passes run on from item to item.
struct RingPos {
  int stage = 0;
  u32 phase = 0;
  int filled = 0;
  u32 q_phase = 0;  // the MMA warps: parity of the current item's Q (copied by the producer)
};

// Problems whose K/V tiles TMA boxes fill (Problem::TMA): one producer thread issues a
// tile's boxes (Problem::tma_kv) and the stage's full barrier counts that thread's one
// arrival plus the boxes' bytes; the other problems' tiles are cp.async copies by the whole
// producer warpgroup.
template <class P, class = void> struct UsesTma { static constexpr bool value = false; };
template <class P> struct UsesTma<P, decltype(void(P::TMA))> { static constexpr bool value = P::TMA; };
// TMA problems over pages (a box a page, Problem::tma_pages; the tail by cp.async).
template <class P, class = void> struct PagedTma { static constexpr bool value = false; };
template <class P> struct PagedTma<P, decltype(void(P::TMA))> { static constexpr bool value = P::TMA && P::IS_PAGED; };

// The TMA boxes of a problem's key tiles, shared by the problems that take them (prefill,
// block-sparse). `tmk` / `tmv`: K's and V's maps in the kernel's parameters; `hk`: the K/V
// head; `b`: the request (contiguous maps).
struct TmaKv {
  const TmaMap* tmk;
  const TmaMap* tmv;
  int hk, b;
  // contiguous maps (D, Hkv, S, B), boxes (64, 1, BN, 1): keys k0 .. k0 + BN - 1 of K and V,
  // a box per 64-column panel (the maps zero keys past S)
  template <class Tile>
  __device__ __forceinline__ void rows(u32 dst_k, u32 dst_v, int k0, u32 bar) const {
#pragma unroll
    for (int c = 0; c < Tile::CHUNKS / 8; ++c) {
      tma_load_4d(dst_k + (u32)(c * Tile::PANEL), tmk, c * 64, hk, k0, b, bar);
      tma_load_4d(dst_v + (u32)(c * Tile::PANEL), tmv, c * 64, hk, k0, b, bar);
    }
  }
  // pool maps (D, page_size, Hkv, P), boxes (64, min(page_size, BN), 1, 1): the rows of a tile
  // at k0 that whole pages below the request's end (sk keys) fill, from row 0: every row if
  // the tile is below the end; else the whole pages before the cut one; none when one page
  // spans the tile
  template <int BN>
  __device__ __forceinline__ static int whole_page_rows(int k0, int sk, int page_shift) {
    const int live = sk - k0;
    if (live >= BN) return BN;
    return (1 << page_shift) >= BN ? 0 : (live >> page_shift) << page_shift;
  }
  // tile rows 0 .. rows - 1 (keys k0 ..) of K and V from the pools, a box per page (per BN
  // rows of one page) and 64-column panel; the pages are dealt over `lanes` threads (`lane`
  // this one's), each reading its pages' IDs (pb.kv_page) and issuing their boxes
  template <class Tile, int BN, class Problem>
  __device__ __forceinline__ void pages(const Problem& pb, u32 dst_k, u32 dst_v, int k0, int rows, int page_shift,
                                        u32 bar, int lane, int lanes) const {
    const int ps = 1 << page_shift;
    const int box = ps < BN ? ps : BN;
    for (int r = lane * box; r < rows; r += lanes * box) {
      const int j = k0 + r;
      const int page = pb.kv_page(j), slot = j & (ps - 1);
#pragma unroll
      for (int c = 0; c < Tile::CHUNKS / 8; ++c) {
        const u32 at = (u32)(c * Tile::PANEL + r * 128);
        tma_load_4d(dst_k + at, tmk, c * 64, slot, hk, page, bar);
        tma_load_4d(dst_v + at, tmv, c * 64, slot, hk, page, bar);
      }
    }
  }
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
      return;
    }
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
      fence_regs(s);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < KD; ++ks) {
        const u32 koff = (u32)(ks & 3) * 32;  // 16 columns = 32 bytes into the panel
        Wgmma<T, BNW>::ss(s, desc_kmajor(q_wg + (ks >> 2) * QTile::PANEL + koff),
                          desc_kmajor(k_wg + (ks >> 2) * KVTile::PANEL + koff), ks > 0);
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
  // this warp's row maxima over its keys of the tile and the running max
  auto tile_max = [&](const float (&s)[NT][4], float (&mx)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = m_row[h];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx[h] = max_(mx[h], max_(s[nt][2 * h], s[nt][2 * h + 1]));
      mx[h] = max_(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = max_(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
  };
  // P = exp2(S - max) in place; the running max and sums move on; corr rescales O
  auto exp_tile = [&](float (&s)[NT][4], const float (&mx)[2], float (&corr)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // A row that has seen no key yet keeps m = -inf; subtract 0 then so that
      // exp2(-inf - base) is 0 and never NaN.
      const float base = mx[h] == neg_inf() ? 0.f : mx[h] * scale_log2;
      corr[h] = fast_exp2(m_row[h] * scale_log2 - base);
      m_row[h] = mx[h];
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][2 * h] = fast_exp2(s[nt][2 * h] * scale_log2 - base);
        s[nt][2 * h + 1] = fast_exp2(s[nt][2 * h + 1] * scale_log2 - base);
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
      }
      l_row[h] = l_row[h] * corr[h] + sum;
    }
  };
  auto rescale_o = [&](const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      o[i][0] *= corr[0];
      o[i][1] *= corr[0];
      o[i][2] *= corr[1];
      o[i][3] *= corr[1];
    }
  };
  // P as the A fragments of the PV product (the mma.sync C layout is the A layout)
  auto pack_p = [&](const float (&s)[NT][4], u32 (&pf)[BNW / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < BNW / 16; ++kk) {
      pf[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pf[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pf[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pf[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  // O += P V on the wgmma engine, issued (not waited): A = P from registers, B = V N-major
  auto issue_pv_wgmma = [&](const u32 (&pf)[BNW / 16][4], int stage) {
    if constexpr (Cfg::ARCH == 90 && !SPLIT_O) {
      fence_regs(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<T, DT * 8>::rs_nmajor(o, pf[kk], desc_nmajor(sV(stage) + kk * 16 * 128, KVTile::PANEL), 1);
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
      tile_max(s, mx);
      exp_tile(s, mx, corr);
    };
    if (n_tiles > 0) {
      float corr[2];
      ring.acquire(stage, phase);
      if constexpr (Cfg::PINGPONG) named_bar_sync(3 + wg, THREADS);
      issue_s_wgmma(s, stage);
      if constexpr (Cfg::PINGPONG) named_bar_arrive(4 - wg, THREADS);
      wgmma_wait<0>();
      if (n_tiles == 1) release_q();  // the item's last S^T has landed: Q is free
      softmax_tile(range.tile(0), corr);  // O is still zero: nothing to rescale
      pack_p(s, pf);
      prev = stage;
      ring.advance(stage, phase);
      for (int it = 1; it < n_tiles; ++it) {
        ring.acquire(stage, phase);
        if constexpr (Cfg::PINGPONG) named_bar_sync(3 + wg, THREADS);
        issue_s_wgmma(s, stage);
        issue_pv_wgmma(pf, prev);
        if constexpr (Cfg::PINGPONG) named_bar_arrive(4 - wg, THREADS);
        wgmma_wait<1>();  // S(it) has landed; PV(it - 1) may still run
        if (it == n_tiles - 1) release_q();
        softmax_tile(range.tile(it), corr);
        wgmma_wait<0>();
        fence_regs(o);
        ring.release(prev);  // PV(it - 1) has landed: this warp is done with tile it - 1
        rescale_o(corr);
        pack_p(s, pf);
        prev = stage;
        ring.advance(stage, phase);
      }
      if constexpr (Cfg::PINGPONG) {
        if (wg == 0) named_bar_sync(3, THREADS);  // warpgroup 1's last hand-over
      }
      issue_pv_wgmma(pf, prev);
      wgmma_wait<0>();
      fence_regs(o);
      ring.release(prev);
    }
  }
  for (int it = 0; !Cfg::OVERLAP && it < n_tiles; ++it) {
    const KeyTile kt = range.tile(it);
    if constexpr (Cfg::PRODUCER) {
      ring.acquire(stage, phase);
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
    tile_max(s, mx);
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
    exp_tile(s, mx, corr);
    rescale_o(corr);

    // ---- O += P V -------------------------------------------------------------
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
      ring.release(stage);  // this warp's reads of the stage have completed (waited above)
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
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 1);
    l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 2);
  }
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
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = l_row[h];
    const float inv = l > 0.f ? out_scale / l : 0.f;
    const int r = row0 + g + 8 * h;
    if constexpr (Problem::WANTS_LSE) {
      // log2-domain log-sum-exp of the scaled scores, for merging split-KV partials
      if (r < pb.q_rows && t == 0 && (!SPLIT_O || warp_n == 0)) pb.store_lse(r, l > 0.f ? m_row[h] * scale_log2 + fast_log2(l) : neg_inf());
    }
    if (r < pb.q_rows) {
#pragma unroll
      for (int n = 0; n < DT; ++n) pb.store2(r, (col0 + n) * 8 + 2 * t, o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
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
