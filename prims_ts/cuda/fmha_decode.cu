// Paged decode (prims_ts_batch_decode_with_kv_cache): few query tokens per
// request over CSR-paged K/V, on the shared FMHA core.
//
// Work policy: blockIdx = (split, K/V head * row_tiles + row tile, request).
// The M rows of a CTA are the query rows of one GQA group: row rr of (request,
// K/V head) is query token rr / group of head hk * group + rr % group, so each
// K/V byte is loaded once per group. A split covers a BN-aligned chunk of keys;
// with more than one split, every CTA writes its normalised partial O and its
// log-sum-exp to the workspace and decode_merge combines them.
// Address policy: key j of request b lives in page indices[indptr[b] + j / ps] (CSR
// pages), or indices[b * bt_stride + j / ps] without an indptr (a dense block table),
// slot j % ps, of the K and V pools (combined caches are passed as two views).
// MLA decode is this kernel with one latent K/V head (Hkv = 1, group = H) whose V row
// is the first DV values of the K row: the core then keeps one tile per stage.
// Mask policy: key bound, bottom-right causal on the query token, left window.
//
// The host appends the `extern "C"` entries (prims_ts/cuda/kernels.py).
#include "pt_fmha.cuh"

namespace pt {

struct DecodeParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* ws_o;    // [B, Hkv, splits, rows_max, D] partial outputs (splits > 1)
  float* ws_lse;  // [B, Hkv, splits, rows_max]
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
  float scale_log2;
  float out_scale;
};

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

template <class T, int DV, int BM, int BN, bool CAUSAL>
struct DecodeProblem {
  static constexpr bool WANTS_LSE = true;
  const DecodeParams* p;
  const T* q;  // request's first query token, head hk * group
  const T* k;  // K/V head applied
  const T* v;
  const int* pages;  // this request's CSR page IDs
  int b, hk, split, q_start, row0;  // row0: first group row of this tile
  int q_rows, sk, sq, kv_begin, kv_end;

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
    if (CAUSAL) {
      const int d = diag(r);
      ok = ok && j <= d && (p->window_left < 0 || j >= d - p->window_left);
    }
    return ok;
  }
  __device__ __forceinline__ i64 partial_row(int r) const {
    return (((i64)b * p->hkv + hk) * p->splits + split) * p->rows_max + row0 + r;
  }
  __device__ __forceinline__ void store2(int r, int c, float x, float y) const {
    if (p->splits > 1) {
      *reinterpret_cast<float2*>(p->ws_o + partial_row(r) * DV + c) = make_float2(x, y);
    } else {
      store_pair(decode_out_row(*p, b, hk, q_start, row0 + r) + c * out_dtype_size(p->out_dtype), p->out_dtype,
                 x, y);
    }
  }
  __device__ __forceinline__ void store_lse(int r, float lse) const {
    if (p->splits > 1) p->ws_lse[partial_row(r)] = lse;
  }
};

template <class Cfg, bool CAUSAL>
__device__ __forceinline__ void decode_kernel(const DecodeParams& p) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  extern __shared__ __align__(128) char smem[];

  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.row_tiles, rt = blockIdx.y % p.row_tiles;
  DecodeProblem<T, Cfg::DV, BM, BN, CAUSAL> pb;
  pb.p = &p;
  pb.b = b;
  pb.hk = hk;
  pb.split = split;
  decode_request(p, b, pb.q_start, pb.sq);
  pb.row0 = rt * BM;
  pb.q_rows = min_(BM, p.group * pb.sq - pb.row0);
  if (pb.q_rows <= 0) return;  // rows beyond this request's queries: nothing to write or merge
  pb.sk = p.seq_lens[b];
  pb.q = static_cast<const T*>(p.q) + b * p.q_sb + (i64)pb.q_start * p.q_st + (i64)hk * p.group * p.q_sh;
  pb.k = static_cast<const T*>(p.k) + hk * p.k_sh;
  pb.v = static_cast<const T*>(p.v) + hk * p.v_sh;
  pb.pages = p.kv_indptr != nullptr ? p.kv_indices + p.kv_indptr[b] : p.kv_indices + b * p.bt_stride;

  // range: this split's keys, narrowed by the causal band of the tile's tokens
  int begin = split * p.chunk, end = min_(pb.sk, begin + p.chunk);
  if (CAUSAL) {
    end = min_(end, pb.diag(pb.q_rows - 1) + 1);
    if (p.window_left >= 0) begin = max_(begin, pb.diag(0) - p.window_left);
  }
  pb.kv_begin = begin;
  pb.kv_end = max_(begin, end);
  // Every split CTA runs the core, even with an empty range: it then writes a zero
  // partial with lse = -inf, which the merge weighs as nothing.
  fmha_tile<Cfg>(pb, smem, p.scale_log2, p.splits > 1 ? 1.f : p.out_scale);
}

// Combine the split partials of one output row: O = sum_s 2^(lse_s - lse_max) O_s / sum_s 2^(lse_s - lse_max).
// grid = (rows_max, Hkv, B); blockDim.x * 2 >= D.
__device__ __forceinline__ void decode_merge(const DecodeParams& p, int head_dim) {
  const int rr = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  int q_start, sq;
  decode_request(p, b, q_start, sq);
  if (rr >= p.group * sq) return;
  const i64 base = (((i64)b * p.hkv + hk) * p.splits) * p.rows_max + rr;
  float mx = neg_inf();
  for (int s = 0; s < p.splits; ++s) mx = max_(mx, p.ws_lse[base + (i64)s * p.rows_max]);
  const int c = 2 * threadIdx.x;
  if (c >= head_dim) return;
  float x = 0.f, y = 0.f, wsum = 0.f;
  if (mx != neg_inf()) {
    for (int s = 0; s < p.splits; ++s) {
      const i64 row = base + (i64)s * p.rows_max;
      const float w = fast_exp2(p.ws_lse[row] - mx);
      const float2 o = *reinterpret_cast<const float2*>(p.ws_o + row * head_dim + c);
      x += w * o.x;
      y += w * o.y;
      wsum += w;
    }
  }
  const float inv = wsum > 0.f ? p.out_scale / wsum : 0.f;
  store_pair(decode_out_row(p, b, hk, q_start, rr) + c * out_dtype_size(p.out_dtype), p.out_dtype, x * inv,
             y * inv);
}

}  // namespace pt
