// The online softmax (exp2, scale * log2(e) folded into the scores): the steps of one row's
// running maximum and sum (OnlineSoftmax: the core's rows and the swapped-operand tile's query
// columns), the core's two rows per thread over a key tile's S fragments (RowSoftmax), and the
// same rows against a reference fixed for a pass (RefSoftmax: the twin MLA tile).
#pragma once
#include "pt_fmha_config.cuh"

namespace pt {

// The steps of one row (or the swapped tile's query column) over its running maximum m of the
// raw scores and its running sum.
struct OnlineSoftmax {
  // Move the maximum m on to mx (>= m). Returns the base the tile's exponents subtract; corr
  // rescales what was summed (and O) to it. A row that has seen no key keeps m = -inf and
  // subtracts 0, so that exp2(-inf - base) is 0 and never NaN.
  __device__ __forceinline__ static float rebase(float& m, float mx, float scale_log2, float& corr) {
    const float base = mx == neg_inf() ? 0.f : mx * scale_log2;
    corr = fast_exp2(m * scale_log2 - base);
    m = mx;
    return base;
  }
  __device__ __forceinline__ static float p(float s, float scale_log2, float base) {
    return fast_exp2(s * scale_log2 - base);
  }
  // The epilogue, `sum` the row's whole sum: what O is multiplied by (0 for a row without
  // keys), and the log2-domain log-sum-exp of the scaled scores (split-KV partials).
  __device__ __forceinline__ static float inverse(float sum, float out_scale) {
    return sum > 0.f ? out_scale / sum : 0.f;
  }
  __device__ __forceinline__ static float lse(float m, float sum, float scale_log2) {
    return sum > 0.f ? m * scale_log2 + fast_log2(sum) : neg_inf();
  }
};

// A thread's rows g and g + 8 of its warp's 16 over S fragments [NT][4] (the mma.sync C
// layout, which wgmma's accumulators share): element e of n-tile nt is row g + 8 * (e >> 1);
// the four lanes of a quad (t = lane & 3) hold a row's keys between them. m / l: the two
// rows' running maxima of the raw scores and this thread's shares of their running sums
// (the caller's: -inf and 0 before the first tile).
// FMAX: the maxima by fmaxf (one min/max instruction; the default compares and selects).
// LAZY: a row keeps its running maximum m while the tile's stays within m + LAZY_SLACK /
// scale_log2, so that P = exp2(S * scale_log2 - m * scale_log2) <= 2^LAZY_SLACK (256: exact in
// the 16-bit P operand, far from fp32's range) and corr is 1: O and the sums need no rescale.
// The sums and O stay relative to the same m, so the final O / l is unchanged; m is then a
// bound, not the maximum (the split-KV merge and the LSE take any reference). The quad's lanes
// (and a SPLIT_O band's warps) share m and mx, so they decide alike.
template <int NT, bool FMAX = false, bool LAZY = false>
struct RowSoftmax {
  static constexpr float LAZY_SLACK = 8.f;
  __device__ __forceinline__ static float max2(float a, float b) {
    if constexpr (FMAX) {
      return fmaxf(a, b);
    } else {
      return max_(a, b);
    }
  }
  // this warp's row maxima over its keys of the tile and the running maxima
  __device__ __forceinline__ static void tile_max(const float (&m)[2], const float (&s)[NT][4], float (&mx)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = m[h];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx[h] = max2(mx[h], max2(s[nt][2 * h], s[nt][2 * h + 1]));
      mx[h] = max2(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = max2(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
  }
  // P = exp2(S - max) in place; the running maxima move on to mx and the sums take the
  // tile's; corr rescales O
  __device__ __forceinline__ static void exp_tile(float (&m)[2], float (&l)[2], float (&s)[NT][4],
                                                  const float (&mx)[2], float (&corr)[2], float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float base;
      // LAZY keeps m where the difference is finite and small (a row that has seen no key has
      // m = -inf: inf or NaN here, and it moves, as it always does otherwise)
      if (LAZY && (mx[h] - m[h]) * scale_log2 <= LAZY_SLACK) {
        corr[h] = 1.f;
        base = m[h] * scale_log2;
      } else {
        base = OnlineSoftmax::rebase(m[h], mx[h], scale_log2, corr[h]);
      }
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][2 * h] = OnlineSoftmax::p(s[nt][2 * h], scale_log2, base);
        s[nt][2 * h + 1] = OnlineSoftmax::p(s[nt][2 * h + 1], scale_log2, base);
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
      }
      l[h] = l[h] * corr[h] + sum;
    }
  }
  // whether O needs corr at all: any row of the warp whose maximum moved (LAZY; otherwise
  // always, as corr is then rarely exactly 1)
  __device__ __forceinline__ static bool rescales(const float (&corr)[2]) {
    if constexpr (LAZY) {
      return __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f);
    } else {
      return true;
    }
  }
  // the epilogue: each row's sum over its quad
  __device__ __forceinline__ static void sum_quad(float (&l)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
  }
};

// Rows g and g + 8 over S fragments [NT][4] (RowSoftmax's layout) against a reference fixed for
// a pass (the twin MLA tile): P = exp2(S * scale_log2 - ref) with no running maximum, so that O
// and the sums are never rescaled. The rows' maxima of the raw scores are kept alongside (fmax,
// this thread's keys only) for the caller's check that none outran the reference.
template <int NT>
struct RefSoftmax {
  // this thread's maxima of rows g, g + 8 over its keys of the tile, from m
  __device__ __forceinline__ static void tile_max(const float (&m)[2], const float (&s)[NT][4], float (&mx)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = m[h];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mx[h] = fmaxf(mx[h], fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    }
  }
  // P in place; l takes the tile's sums (this thread's share)
  __device__ __forceinline__ static void exp_tile(float (&s)[NT][4], const float (&ref)[2], float scale_log2,
                                                  float (&l)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        s[nt][2 * h] = fast_exp2(fmaf(s[nt][2 * h], scale_log2, -ref[h]));
        s[nt][2 * h + 1] = fast_exp2(fmaf(s[nt][2 * h + 1], scale_log2, -ref[h]));
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
      }
      l[h] += sum;
    }
  }
  // the reference of a row whose maximum (raw) is mx: a row without keys subtracts 0
  __device__ __forceinline__ static float reference(float mx, float scale_log2) {
    return mx == neg_inf() ? 0.f : mx * scale_log2;
  }
};

// An accumulator in the C layout ([N][4]: rows g and g + 8) times a factor a row (O rescaled).
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N][4], const float (&f)[2]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    o[i][0] *= f[0];
    o[i][1] *= f[0];
    o[i][2] *= f[1];
    o[i][3] *= f[1];
  }
}

// P over a tile's keys (S fragments [NT][4] after exp_tile) as the A fragments of the P V
// product, 16 keys a k-step (the mma.sync C layout is the A layout).
template <class T, int NT>
__device__ __forceinline__ void pack_p_frags(const float (&s)[NT][4], u32 (&pf)[NT / 2][4]) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    pf[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
    pf[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
    pf[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pf[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

}  // namespace pt
