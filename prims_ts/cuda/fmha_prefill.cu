// Prefill over contiguous K/V (batch_prefill: fixed or packed-ragged) or over
// paged K/V pools (batch_prefill_with_paged_kv_cache: packed Q, block tables).
//
// Work policy: work item w = (K/V head, q tile item, query head of the K/V head's group), in
// that order from the outside in; the q tile item either read from the plan's list
// (request, q tile) or, without one, decoded so that the highest q tiles (the heaviest
// under a causal mask) come first. The CTAs in flight then share the K/V of one or two K/V
// heads, every q tile of it, so that each K/V tile comes from DRAM once and from L2 to the
// q tiles and heads that read it (q tile items outermost re-read every request's K/V from
// DRAM once per q tile as soon as it outgrew L2). The host launches one
// CTA per item, or (PERSIST: the producer-ring engine, Tuning.persistent) at most one per
// SM, CTA c taking items c, c + gridDim.x, ...; its producer then copies the next item's
// first tiles while the MMA warps finish the current one.
// Address policy: rows of q/k/v/o are strided; packed storage offsets requests
// by the live indptr values, so a replay with changed offsets needs no re-plan.
// PAGED: K/V row j of request b lives in page block_tables[b][j / page_size],
// slot j % page_size; the producer reads a row's page ID for its K tile and again for
// its V tile (their own barriers), and copies straight from the pages (no gather).
// TMA (sm_90a; fixed storage: Tuning.tma, pages: Tuning.paged_tma): K/V tiles come as TMA
// boxes of the tensor maps the host encodes over K and V as 4-D (D, Hkv, S, B): one box per
// 64-column panel, the 128-byte swizzle of the wgmma tiles, keys past S zero-filled; or over
// the pools as (D, page_size, Hkv, P): a box per whole page of the tile below the request's
// end (page_size rows, or BN rows of one page), the tail by cp.async with zeros past the end
// (pt_fmha_ring.cuh: KvRing; pt_fmha_copy.cuh: PagedTma, TmaKv). One producer thread issues fixed storage's boxes (UsesTma),
// the first producer warp's lanes a tile's pages.
// Range and mask policies: dense, bottom-right causal with optional left window,
// per-row variable window.
//
// The host appends one `extern "C"` entry per kernel key (prims_ts/cuda/prefill.py).
#include "pt_fmha.cuh"

namespace pt {

enum MaskKind : int { MASK_DENSE = 0, MASK_CAUSAL = 1, MASK_VARWIN = 2 };

struct PrefillParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  const int* qo_indptr;  // packed storage: [B+1]; null for fixed
  const int* kv_indptr;
  const int* win_starts;  // variable window: [B, Sq] rows of stride win_stride
  const int* win_ends;
  const int* work;  // [n_items, 2] = (request, q tile); null: implicit order
  const int* block_tables;  // paged: [B, C] rows of stride bt_stride
  const int* seq_lens;  // paged: [B] live K/V lengths
  i64 q_sb, q_st, q_sh;  // strides in elements: request, token, head
  i64 k_sb, k_st, k_sh;  // paged: page, slot, head
  i64 v_sb, v_st, v_sh;
  i64 o_sb, o_st, o_sh;
  i64 win_stride;
  i64 bt_stride;
  int page_shift;  // paged: log2(page_size)
  int batch;
  int sq, sk;  // fixed storage lengths
  int num_q_tiles;  // implicit order: tiles per request
  int group;  // Hq / Hkv
  int window_left;
  int out_dtype;
  int n_items;  // q tile items per head (the plan's list length, or batch * num_q_tiles)
  int heads;    // query heads
  float scale_log2;
  float out_scale;
  int k_xp, k_xh;  // paged, K's interleaved map (Tuning.page_major_k): its last dimension's entries a page, a head
};

// The parameters of a TMA key: K's and V's maps, (D, Hkv, S, B) in boxes of (64, 1, BN, 1),
// then the rest.
struct PrefillTmaParams {
  TmaMap tmap_k;
  TmaMap tmap_v;
  PrefillParams p;
};

template <class T, int BN, int MASK, bool PAGED, bool TMA_ = false>
struct PrefillProblem {
  using Elem = T;
  static constexpr int MASK_KIND = MASK;
  static constexpr bool IS_PAGED = PAGED;
  static constexpr bool TMA = TMA_;
  static constexpr bool WANTS_LSE = false;
  static constexpr bool SHORT_TILES = false;
  const T* q;
  const T* k;  // request and K/V head applied (contiguous) / K/V head applied (paged)
  const T* v;
  char* o;
  i64 q_st, k_st, v_st, o_st;  // row strides (paged: slot strides)
  int k_sp, v_sp;  // paged: page and slot strides (int32: checked on the host, and the
  int k_ss, v_ss;  // page address is then one 32x32->64-bit multiply-add)
  const int* bt;  // paged: this request's block-table row
  int page_shift;
  int out_dtype;
  int q_rows, sk, kv_begin, kv_end;
  __device__ __forceinline__ BandRange<BN> range() const { return BandRange<BN>(kv_begin, kv_end, sk); }
  int diag0;  // key index on the causal diagonal of tile row 0
  int window;
  const int* lo;  // variable window bounds per tile row (shared memory)
  const int* hi;
  int b, q0;      // request, first query row of the tile
  TmaKv tma;  // TMA: the maps (in the kernel's parameters), this problem's K/V head and request

  __device__ __forceinline__ const T* q_row(int r) const { return q + r * q_st; }
  // TMA (TmaKv): fixed storage's key tiles, or the whole pages of a paged one
  template <class Tile>
  __device__ __forceinline__ void tma_kv(int part, u32 dst, int k0, u32 bar) const {
    tma.template rows<Tile>(part, dst, k0, bar);
  }
  __device__ __forceinline__ int tma_rows(int k0) const { return TmaKv::whole_page_rows<BN>(k0, sk, page_shift); }
  template <class Tile>
  __device__ __forceinline__ void tma_pages(int part, u32 dst, int k0, int rows, u32 bar, int lane, int lanes) const {
    tma.template pages<Tile, BN>(*this, part, dst, k0, rows, page_shift, bar, lane, lanes);
  }
  __device__ __forceinline__ int kv_page(int j) const { return PAGED ? bt[j >> page_shift] : 0; }
  __device__ __forceinline__ const T* k_row(int page, int j) const {
    if (PAGED) return k + ((i64)page * k_sp + (j & ((1 << page_shift) - 1)) * k_ss);
    return k + j * k_st;
  }
  __device__ __forceinline__ const T* v_row(int page, int j) const {
    if (PAGED) return v + ((i64)page * v_sp + (j & ((1 << page_shift) - 1)) * v_ss);
    return v + j * v_st;
  }

  __device__ __forceinline__ bool tile_needs_mask(int k0) const {
    if (MASK == MASK_VARWIN) return true;
    bool m = k0 + BN > sk;
    if (MASK == MASK_CAUSAL) {
      m = m || (k0 + BN - 1 > diag0);
      m = m || (window >= 0 && k0 < diag0 + q_rows - 1 - window);
    }
    return m;
  }
  __device__ __forceinline__ bool visible(int r, int j) const {
    // one interval of keys per row, compared without branches
    if (MASK == MASK_VARWIN) return (j >= lo[r]) & (j <= hi[r]);
    bool ok = j < sk;
    if (MASK == MASK_CAUSAL) {
      const int d = diag0 + r;
      ok = ok & (j <= d) & (j >= (window < 0 ? -2147483647 - 1 : d - window));
    }
    return ok;
  }
  __device__ __forceinline__ void store2(int r, int c, float x, float y) const {
    store_pair(o + (r * o_st + c) * out_dtype_size(out_dtype), out_dtype, x, y);
  }
  static constexpr bool ROW_STORE = true;  // pt_fmha_store.cuh
  __device__ __forceinline__ int row_store() const { return out_dtype == OUT_F32 ? -1 : out_dtype; }
  __device__ __forceinline__ char* o_row(int r) const { return o + r * o_st * 2; }
};

// Work item w's problem (false: its q tile is past its request's queries). The variable
// window's per-row ranges are set by the kernel (they need the CTA's shared memory).
template <int BM, class Problem>
__device__ __forceinline__ bool prefill_problem(const PrefillParams& p, int w, Problem& pb,
                                                const TmaMap* tmaps = nullptr) {
  using T = typename Problem::Elem;
  constexpr int MASK = Problem::MASK_KIND;
  constexpr bool PAGED = Problem::IS_PAGED;
  // ---- work policy ----------------------------------------------------------
  const int per_kv_head = p.n_items * p.group;
  const int hk = w / per_kv_head;
  const int rest = w - hk * per_kv_head;
  const int item = rest / p.group, h = hk * p.group + (rest - item * p.group);
  int b, qt;
  if (p.work != nullptr) {
    b = p.work[2 * item];
    qt = p.work[2 * item + 1];
  } else {
    b = item % p.batch;
    qt = p.num_q_tiles - 1 - item / p.batch;
  }
  int q_start = 0, kv_start = 0, sq = p.sq, sk = p.sk;
  if (p.qo_indptr != nullptr) {
    q_start = p.qo_indptr[b];
    sq = p.qo_indptr[b + 1] - q_start;
    if (PAGED) {
      sk = p.seq_lens[b];
    } else {
      kv_start = p.kv_indptr[b];
      sk = p.kv_indptr[b + 1] - kv_start;
    }
  }
  const int q0 = qt * BM;
  if (q0 >= sq) return false;

  // ---- address policy ---------------------------------------------------------
  pb.q = static_cast<const T*>(p.q) + b * p.q_sb + (i64)(q_start + q0) * p.q_st + h * p.q_sh;
  if (PAGED) {
    pb.k = static_cast<const T*>(p.k) + hk * p.k_sh;
    pb.v = static_cast<const T*>(p.v) + hk * p.v_sh;
    pb.k_sp = (int)p.k_sb;
    pb.v_sp = (int)p.v_sb;
    pb.k_ss = (int)p.k_st;
    pb.v_ss = (int)p.v_st;
    pb.bt = p.block_tables + b * p.bt_stride;
    pb.page_shift = p.page_shift;
  } else {
    pb.k = static_cast<const T*>(p.k) + b * p.k_sb + (i64)kv_start * p.k_st + hk * p.k_sh;
    pb.v = static_cast<const T*>(p.v) + b * p.v_sb + (i64)kv_start * p.v_st + hk * p.v_sh;
  }
  pb.o = static_cast<char*>(p.o) +
         (b * p.o_sb + (i64)(q_start + q0) * p.o_st + h * p.o_sh) * out_dtype_size(p.out_dtype);
  pb.q_st = p.q_st;
  pb.k_st = p.k_st;
  pb.v_st = p.v_st;
  pb.o_st = p.o_st;
  pb.out_dtype = p.out_dtype;
  pb.q_rows = min_(BM, sq - q0);
  pb.sk = sk;
  pb.window = p.window_left;
  pb.diag0 = sk - sq + q0;
  pb.b = b;
  pb.q0 = q0;
  if constexpr (Problem::TMA) {
    pb.tma = TmaKv{tmaps, tmaps + 1, hk, b, p.k_xp, p.k_xh};
  }

  // ---- range policy (the variable window's: prefill_kernel) --------------------
  if (MASK == MASK_CAUSAL) {
    pb.kv_begin = p.window_left >= 0 ? max_(0, pb.diag0 - p.window_left) : 0;
    pb.kv_end = min_(sk, pb.diag0 + pb.q_rows);
  } else {
    pb.kv_begin = 0;
    pb.kv_end = sk;
  }
  return true;
}

// PERSIST: CTA c walks items c, c + gridDim.x, ...; otherwise item blockIdx.x alone.
template <class Cfg, int MASK, bool PAGED, bool PERSIST_, bool TMA>
struct PrefillItems {
  using Problem = PrefillProblem<typename Cfg::T, Cfg::BN, MASK, PAGED, TMA>;
  static constexpr bool PERSIST = PERSIST_;
  const PrefillParams* p;
  const TmaMap* tmaps;  // TMA: K's map, then V's
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int stride() const { return gridDim.x; }
  __device__ __forceinline__ int count() const { return p->n_items * p->heads; }
  __device__ __forceinline__ bool get(int w, Problem& pb) const {
    return prefill_problem<Cfg::BM>(*p, w, pb, tmaps);
  }
};

template <class Cfg, int MASK, bool PAGED, bool PERSIST = false, bool TMA = false>
__device__ __forceinline__ void prefill_kernel(const PrefillParams& p, const TmaMap* tmaps = nullptr) {
  constexpr int BM = Cfg::BM;
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = Cfg::ARCH == 90 ? align_smem_1024(smem_raw) : smem_raw;
  static_assert(!PERSIST || (Cfg::PRODUCER && MASK != MASK_VARWIN), "persistent: the producer ring, no variable window");
  static_assert(!TMA || Cfg::PRODUCER, "TMA: the producer ring");
  using Items = PrefillItems<Cfg, MASK, PAGED, PERSIST, TMA>;
  if constexpr (MASK != MASK_VARWIN) {
    fmha_items<Cfg>(Items{&p, tmaps}, smem, p.scale_log2, p.out_scale);
  } else {
    // one item per CTA: its rows' windows go to shared memory first (the whole CTA)
    typename Items::Problem pb;
    if (!prefill_problem<BM>(p, blockIdx.x, pb, tmaps)) return;
    int* lo = reinterpret_cast<int*>(smem + Cfg::SMEM_BYTES);
    int* hi = lo + BM;
    __shared__ int range[2];
    if (threadIdx.x == 0) {
      range[0] = 0x7fffffff;
      range[1] = -1;
    }
    __syncthreads();
    for (int r = threadIdx.x; r < BM; r += Cfg::THREADS) {
      int s = 0, e = -1;  // padding rows see nothing
      if (r < pb.q_rows) {
        const i64 off = pb.b * p.win_stride + pb.q0 + r;
        s = max_(0, p.win_starts[off]);
        e = min_(pb.sk - 1, p.win_ends[off]);
        atomicMin(&range[0], s);
        atomicMax(&range[1], e);
      }
      lo[r] = s;
      hi[r] = e;
    }
    __syncthreads();
    pb.lo = lo;
    pb.hi = hi;
    pb.kv_begin = range[0] == 0x7fffffff ? 0 : range[0];
    pb.kv_end = range[1] + 1;
    fmha_tile<Cfg>(pb, smem, p.scale_log2, p.out_scale);
  }
}

// A TMA key's entry: the maps live in the kernel's __grid_constant__ parameters.
template <class Cfg, int MASK, bool PAGED, bool PERSIST, bool TMA>
__device__ __forceinline__ void prefill_kernel(const PrefillTmaParams& tp) {
  static_assert(TMA, "PrefillTmaParams: the TMA keys");
  prefill_kernel<Cfg, MASK, PAGED, PERSIST, TMA>(tp.p, &tp.tmap_k);
}

}  // namespace pt
