// The FMHA core's copies into shared memory: a range's key tiles (KeyTile, BandRange), the
// cp.async copies of Q and K/V rows (load_tile, load_kv_tiles) and the TMA boxes of K/V
// tiles and pages (TmaKv; UsesTma / PagedTma: which problems take them).
#pragma once
#include "pt_fmha_config.cuh"

namespace pt {

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
// looks the row's page up and copies every TPR-th 16-byte chunk of its row in each tile of
// PARTS (16 * TPR contiguous bytes per row and copy instruction: 8 rows x 64 bytes a warp at 4,
// 4 rows x one 128-byte line at 8; FmhaConfig COPY_TPR). Otherwise K first, then V, each pass
// keeping only its pointers live; the page of each row is looked up once, in the K
// pass, and kept (an int per copied chunk) for the V pass.
// PARTS (PAIRED only): the tiles copied, KV_K and / or KV_V (the producer ring fills K and V
// under barriers of their own, each call looking its rows' pages up; a shared K/V tile, V a
// prefix of the K row, is KV_K alone).
// FROM_ROW (PAIRED): tile rows below r_begin are left alone (a paged TMA tile's whole pages).
constexpr int KV_K = 1, KV_V = 2, KV_BOTH = KV_K | KV_V;
template <class Tile, int THREADS, bool PAIRED, int PARTS = KV_BOTH, int TPR = 4, bool FROM_ROW = false,
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
      if constexpr ((PARTS & KV_K) != 0) copy_row(sk, pb.k_row(page, j));
      if constexpr ((PARTS & KV_V) != 0) copy_row(sv, pb.v_row(page, j));
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

// Problems whose K/V tiles TMA boxes fill (Problem::TMA): one producer thread issues a
// tile's boxes (Problem::tma_kv, K's and V's apart) and each tile's full barrier counts that
// thread's one arrival plus the boxes' bytes; the other problems' tiles are cp.async copies
// by the whole producer warpgroup.
template <class P, class = void> struct UsesTma { static constexpr bool value = false; };
template <class P> struct UsesTma<P, decltype(void(P::TMA))> { static constexpr bool value = P::TMA; };
// TMA problems over pages (a box a page, Problem::tma_pages; the tail by cp.async).
template <class P, class = void> struct PagedTma { static constexpr bool value = false; };
template <class P> struct PagedTma<P, decltype(void(P::TMA))> { static constexpr bool value = P::TMA && P::IS_PAGED; };

// The TMA boxes of a problem's key tiles, shared by the problems that take them (prefill,
// block-sparse). `tmk` / `tmv`: K's and V's maps in the kernel's parameters; `hk`: the K/V
// head; `b`: the request (contiguous maps); `kxp` / `kxh`: an interleaved K tile's map, the
// entries of its last dimension (pages and heads folded) a page and a head. `part` (KV_K or
// KV_V): the tensor a call copies.
struct TmaKv {
  const TmaMap* tmk;
  const TmaMap* tmv;
  int hk, b;
  int kxp, kxh;
  __device__ __forceinline__ const TmaMap* map(int part) const { return part == KV_K ? tmk : tmv; }
  // contiguous maps (D, Hkv, S, B), boxes (64, 1, BN, 1): keys k0 .. k0 + BN - 1 of K or V,
  // a box per 64-column panel (the maps zero keys past S)
  template <class Tile>
  __device__ __forceinline__ void rows(int part, u32 dst, int k0, u32 bar) const {
    static_assert(!Tile::INTERLEAVED, "contiguous K/V boxes land a panel at a time");
    const TmaMap* tm = map(part);
#pragma unroll
    for (int c = 0; c < Tile::CHUNKS / 8; ++c) tma_load_4d(dst + (u32)(c * Tile::PANEL), tm, c * 64, hk, k0, b, bar);
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
  // tile rows 0 .. rows - 1 (keys k0 ..) of K or V from its pool, a box per page (per BN
  // rows of one page) and 64-column panel; the pages are dealt over `lanes` threads (`lane`
  // this one's), each reading its pages' IDs (pb.kv_page) and issuing their boxes. A
  // page-major tile (SmemTileP, V under Tuning.page_major_v: the map (64, page_size, D / 64,
  // Hkv, P)) takes one box (64, GROUP, D / 64) a page, all its panels; a row-group interleaved
  // one (SmemTileI, K under Tuning.page_major_k: the map (64, 8, D / 64, page_size / 8, pages
  // x kxp + heads x kxh), its last dimension striding the pages' and heads' common divisor)
  // one box (64, 8, D / 64, rows / 8) a page.
  template <class Tile, int BN, class Problem>
  __device__ __forceinline__ void pages(const Problem& pb, int part, u32 dst, int k0, int rows, int page_shift,
                                        u32 bar, int lane, int lanes) const {
    const TmaMap* tm = map(part);
    const int ps = 1 << page_shift;
    const int box = ps < BN ? ps : BN;
    for (int r = lane * box; r < rows; r += lanes * box) {
      const int j = k0 + r;
      const int page = pb.kv_page(j), slot = j & (ps - 1);
      if constexpr (Tile::PAGE_MAJOR) {
        tma_load_5d(dst + Tile::offset(r, 0), tm, 0, slot, 0, hk, page, bar);
      } else if constexpr (Tile::INTERLEAVED) {
        tma_load_5d(dst + Tile::row8(r), tm, 0, 0, 0, slot >> 3, page * kxp + hk * kxh, bar);
      } else {
#pragma unroll
        for (int c = 0; c < Tile::CHUNKS / 8; ++c)
          tma_load_4d(dst + (u32)(c * Tile::PANEL + r * 128), tm, c * 64, slot, hk, page, bar);
      }
    }
  }
};

}  // namespace pt
