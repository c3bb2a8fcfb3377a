// Paged decode (prims_ts_batch_decode_with_kv_cache) and MLA decode: few query tokens
// per request over paged K/V, on the shared FMHA core (the problem: pt_decode.cuh).
//
// Work policy: blockIdx = (split, K/V head * row_tiles + row tile, request). A split
// covers a BN-aligned chunk of keys; with more than one split, every CTA writes its
// normalised partial O and its log-sum-exp to the workspace, and the last split CTA of
// each row tile to finish merges them (merge_if_last: a ticket counter per row tile).
// Balanced keys (Tuning.balanced_split) instead share the launch's key tiles evenly over
// a persistent grid, whatever the requests' lengths (DecodeWalk below).
// MLA decode is this kernel with one latent K/V head (Hkv = 1, group = H) whose V row
// is the first DV values of the K row: the core then keeps one tile per stage. On sm_90a
// row tiles of 64 (H x SQ >= 64) take the twin tile (pt_fmha_twin.cuh; its tiles are TMA
// boxes of the latent pool, DecodeTmaParams) and row tiles of 16/32 the swapped-operand tile
// (pt_fmha_swap.cuh: the keys as wgmma's M; Tuning.mla_swapped); the core's FmhaConfig tiles
// here are the portable engine's (mma.sync), on every arch.
//
// The host appends the `extern "C"` entries (prims_ts/cuda/decode.py).
#include "pt_decode.cuh"
#include "pt_fmha_swap.cuh"
#include "pt_fmha_twin.cuh"

#ifdef PT_CTA_TRACE
// PT_CTA_TRACE (Tuning.cta_trace, a measurement aid; results unchanged): each CTA of the first
// CTA_TRACE_MAX in linear block order records %globaltimer at its start (thread 0) and at its
// last warp's end (the latest of its warps'), and its SM; then the items it ran (a static key's
// one, a balanced key's walk) and, for its first CTA_TRACE_ITEMS, each one's key tiles and
// (thread 0) the clock where its core starts (after the metadata and the page check), where its
// core returns (after the epilogue) and where the item ends (after its merge): [CTA][start ns,
// end ns, SM, 1, items, then per item: tiles, core start, core end, end] (the buffer cleared
// before the launch). benchmarks/cta_trace.py reads it (the launch's edges: how long the SMs
// wait for their first CTA and idle after their last; an item's fixed costs).
#define CTA_TRACE_MAX 8192
#define CTA_TRACE_ITEMS 4
#define CTA_TRACE_WORDS (5 + 4 * CTA_TRACE_ITEMS)
extern "C" {
__device__ unsigned long long pt_cta_trace[CTA_TRACE_MAX][CTA_TRACE_WORDS];
}
__device__ __forceinline__ unsigned long long pt_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// this CTA's row of the trace (its linear block index)
__device__ __forceinline__ unsigned long long pt_cta_trace_row() {
  return blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
}
#endif

namespace pt {

// Split-KV without a second kernel: every split CTA of a (request, K/V head, row tile)
// publishes its partial and takes a ticket; the last one to arrive merges the tile's
// rows and resets the counter to zero for the next launch (the workspace contract:
// zeroed before first use, left reusable). The MMA threads (0 .. Cfg::THREADS - 1) meet
// at named barrier 2; a producer warpgroup has left already.
//
// The merge: O = sum_s 2^(lse_s - lse_max) O_s / sum_s 2^(lse_s - lse_max). The splits'
// log-sum-exps go to shared memory (the core is done with it) in one parallel pass, a
// warp per row turns them into normalised weights (out_scale folded in). The weighted
// sum is latency-bound (one merging CTA reads every split's rows), so its work units
// are (4-column group, split lane): a unit sums its group over the splits s = lane
// (mod lanes), UNITS of them a thread with two splits each in flight. There are as many
// lanes as fill one pass, so few rows over many splits (long-context decode: 4 rows x
// 128 splits) still keep every thread's loads in flight; the lanes' sums then meet in
// shared memory. Many rows (MLA's 64) take one lane and several passes.
// The partials a merge reads: part s's first row (of DV floats) in the workspace. Static
// split-KV: the tile's rows of split s, rows_max apart. Balanced split-KV: the parts are the
// slots of the row tile's CTAs in consecutive groups (row_tiles CTAs apart), two slots a CTA,
// part 0 one slot off the others' stride where the unit is its CTA's last item, not its first
// (DecodeWalk).
struct MergeParts {
  int count;
  i64 first, second, step;  // part 0's row, part 1's row, rows from part s to s + 1 (s >= 1)
  __device__ __forceinline__ i64 row(int s) const { return s == 0 ? first : second + (i64)(s - 1) * step; }
  __device__ __forceinline__ static MergeParts strided(int count, i64 first, i64 step) {
    return MergeParts{count, first, first + step, step};
  }
};

// The ticket: true in the CTA that arrives last (thread 0 takes it: `take`, true in the last
// arrival, which resets the counter). The MMA threads meet at named barrier 2.
template <int THREADS, class Take>
__device__ __forceinline__ bool merge_ticket_by(const Take& take) {
  __shared__ int last;
  __threadfence();  // this thread's partial stores, before the ticket
  named_bar_sync(2, THREADS);
  if (threadIdx.x == 0) last = take();
  named_bar_sync(2, THREADS);
  if (!last) return false;
  __threadfence();  // every other split's partials, after the ticket
  return true;
}
// A row tile's ticket over its `parts`
template <int THREADS>
__device__ __forceinline__ bool merge_ticket(const DecodeParams& p, int parts, int b, int hk, int rt) {
  return merge_ticket_by<THREADS>([&] { return take_ticket(p, b, hk, rt, parts); });
}

// The parts' weights w[q_rows][S] in shared memory: every (row, part) log-sum-exp loaded with
// all the loads in flight, then a warp per row turns them into normalised weights in place
// (out_scale folded in).
// TO_PART: the merged rows are a partial again (balanced split-KV's group, merged into its
// part 0's slot): no out_scale, and each row's merged log-sum-exp written over part 0's (every
// part's read into shared memory before; +-inf kept, so that a poisoned part still poisons).
template <int THREADS, bool TO_PART = false>
__device__ __forceinline__ void merge_weights(const DecodeParams& p, const MergeParts& parts, float* w, int q_rows) {
  const int S = parts.count;
  for (int i = threadIdx.x; i < q_rows * S; i += THREADS) {
    const int r = i / S;
    w[i] = p.ws_lse[parts.row(i - r * S) + r];
  }
  named_bar_sync(2, THREADS);
  const int lane = threadIdx.x & 31;
  for (int r = threadIdx.x >> 5; r < q_rows; r += THREADS / 32) {
    float* wr = w + r * S;
    float mx = neg_inf();
    for (int s = lane; s < S; s += 32) mx = max_(mx, wr[s]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max_(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int s = lane; s < S; s += 32) {
      // an all-empty row (every lse -inf) weighs nothing and writes zeros; so does a row
      // that a split poisoned (lse +inf: a page ID outside the pools)
      const float e = (mx == neg_inf() || mx == pos_inf()) ? 0.f : fast_exp2(wr[s] - mx);
      wr[s] = e;
      sum += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float scale = sum > 0.f ? (TO_PART ? 1.f : p.out_scale) / sum : 0.f;
    for (int s = lane; s < S; s += 32) wr[s] *= scale;
    if (TO_PART && lane == 0) {
      p.ws_lse[parts.first + r] = (mx == neg_inf() || mx == pos_inf()) ? mx : mx + fast_log2(sum);
    }
  }
  named_bar_sync(2, THREADS);
}

// Group g of a tile's merged rows (row g / QUADS, columns 4 (g % QUADS) .. + 3) to the output.
template <int QUADS>
__device__ __forceinline__ void merge_store(const DecodeParams& p, int b, int hk, int q_start, int row0, int g,
                                            const float4& v) {
  const int r = g / QUADS, c = 4 * (g % QUADS);
  char* dst = decode_out_row(p, b, hk, q_start, row0 + r) + c * out_dtype_size(p.out_dtype);
  store_pair(dst, p.out_dtype, v.x, v.y);
  store_pair(dst + 2 * out_dtype_size(p.out_dtype), p.out_dtype, v.z, v.w);
}

// Group g of the merged rows to the output (merge_store), or (TO_PART) to part 0's rows
template <int QUADS, bool TO_PART>
__device__ __forceinline__ void merge_out(const DecodeParams& p, const MergeParts& parts, int b, int hk, int q_start,
                                          int row0, int g, const float4& v) {
  if constexpr (TO_PART) {
    reinterpret_cast<float4*>(p.ws_o)[(parts.first + g / QUADS) * QUADS + g % QUADS] = v;
  } else {
    merge_store<QUADS>(p, b, hk, q_start, row0, g, v);
  }
}

// The merge of `parts` into rows row0 .. row0 + q_rows - 1 of a tile (the rows of part s at
// parts.row(s)), by the MMA threads of one CTA. TO_PART: into part 0's rows instead (in place:
// each of a row group's sums is stored by the thread that read it, or after the lanes' barrier).
template <class Cfg, bool TO_PART = false>
__device__ __noinline__ void merge_parts(const DecodeParams& p, const MergeParts parts, int b, int hk, int q_start,
                                         int row0, int q_rows) {
  extern __shared__ __align__(1024) char smem[];  // the core is done with it (not re-aligned: floats)
  constexpr int THREADS = Cfg::THREADS, DV = Cfg::DV, QUADS = DV / 4;
  // units a thread: 6, within every decode kernel's own register count (none re-divides its
  // registers among warpgroups with setmaxnreg, which would compile this out-of-line function
  // at the smallest share: fewer units there, its spills growing with them)
  constexpr int UNITS = 6;
  static_assert(DV % 4 == 0, "4-column groups");
  static_assert((Cfg::BM * DECODE_MAX_SPLITS * 4 + 15) / 16 * 16 <= Cfg::SMEM_BYTES,
                "the static split's weights fit the tile's shared memory (balanced split-KV: the plan checks)");
  const int S = parts.count;  // >= 2
  const int w_bytes = (q_rows * S * 4 + 15) / 16 * 16;
  float* w = reinterpret_cast<float*>(smem);                  // [q_rows][S]
  float4* sums = reinterpret_cast<float4*>(smem + w_bytes);   // [lane][group]
  merge_weights<THREADS, TO_PART>(p, parts, w, q_rows);

  // The weighted sums over (group, split lane) units (above). Group g is the float4 at 4 g of a
  // part's rows (DV = 4 QUADS; the workspace is 16-byte aligned); lanes: as many as fill one
  // pass and the shared memory after the weights (CTA-uniform).
  const int n = q_rows * QUADS;
  const float4* o4 = reinterpret_cast<const float4*>(p.ws_o);  // part s's group g: o4[row(s) QUADS + g]
  const int slots = (Cfg::SMEM_BYTES - w_bytes) / 16;
  const int lanes = max_(1, min_(S, min_(THREADS * UNITS, slots) / n));
  const int units = lanes * n;
#pragma unroll 1
  for (int u0 = 0; u0 < units; u0 += THREADS * UNITS) {
    float4 acc[UNITS];
    int grp[UNITS], first[UNITS], wrow[UNITS];  // the unit's group, first split (S or more: none), weights
#pragma unroll
    for (int k = 0; k < UNITS; ++k) {
      acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      const int u = u0 + threadIdx.x + k * THREADS;
      grp[k] = u % n;
      first[k] = u < units ? u / n : S;
      wrow[k] = grp[k] / QUADS * S;
    }
#pragma unroll 1
    for (int s = 0; s < S; s += 2 * lanes) {
#pragma unroll
      for (int k = 0; k < UNITS; ++k) {
        const int sa = s + first[k], sb = sa + lanes;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), c = a;
        if (sa < S) a = o4[parts.row(sa) * QUADS + grp[k]];
        if (sb < S) c = o4[parts.row(sb) * QUADS + grp[k]];
        const float wa = sa < S ? w[wrow[k] + sa] : 0.f, wb = sb < S ? w[wrow[k] + sb] : 0.f;
        acc[k].x += wa * a.x + wb * c.x;
        acc[k].y += wa * a.y + wb * c.y;
        acc[k].z += wa * a.z + wb * c.z;
        acc[k].w += wa * a.w + wb * c.w;
      }
    }
#pragma unroll
    for (int k = 0; k < UNITS; ++k) {
      const int u = u0 + threadIdx.x + k * THREADS;
      if (u >= units) continue;
      if (lanes > 1) {
        sums[u] = acc[k];  // u = lane * n + group
      } else {
        merge_out<QUADS, TO_PART>(p, parts, b, hk, q_start, row0, u, acc[k]);
      }
    }
  }
  if (lanes > 1) {  // one pass (units <= THREADS * UNITS): the lanes' sums per group
    named_bar_sync(2, THREADS);
    for (int g = threadIdx.x; g < n; g += THREADS) {
      float4 t = sums[g];
      for (int l = 1; l < lanes; ++l) {
        const float4 x = sums[l * n + g];
        t.x += x.x;
        t.y += x.y;
        t.z += x.z;
        t.w += x.w;
      }
      merge_out<QUADS, TO_PART>(p, parts, b, hk, q_start, row0, g, t);
    }
  }
}

// The ticket merge: the row tile's split CTA that arrives last merges every part. Balanced
// split-KV's MLA units (the twin's and the swapped tile's) of more than 2 merge_fan parts (one
// long request cut over many CTAs, all of them done at about the same time) merge in two
// levels, so that no CTA reads them all alone: the parts in groups of merge_fan (group j: parts
// j fan .. j fan + fan - 1), the last arrival of each group merging it into its part 0's slot
// (its own ticket, group_ticket); then the unit's ticket over the groups, whose last arrival
// merges the groups' partials. A unit of fan + 1 .. 2 fan parts merges in one level: a second
// level there reads about as many parts and adds a ticket's trip (MLA H16, 9 parts: x 0.96).
// The MLA parts (8-64 rows x 512 floats, 16-128 KB) are worth a second level (MLA H64 x 1.86,
// H16 x 1.37); the decode tiles' (2-16 KB) merge in a few trips, which it only lengthens (a long
// request's decode x 0.97): benchmarks/NOTES.md. `s`: this CTA's part.
template <class Cfg, bool BALANCED>
__device__ __forceinline__ void merge_if_last(const DecodeParams& p, const MergeParts& parts, int s, int b, int hk,
                                              int rt, int q_start, int row0, int q_rows) {
  constexpr int THREADS = Cfg::THREADS;
  const int P = parts.count;
  if constexpr (BALANCED && (Cfg::TWIN || Cfg::SWAP)) {
    const int fan = p.merge_fan;
    if (fan >= 2 && P > 2 * fan) {
      const int j = s / fan, n = min_(fan, P - j * fan), groups = (P + fan - 1) / fan;
      const i64 first = parts.row(j * fan);
      if (n > 1) {  // (a group of one part is its own partial)
        const i64 rows = min_(Cfg::BM, p.rows_max);  // a balanced slot's rows
        if (!merge_ticket_by<THREADS>([&] { return take_ticket(group_ticket(p, first / rows), n); })) return;
        merge_parts<Cfg, true>(p, MergeParts{n, first, parts.row(j * fan + 1), parts.step}, b, hk, q_start, row0,
                               q_rows);
      }
      if (merge_ticket<THREADS>(p, groups, b, hk, rt)) {
        merge_parts<Cfg>(p, MergeParts{groups, parts.first, parts.row(fan), (i64)fan * parts.step}, b, hk, q_start,
                         row0, q_rows);
      }
      return;
    }
  }
  if (merge_ticket<THREADS>(p, P, b, hk, rt)) merge_parts<Cfg>(p, parts, b, hk, q_start, row0, q_rows);
}

// Split-KV in thread block clusters (sm_90a; Tuning.cluster_merge). The plan launches a row
// tile's 2-8 split CTAs as one cluster where the partials fit the shared memory, or (two
// levels) its splits as C > 1 clusters of S = splits / C each. Each split CTA leaves its
// normalised partial rows and log-sum-exps at the end of its own dynamic shared memory (part:
// [BM][DV + pad], then [BM]); after one cluster barrier every CTA merges its slice of the
// tile's 4-column groups, reading the S partials of a group through distributed shared
// memory, all in flight at once; a second barrier keeps each CTA's partials alive until its
// peers have read them. One level: the merged rows are the output; no workspace, ticket or
// last CTA. Two levels: the merged rows are cluster c's partial in the workspace (the static
// split's slot c), its rank 0 takes the row tile's ticket (counting clusters) once every CTA
// of the cluster has written, and the cluster that arrives last merges the C partials, each of
// its CTAs a slice of the tile's rows (merge_parts): the second level is S CTAs wide too.
// O = sum_s 2^(lse_s - lse_max) O_s / sum_s 2^(lse_s - lse_max) as in merge_parts (an
// all-empty or poisoned row writes zeros; a poisoned one's +inf carries to the second level).
constexpr int CLUSTER_MAX_SPLITS = 8;  // decode.CLUSTER_MAX_SPLITS: the portable cluster size
constexpr int DECODE_SMEM_LIMIT = 232448;  // keys.SM90_SMEM_LIMIT: sm_90's per-block opt-in shared memory

// Two levels: whether this launch's clusters hold part of a row tile's splits (the plan's
// clusters divide them: the grid's x is the splits)
__device__ __forceinline__ bool cluster_two_levels(const DecodeParams& p) {
  return (int)cluster_nctarank() < p.splits;
}

// The second level of a two-level cluster merge (after every CTA of the cluster wrote its share
// of the cluster's partial): rank 0 takes the row tile's ticket, counting clusters, and writes
// the verdict into every CTA of its cluster; the last cluster's CTAs merge the C partials, each
// a slice of the tile's rows. Out of line: the core's registers are not held for it.
template <class Cfg>
__device__ __noinline__ void merge_clusters(const DecodeParams& p, int b, int hk, int rt, int q_start, int row0,
                                            int q_rows) {
  const int S = (int)cluster_nctarank(), rank = (int)cluster_ctarank();
  __shared__ u32 last;  // rank 0's verdict, written into every CTA of the cluster
  if (rank == 0 && threadIdx.x == 0) {
    const u32 v = take_ticket(p, b, hk, rt, p.splits / S);
    for (int k = 0; k < S; ++k) st_cluster_u32(cluster_map(smem_addr(&last), (u32)k), v);
  }
  __syncwarp();
  cluster_sync();  // the verdict in every CTA (no CTA reads another's shared memory after this)
  if (!last) return;
  __threadfence();  // every other cluster's partials, after the ticket
  const int rows = (q_rows + S - 1) / S, r0 = min_(q_rows, rank * rows), r1 = min_(q_rows, r0 + rows);
  if (r1 > r0) {
    merge_parts<Cfg>(p, MergeParts::strided(p.splits / S, decode_split_row(p, b, hk, 0, row0 + r0), p.rows_max), b,
                     hk, q_start, row0 + r0, r1 - r0);
  }
}

// The MMA threads (0 .. Cfg::THREADS - 1) merge; a producer warpgroup (its registers given
// back) only meets the barriers (cluster_merge_syncs of them).
template <class Cfg>
__device__ __forceinline__ void merge_cluster(const DecodeParams& p, const float* part, int b, int hk, int rt,
                                              int q_start, int row0, int q_rows) {
  constexpr int BM = Cfg::BM, DV = Cfg::DV, QUADS = DV / 4, PS = cluster_part_stride<DV>();
  const int S = (int)cluster_nctarank();  // the cluster's CTAs (2-8)
  const bool two = cluster_two_levels(p);
  // two levels: this cluster's partial rows, the static split's slot c of the row tile
  const i64 slot0 = decode_split_row(p, b, hk, (int)blockIdx.x / S, row0);
  __syncwarp();  // converged for the .aligned barrier
  cluster_sync();  // every split's partials written
  const int n = q_rows * QUADS, per = (n + S - 1) / S;
  const int rank = (int)cluster_ctarank();
  const int g0 = rank * per, g1 = min_(n, g0 + per);
  const u32 local = smem_addr(part);
  for (int g = g0 + (int)threadIdx.x; g < g1; g += Cfg::THREADS) {
    const int r = g / QUADS, c = 4 * (g % QUADS);
    float lse[CLUSTER_MAX_SPLITS];
    float4 o[CLUSTER_MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < CLUSTER_MAX_SPLITS; ++s) {
      lse[s] = neg_inf();
      o[s] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (s < S) {
        const u32 peer = cluster_map(local, (u32)s);
        lse[s] = ld_cluster_f32(peer + (u32)(BM * PS + r) * 4);
        o[s] = ld_cluster_f32x4(peer + (u32)(r * PS + c) * 4);
      }
    }
    float mx = neg_inf();
#pragma unroll
    for (int s = 0; s < CLUSTER_MAX_SPLITS; ++s) mx = max_(mx, lse[s]);
    const bool none = mx == neg_inf() || mx == pos_inf();
    float sum = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < CLUSTER_MAX_SPLITS; ++s) {
      const float e = none || s >= S ? 0.f : fast_exp2(lse[s] - mx);
      sum += e;
      acc.x += e * o[s].x;
      acc.y += e * o[s].y;
      acc.z += e * o[s].z;
      acc.w += e * o[s].w;
    }
    if (two) {  // cluster c's partial: normalised rows and their log-sum-exp (+-inf kept)
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      *reinterpret_cast<float4*>(p.ws_o + (slot0 + r) * DV + c) =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (c == 0) p.ws_lse[slot0 + r] = none ? mx : mx + fast_log2(sum);
    } else {
      const float scale = sum > 0.f ? p.out_scale / sum : 0.f;
      char* dst = decode_out_row(p, b, hk, q_start, row0 + r) + c * out_dtype_size(p.out_dtype);
      store_pair(dst, p.out_dtype, acc.x * scale, acc.y * scale);
      store_pair(dst + 2 * out_dtype_size(p.out_dtype), p.out_dtype, acc.z * scale, acc.w * scale);
    }
  }
  if (two) __threadfence();  // this thread's partial stores, before rank 0's ticket
  __syncwarp();
  cluster_sync();  // the peers are done reading this CTA's partials (two levels: the cluster's written)
  if (two) merge_clusters<Cfg>(p, b, hk, rt, q_start, row0, q_rows);
}

// The cluster barriers a CTA of a clustered launch meets in merge_cluster (its producer
// warpgroup, which leaves before the merge, meets them too): two, three with two levels.
__device__ __forceinline__ int cluster_merge_syncs(const DecodeParams& p) { return cluster_two_levels(p) ? 3 : 2; }

// The twin keys' parameters: the latent pool's TMA map (pages of 64-column boxes; V's slot
// unused: V is K's prefix), then the DecodeParams.
struct DecodeTmaParams {
  TmaMap tmap_k;
  TmaMap tmap_v;
  DecodeParams p;
};

// One work item of a CTA: request b, K/V head hk, row tile rt, keys [begin, end) (clipped to
// the request's length), and where its output goes: slot < 0 the output rows; else partials
// (the static split's index, or a balanced slot), merged once every part of the unit arrived.
// parts, c0, x: a balanced partial's unit (its part count, first group and part 0's slot offset).
struct DecodeItem {
  int b, hk, rt, begin, end, slot, parts, c0, x;
};

// Balanced split-KV (DecodeParams::balanced = G > 0; the balanced keys, Tuning.balanced_split).
// The CTAs form groups of R = row_tiles (CTA c: group c / R, row tile c % R; the G mod R CTAs
// past the last whole group leave at once), and a group's CTAs walk the same keys, each its
// own row tile: a request's row tiles read the same pages at the same time, so DRAM streams
// them once (a walk over (request, head, row tile) units read them twice: the twin at H128 x
// 0.60, benchmarks/NOTES.md). The units (request b, K/V head), in that order, weigh W(b) key
// tiles each: the request's length in BN tiles (1 where it is empty or past the plan's
// capacity: the unit is still written), from the first one a causal window lets its rows see
// (unit_span). Every CTA scans the weights (the same sums everywhere: the metadata do not
// change under a launch); group k takes the global tiles [k T / G', (k + 1) T / G'), T the
// total and G' = min(G / R, T) (so that no range is empty: the groups past G' leave at once),
// and walks the items its range's unit boundaries cut. An item holding its whole unit writes
// the output rows; a cut one (only a range's first and last can be) leaves partials in the
// CTA's slot 2c (its first item) or 2c + 1 (its last), and the row tile's last part to arrive
// merges them. The parts of a unit are the consecutive groups grp(first tile) .. grp(last
// tile), grp(v) = floor(((v + 1) G' - 1) / T), each the row tile's CTA of its group: part
// s >= 1 holds the unit as its CTA's first item (slot 2 ((k0 + s) R + rt)), part 0 as its first
// or, where its range began before the unit, its last (x). Thread 0 walks the range in shared
// memory (the items double-buffered behind the CTA barrier that starts each item), so no walk
// state is live in registers across the core.
struct DecodeWalk {
  i64 pos, t1, total, sreq;  // next tile; the range's end; the tile total; request b's first tile
  int b, wb, wf, g;          // the current request, its units' weight and first key tile, G'
};

// This CTA's group and row tile under balanced split-KV (DecodeWalk)
__device__ __forceinline__ int walk_group(const DecodeParams& p) { return (int)blockIdx.x / p.row_tiles; }
__device__ __forceinline__ int walk_row_tile(const DecodeParams& p) { return (int)blockIdx.x % p.row_tiles; }

// The key tiles of each unit of request b: `weight` of its BN tiles from tile `first`. Its
// length (one tile where it is empty or past the plan's capacity: the unit is still written),
// from the first tile a causal window lets any of its query rows see (token 0's band starts
// lowest).
struct UnitSpan {
  int first, weight;
};

template <int BN, bool CAUSAL>
__device__ __forceinline__ UnitSpan unit_span(const DecodeParams& p, int b) {
  const int sk = p.seq_lens[b];
  if (!(sk > 0 && sk <= p.chunk)) return UnitSpan{0, 1};
  int first = 0;
  if (CAUSAL && p.window_left >= 0) {
    const int sq = p.qo_indptr != nullptr ? p.qo_indptr[b + 1] - p.qo_indptr[b] : p.sq;
    const i64 lo = (i64)sk - max_(sq, 1) - p.window_left;  // token 0's first visible key
    first = lo > 0 ? (int)(lo / BN) : 0;
  }
  return UnitSpan{first, (sk + BN - 1) / BN - first};
}

// Group k's first global tile, and the group whose range holds tile v
__device__ __forceinline__ i64 walk_first(int k, i64 total, int g) { return (i64)k * total / g; }
__device__ __forceinline__ int walk_grp(i64 v, i64 total, int g) { return (int)(((v + 1) * g - 1) / total); }

// Thread 0: the walk's next item into `it` (b = -1: the range is done).
template <int BN, bool CAUSAL>
__device__ __forceinline__ void walk_next(const DecodeParams& p, DecodeWalk& w, DecodeItem& it) {
  if (w.pos >= w.t1 || w.b >= p.batch) {
    it.b = -1;
    return;
  }
  const int units = p.hkv;
  const int j = (int)((w.pos - w.sreq) / w.wb);  // the unit (K/V head) within request b
  const i64 su = w.sreq + (i64)j * w.wb, eu = su + w.wb;
  const int a = (int)(w.pos - su), e = (int)(min_(w.t1, eu) - su);
  const bool first = w.pos == walk_first(walk_group(p), w.total, w.g);
  it.b = w.b;
  it.hk = j;
  it.rt = walk_row_tile(p);
  it.begin = (w.wf + a) * BN;
  it.end = (w.wf + e) * BN;
  if (a == 0 && e == w.wb) {
    it.slot = -1;
  } else {
    it.slot = 2 * (int)blockIdx.x + (first ? 0 : 1);
    it.c0 = walk_grp(su, w.total, w.g);
    it.parts = walk_grp(eu - 1, w.total, w.g) - it.c0 + 1;
    it.x = walk_first(it.c0, w.total, w.g) != su;
  }
  w.pos = su + e;
  if (j + 1 == units && w.pos < w.t1) {  // request b's units are done: on to b + 1
    w.sreq = eu;
    if (++w.b < p.batch) {
      const UnitSpan u = unit_span<BN, CAUSAL>(p, w.b);
      w.wb = u.weight;
      w.wf = u.first;
    }
  }
}

// Every thread of the CTA: the tile total, this CTA's group's range and the request holding its
// first tile (a scan of the requests' weights, each thread a run of consecutive requests), into
// thread 0's walk with the first item. False: no range (a CTA past the whole groups, or a group
// past G').
template <class Cfg, bool CAUSAL>
__device__ __forceinline__ bool walk_start(const DecodeParams& p, char* scratch, DecodeWalk& w, DecodeItem& it) {
  constexpr int NT = Cfg::LAUNCH_THREADS, NW = NT / 32, BN = Cfg::BN;
  i64* wsum = reinterpret_cast<i64*>(scratch);  // [NW] the warps' sums
  const int units = p.hkv, B = p.batch;
  const int per = (B + NT - 1) / NT, b0 = min_(B, (int)threadIdx.x * per), b1 = min_(B, b0 + per);
  i64 mine = 0;
  for (int i = b0; i < b1; ++i) mine += unit_span<BN, CAUSAL>(p, i).weight;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  i64 incl = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const i64 y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  i64 before = 0, all = 0;
#pragma unroll
  for (int k = 0; k < NW; ++k) {
    const i64 x = wsum[k];
    before += k < warp ? x : 0;
    all += x;
  }
  const i64 total = all * units;  // >= B * units >= 1
  const int g = (int)min_((i64)gridDim.x / p.row_tiles, total), k = walk_group(p);
  if (k >= g) return false;  // the same in every thread (g >= 1: the plan's G >= row_tiles)
  const i64 t0 = walk_first(k, total, g);
  const i64 s0 = (before + incl - mine) * units;  // the first tile of request b0
  if (s0 <= t0 && t0 < s0 + mine * units) {       // this thread's requests hold tile t0
    i64 s = s0;
    for (int i = b0; i < b1; ++i) {
      const i64 e = s + (i64)unit_span<BN, CAUSAL>(p, i).weight * units;
      if (t0 < e) {
        w.b = i;
        w.sreq = s;
        break;
      }
      s = e;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    w.pos = t0;
    w.t1 = walk_first(k + 1, total, g);
    w.total = total;
    w.g = g;
    const UnitSpan u = unit_span<BN, CAUSAL>(p, w.b);
    w.wb = u.weight;
    w.wf = u.first;
    walk_next<BN, CAUSAL>(p, w, it);
  }
  __syncthreads();  // the first item in shared memory; the scratch free again
  return true;
}

// One item on the whole CTA: the core over its keys, then (partials) the merge.
template <class Cfg, bool CAUSAL, bool BALANCED>
__device__ __forceinline__ void decode_item(const DecodeParams& p, char* smem, const DecodeItem& it,
                                            const TmaMap* tmk, u64* core_clock = nullptr) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  const int b = it.b, hk = it.hk, rt = it.rt;
  DecodeProblem<T, Cfg::DV, BM, BN, CAUSAL> pb;
  int q_start, sq;
  decode_request(p, b, q_start, sq);
  // rows beyond this request's queries: nothing to write or merge
  if (!pb.init(p, b, hk, q_start, sq, rt * BM, p.group * sq)) return;
  pb.split = it.slot;

  // range: the item's keys, narrowed by the causal band of the tile's tokens
  int begin = it.begin, end = min_(pb.sk, it.end);
  if (CAUSAL) {
    end = min_(end, pb.diag(pb.q_rows - 1) + 1);
    if (p.window_left >= 0) begin = max_(begin, pb.diag(0) - p.window_left);
  }
  pb.kv_begin = begin;
  pb.kv_end = max_(begin, end);
  // fail closed: the pages of every key the range's tiles load (BN-aligned, up to the length:
  // past a causal band's end and before a window's start too) index the pools; else no key
  // and a poisoned merge
  if (pb.kv_end > pb.kv_begin &&
      !pb.pages_ok(pb.kv_begin / BN * BN, min_(pb.sk, ((pb.kv_end - 1) / BN + 1) * BN))) {
    pb.kv_end = pb.kv_begin;
    pb.poisoned = true;
  }
  // Every item runs the core, even with an empty range: a partial is then zero with
  // lse = -inf, which the merge weighs as nothing.
  const float out_scale = it.slot >= 0 ? 1.f : p.out_scale;
#ifdef PT_CTA_TRACE
  if (core_clock != nullptr && threadIdx.x == 0) core_clock[0] = pt_globaltimer();
#endif
  if constexpr (Cfg::TWIN) {
    fmha_tile_twin<Cfg>(pb, smem, p.scale_log2, out_scale, tmk);
  } else if constexpr (Cfg::SWAP) {
    fmha_tile_swap<Cfg>(pb, smem, p.scale_log2, out_scale);
  } else {
    fmha_tile<Cfg>(pb, smem, p.scale_log2, out_scale);
  }
#ifdef PT_CTA_TRACE
  if (core_clock != nullptr && threadIdx.x == 0) core_clock[1] = pt_globaltimer();
#endif
  // the splits launched as one cluster (the plan's launch shape: decode.decode_cluster, which
  // takes it only where round16(the key's bytes) + the partials fit, so CLUSTER_FITS holds,
  // and launches with those bytes: the partials lie past the core's). The twin's lie over its
  // own bytes, which its epilogue no longer needs (the launch keeps the key's bytes: the tile's
  // plus 1024 of alignment slack): they end at the launch's end and must not reach Q, which
  // ends at most 1023 bytes past the tile's SMEM_Q.
  constexpr int PART = cluster_part_bytes<Cfg::BM, Cfg::DV>();
  constexpr bool CLUSTER_FITS = Cfg::TWIN ? Cfg::SMEM_Q + PART <= Cfg::SMEM_BYTES
                                          : Cfg::SMEM_BYTES + PART <= DECODE_SMEM_LIMIT;
  const bool clustered = CLUSTER_FITS && pb.clustered();
  if (threadIdx.x >= Cfg::THREADS) {  // the producer warpgroup: done, but for the cluster's barriers
#if __CUDA_ARCH__ >= 900
    if (clustered) {
      for (int k = cluster_merge_syncs(p); k > 0; --k) cluster_sync();
    }
#endif
    return;
  }
  if (clustered) {
#if __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER_FITS) merge_cluster<Cfg>(p, pb.cluster_part(), b, hk, rt, pb.q_start, pb.row0, pb.q_rows);
#endif
  } else if (it.slot >= 0) {
    const i64 rows = min_(BM, p.rows_max), R = p.row_tiles;  // a balanced slot's rows; CTAs a group
    const MergeParts parts =
        p.balanced > 0
            ? MergeParts{it.parts, rows * (2 * (it.c0 * R + rt) + it.x), rows * (2 * ((it.c0 + 1) * R + rt)),
                         2 * R * rows}
            : MergeParts::strided(p.splits, decode_split_row(p, b, hk, 0, pb.row0), p.rows_max);
    // this CTA's part: its group's place after the unit's first (static: the split)
    const int part = BALANCED ? walk_group(p) - it.c0 : it.slot;
    merge_if_last<Cfg, BALANCED>(p, parts, part, b, hk, rt, pb.q_start, pb.row0, pb.q_rows);
  }
}

// PT_CTA_TRACE: thread 0 records item i (its key tiles, its core's clocks, its end)
template <class Cfg>
__device__ __forceinline__ void trace_item(int i, const DecodeItem& it, const u64* core_clock) {
#ifdef PT_CTA_TRACE
  const u64 lin = pt_cta_trace_row();
  if (threadIdx.x == 0 && lin < CTA_TRACE_MAX) {
    pt_cta_trace[lin][4] = (u64)(i + 1);
    if (i < CTA_TRACE_ITEMS) {
      unsigned long long* w = &pt_cta_trace[lin][5 + 4 * i];
      w[0] = (u64)((it.end - it.begin) / Cfg::BN);
      w[1] = core_clock[0];
      w[2] = core_clock[1];
      w[3] = pt_globaltimer();
    }
  }
#endif
}

// BALANCED: the balanced split-KV keys (decode.DecodeKey.balanced), whose grid walks the
// items of its key tiles; the others one item a CTA, blockIdx = (split, K/V head * row_tiles
// + row tile, request).
template <class Cfg, bool CAUSAL, bool BALANCED = false>
__device__ __forceinline__ void decode_grid(const DecodeParams& p, const TmaMap* tmk) {
  // sm_90a's decode tiles are SwapConfig and TwinConfig; FmhaConfig's wgmma engine (a producer
  // ring of whole-row warpgroups) is the prefill family's
  static_assert(Cfg::SWAP || Cfg::TWIN || Cfg::ARCH == 80, "decode: FmhaConfig tiles on the portable engine");
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = Cfg::ARCH == 90 ? align_smem_1024(smem_raw) : smem_raw;
#ifdef PT_CTA_TRACE
  __shared__ u64 core_clock[2];  // thread 0's: the current item's core start and end
#else
  u64* const core_clock = nullptr;
#endif
  if constexpr (BALANCED) {
    __shared__ DecodeWalk walk;
    __shared__ DecodeItem items[2];
    if (!walk_start<Cfg, CAUSAL>(p, smem, walk, items[0])) return;
#pragma unroll 1
    for (int i = 0;; ++i) {
      if (i > 0) {
        // this thread's generic writes (epilogue, merge) before the next item's TMA / wgmma
        if constexpr (Cfg::ARCH == 90) fence_proxy_async();
        __syncthreads();  // the previous item's shared memory and merge done; items[i & 1] written
      }
      if (items[i & 1].b < 0) break;
      if (threadIdx.x == 0) walk_next<Cfg::BN, CAUSAL>(p, walk, items[(i + 1) & 1]);
      decode_item<Cfg, CAUSAL, true>(p, smem, items[i & 1], tmk, core_clock);  // its fields read where used
      trace_item<Cfg>(i, items[i & 1], core_clock);
    }
  } else {
    const int split = blockIdx.x;
    const DecodeItem it{(int)blockIdx.z, (int)blockIdx.y / p.row_tiles, (int)blockIdx.y % p.row_tiles,
                        split * p.chunk, split * p.chunk + p.chunk, p.splits > 1 ? split : -1, 0, 0, 0};
    decode_item<Cfg, CAUSAL, false>(p, smem, it, tmk, core_clock);
    trace_item<Cfg>(0, it, core_clock);
  }
}

template <class Cfg, bool CAUSAL, bool BALANCED = false>
__device__ __forceinline__ void decode_kernel(const DecodeParams& p, const TmaMap* tmk = nullptr) {
#ifdef PT_CTA_TRACE
  const u64 t0 = pt_globaltimer();
  decode_grid<Cfg, CAUSAL, BALANCED>(p, tmk);
  // no CTA barrier (a producer warpgroup may have left early): each warp's end, the latest kept
  const u64 lin = pt_cta_trace_row();
  if ((threadIdx.x & 31) == 0 && lin < CTA_TRACE_MAX) {
    const u64 t1 = pt_globaltimer();
    atomicMax(&pt_cta_trace[lin][1], (unsigned long long)t1);
    if (threadIdx.x == 0) {
      u32 smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      pt_cta_trace[lin][0] = t0;
      pt_cta_trace[lin][2] = smid;
      pt_cta_trace[lin][3] = 1;
    }
  }
#else
  decode_grid<Cfg, CAUSAL, BALANCED>(p, tmk);
#endif
}

// A TMA key's entry: the map lives in the kernel's __grid_constant__ parameters.
template <class Cfg, bool CAUSAL, bool BALANCED = false>
__device__ __forceinline__ void decode_kernel(const DecodeTmaParams& tp) {
  static_assert(Cfg::TWIN, "DecodeTmaParams: the twin keys");
  decode_kernel<Cfg, CAUSAL, BALANCED>(tp.p, &tp.tmap_k);
}

}  // namespace pt
