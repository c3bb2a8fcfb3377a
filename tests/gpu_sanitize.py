"""Small prefill (contiguous and paged), paged-decode, MLA-decode and block-sparse cases for
compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py

Both tools slow kernels ~100x: keep every case small and the launches few.
"""
import torch

import prims_ts
from prims_ts import reference as R
from prims_ts.testing import cumsum0, relative_error, stable_seed

# CSR entries past a request's live pages: never read (an out-of-range ID makes a stray read fatal)
GARBAGE = (-1, 2**31 - 1)
# (name, query mode, SQ / packed Q lengths, mask, window, D, Hq, Hkv, page size, cache form, K/V lengths,
#  max_seq_len, split-KV expected). One-split cases keep max_seq_len within one K/V tile, so that
#  no split policy splits them; the split ones are long with few CTAs.
DECODE_CASES = [
    ("single d128 dense", "single", None, "dense", -1, 128, 8, 2, 16, "combined", [1, 37, 60], 60, False),
    ("fixed sq3 d64 causal w20", "fixed", 3, "causal", 20, 64, 8, 1, 32, "tuple", [3, 45, 77], 77, False),
    ("packed d128 causal", "packed", [1, 3, 2], "causal", -1, 128, 16, 2, 32, "tuple", [5, 50, 61], 64, False),
    ("split single d128 dense", "single", None, "dense", -1, 128, 8, 2, 64, "combined", [3000], 3000, True),
    ("split fixed sq2 d64 causal w700", "fixed", 2, "causal", 700, 64, 8, 2, 128, "tuple", [2999, 2], 3000, True),
    ("split packed d128 causal", "packed", [2, 1], "causal", -1, 128, 32, 8, 16, "combined", [2500, 700], 2600,
     True),
    # D256: the warps split O's columns and exchange P through shared memory (SPLIT_O)
    ("single d256 dense", "single", None, "dense", -1, 256, 8, 2, 16, "combined", [1, 17, 30], 30, False),
    ("split fixed sq4 d256 causal", "fixed", 4, "causal", -1, 256, 16, 2, 32, "tuple", [1500, 40], 1500, True),
]


def _sm_count(dev) -> int:
    from prims_ts.cuda.kernels import DECODE_NOMINAL_SMS

    if torch.device(dev).type == "cuda":
        return torch.cuda.get_device_properties(torch.device(dev)).multi_processor_count
    return DECODE_NOMINAL_SMS


def poisoned_csr_pool(dev, lens, hkv, ps, d, form, dt):
    """K/V pools for requests of `lens` keys over shuffled pages: CSR entries past a request's
    live pages hold garbage IDs, two pages no request uses, and every unused slot NaN.
    Returns (indptr, indices, seq_lens, cache, k, v); `cache` is the combined pool or (k, v)."""
    n_live = [(n + ps - 1) // ps for n in lens]
    num_pages = sum(n_live) + 2  # two pages no request uses
    perm = torch.randperm(num_pages).tolist()
    indices, entries, live, at = [], [], [], 0
    for b, n in enumerate(n_live):
        live.append(perm[at:at + n])
        at += n
        slack = [GARBAGE[b % 2]] * (b % 2 + 1)
        indices += live[b] + slack
        entries.append(n + len(slack))
    indptr = torch.tensor(cumsum0(entries), dtype=torch.int32, device=dev)
    indices = torch.tensor(indices, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    if form == "combined":
        cache = torch.randn(num_pages, 2, hkv, ps, d, device=dev, dtype=dt)
        k, v = cache[:, 0], cache[:, 1]
    else:
        k = torch.randn(num_pages, hkv, ps, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        cache = (k, v)
    used = torch.zeros(num_pages, ps, dtype=torch.bool)
    for b, n in enumerate(lens):
        j = torch.arange(n)
        used[torch.tensor(live[b])[j // ps], j % ps] = True
    unused = (~used).to(dev)[:, None, :, None].expand_as(k)
    k.masked_fill_(unused, float("nan"))
    v.masked_fill_(unused, float("nan"))
    return indptr, indices, seq_lens, cache, k, v


def decode_case(dev, name, qmode, sq, mask, window, d, hq, hkv, ps, form, lens, max_seq_len, split) -> None:
    """One decode launch over shuffled pages (unused slots NaN, garbage CSR entries past the live
    pages) into a NaN-poisoned out, against the float64 reference."""
    from prims_ts.cuda.kernels import decode_policy

    B, dt = len(lens), torch.bfloat16
    indptr, indices, seq_lens, cache, k, v = poisoned_csr_pool(dev, lens, hkv, ps, d, form, dt)
    kw, qo_indptr, max_sq = {}, None, 1
    if qmode == "single":
        q = torch.randn(B, hq, d, device=dev, dtype=dt)
    elif qmode == "fixed":
        q = torch.randn(B, sq, hq, d, device=dev, dtype=dt)
        kw["seq_len_q"] = max_sq = sq
    else:
        qo_indptr = torch.tensor(cumsum0(sq), dtype=torch.int32, device=dev)
        q = torch.randn(sum(sq), hq, d, device=dev, dtype=dt)
        max_sq = max(sq)
        kw.update(qo_indptr=qo_indptr, max_seq_len_q=max_sq)
    pol = decode_policy(B, hkv, hq // hkv, max_sq, d, max_seq_len, _sm_count(dev))
    assert (pol.splits > 1) == split, (name, pol)
    nbytes = prims_ts.get_prims_ts_batch_decode_workspace_size(B, hq, hkv, d, max_seq_len, max_seq_len_q=max_sq,
                                                                device=dev)
    workspace = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    out = torch.full(q.shape, float("nan"), dtype=dt, device=dev)
    res = prims_ts.prims_ts_batch_decode_with_kv_cache(q, cache, workspace, indptr, indices, seq_lens, max_seq_len,
                                                       mask_type=mask, window_left=window, out=out, **kw)
    assert res is out
    ref = R.batch_decode(q, k, v, indptr, indices, seq_lens, qo_indptr=qo_indptr, mask_type=mask,
                         window_left=window, compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"decode {name} (splits {pol.splits}): rel err {err:.2e}")
    assert err < 2e-2  # NaN (an unwritten row, a poisoned slot read) fails too


def decode_cases(dev) -> None:
    for case in DECODE_CASES:
        decode_case(dev, *case)


# (name, query mode, SQ / packed Q lengths, mask, H, page size, cache rank, K/V lengths, max_seq_len,
#  split-KV expected)
MLA_CASES = [
    ("fixed sq1 h16 causal", "fixed", 1, "causal", 16, 16, 3, [1, 37, 60], 60, False),
    ("packed h64 causal", "packed", [1, 3, 2], "causal", 64, 32, 4, [5, 50, 61], 64, False),
    ("split fixed sq2 h8 dense", "fixed", 2, "dense", 8, 64, 3, [3000, 1], 3000, True),
    ("split packed h128 causal", "packed", [4, 1], "causal", 128, 128, 4, [1200, 300], 1300, True),
]


def mla_case(dev, name, qmode, sq, mask, h, ps, rank, lens, max_seq_len, split) -> None:
    """One MLA launch over shuffled pages (unused slots NaN, garbage block-table entries past the live
    pages, a row-strided table) into a NaN-poisoned out, against the float64 reference."""
    from prims_ts.cuda.kernels import MLA_DIM_QK, decode_policy

    B, dt = len(lens), torch.bfloat16
    n_live = [(n + ps - 1) // ps for n in lens]
    num_pages = sum(n_live) + 2  # two pages no request uses
    perm = torch.randperm(num_pages).tolist()
    cols = max(n_live) + 1
    wide = torch.full((B, cols + 2), GARBAGE[1], dtype=torch.int32)
    at = 0
    for b, n in enumerate(n_live):
        wide[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        wide[b, n:cols] = GARBAGE[b % 2]
        at += n
    table = wide.to(dev)[:, :cols]
    latents = torch.randn(num_pages, ps, 576, device=dev, dtype=dt)
    used = torch.zeros(num_pages, ps, dtype=torch.bool)
    for b, n in enumerate(lens):
        j = torch.arange(n)
        used[wide[b, :n_live[b]].long()[j // ps], j % ps] = True
    latents.masked_fill_((~used).to(dev)[:, :, None], float("nan"))
    cache = latents.unsqueeze(1) if rank == 4 else latents
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    kw, qo_indptr = {}, None
    if qmode == "fixed":
        q = torch.randn(B, sq, h, 576, device=dev, dtype=dt)
        max_sq = sq
    else:
        qo_indptr = torch.tensor(cumsum0(sq), dtype=torch.int32, device=dev)
        q = torch.randn(sum(sq), h, 576, device=dev, dtype=dt)
        max_sq = max(sq)
        kw.update(qo_indptr=qo_indptr, max_seq_len_q=max_sq)
    pol = decode_policy(B, 1, h, max_sq, MLA_DIM_QK, max_seq_len, _sm_count(dev))
    assert (pol.splits > 1) == split, (name, pol)
    nbytes = prims_ts.get_prims_ts_batch_decode_mla_workspace_size(B, h, max_seq_len, max_sq, device=dev)
    workspace = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    out = torch.full(tuple(q.shape[:-1]) + (512,), float("nan"), dtype=dt, device=dev)
    scale = 576 ** -0.5
    res = prims_ts.prims_ts_batch_decode_with_kv_cache_mla(q, cache, workspace, table, seq_lens, max_seq_len,
                                                           mask_type=mask, bmm1_scale=scale, out=out, **kw)
    assert res is out
    ref = R.batch_mla_decode(q, cache, table, seq_lens, qo_indptr=qo_indptr, mask_type=mask, sm_scale=scale,
                             compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"mla {name} (splits {pol.splits}): rel err {err:.2e}")
    assert err < 2e-2  # NaN (an unwritten row, a poisoned slot read) fails too


# Rows of 16/32 take the swapped-operand tile on sm_90a (MLA_CASES' first and third); these run
# the mma.sync tile there as well (the engine of sm_80/sm_89).
MLA_MMA_SYNC_CASES = [
    ("mma.sync fixed sq1 h16 causal", "fixed", 1, "causal", 16, 16, 3, [1, 37, 60], 60, False),
    ("mma.sync split packed h8 dense", "packed", [4, 1], "dense", 8, 64, 4, [3000, 2], 3000, True),
]


def mla_cases(dev) -> None:
    from prims_ts.cuda import kernels

    for case in MLA_CASES:
        mla_case(dev, *case)
    if torch.cuda.get_device_capability(dev) == (9, 0):
        try:
            kernels.MLA_SWAPPED_TILE = False
            for case in MLA_MMA_SYNC_CASES:
                mla_case(dev, *case)
        finally:
            kernels.MLA_SWAPPED_TILE = True


# (name, entry, mask, D, Hq, Hkv, q_block, kv_block, page size, cache form, valid bits, Sq, K/V lengths,
#  empty rows). Rows of one route row (min(q_block, Sq) x group) at 64 and 256 pick both wgmma row
#  tiles on sm_90a for 64+-key blocks; 8/32-key blocks take the mma.sync engine with short tiles.
BSR_CASES = [
    ("kv8 dense bits", "oneshot", "dense", 128, 8, 2, 16, 8, 16, "combined", "uint32", 20, [45, 70], True),
    ("kv64 causal rows256", "oneshot", "causal", 128, 8, 2, 64, 64, 32, "tuple", None, 70, [70, 150], True),
    ("kv64 dense rows64 bits", "wrapper", "dense", 128, 8, 2, 16, 64, 128, "tuple", "int32", 33, [130, 40], True),
    ("kv128 causal bits d256", "oneshot", "causal", 256, 4, 2, 32, 128, 64, "combined", "int32", 40, [130, 300],
     True),
    ("kv32 causal sq1", "wrapper", "causal", 128, 16, 4, 2, 32, 16, "combined", "uint32", 1, [1, 77], False),
]


def block_sparse_case(dev, name, entry, mask, d, hq, hkv, q_block, kv_block, ps, form, bits_kind, sq, lens,
                      empty) -> None:
    """One block-sparse launch over shuffled pages (unused slots NaN, garbage CSR entries past the live
    pages, garbage block IDs past the route segments) into a NaN-poisoned out, against the float64
    reference. Routes: random blocks plus the diagonal; ``empty``: request 0's last K/V head has an
    empty last row and request 1's first K/V head selects nothing."""
    from prims_ts.check import bsr_routes, bsr_tensors

    B, dt = len(lens), torch.bfloat16
    g = torch.Generator().manual_seed(stable_seed("bsr", name))
    indptr, indices, seq_lens, cache, k, v = poisoned_csr_pool(dev, lens, hkv, ps, d, form, dt)
    block_indptr, block_indices = bsr_tensors(bsr_routes(lens, sq, hkv, q_block, kv_block, g, empty=empty), dev)
    max_len = max(lens) + 40  # spare valid-bit words
    bits = None
    if bits_kind is not None:
        on = (torch.rand(B, -(-max_len // 32), 32, generator=g) < 0.75).to(torch.int64)
        w = (on << torch.arange(32)).sum(-1)
        w[0, 0] |= 1 << 31
        bits = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).to(dev)
        if bits_kind == "uint32":
            bits = bits.view(torch.uint32)
    q = torch.randn(B, sq, hq, d, device=dev, dtype=dt)
    out = torch.full(q.shape, float("nan"), dtype=dt, device=dev)
    if entry == "oneshot":
        res = prims_ts.block_sparse_attention_with_paged_kv_cache(
            q, cache, indptr, indices, block_indptr, block_indices, q_block, kv_block, max_seq_len_kv=max_len,
            seq_lens_kv=seq_lens, kv_valid_bits=bits, mask_type=mask, out=out)
    else:
        wr = prims_ts.BlockSparsePagedTSWrapper()
        wr.plan(B, sq, hq, hkv, d, ps, q_block, kv_block, max_len, use_valid_bits=bits is not None, mask_type=mask,
                q_data_type=dt)
        res = wr.run(q, cache, indptr, indices, block_indptr, block_indices, seq_lens, kv_valid_bits=bits, out=out)
    assert res is out
    ref = R.block_sparse_attention(q, k, v, indptr, indices, block_indptr, block_indices, q_block, kv_block,
                                   seq_lens, kv_valid_bits=bits, mask_type=mask, compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"block-sparse {name}: rel err {err:.2e}")
    assert err < 2e-2  # NaN (an unwritten row, a poisoned slot read) fails too


def block_sparse_cases(dev) -> None:
    for case in BSR_CASES:
        block_sparse_case(dev, *case)


def prefill_cases(dev) -> None:
    """Contiguous (fixed and packed) and paged prefill, every mask, D 128 and 256."""
    for d in (128, 256):
        for mask, window in (("dense", -1), ("causal", -1), ("causal", 5), ("variable_window", -1)):
            q = torch.randn(2, 70, 4, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(2, 133, 2, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            s = e = None
            if mask == "variable_window":
                a = torch.randint(0, 133, (2, 70), device=dev, dtype=torch.int32)
                b = torch.randint(0, 133, (2, 70), device=dev, dtype=torch.int32)
                s, e = torch.minimum(a, b), torch.maximum(a, b)
            out = prims_ts.batch_prefill(q, k, v, mask_type=mask, window_left=window, variable_window_token_starts=s,
                                         variable_window_token_ends=e, out_dtype=torch.float32)
            ref = R.batch_prefill(q, k, v, mask_type=mask, window_left=window, window_starts=s, window_ends=e,
                                  compute_dtype=torch.float64)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"d={d} {mask}{window}: rel err {err:.2e}")
            assert err < 2e-2
        qo = torch.tensor([0, 1, 60, 129], dtype=torch.int32, device=dev)
        kvo = torch.tensor([0, 5, 70, 200], dtype=torch.int32, device=dev)
        q = torch.randn(129, 4, d, device=dev, dtype=torch.float16)
        k = torch.randn(200, 1, d, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        out = prims_ts.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
        ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3
    # paged prefill: shuffled pages, a padded row-strided table, lengths not page multiples
    for ps in (16, 128):
        pool = 12
        kc = torch.randn(pool, 2, ps, 128, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        wide = torch.randperm(pool, device=dev).to(torch.int32).view(2, 6)
        table = wide[:, :4]
        lens = torch.tensor([3 * ps + 1, 2 * ps - 5], dtype=torch.int32, device=dev)
        qo = torch.tensor([0, 20, 45], dtype=torch.int32, device=dev)
        q = torch.randn(45, 8, 128, device=dev, dtype=torch.bfloat16)
        out = prims_ts.batch_prefill_with_paged_kv_cache(q, kc, vc, qo, table, lens, page_size=ps, mask_type="causal")
        ref = R.batch_prefill_paged(q, kc, vc, qo, table, lens, mask_type="causal", compute_dtype=torch.float64)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"paged ps={ps}: rel err {err:.2e}")
        assert err < 2e-2


def main() -> None:
    from prims_ts.cuda import kernels

    torch.manual_seed(0)
    dev = "cuda"
    prefill_cases(dev)
    # paged decode: [B,Hq,D], [B,SQ,Hq,D] causal + window, packed; with and without split-KV
    decode_cases(dev)
    # MLA decode: fixed and packed, both cache ranks, with and without split-KV
    mla_cases(dev)
    # both again with the other split merge (register units / partials staged in shared memory)
    kernels.DECODE_MERGE_STAGED = not kernels.DECODE_MERGE_STAGED
    try:
        print(f"split merge staged={kernels.DECODE_MERGE_STAGED}:")
        decode_cases(dev)
        mla_cases(dev)
    finally:
        kernels.DECODE_MERGE_STAGED = not kernels.DECODE_MERGE_STAGED
    # block-sparse: kv blocks 8/32/64/128, valid bits, causal, empty rows, both cache forms
    block_sparse_cases(dev)
    # the producer ring's variants (sm_90a), each selected explicitly (the default run above
    # took kernels.fmha_loop's choice per head dim): consumer loops 0/1/2, persistent CTAs,
    # and the producer copy the default does not take (KV_COPY_FLIP; MLA's wgmma tiles too)
    if torch.cuda.get_device_capability() == (9, 0):
        default = (kernels.FMHA_LOOP, kernels.PERSISTENT, kernels.PERSISTENT_CTAS, kernels.KV_COPY_FLIP)
        variants = ([(loop, False, False) for loop in kernels.FMHA_LOOPS] +
                    [(0, True, False), (2, True, False), (None, False, True)])
        for loop, persistent, flip in variants:
            kernels.FMHA_LOOP, kernels.PERSISTENT, kernels.KV_COPY_FLIP = loop, persistent, flip
            kernels.PERSISTENT_CTAS = 3 if persistent else None  # a few CTAs walk many items
            try:
                print(f"consumer loop {loop}, persistent {persistent}, the other producer copy {flip}:")
                prefill_cases(dev)
                block_sparse_cases(dev)
                if flip:
                    for case in MLA_CASES:
                        mla_case(dev, *case)
            finally:
                kernels.FMHA_LOOP, kernels.PERSISTENT, kernels.PERSISTENT_CTAS, kernels.KV_COPY_FLIP = default
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
