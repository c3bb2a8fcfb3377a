// The portable tile engine's instructions (sm_80 and up): cp.async global->shared
// copies, ldmatrix fragment loads and mma.sync m16n8k16 with float32 accumulation.
//
// Fragment layouts used throughout (lane = 4*g + t):
//   A 16x16 (row-major): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8  (k x n):     b0 (k=2t..2t+1, n=g)  b1 (k=2t+8.., n=g)
//   C 16x8  (float):     c0,c1 (g, 2t..2t+1)   c2,c3 (g+8, 2t..2t+1)
#pragma once
#include "pt_types.cuh"

namespace pt {

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16-byte global->shared copy; copies zeros instead when `valid` is false.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <class T> __device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1);
template <> __device__ __forceinline__ void mma_16816<bf16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<f16>(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A shared-memory tile of ROWS x COLS 16-bit elements, stored as 16-byte chunks
// with the chunk index XOR-swizzled by (row & 7): ldmatrix over 8 consecutive rows
// at one logical chunk then touches 8 distinct bank groups.
template <int ROWS, int COLS> struct SmemTile {
  static constexpr int CHUNKS = COLS / 8;  // 16-byte chunks per row
  static constexpr int BYTES = ROWS * COLS * 2;
  static_assert(CHUNKS % 8 == 0, "swizzle needs a multiple of 8 chunks per row");
  __device__ static __forceinline__ u32 offset(int row, int chunk) {
    return (u32)(row * COLS + ((chunk ^ (row & 7)) << 3)) * 2u;
  }
};

}  // namespace pt
