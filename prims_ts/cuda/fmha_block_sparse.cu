// Paged block-sparse attention (block_sparse_attention_with_paged_kv_cache): fixed Q
// [B, Sq, Hq, D] over CSR-paged K/V, each (request, K/V head, query-block row) walking
// only the KV blocks its BSR route selects.
//
// Work policy: work item w = ((request * Hkv + K/V head) * R + route row) * row_tiles +
// row tile; one CTA per item, or (PERSIST: the producer-ring engine, Tuning.persistent)
// at most one per SM, CTA c taking items c, c + gridDim.x, ... (pt_fmha.cuh: fmha_items). The M
// rows of a route row are its q_block_size query tokens x the GQA group (the decode
// problem's row mapping, pt_decode.cuh, offset to the row's first token), cut into
// row tiles of BM; the seed's q_block_size * group % 8 == 0 keeps tiles inside a row.
// Range policy (BsrRange): the route's blocks, last first; a block of kv_block_size >= BN
// keys is kv_block_size / BN tiles, a smaller block is one short tile (SHORT_TILES).
// Address policy: the decode problem's CSR pages; or (CONTIG, block_sparse_attention)
// contiguous K/V [B, Skv, Hkv, D], request b's key j at b * k_sp + j * k_ss (the pool
// stride fields hold the request and token strides), no page table, every request Skv keys.
// TMA (sm_90a, blocks a multiple of BN: Tuning.tma for CONTIG, Tuning.paged_tma for pages):
// the key tiles come as the boxes of prefill's maps (pt_fmha_copy.cuh: TmaKv), contiguous K/V as
// (D, Hkv, Skv, B), the pools as (D, page_size, Hkv, P) with the tail page by cp.async.
// Mask policy: key bound, optional valid bits (bit j % 32 of word j / 32 of the
// request's row), bottom-right causal on the query token. A row that sees no key
// writes zeros (the core's l = 0 path).
// Fail closed (the routes are read live): a route row whose offsets leave block_indices,
// whose block IDs do not increase strictly or start at or past the request's length, or
// whose blocks' page IDs leave the pools, sees no key; every warp checks the row itself
// (its lanes over the row's entries, one compare each), so no barrier is needed even
// where the producer and the MMA warps build an item at different times.
//
// The host appends the `extern "C"` entries (prims_ts/cuda/block_sparse.py).
#include "pt_decode.cuh"

namespace pt {

struct BlockSparseParams {
  DecodeParams d;            // addressing, output, scales (splits = 1, no workspace)
  const int* block_indptr;   // [B, Hkv, R + 1] absolute offsets into block_indices
  const int* block_indices;  // logical KV-block IDs, strictly increasing per row
  const u32* valid_bits;     // [B, valid_words] or null
  int rows_r;                // R = ceil(Sq / q_block)
  int q_block;
  int kv_block;
  int row_tiles;             // ceil(q_block * group / BM)
  int valid_words;
  int batch;
  int seq_len_kv;            // CONTIG: every request's K/V length
  int num_listed;            // block_indices' entries (the routes' offsets stay inside)
};

// The parameters of a TMA key: K's and V's maps, then the rest.
struct BlockSparseTmaParams {
  TmaMap tmap_k;
  TmaMap tmap_v;
  BlockSparseParams bp;
};

// The route's blocks as key tiles: block c covers keys [c * kv_block, (c + 1) * kv_block).
template <int BN> struct BsrRange {
  const int* blocks;
  int nblk, tpb, kv_block, sk;  // tpb: tiles per block
  __device__ __forceinline__ int n_tiles() const { return nblk * tpb; }
  __device__ __forceinline__ KeyTile tile(int it) const {
    const int start = blocks[nblk - 1 - it / tpb] * kv_block;  // < sk (the route contract)
    const int k0 = start + (tpb - 1 - it % tpb) * BN;
    const int end = min_(sk, start + kv_block);
    // A sub-tile of a block cut by the request's end holds nothing: an empty tile at the
    // block's start (every address the loader forms stays inside the live pages).
    if (k0 >= end) return {start, 0};
    return {k0, min_(BN, end - k0)};
  }
};

// Warp-collective (every lane of the calling warp): route row `blocks[0 .. nblk)` keeps the
// contract: block IDs strictly increasing, each block starting inside the request (sk keys),
// and (pages non-null) every page ID of its keys inside the pools.
template <class Problem>
__device__ __forceinline__ bool route_ok(const Problem& pb, const int* blocks, int nblk, int kv_block) {
  bool bad = false;  // accumulated without short-circuits: a lane's loads stay in flight together
  const int sk = pb.sk;
  for (int i = threadIdx.x & 31; i < nblk; i += 32) {
    const int c = blocks[i];
    const int prev = i > 0 ? blocks[i - 1] : -1;
    const bool out = c < 0 || (i64)c * kv_block >= sk;
    bad |= out | (prev >= c);
    if (!out && pb.pages != nullptr) {
      const int first = (c * kv_block) >> pb.p->page_shift;
      const int n = ((min_(sk, (c + 1) * kv_block) - 1) >> pb.p->page_shift) - first + 1;
#pragma unroll 4
      for (int j = 0; j < n; ++j) bad |= (unsigned)pb.pages[first + j] >= (unsigned)pb.p->num_pages;
    }
  }
  return !__any_sync(0xffffffffu, bad);
}

template <class T, int DV, int BM, int BN, bool CAUSAL, bool CONTIG, bool TMA_ = false>
struct BlockSparseProblem : DecodeProblem<T, DV, BM, BN, CAUSAL> {
  using Base = DecodeProblem<T, DV, BM, BN, CAUSAL>;
  static constexpr bool SHORT_TILES = true;
  static constexpr bool TMA = TMA_;
  static constexpr bool IS_PAGED = !CONTIG;
  const u32* bits;  // this request's valid-bit words, or null
  BsrRange<BN> routes;
  int t0;           // the route row's first query token
  TmaKv tma;        // TMA: the maps, K/V head and request

  template <class Tile>
  __device__ __forceinline__ void tma_kv(int part, u32 dst, int k0, u32 bar) const {
    tma.template rows<Tile>(part, dst, k0, bar);
  }
  __device__ __forceinline__ int tma_rows(int k0) const {
    return TmaKv::whole_page_rows<BN>(k0, this->sk, this->p->page_shift);
  }
  template <class Tile>
  __device__ __forceinline__ void tma_pages(int part, u32 dst, int k0, int rows, u32 bar, int lane, int lanes) const {
    tma.template pages<Tile, BN>(*this, part, dst, k0, rows, this->p->page_shift, bar, lane, lanes);
  }

  __device__ __forceinline__ BsrRange<BN> range() const { return routes; }
  static constexpr bool ROW_STORE = true;  // pt_fmha_store.cuh (no split-KV: partials never)
  __device__ __forceinline__ int row_store() const {
    return this->p->splits > 1 || this->p->out_dtype == OUT_F32 ? -1 : this->p->out_dtype;
  }
  __device__ __forceinline__ char* o_row(int r) const {
    return decode_out_row(*this->p, this->b, this->hk, this->q_start, this->row0 + r);
  }
  // CONTIG: k and v point at the request's rows of the K/V head (see the items' get)
  __device__ __forceinline__ int kv_page(int j) const { return CONTIG ? 0 : Base::kv_page(j); }
  __device__ __forceinline__ const T* k_row(int page, int j) const {
    return CONTIG ? this->k + (i64)j * this->p->k_ss : Base::k_row(page, j);
  }
  __device__ __forceinline__ const T* v_row(int page, int j) const {
    return CONTIG ? this->v + (i64)j * this->p->v_ss : Base::v_row(page, j);
  }
  __device__ __forceinline__ int diag(int r) const {
    return this->sk - this->sq + t0 + (this->row0 + r) / this->p->group;
  }
  __device__ __forceinline__ bool tile_needs_mask(int k0) const {
    bool m = bits != nullptr || k0 + BN > this->sk;
    if (CAUSAL) m = m || (k0 + BN - 1 > diag(0));
    return m;
  }
  __device__ __forceinline__ bool visible(int r, int j) const {
    bool ok = j < this->sk;
    if (CAUSAL) ok = ok && j <= diag(r);
    if (bits != nullptr) ok = ok && ((bits[j >> 5] >> (j & 31)) & 1u);
    return ok;
  }
};

// PERSIST: CTA c walks items c, c + gridDim.x, ...; otherwise item blockIdx.x alone.
template <class Cfg, bool CAUSAL, bool PERSIST_, bool CONTIG, bool TMA>
struct BlockSparseItems {
  using Problem = BlockSparseProblem<typename Cfg::T, Cfg::DV, Cfg::BM, Cfg::BN, CAUSAL, CONTIG, TMA>;
  static constexpr bool PERSIST = PERSIST_;
  const BlockSparseParams* bp;
  const TmaMap* tmaps;  // TMA: K's map, then V's
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int stride() const { return gridDim.x; }
  __device__ __forceinline__ int count() const { return bp->batch * bp->d.hkv * bp->rows_r * bp->row_tiles; }
  // item w's problem; false: its row tile holds no row
  __device__ __forceinline__ bool get(int w, Problem& pb) const {
    const DecodeParams& p = bp->d;
    const int rt = w % bp->row_tiles;
    int rest = w / bp->row_tiles;
    const int r = rest % bp->rows_r;
    rest /= bp->rows_r;
    const int hk = rest % p.hkv, b = rest / p.hkv;
    pb.t0 = r * bp->q_block;
    // the route row's query rows start at token t0 (also where its output rows go)
    if (!pb.init(p, b, hk, pb.t0, p.sq, rt * Cfg::BM, p.group * min_(bp->q_block, p.sq - pb.t0))) return false;
    if (CONTIG) {
      pb.sk = bp->seq_len_kv;
      pb.k += b * p.k_sp;
      pb.v += b * p.v_sp;
    }
    if constexpr (TMA) pb.tma = TmaKv{tmaps, tmaps + 1, hk, b};
    pb.bits = bp->valid_bits != nullptr ? bp->valid_bits + (i64)b * bp->valid_words : nullptr;
    const int* row_ptr = bp->block_indptr + ((i64)b * p.hkv + hk) * (bp->rows_r + 1) + r;
    const int first_block = row_ptr[0], last_block = row_ptr[1];
    const bool offsets_ok = first_block >= 0 && first_block <= last_block && last_block <= bp->num_listed;
    pb.routes.blocks = bp->block_indices + (offsets_ok ? first_block : 0);
    pb.routes.nblk = offsets_ok ? last_block - first_block : 0;
    pb.routes.tpb = bp->kv_block >= Cfg::BN ? bp->kv_block / Cfg::BN : 1;
    pb.routes.kv_block = bp->kv_block;
    pb.routes.sk = pb.sk;
    if (!route_ok(pb, pb.routes.blocks, pb.routes.nblk, bp->kv_block)) pb.routes.nblk = 0;  // fail closed
    return true;
  }
};

template <class Cfg, bool CAUSAL, bool PERSIST = false, bool CONTIG = false, bool TMA = false>
__device__ __forceinline__ void block_sparse_kernel(const BlockSparseParams& bp, const TmaMap* tmaps = nullptr) {
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = Cfg::ARCH == 90 ? align_smem_1024(smem_raw) : smem_raw;
  static_assert(!PERSIST || Cfg::PRODUCER, "persistent: the producer ring");
  static_assert(!TMA || Cfg::PRODUCER, "TMA: the producer ring");
  fmha_items<Cfg>(BlockSparseItems<Cfg, CAUSAL, PERSIST, CONTIG, TMA>{&bp, tmaps}, smem, bp.d.scale_log2,
                  bp.d.out_scale);
}

// A TMA key's entry: the maps live in the kernel's __grid_constant__ parameters.
template <class Cfg, bool CAUSAL, bool PERSIST, bool CONTIG, bool TMA>
__device__ __forceinline__ void block_sparse_kernel(const BlockSparseTmaParams& tp) {
  static_assert(TMA, "BlockSparseTmaParams: the TMA keys");
  block_sparse_kernel<Cfg, CAUSAL, PERSIST, CONTIG, TMA>(tp.bp, &tp.tmap_k);
}

}  // namespace pt
