// The host's read of a call's int32 metadata: a few device ranges gathered, back to back,
// into host-mapped pinned memory. Block b copies elements [b * chunk, (b + 1) * chunk) of the
// concatenation and then sets its flag to `seq`; the host waits on the flags (runtime.py
// read_int32), not on the stream: one launch and no copy-engine round trips.
namespace pt {

constexpr int kReadMaxSpans = 8;

struct ReadParams {
  const int* src[kReadMaxSpans];
  int start[kReadMaxSpans + 1];  // span s fills dst[start[s], start[s + 1])
  int n;                         // spans
  int chunk;                     // elements a block copies
  int seq;                       // every block's flag once its elements have landed
  int* dst;                      // host-mapped
  int* flags;                    // host-mapped, one a block
};

__device__ __forceinline__ void read_int32(const ReadParams& p) {
  const int lo = blockIdx.x * p.chunk;
  const int hi = min(lo + p.chunk, p.start[p.n]);
  for (int s = 0; s < p.n; ++s) {
    const int a = max(lo, p.start[s]), b = min(hi, p.start[s + 1]);
    const int* src = p.src[s];
    const int off = p.start[s];
    for (int i = a + static_cast<int>(threadIdx.x); i < b; i += blockDim.x) p.dst[i] = src[i - off];
  }
  __threadfence_system();  // this thread's elements are visible system-wide
  __syncthreads();         // every thread's are
  if (threadIdx.x == 0) {
    __threadfence_system();  // ordered before the flag for the host (cumulative over the barrier)
    *reinterpret_cast<volatile int*>(p.flags + blockIdx.x) = p.seq;
  }
}

}  // namespace pt

