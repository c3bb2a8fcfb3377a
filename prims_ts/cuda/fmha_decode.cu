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

// Split-KV without a second kernel: every split CTA of a (request, K/V head, row tile)
// publishes its partial and takes a ticket; the last one to arrive merges the tile's
// rows and resets the counter to zero for the next launch (the workspace contract:
// zeroed before first use, left reusable). The MMA threads (0 .. Cfg::THREADS - 1) meet
// at named barrier 2; a producer warpgroup has left already.
//
// The merge: O = sum_s 2^(lse_s - lse_max) O_s / sum_s 2^(lse_s - lse_max). The splits'
// log-sum-exps go to shared memory (the core is done with it) in one parallel pass, a
// warp per row turns them into normalised weights (out_scale folded in), then every
// thread accumulates its column pairs split by split, all of its pairs' loads of one
// split in flight together.
template <class Cfg>
__device__ __noinline__ void merge_if_last(const DecodeParams& p, int b, int hk, int rt, int q_start, int row0,
                                           int q_rows) {
  extern __shared__ __align__(1024) char smem[];  // the core is done with it (not re-aligned: floats)
  constexpr int THREADS = Cfg::THREADS, DV = Cfg::DV, PAIRS = DV / 2;
  constexpr int ITEMS = (Cfg::BM * PAIRS + THREADS - 1) / THREADS;  // column pairs per thread
  // pairs accumulated per pass: kernels that re-divide registers among warpgroups
  // (setmaxnreg, 384 threads) compile this out-of-line function at the smallest share
  constexpr int CHUNK_MAX = Cfg::LAUNCH_THREADS >= 384 ? 4 : 16;
  constexpr int CHUNK = ITEMS < CHUNK_MAX ? ITEMS : CHUNK_MAX;
  static_assert(Cfg::BM * DECODE_MAX_SPLITS * 4 <= Cfg::SMEM_BYTES, "split weights fit the tile's shared memory");
  __shared__ int last;
  __threadfence();  // this thread's partial stores, before the ticket
  named_bar_sync(2, THREADS);
  if (threadIdx.x == 0) {
    int* count = p.ws_count + ((i64)b * p.hkv + hk) * p.row_tiles + rt;
    last = atomicAdd(count, 1) == p.splits - 1;
    if (last) *count = 0;
  }
  named_bar_sync(2, THREADS);
  if (!last) return;
  __threadfence();  // every other split's partials, after the ticket

  const int S = p.splits;
  const i64 base = ((i64)b * p.hkv + hk) * S * p.rows_max + row0;  // partial row (split 0, row0)
  float* w = reinterpret_cast<float*>(smem);                         // [q_rows][S]
  // every (row, split) log-sum-exp into shared memory, the loads all in flight together
  for (int i = threadIdx.x; i < q_rows * S; i += THREADS) {
    const int r = i / S;
    w[i] = p.ws_lse[base + (i64)(i - r * S) * p.rows_max + r];
  }
  named_bar_sync(2, THREADS);
  // a warp per row: the max and the sum over the splits, then the weights in place
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < q_rows; r += THREADS / 32) {
    float* wr = w + r * S;
    float mx = neg_inf();
    for (int s = lane; s < S; s += 32) mx = max_(mx, wr[s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max_(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int s = lane; s < S; s += 32) {
      // an all-empty row (every lse -inf) weighs nothing and writes zeros
      const float e = mx == neg_inf() ? 0.f : fast_exp2(wr[s] - mx);
      wr[s] = e;
      sum += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float scale = sum > 0.f ? p.out_scale / sum : 0.f;
    for (int s = lane; s < S; s += 32) wr[s] *= scale;
  }
  named_bar_sync(2, THREADS);

  const int n = q_rows * PAIRS;
#pragma unroll 1
  for (int k0 = 0; k0 < ITEMS; k0 += CHUNK) {
    float acc[CHUNK][2];
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) acc[k][0] = acc[k][1] = 0.f;
    // pair i of the tile's rows is the float2 at 2 i of the split's partial rows (DV = 2 PAIRS)
    const float* os = p.ws_o + base * DV + 2 * (threadIdx.x + k0 * THREADS);
    for (int s = 0; s < S; ++s, os += (i64)p.rows_max * DV) {
#pragma unroll
      for (int k = 0; k < CHUNK; ++k) {
        const int i = threadIdx.x + (k0 + k) * THREADS;
        if (i < n) {
          const float ws = w[(i / PAIRS) * S + s];
          const float2 o = *reinterpret_cast<const float2*>(os + 2 * k * THREADS);
          acc[k][0] += ws * o.x;
          acc[k][1] += ws * o.y;
        }
      }
    }
#pragma unroll
    for (int k = 0; k < CHUNK; ++k) {
      const int i = threadIdx.x + (k0 + k) * THREADS;
      if (i < n) {
        const int r = i / PAIRS, c = 2 * (i % PAIRS);
        store_pair(decode_out_row(p, b, hk, q_start, row0 + r) + c * out_dtype_size(p.out_dtype), p.out_dtype,
                   acc[k][0], acc[k][1]);
      }
    }
  }
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
  if (p.splits > 1) merge_if_last<Cfg>(p, b, hk, rt, pb.q_start, pb.row0, pb.q_rows);
}

}  // namespace pt
