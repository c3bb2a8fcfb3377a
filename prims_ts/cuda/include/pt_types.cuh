// prims_ts device basics: fixed-width integers, 16-bit float storage types and
// conversions written in inline PTX, so that no CUDA toolkit header is needed
// (the NVRTC wheels ship none). Compiles under NVRTC 12 and 13, sm_80 and up.
#pragma once

namespace pt {

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

// A CUDA tensor map (CUtensorMap), encoded on the host and passed in a kernel's
// __grid_constant__ parameters: what a TMA copy reads its box from.
struct alignas(64) TmaMap { u64 opaque[16]; };

// Storage-only 16-bit float types; arithmetic happens in float32.
struct bf16 { u16 bits; };
struct f16 { u16 bits; };

// Output dtype codes shared with the host (prims_ts/cuda/keys.py).
enum OutDtype : int { OUT_F16 = 0, OUT_BF16 = 1, OUT_F32 = 2 };

__device__ __forceinline__ float to_float(bf16 x) {
  return __uint_as_float(((u32)x.bits) << 16);
}
__device__ __forceinline__ float to_float(f16 x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

// Two floats -> packed 16-bit pair; `lo` lands in the low half (lower address).
template <class T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ u32 pack2<f16>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ int out_dtype_size(int out_dtype) { return out_dtype == OUT_F32 ? 4 : 2; }

// Store two adjacent output elements at `p` in the run-time output dtype.
__device__ __forceinline__ void store_pair(char* p, int out_dtype, float x, float y) {
  if (out_dtype == OUT_F32) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
  } else if (out_dtype == OUT_BF16) {
    *reinterpret_cast<u32*>(p) = pack2<bf16>(x, y);
  } else {
    *reinterpret_cast<u32*>(p) = pack2<f16>(x, y);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

template <class T> __device__ __forceinline__ T min_(T a, T b) { return a < b ? a : b; }
template <class T> __device__ __forceinline__ T max_(T a, T b) { return a > b ? a : b; }
__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace pt
