// The wgmma engine's staged epilogue: a warpgroup's O rows, scaled and cast to the 16-bit
// output type, go into shared memory by stmatrix (into the warpgroup's own rows of the Q
// tile, in the tile's 128-byte swizzle: free once its last S^T has landed) and from there to
// global memory as whole 16-byte chunks of each row, a row's 2 * D bytes written contiguously
// by D / 8 threads. The alternative (store2) writes 4 bytes a column pair, 2 * D / 8 stores a
// thread with their address arithmetic.
#pragma once
#include "pt_fmha_config.cuh"

namespace pt {

// Problems whose output rows can be stored whole (ROW_STORE): row_store() is the output's
// OutDtype when they can be on this launch (16-bit output, no split-KV partials), else -1;
// o_row(r) is tile row r's first output byte (16-byte aligned: the host checks out's rows).
template <class P, class = void> struct RowStore { static constexpr bool value = false; };
template <class P> struct RowStore<P, decltype(void(P::ROW_STORE))> { static constexpr bool value = P::ROW_STORE; };

__device__ __forceinline__ void stmatrix_x4(u32 addr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b),
               "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared_u4(u32 addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// The calling warp's O (16 rows from tile row `row0`: rows g and g + 8 of each 8-column n-tile,
// its columns from 16-byte chunk `chunk0` on), scaled by `inv` (its two rows' factors) and cast,
// into a Tile at `base`. The mma C layout is stmatrix's: matrix 2k + h is n-tile n + k's rows
// h * 8..; lane l gives row l & 7 of matrix l >> 3 its address.
template <class Tile, class OutT, int DT>
__device__ __forceinline__ void stage_o_rows(u32 base, const float (&o)[DT][4], const float (&inv)[2], int row0,
                                             int chunk0) {
  static_assert(DT % 2 == 0, "n-tile pairs");
  const int lane = threadIdx.x & 31;
  const int mat = lane >> 3;
#pragma unroll
  for (int n = 0; n < DT; n += 2) {
    stmatrix_x4(base + Tile::offset(row0 + (lane & 7) + 8 * (mat & 1), chunk0 + n + (mat >> 1)),
                pack2<OutT>(o[n][0] * inv[0], o[n][1] * inv[0]), pack2<OutT>(o[n][2] * inv[1], o[n][3] * inv[1]),
                pack2<OutT>(o[n + 1][0] * inv[0], o[n + 1][1] * inv[0]),
                pack2<OutT>(o[n + 1][2] * inv[1], o[n + 1][3] * inv[1]));
  }
}

// Warpgroup `wg` (whole-row warps, every thread of it): its rows staged in its Q rows
// (stage_o_rows), then stored. Named barrier 6 + wg orders the warpgroup's rows between the
// two passes.
template <class QTile, class OutT, int DT, class Problem>
__device__ __forceinline__ void store_o_rows(const Problem& pb, u32 sQ, const float (&o)[DT][4],
                                             const float (&inv)[2], int wg, int row0) {
  stage_o_rows<QTile, OutT, DT>(sQ, o, inv, row0, 0);
  named_bar_sync(6 + wg, 128);
  // every chunk read first (O's registers are free now), then the stores of the rows there are
  constexpr int PER_THREAD = 64 * DT / 128;  // DT 16-byte chunks a row
  const int tid = threadIdx.x & 127;
  uint4 v[PER_THREAD];
#pragma unroll
  for (int k = 0; k < PER_THREAD; ++k) {
    const int idx = k * 128 + tid;
    v[k] = ld_shared_u4(sQ + QTile::offset(64 * wg + idx / DT, idx % DT));
  }
#pragma unroll
  for (int k = 0; k < PER_THREAD; ++k) {
    const int idx = k * 128 + tid, row = 64 * wg + idx / DT;
    if (row < pb.q_rows) *reinterpret_cast<uint4*>(pb.o_row(row) + (idx % DT) * 16) = v[k];
  }
}

}  // namespace pt
