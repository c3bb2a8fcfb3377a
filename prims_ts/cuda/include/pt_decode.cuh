// The GQA-row decode problem shared by the decode-shaped kernels (paged decode, MLA
// decode, block-sparse): parameters, the row mapping and the FMHA core policies.
//
// The M rows of a CTA are the query rows of one GQA group: row rr of (request, K/V
// head) is query token rr / group of head hk * group + rr % group, so each K/V byte is
// loaded once per group.
// Address policy: key j of request b lives in page indices[indptr[b] + j / ps] (CSR
// pages), or indices[b * bt_stride + j / ps] without an indptr (a dense block table),
// slot j % ps, of the K and V pools (combined caches are passed as two views).
// Mask policy: key bound, bottom-right causal on the query token, left window.
// Output policy: the output rows, or (split-KV) normalised partials and their
// log-sum-exp in the workspace, or (split-KV in a cluster) in the CTA's shared memory.
// Balanced split-KV (`balanced` CTAs, fmha_decode.cu: DecodeWalk): a CTA's partial
// items go to its two workspace slots of min(BM, rows_max) rows.
// Fail closed: the live metadata are checked where they are read, one compare an entry.
// Packed query offsets outside the query rows: the request's rows are not written (they
// have no place). More query rows than the launch's row tiles (past max_seq_len_q), CSR
// offsets outside kv_indices, or a length that needs more pages than the request lists (or
// than a split launch covers): the request has no key (the tiles' rows written as zeros, any
// further ones not at all). A CTA whose tiles would read a page ID outside the pools
// computes nothing and, under split-KV, poisons its row tile's merge (lse +inf). Rows
// without keys are written as zeros.
#pragma once
#include "pt_fmha.cuh"

namespace pt {

// The most split-KV chunks per (request, K/V head): decode.DECODE_MAX_SPLITS.
constexpr int DECODE_MAX_SPLITS = 128;

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* ws_o;    // [B, Hkv, splits, rows_max, D] partial outputs (splits > 1)
  float* ws_lse;  // [B, Hkv, splits, rows_max]
  int* ws_count;  // [B, Hkv, row_tiles] split arrivals, then (balanced) [2 balanced] group arrivals
                  // (zero between launches)
  const int* qo_indptr;  // packed queries: [B+1]; null: fixed
  const int* kv_indptr;  // CSR pages: [B+1]; null: kv_indices is a block table
  const int* kv_indices;
  const int* seq_lens;   // [B]
  i64 q_sb, q_st, q_sh;  // element strides: request, token, head
  i64 o_sb, o_st, o_sh;
  i64 k_sp, k_sh, k_ss;  // pools: page, head, slot
  i64 v_sp, v_sh, v_ss;
  i64 bt_stride;   // block-table row stride (kv_indptr null)
  int sq;          // fixed storage: query tokens per request
  int rows_max;    // group * (max) query tokens: M rows per (request, K/V head)
  int row_tiles;   // ceil(rows_max / BM)
  int splits;
  int chunk;       // keys per split, a multiple of BN
  int group;
  int hkv;
  int page_shift;
  int window_left;
  int out_dtype;
  int num_pages;     // pages in the pools: every page ID read must be in [0, num_pages)
  int num_indices;   // kv_indices' entries (CSR), or the block table's columns
  int total_q;       // packed queries: the query rows qo_indptr must stay inside
  int balanced;      // > 0: balanced split-KV over this many CTAs (splits = 1, chunk = the keys' capacity)
  int batch;        // requests (balanced split-KV walks them)
  float scale_log2;
  float out_scale;
  int merge_fan;    // balanced split-KV on sm_90a's MLA tiles: a unit of more than twice this many parts merges in groups of it first
};

// Static split-KV: the workspace row (of ws_o's DV floats, ws_lse's one) of split s's row
// `row` of (request b, K/V head hk).
__device__ __forceinline__ i64 decode_split_row(const DecodeParams& p, int b, int hk, int s, int row) {
  return (((i64)b * p.hkv + hk) * p.splits + s) * p.rows_max + row;
}

// A row tile's ticket, taken by one thread: true in the `parts`-th arrival, which resets the
// counter to zero for the next launch (the workspace contract: zeroed before first use, left
// reusable).
__device__ __forceinline__ bool take_ticket(int* count, int parts) {
  const bool last = atomicAdd(count, 1) == parts - 1;
  if (last) *count = 0;
  return last;
}
__device__ __forceinline__ bool take_ticket(const DecodeParams& p, int b, int hk, int rt, int parts) {
  return take_ticket(p.ws_count + ((i64)b * p.hkv + hk) * p.row_tiles + rt, parts);
}
// Balanced split-KV's group of parts (the MLA tiles' two-level merge) whose first part lies in
// workspace slot `slot` (a CTA's 2 c or 2 c + 1): its arrivals, past the units' counters.
__device__ __forceinline__ int* group_ticket(const DecodeParams& p, i64 slot) {
  return p.ws_count + (i64)p.batch * p.hkv * p.row_tiles + slot;
}

// Where output row rr (query token rr / group, head hk * group + rr % group) lives.
__device__ __forceinline__ char* decode_out_row(const DecodeParams& p, int b, int hk, int q_start, int rr) {
  const int t = rr / p.group, h = hk * p.group + rr % p.group;
  return static_cast<char*>(p.o) +
         (b * p.o_sb + (i64)(q_start + t) * p.o_st + h * p.o_sh) * out_dtype_size(p.out_dtype);
}

__device__ __forceinline__ void decode_request(const DecodeParams& p, int b, int& q_start, int& sq) {
  if (p.qo_indptr != nullptr) {
    q_start = p.qo_indptr[b];
    sq = p.qo_indptr[b + 1] - q_start;
  } else {
    q_start = 0;
    sq = p.sq;
  }
}

// The cluster merge's partials of a CTA: [BM] rows of DV floats CLUSTER_PAD apart, then [BM]
// log-sum-exps, the last bytes of the launch's dynamic shared memory (decode.decode_cluster
// sizes it). The pad (8 floats) puts the 8 rows of a warp's float2 stores (store2: rows g, 4
// lanes a row) in two wavefronts, where rows DV floats apart fell on the same banks.
constexpr int CLUSTER_PAD = 8;  // decode.CLUSTER_PAD
template <int DV> __host__ __device__ constexpr int cluster_part_stride() { return DV + CLUSTER_PAD; }
template <int BM, int DV> __host__ __device__ constexpr int cluster_part_bytes() {
  return (BM * cluster_part_stride<DV>() + BM) * 4;
}
template <int BM, int DV>
__device__ __forceinline__ float* decode_cluster_part() {
  extern __shared__ __align__(1024) char smem_dyn[];
  u32 bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return reinterpret_cast<float*>(smem_dyn + bytes - cluster_part_bytes<BM, DV>());
}

template <class T, int DV, int BM, int BN, bool CAUSAL>
struct DecodeProblem {
  static constexpr bool WANTS_LSE = true;
  static constexpr bool SHORT_TILES = false;
  const DecodeParams* p;
  const T* q;  // request's first query token, head hk * group
  const T* k;  // K/V head applied
  const T* v;
  const int* pages;  // this request's CSR page IDs
  int b, hk, q_start, row0;  // row0: first group row of this tile
  int split;  // where the partials go: the split (static), the slot (balanced); -1: the output rows
  int q_rows, sk, sq, kv_begin, kv_end;
  bool poisoned;  // a page ID of this CTA's keys lay outside the pools (split-KV: lse +inf)
  __device__ __forceinline__ BandRange<BN> range() const { return BandRange<BN>(kv_begin, kv_end, sk); }

  // The CTA's rows: request b, K/V head hk, row tile at group row row0_ of the request's
  // query tokens from q_start_ (sq_ of them). Returns false when the tile holds no row
  // (nothing to compute, write or merge); otherwise also sets the K/V length and pointers.
  __device__ __forceinline__ bool init(const DecodeParams& params, int b_, int hk_, int q_start_, int sq_, int row0_,
                                       int max_rows) {
    p = &params;
    b = b_;
    hk = hk_;
    split = -1;
    q_start = q_start_;
    sq = sq_;
    row0 = row0_;
    // more live query rows than the launch has row tiles for (packed offsets past
    // max_seq_len_q): the tiles' rows only, and the request fails closed below
    const bool too_tall = max_rows > params.rows_max;
    q_rows = min_(BM, min_(max_rows, params.rows_max) - row0);
    if (q_rows <= 0) return false;
    poisoned = false;
    sk = params.seq_lens != nullptr ? params.seq_lens[b] : 0;  // null: the caller sets sk (block-sparse CONTIG)
    // the request's bounds (fail closed): query offsets outside the query rows leave nothing
    // to write; K/V metadata that break theirs leave the request no key
    if (params.qo_indptr != nullptr && (q_start_ < 0 || (i64)q_start_ + sq_ > params.total_q)) return false;
    bool ok = !too_tall;
    int first_page = 0;
    if (params.kv_indices != nullptr) {
      i64 listed = params.num_indices;  // block table: its columns
      if (params.kv_indptr != nullptr) {
        first_page = params.kv_indptr[b];
        const int last = params.kv_indptr[b + 1];
        ok = ok && first_page >= 0 && first_page <= last && last <= params.num_indices;
        listed = (i64)last - first_page;
      }
      ok = ok && sk >= 0 && (i64)sk <= (listed << params.page_shift);
    }
    if (params.splits > 1 || params.balanced > 0) ok = ok && (i64)sk <= (i64)params.splits * params.chunk;
    if (!ok) sk = 0;
    q = static_cast<const T*>(params.q) + b * params.q_sb + (i64)q_start * params.q_st +
        (i64)hk * params.group * params.q_sh;
    k = static_cast<const T*>(params.k) + hk * params.k_sh;
    v = static_cast<const T*>(params.v) + hk * params.v_sh;
    pages = params.kv_indices == nullptr  ? nullptr
            : params.kv_indptr != nullptr ? params.kv_indices + first_page
                                          : params.kv_indices + b * params.bt_stride;
    return true;
  }

  // Warp-collective (every lane of the calling warp, each warp on its own: no barrier): the
  // page IDs of keys [begin, end) (inside the request's listed pages) index the pools. A lane
  // reads PAGES_IN_FLIGHT IDs a round trip, every load issued before any is compared (a loop
  // that compares each ID before its next load pays a trip per 32 pages: ~16 on a CTA's 500).
  static constexpr int PAGES_IN_FLIGHT = 8;
  __device__ __forceinline__ bool pages_ok(int begin, int end) const {
    if (pages == nullptr || begin >= end) return true;
    unsigned bad = 0;
    const unsigned num = (unsigned)p->num_pages;
    const int last = (end - 1) >> p->page_shift;
#pragma unroll 1
    for (int i0 = (begin >> p->page_shift) + (threadIdx.x & 31); i0 <= last; i0 += 32 * PAGES_IN_FLIGHT) {
      int id[PAGES_IN_FLIGHT];
#pragma unroll
      for (int k = 0; k < PAGES_IN_FLIGHT; ++k) id[k] = i0 + 32 * k <= last ? pages[i0 + 32 * k] : 0;
#pragma unroll
      for (int k = 0; k < PAGES_IN_FLIGHT; ++k) bad |= (unsigned)id[k] >= num;
    }
    return !__any_sync(0xffffffffu, bad != 0);
  }

  __device__ __forceinline__ const T* q_row(int r) const {
    const int rr = row0 + r;
    return q + (rr / p->group) * p->q_st + (rr % p->group) * p->q_sh;
  }
  // page and slot strides fit in int32 (checked on the host): one 32x32->64 multiply-add
  __device__ __forceinline__ int kv_page(int j) const { return pages[j >> p->page_shift]; }
  __device__ __forceinline__ const T* k_row(int page, int j) const {
    return k + ((i64)page * (int)p->k_sp + (j & ((1 << p->page_shift) - 1)) * (int)p->k_ss);
  }
  __device__ __forceinline__ const T* v_row(int page, int j) const {
    return v + ((i64)page * (int)p->v_sp + (j & ((1 << p->page_shift) - 1)) * (int)p->v_ss);
  }
  __device__ __forceinline__ int diag(int r) const { return sk - sq + (row0 + r) / p->group; }
  __device__ __forceinline__ bool tile_needs_mask(int k0) const {
    bool m = k0 + BN > sk;
    if (CAUSAL) {
      m = m || (k0 + BN - 1 > diag(0));
      m = m || (p->window_left >= 0 && k0 < diag(q_rows - 1) - p->window_left);
    }
    return m;
  }
  __device__ __forceinline__ bool visible(int r, int j) const {
    bool ok = j < sk;
    if (CAUSAL) {  // one interval of keys per row, compared without branches
      const int d = diag(r);
      ok = ok & (j <= d) & (j >= (p->window_left < 0 ? -2147483647 - 1 : d - p->window_left));
    }
    return ok;
  }
  __device__ __forceinline__ i64 partial_row(int r) const {
    if (p->balanced > 0) return (i64)split * min_(BM, p->rows_max) + r;
    return decode_split_row(*p, b, hk, split, row0 + r);
  }
  // Split-KV launched as thread block clusters (fmha_decode.cu: merge_cluster; a row tile's
  // splits one cluster, or several of the same size): this CTA's partial rows [BM][DV] and
  // log-sum-exps [BM] at the end of its dynamic shared memory. Read where the partials are
  // stored (a flag kept through the core costs registers).
  __device__ __forceinline__ bool clustered() const {
#if __CUDA_ARCH__ >= 900
    return p->splits > 1 && cluster_nctarank() > 1u;
#else
    return false;
#endif
  }
  __device__ __forceinline__ float* cluster_part() const { return decode_cluster_part<BM, DV>(); }
  __device__ __forceinline__ void store2(int r, int c, float x, float y) const {
    if (clustered()) {
      *reinterpret_cast<float2*>(cluster_part() + r * cluster_part_stride<DV>() + c) = make_float2(x, y);
    } else if (split >= 0) {
      *reinterpret_cast<float2*>(p->ws_o + partial_row(r) * DV + c) = make_float2(x, y);
    } else {
      store_pair(decode_out_row(*p, b, hk, q_start, row0 + r) + c * out_dtype_size(p->out_dtype), p->out_dtype,
                 x, y);
    }
  }
  __device__ __forceinline__ void store_lse(int r, float lse) const {
    if (clustered()) {
      cluster_part()[BM * cluster_part_stride<DV>() + r] = poisoned ? pos_inf() : lse;
    } else if (split >= 0) {
      p->ws_lse[partial_row(r)] = poisoned ? pos_inf() : lse;
    }
  }
};

}  // namespace pt
