// Paged decode (prims_ts_batch_decode_with_kv_cache) and MLA decode: few query tokens
// per request over paged K/V, on the shared FMHA core (the problem: pt_decode.cuh).
//
// Work policy: blockIdx = (split, K/V head * row_tiles + row tile, request). A split
// covers a BN-aligned chunk of keys; with more than one split, every CTA writes its
// normalised partial O and its log-sum-exp to the workspace, and the last split CTA of
// each row tile to finish merges them (merge_if_last: a ticket counter per row tile).
// MLA decode is this kernel with one latent K/V head (Hkv = 1, group = H) whose V row
// is the first DV values of the K row: the core then keeps one tile per stage. Row
// tiles of 64 (H x SQ >= 64) take the wgmma engine on sm_90a: two warpgroups split each
// tile's keys for S and O's columns for PV, P exchanged through shared memory. Row
// tiles of 16/32 may take the swapped-operand tile (pt_fmha_swap.cuh: the keys as
// wgmma's M) on sm_90a.
//
// The host appends the `extern "C"` entries (prims_ts/cuda/kernels.py).
#include "pt_decode.cuh"
#include "pt_fmha_swap.cuh"

namespace pt {

// Output columns c, c + 1 of row rr from the split partials:
// O = sum_s 2^(lse_s - lse_max) O_s / sum_s 2^(lse_s - lse_max).
__device__ __forceinline__ void merge_pair(const DecodeParams& p, int b, int hk, int q_start, int rr, int dv, int c) {
  const i64 base = (((i64)b * p.hkv + hk) * p.splits) * p.rows_max + rr;
  float mx = neg_inf();
  for (int s = 0; s < p.splits; ++s) mx = max_(mx, p.ws_lse[base + (i64)s * p.rows_max]);
  float x = 0.f, y = 0.f, wsum = 0.f;
  if (mx != neg_inf()) {
    for (int s = 0; s < p.splits; ++s) {
      const i64 row = base + (i64)s * p.rows_max;
      const float w = fast_exp2(p.ws_lse[row] - mx);
      const float2 o = *reinterpret_cast<const float2*>(p.ws_o + row * dv + c);
      x += w * o.x;
      y += w * o.y;
      wsum += w;
    }
  }
  const float inv = wsum > 0.f ? p.out_scale / wsum : 0.f;
  store_pair(decode_out_row(p, b, hk, q_start, rr) + c * out_dtype_size(p.out_dtype), p.out_dtype, x * inv, y * inv);
}

// Split-KV without a second kernel: every split CTA of a (request, K/V head, row tile)
// publishes its partial and takes a ticket; the last one to arrive merges the tile's
// rows and resets the counter to zero for the next launch (the workspace contract:
// zeroed before first use, left reusable). `threads`: the MMA threads (0 .. threads - 1),
// which meet at named barrier 2; a producer warpgroup has left already.
__device__ __noinline__ void merge_if_last(const DecodeParams& p, int b, int hk, int rt, int q_start, int row0,
                                           int q_rows, int dv, int threads) {
  __shared__ int last;
  __threadfence();  // this thread's partial stores, before the ticket
  named_bar_sync(2, threads);
  if (threadIdx.x == 0) {
    int* count = p.ws_count + ((i64)b * p.hkv + hk) * p.row_tiles + rt;
    last = atomicAdd(count, 1) == p.splits - 1;
    if (last) *count = 0;
  }
  named_bar_sync(2, threads);
  if (!last) return;
  __threadfence();  // every other split's partials, after the ticket
  const int pairs = dv / 2;
  for (int i = threadIdx.x; i < q_rows * pairs; i += threads)
    merge_pair(p, b, hk, q_start, row0 + i / pairs, dv, 2 * (i % pairs));
}

template <class Cfg, bool CAUSAL>
__device__ __forceinline__ void decode_kernel(const DecodeParams& p) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = Cfg::ARCH == 90 ? align_smem_1024(smem_raw) : smem_raw;

  const int split = blockIdx.x, b = blockIdx.z;
  const int hk = blockIdx.y / p.row_tiles, rt = blockIdx.y % p.row_tiles;
  DecodeProblem<T, Cfg::DV, BM, BN, CAUSAL> pb;
  int q_start, sq;
  decode_request(p, b, q_start, sq);
  // rows beyond this request's queries: nothing to write or merge
  if (!pb.init(p, b, hk, q_start, sq, rt * BM, p.group * sq)) return;
  pb.split = split;

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
  if constexpr (Cfg::SWAP) {
    fmha_tile_swap<Cfg>(pb, smem, p.scale_log2, p.splits > 1 ? 1.f : p.out_scale);
  } else {
    fmha_tile<Cfg>(pb, smem, p.scale_log2, p.splits > 1 ? 1.f : p.out_scale);
  }
  if (threadIdx.x >= Cfg::THREADS) return;  // the producer warpgroup: done
  if (p.splits > 1) merge_if_last(p, b, hk, rt, pb.q_start, pb.row0, pb.q_rows, Cfg::DV, Cfg::THREADS);
}

}  // namespace pt
