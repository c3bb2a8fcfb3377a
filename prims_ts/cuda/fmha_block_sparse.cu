// Paged block-sparse attention (block_sparse_attention_with_paged_kv_cache): fixed Q
// [B, Sq, Hq, D] over CSR-paged K/V, each (request, K/V head, query-block row) walking
// only the KV blocks its BSR route selects.
//
// Work policy: blockIdx = (route row * row_tiles + row tile, K/V head, request). The M
// rows of a route row are its q_block_size query tokens x the GQA group (the decode
// problem's row mapping, pt_decode.cuh, offset to the row's first token), cut into
// row tiles of BM; the seed's q_block_size * group % 8 == 0 keeps tiles inside a row.
// Range policy (BsrRange): the route's blocks, last first; a block of kv_block_size >= BN
// keys is kv_block_size / BN tiles, a smaller block is one short tile (SHORT_TILES).
// Address policy: the decode problem's CSR pages.
// Mask policy: key bound, optional valid bits (bit j % 32 of word j / 32 of the
// request's row), bottom-right causal on the query token. A row that sees no key
// writes zeros (the core's l = 0 path).
//
// The host appends the `extern "C"` entries (prims_ts/cuda/kernels.py).
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

template <class T, int DV, int BM, int BN, bool CAUSAL>
struct BlockSparseProblem : DecodeProblem<T, DV, BM, BN, CAUSAL> {
  static constexpr bool SHORT_TILES = true;
  const u32* bits;  // this request's valid-bit words, or null
  BsrRange<BN> routes;
  int t0;           // the route row's first query token

  __device__ __forceinline__ BsrRange<BN> range() const { return routes; }
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

template <class Cfg, bool CAUSAL>
__device__ __forceinline__ void block_sparse_kernel(const BlockSparseParams& bp) {
  using T = typename Cfg::T;
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  extern __shared__ __align__(1024) char smem_raw[];
  char* smem = Cfg::ARCH == 90 ? align_smem_1024(smem_raw) : smem_raw;
  const DecodeParams& p = bp.d;

  const int r = blockIdx.x / bp.row_tiles, rt = blockIdx.x % bp.row_tiles;
  const int hk = blockIdx.y, b = blockIdx.z;
  BlockSparseProblem<T, Cfg::DV, BM, BN, CAUSAL> pb;
  pb.t0 = r * bp.q_block;
  // the route row's query rows start at token t0 (also where its output rows go)
  if (!pb.init(p, b, hk, pb.t0, p.sq, rt * BM, p.group * min_(bp.q_block, p.sq - pb.t0))) return;
  pb.bits = bp.valid_bits != nullptr ? bp.valid_bits + (i64)b * bp.valid_words : nullptr;

  const int* row_ptr = bp.block_indptr + ((i64)b * p.hkv + hk) * (bp.rows_r + 1) + r;
  const int first = row_ptr[0];
  pb.routes.blocks = bp.block_indices + first;
  pb.routes.nblk = row_ptr[1] - first;
  pb.routes.tpb = bp.kv_block >= BN ? bp.kv_block / BN : 1;
  pb.routes.kv_block = bp.kv_block;
  pb.routes.sk = pb.sk;
  fmha_tile<Cfg>(pb, smem, p.scale_log2, p.out_scale);
}

}  // namespace pt
