"""Small prefill (contiguous and paged), paged-decode, MLA-decode and block-sparse cases for
compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py --variant tma   (one ring variant's cases)
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py --block-sparse   (the block-sparse cases)
    compute-sanitizer --tool racecheck python tests/gpu_sanitize.py --decode   (the paged and MLA decode cases)
    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py --part 2/6   (every 6th section from the 3rd)

Both tools slow kernels ~100x: keep every case small and the launches few.

The default tuning runs through the one-shots and the standalone decode/MLA functions (they
always take ``Tuning()``); every other kernel variant through a wrapper planned with its
``prims_ts.Tuning`` (``tuning=``): the ticket merge at every split count
(``Tuning(cluster_merge=False)``), the mma.sync tile of MLA rows of 16/32
(``Tuning(mla_swapped=False)``), the producer ring's variants of
``prims_ts.cuda.catalog.RING_VARIANTS`` (consumer loops 0/1, persistent CTAs with
``persistent_ctas=3``, the producer copy the default does not take: ``flip_copy=True``, MLA's
swapped tile of rows of 16/32 included) and the twin tile's own cases (``--mla-twin``: spiked
keys, an odd tile count, balanced split-KV). ``run_all(dev)`` takes any device: on the CPU every
case runs the reference path (a dry run of the case builders; the CPU counts as the nominal H200).
"""
import dataclasses
import sys
from pathlib import Path

import torch

try:
    import prims_ts
except ModuleNotFoundError:  # run as `python tests/gpu_sanitize.py` from an uninstalled checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import prims_ts
from prims_ts import Tuning
from prims_ts import reference as R
from prims_ts.cuda.catalog import DECODE_VARIANTS, RING_VARIANTS
from prims_ts.cuda.decode import MLA_DIM_QK, balances, decode_policy
from prims_ts.cuda.keys import device_limits
from prims_ts.testing import check_decode_workspace, check_launch_policy, cumsum0, relative_error, stable_seed

DEFAULT = Tuning()
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
    # 2-8 splits (sm_90a: one thread block cluster a row tile, merged through distributed shared
    # memory): 8 at D128, 8 with SPLIT_O at D256, 5 at D64 (one split of a request empty)
    ("cluster single d128 dense", "single", None, "dense", -1, 128, 32, 8, 32, "combined", [1000], 1024, True),
    ("cluster fixed sq2 d256 causal", "fixed", 2, "causal", -1, 256, 16, 8, 16, "tuple", [900, 300], 1000, True),
    ("cluster single d64 causal w100", "single", None, "causal", 100, 64, 16, 4, 64, "combined", [600, 70, 5], 600,
     True),
]


def _label(tuning) -> str:
    return "default (one-shot / standalone)" if tuning is None else f"wrapper tuning={tuning.encode() or 'default'}"


def _sm90(dev) -> bool:
    """The ring's and the MLA tiles' variants exist on sm_90a (the CPU: the nominal H200)."""
    return device_limits(dev)[0] == "sm_90a"


def _policy(dev, batch, hkv, group, max_sq, d, max_seq_len, tuning=None):
    """The decode policy on `dev` (the CPU: the nominal H200's SMs and shared memory): the static
    one, or the one a plan launching `tuning` takes (its plan's, balanced by its lengths or not)."""
    _, sms, limit = device_limits(dev)
    balance = balances(tuning) if tuning is not None else 0
    return decode_policy(batch, hkv, group, max_sq, d, max_seq_len, sms, limit, balance)


def poisoned_csr_pool(dev, lens, hkv, ps, d, form, dt):
    """K/V pools for requests of `lens` keys over shuffled pages: CSR entries past a request's
    live pages hold garbage IDs, two pages no request uses, and every unused slot NaN.
    Returns (indptr, indices, seq_lens, cache, k, v, live_csr); `cache` is the combined pool or
    (k, v); `live_csr` is FlashInfer's (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
    of the live pages only (what a decode wrapper's plan takes)."""
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
    live_csr = (torch.tensor(cumsum0(n_live), dtype=torch.int32, device=dev),
                torch.tensor([p for row in live for p in row], dtype=torch.int32, device=dev),
                torch.tensor([n - (m - 1) * ps for n, m in zip(lens, n_live)], dtype=torch.int32, device=dev))
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
    return indptr, indices, seq_lens, cache, k, v, live_csr


def _check_workspace(dev, name, split, workspace) -> None:
    """A standalone call's workspace after it: untouched by the cluster merge (sm_90a, the
    cases named so), the ticket's or the second level's partials in it otherwise (split-KV)."""
    if torch.device(dev).type != "cuda" or not split:
        return
    torch.cuda.synchronize()
    check_decode_workspace(workspace, "cluster" in name and "two levels" not in name and _sm90(dev))


def decode_case(dev, name, qmode, sq, mask, window, d, hq, hkv, ps, form, lens, max_seq_len, split,
                tuning=None) -> None:
    """One decode launch over shuffled pages (unused slots NaN; the standalone's CSR: garbage
    entries past the live pages) into a NaN-poisoned out, against the float64 reference.
    `tuning` None: the standalone function; else a BatchDecodePagedTSWrapper planned with it."""
    B, dt = len(lens), torch.bfloat16
    indptr, indices, seq_lens, cache, k, v, live_csr = poisoned_csr_pool(dev, lens, hkv, ps, d, form, dt)
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
    pol = _policy(dev, B, hkv, hq // hkv, max_sq, d, max_seq_len)
    assert (pol.splits > 1) == split, (name, pol)
    out = torch.full(q.shape, float("nan"), dtype=dt, device=dev)
    if tuning is None:
        nbytes = prims_ts.get_prims_ts_batch_decode_workspace_size(B, hq, hkv, d, ps, max_seq_len, q_dtype=dt,
                                                                    device=dev, **kw)
        workspace = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        res = prims_ts.prims_ts_batch_decode_with_kv_cache(q, cache, workspace, indptr, indices, seq_lens,
                                                           max_seq_len, mask_type=mask, window_left=window, out=out,
                                                           **kw)
        _check_workspace(dev, name, split, workspace)
    else:
        w = prims_ts.BatchDecodePagedTSWrapper("HND", tuning=tuning)
        w.plan(*live_csr, hq, hkv, d, ps, q_data_type=dt, mask_type=mask, window_left=window,
               max_kv_len=max_seq_len, **kw)  # the standalone's static problem: the same policy
        launch = w._plan.launch
        if launch is not None:
            planned = _policy(dev, B, hkv, hq // hkv, max_sq, d, max_seq_len, w._plan.static.tuning)
            check_launch_policy(launch, planned)
            clustered = "cluster" in name and _sm90(dev) and tuning.cluster_merge and not planned.balanced
            assert (launch.launch.cluster > 1) == clustered, name
        res = w.run(q, cache, out=out)
    assert res is out
    ref = R.batch_decode(q, k, v, indptr, indices, seq_lens, qo_indptr=qo_indptr, mask_type=mask,
                         window_left=window, compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"decode {name} (splits {pol.splits}, {_label(tuning)}): rel err {err:.2e}")
    assert err < 2e-2  # NaN (an unwritten row, a poisoned slot read) fails too


def decode_cases(dev, tuning=None) -> None:
    for case in DECODE_CASES:
        decode_case(dev, *case, tuning=tuning)


# (name, query mode, SQ / packed Q lengths, mask, H, page size, cache rank, K/V lengths, max_seq_len,
#  split-KV expected)
MLA_CASES = [
    ("fixed sq1 h16 causal", "fixed", 1, "causal", 16, 16, 3, [1, 37, 60], 60, False),
    ("packed h64 causal", "packed", [1, 3, 2], "causal", 64, 32, 4, [5, 50, 61], 64, False),
    ("split fixed sq2 h8 dense", "fixed", 2, "dense", 8, 64, 3, [3000, 1], 3000, True),
    # the twin's splits in two levels (decode.launch_shape on a 132-SM sm_90a): two clusters of 8
    # a row tile (two of 7, three of 5 where the device holds fewer clusters of 8; the H64 case
    # two of 8)
    ("cluster twin two levels packed h128 causal", "packed", [2, 1], "causal", 128, 128, 4, [12000, 300], 12000, True),
    ("cluster twin two levels fixed sq1 h64 dense", "fixed", 1, "dense", 64, 64, 3, [3000], 3000, True),
    # 2-8 splits (sm_90a: one cluster a row tile where the partials fit: the rows of 16)
    ("cluster fixed sq1 h16 causal", "fixed", 1, "causal", 16, 64, 3, [1000, 200], 1000, True),
    ("cluster fixed sq1 h8 dense", "fixed", 1, "dense", 8, 32, 4, [600], 600, True),
    # the twin tile's 2-8 splits in a cluster, their partials over its own shared memory (8 and 4)
    ("cluster twin fixed sq1 h128 dense", "fixed", 1, "dense", 128, 64, 3, [1000, 700, 64], 1000, True),
    ("cluster twin fixed sq1 h64 causal", "fixed", 1, "causal", 64, 32, 4, [512, 100], 512, True),
]


def mla_case(dev, name, qmode, sq, mask, h, ps, rank, lens, max_seq_len, split, tuning=None, spike=False) -> None:
    """One MLA launch over shuffled pages (unused slots NaN, garbage block-table entries past the live
    pages, a row-strided table) into a NaN-poisoned out, against the float64 reference. `tuning`
    None: the standalone function; else a BatchMLADecodePagedTSWrapper planned with it. `spike`:
    key 5 of each request (its last if shorter) is 4x one head's query of its first token, a score
    far above every other (the twin tile's rerun)."""
    B, dt = len(lens), torch.bfloat16
    n_live = [(n + ps - 1) // ps for n in lens]
    num_pages = sum(n_live) + 2  # two pages no request uses
    perm = torch.randperm(num_pages).tolist()
    cols = max(max(n_live), -(-max_seq_len // ps)) + 1  # a wrapper plans max_kv_len = max_seq_len
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
    if spike:
        first = cumsum0(sq) if qmode == "packed" else None
        for b, n in enumerate(lens):
            j = min(5, n - 1)
            row = q[first[b]] if first is not None else q[b, 0]
            latents[int(wide[b, j // ps]), j % ps] = 4 * row[(37 * b) % h]
    pol = _policy(dev, B, 1, h, max_sq, MLA_DIM_QK, max_seq_len)
    assert (pol.splits > 1) == split, (name, pol)
    out = torch.full(tuple(q.shape[:-1]) + (512,), float("nan"), dtype=dt, device=dev)
    scale = 576 ** -0.5
    if tuning is None:
        nbytes = prims_ts.get_prims_ts_batch_decode_mla_workspace_size(B, h, 512, 64, ps, max_seq_len,
                                                                        max_seq_len_q=max_sq, q_dtype=dt, device=dev)
        workspace = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        res = prims_ts.prims_ts_batch_decode_with_kv_cache_mla(q, cache, workspace, 512, 64, table, seq_lens,
                                                               max_seq_len, mask_type=mask, bmm1_scale=scale,
                                                               out=out, **kw)
        _check_workspace(dev, name, split, workspace)
    else:
        w = prims_ts.BatchMLADecodePagedTSWrapper(tuning=tuning)
        mode = kw if qmode == "packed" else dict(seq_len_q=sq)
        w.plan(table, seq_lens, h, 512, 64, ps, q_data_type=dt, mask_type=mask, max_kv_len=max_seq_len, **mode)
        launch = w._plan.launch
        if launch is not None:
            planned = _policy(dev, B, 1, h, max_sq, MLA_DIM_QK, max_seq_len, w._plan.static.tuning)
            check_launch_policy(launch, planned)
            clustered = "cluster" in name and _sm90(dev) and tuning.cluster_merge and not planned.balanced
            assert (launch.launch.cluster > 1) == clustered, name
        res = w.run(q, cache, bmm1_scale=scale, out=out)
    assert res is out
    ref = R.batch_mla_decode(q, cache, table, seq_lens, qo_indptr=qo_indptr, mask_type=mask, sm_scale=scale,
                             compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"mla {name} (splits {pol.splits}, {_label(tuning)}): rel err {err:.2e}")
    assert err < 2e-2  # NaN (an unwritten row, a poisoned slot read) fails too


# Rows of 16/32 take the swapped-operand tile on sm_90a (MLA_CASES' first and third); these run
# the mma.sync tile there as well (the engine of sm_80/sm_89): Tuning(mla_swapped=False).
MLA_MMA_SYNC_CASES = [
    ("mma.sync fixed sq1 h16 causal", "fixed", 1, "causal", 16, 16, 3, [1, 37, 60], 60, False),
    ("mma.sync split packed h8 dense", "packed", [4, 1], "dense", 8, 64, 4, [3000, 2], 3000, True),
    ("mma.sync cluster fixed sq1 h16 causal", "fixed", 1, "causal", 16, 32, 3, [1000, 300], 1000, True),
]


def mla_cases(dev, tuning=None) -> None:
    """MLA_CASES under `tuning` (None: the standalone function), then on sm_90a the mma.sync tile
    cases through a wrapper with `tuning`'s split merge."""
    for case in MLA_CASES:
        mla_case(dev, *case, tuning=tuning)
    if _sm90(dev):
        base = tuning or DEFAULT
        mma = dataclasses.replace(DECODE_VARIANTS["mla_mma"], cluster_merge=base.cluster_merge,
                                  balanced_split=base.balanced_split, balanced_ctas=base.balanced_ctas,
                                  merge_fan=base.merge_fan)
        assert not mma.mla_swapped
        for case in MLA_MMA_SYNC_CASES:
            mla_case(dev, *case, tuning=mma)


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
                      empty, tuning=None) -> None:
    """One block-sparse launch over shuffled pages (unused slots NaN, garbage CSR entries past the live
    pages, garbage block IDs past the route segments) into a NaN-poisoned out, against the float64
    reference. Routes: random blocks plus the diagonal; ``empty``: request 0's last K/V head has an
    empty last row and request 1's first K/V head selects nothing. The one-shot runs "oneshot"
    cases under the default tuning (`tuning` None); everything else a wrapper planned with
    `tuning` (None: the default)."""
    from prims_ts.check import bsr_routes, bsr_tensors

    B, dt = len(lens), torch.bfloat16
    g = torch.Generator().manual_seed(stable_seed("bsr", name))
    indptr, indices, seq_lens, cache, k, v, _ = poisoned_csr_pool(dev, lens, hkv, ps, d, form, dt)
    routes = bsr_routes(lens, sq, hkv, q_block, kv_block, g, empty=empty)
    block_indptr, block_indices = bsr_tensors(routes, dev)
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
    if entry == "oneshot" and tuning is None:
        label = "one-shot"
        res = prims_ts.block_sparse_attention_with_paged_kv_cache(
            q, cache, indptr, indices, block_indptr, block_indices, q_block, kv_block, max_seq_len_kv=max_len,
            seq_lens_kv=seq_lens, kv_valid_bits=bits, mask_type=mask, out=out)
    else:
        label = _label(tuning or DEFAULT)
        most = max((len(row) for heads in routes for rows in heads for row in rows), default=0)
        wr = prims_ts.BlockSparsePagedTSWrapper(tuning=tuning)
        wr.plan(indptr, sq, max_len, hq, hkv, d, q_block, kv_block, ps, max_blocks_per_row=most,
                use_kv_valid_bits=bits is not None, seq_lens_kv=seq_lens, mask_type=mask, q_data_type=dt)
        res = wr.run(q, cache, indices, block_indptr, block_indices, kv_valid_bits=bits, out=out)
    assert res is out
    ref = R.block_sparse_attention(q, k, v, indptr, indices, block_indptr, block_indices, q_block, kv_block,
                                   seq_lens, kv_valid_bits=bits, mask_type=mask, compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"block-sparse {name} ({label}): rel err {err:.2e}")
    assert err < 2e-2  # NaN (an unwritten row, a poisoned slot read) fails too


# block_sparse_attention over contiguous K/V: (name, mask, D, Hq, Hkv, q_block, kv_block, Sq, Skv). Skv not a
# block multiple; 64+-key blocks take the sm_90a TMA keys (the last tile cut by Skv), 8-key blocks the short tiles.
CONTIG_BSR_CASES = [
    ("contig kv128 causal", "causal", 128, 8, 2, 64, 128, 70, 300),
    ("contig kv64 dense d256", "dense", 256, 4, 2, 32, 64, 40, 150),
    ("contig kv8 dense", "dense", 128, 8, 2, 16, 8, 20, 45),
]


def contiguous_block_sparse_case(dev, name, mask, d, hq, hkv, q_block, kv_block, sq, skv, tuning=None) -> None:
    """One block_sparse_attention launch (tuning None: the one-shot; else a BlockSparseTSWrapper planned
    with it) into a NaN-poisoned out, random routes with empty rows, against the float64 reference."""
    from prims_ts.check import bsr_routes, bsr_tensors

    B, dt = 2, torch.bfloat16
    g = torch.Generator().manual_seed(stable_seed("bsr contiguous", name))
    q = torch.randn(B, sq, hq, d, generator=g).to(dt).to(dev)
    k, v = (torch.randn(B, skv, hkv, d, generator=g).to(dt).to(dev) for _ in range(2))
    block_indptr, block_indices = bsr_tensors(bsr_routes([skv] * B, sq, hkv, q_block, kv_block, g, empty=True), dev)
    out = torch.full(q.shape, float("nan"), dtype=dt, device=dev)
    if tuning is None:
        res = prims_ts.block_sparse_attention(q, k, v, block_indptr, block_indices, q_block, kv_block,
                                              mask_type=mask, out=out)
    else:
        wr = prims_ts.BlockSparseTSWrapper(tuning=tuning)
        wr.plan(B, sq, skv, hq, hkv, d, q_block, kv_block, device=dev, max_blocks_per_row=-(-skv // kv_block),
                use_kv_valid_bits=False, mask_type=mask, q_data_type=dt)
        res = wr.run(q, k, v, block_indptr, block_indices, out=out)
    assert res is out
    ref = R.block_sparse_attention_contiguous(q, k, v, block_indptr, block_indices, q_block, kv_block,
                                              mask_type=mask, compute_dtype=torch.float64)
    err = relative_error(out, ref)
    print(f"block-sparse {name} ({_label(tuning)}): rel err {err:.2e}")
    assert err < 2e-2


def block_sparse_cases(dev, tuning=None) -> None:
    for case in BSR_CASES:
        block_sparse_case(dev, *case, tuning=tuning)
    for case in CONTIG_BSR_CASES:
        contiguous_block_sparse_case(dev, *case, tuning=tuning)


def _prefill(tuning, q, k, v, **kw):
    """batch_prefill (tuning None) or a BatchPrefillTSWrapper planned with `tuning`, run."""
    if tuning is None:
        return prims_ts.batch_prefill(q, k, v, **kw)
    w = prims_ts.BatchPrefillTSWrapper(tuning=tuning)
    w.plan(q, k, v, **kw)
    return w.run(q, k, v)


def prefill_cases(dev, tuning=None) -> None:
    """Contiguous (fixed and packed) and paged prefill, every mask, D 128 and 256: the one-shots
    (tuning None) or wrappers planned with `tuning`."""
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
            out = _prefill(tuning, q, k, v, mask_type=mask, window_left=window, variable_window_token_starts=s,
                           variable_window_token_ends=e, out_dtype=torch.float32)
            ref = R.batch_prefill(q, k, v, mask_type=mask, window_left=window, window_starts=s, window_ends=e,
                                  compute_dtype=torch.float64)
            err = relative_error(out, ref)
            print(f"d={d} {mask}{window} ({_label(tuning)}): rel err {err:.2e}")
            assert err < 2e-2
        qo = torch.tensor([0, 1, 60, 129], dtype=torch.int32, device=dev)
        kvo = torch.tensor([0, 5, 70, 200], dtype=torch.int32, device=dev)
        q = torch.randn(129, 4, d, device=dev, dtype=torch.float16)
        k = torch.randn(200, 1, d, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        out = _prefill(tuning, q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
        ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
        err = relative_error(out, ref)
        print(f"d={d} packed causal ({_label(tuning)}): rel err {err:.2e}")
        assert err < 5e-3
    # paged prefill: shuffled pages, a padded row-strided table (the one-shot) or its CSR form (the
    # wrapper), lengths not page multiples
    for ps in (16, 128):
        pool = 12
        kc = torch.randn(pool, 2, ps, 128, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        wide = torch.randperm(pool, device=dev).to(torch.int32).view(2, 6)
        table = wide[:, :4]
        n_pages = [4, 2]
        lens = torch.tensor([3 * ps + 1, 2 * ps - 5], dtype=torch.int32, device=dev)
        qo = torch.tensor([0, 20, 45], dtype=torch.int32, device=dev)
        q = torch.randn(45, 8, 128, device=dev, dtype=torch.bfloat16)
        if tuning is None:
            out = prims_ts.batch_prefill_with_paged_kv_cache(q, kc, vc, qo, table, lens, page_size=ps,
                                                             mask_type="causal")
        else:
            indptr = torch.tensor(cumsum0(n_pages), dtype=torch.int32, device=dev)
            indices = torch.cat([table[b, :n] for b, n in enumerate(n_pages)]).contiguous()
            last = torch.tensor([1, ps - 5], dtype=torch.int32, device=dev)
            w = prims_ts.BatchPrefillPagedTSWrapper("HND", tuning=tuning)
            w.plan(q, kc, vc, qo, indptr, indices, last, page_size=ps, mask_type="causal")
            out = w.run(q, kc, vc)
        ref = R.batch_prefill_paged(q, kc, vc, qo, table, lens, mask_type="causal", compute_dtype=torch.float64)
        err = relative_error(out, ref)
        print(f"paged ps={ps} ({_label(tuning)}): rel err {err:.2e}")
        assert err < 2e-2


def sections(dev) -> list:
    """Every case of the sanitizer pass as (label, callable) sections, in order: the default
    tuning (the one-shots and the standalone functions), the ticket merge, and on sm_90a each
    ring variant's prefill and block-sparse cases, the swapped MLA tile's other copy and the
    twin tile's own pass."""
    out = [
        # the default tuning: the one-shots and the standalone functions
        ("prefill", lambda: prefill_cases(dev)),
        # paged decode: [B,Hq,D], [B,SQ,Hq,D] causal + window, packed; with and without split-KV
        ("decode", lambda: decode_cases(dev)),
        # MLA decode: fixed and packed, both cache ranks, with and without split-KV (sm_90a: the
        # mma.sync tile of rows of 16/32 through a wrapper too)
        ("mla", lambda: mla_cases(dev)),
        # both again with the ticket merge (at 2-8 splits too)
        ("decode, ticket merge", lambda: decode_cases(dev, Tuning(cluster_merge=False))),
        ("mla, ticket merge", lambda: mla_cases(dev, Tuning(cluster_merge=False))),
        # block-sparse: kv blocks 8/32/64/128, valid bits, causal, empty rows, both cache forms
        ("block-sparse", lambda: block_sparse_cases(dev)),
    ]
    if _sm90(dev):
        # the producer ring's variants, each through wrappers planned with its tuning: consumer
        # loops 0/1/2, persistent CTAs (three: each walks many items), and the producer copy the
        # default does not take
        for name, tuning in RING_VARIANTS.items():
            out.append((f"ring variant {name} ({tuning.encode()}), prefill", lambda t=tuning: prefill_cases(dev, t)))
            out.append((f"ring variant {name} ({tuning.encode()}), block-sparse",
                        lambda t=tuning: block_sparse_cases(dev, t)))
        out.append(("MLA's swapped tile, the other producer copy", lambda: other_copy_mla(dev)))
        out.append(("MLA twin tile", lambda: run_mla_twin(dev, default=False)))  # its default pass ran above
    return out


def other_copy_mla(dev) -> None:
    """MLA's swapped tile (rows of 16/32) with the producer copy the default does not take (the
    twin's rows of 64 have no producer: their cases would repeat the default)."""
    tuning = RING_VARIANTS["other_copy"]
    assert tuning.flip_copy
    for case in MLA_CASES:
        h, sq = case[4], case[2]
        if h * (max(sq) if isinstance(sq, list) else sq) <= 32:
            mla_case(dev, *case, tuning=tuning)


def run_all(dev, part: int = 0, parts: int = 1) -> None:
    """Every section (``sections``), or with ``parts`` > 1 every parts-th from the part-th: the
    parts together run each section once, so that a tool's pass can run as several processes
    at once or over several device calls."""
    for i, (label, run) in enumerate(sections(dev)):
        if i % parts == part:
            print(f"[{label}]")
            run()
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def run_mla_twin(dev, default: bool = True) -> None:
    """MLA_CASES through a wrapper planned with the twin tile (the default for rows of 64 and
    more: the packed H64, split H128 and cluster twin cases; the others keep the swapped tile):
    the default tuning (`default`; 2-8 splits merge in a cluster, their partials over the tile's
    own shared memory, more by the ticket) and balanced split-KV over 7 CTAs (its barriers
    retired and set up again item after item); three twin cases again with a spiked key (the
    rerun: the barrier phases it continues); and three whole tiles a request,
    dense (an odd tile count without the first tile's zeroing: warpgroup 1 waits for one P more
    than warpgroup 0)."""
    twin = Tuning()
    tunings = [dataclasses.replace(twin, balanced_split=True, balanced_ctas=7, merge_fan=2)]
    if default:
        tunings = [twin] + tunings
    for tuning in tunings:
        for case in MLA_CASES:
            mla_case(dev, *case, tuning=tuning)
        mla_case(dev, "three tiles packed h64 dense", "packed", [1, 1, 1], "dense", 64, 32, 4, [192, 192, 192], 192,
                 False, tuning=tuning)
        for case in MLA_CASES[1:4:2] + MLA_CASES[-2:-1]:
            mla_case(dev, *case, tuning=tuning, spike=True)
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


def run_variant(dev, name: str) -> None:
    """The prefill and block-sparse cases of one ring variant (``RING_VARIANTS[name]``) only."""
    tuning = RING_VARIANTS[name]
    print(f"ring variant {name} ({tuning.encode()}):")
    prefill_cases(dev, tuning)
    block_sparse_cases(dev, tuning)
    torch.cuda.synchronize()


def run_decode(dev) -> None:
    """The paged- and MLA-decode cases alone: the standalone functions (the default tuning: 2-8
    splits as a cluster on sm_90a), then wrappers with the ticket merge and with balanced
    split-KV over 7 CTAs (the walk, its CTA barriers, a unit's parts merged by the ticket)."""
    for tuning in (None, Tuning(cluster_merge=False), Tuning(balanced_split=True, balanced_ctas=7, merge_fan=2)):
        decode_cases(dev, tuning)
        mla_cases(dev, tuning)
    torch.cuda.synchronize()


def run_block_sparse(dev) -> None:
    """The block-sparse cases alone: the default tuning, then (sm_90a) the cp.async producer."""
    block_sparse_cases(dev)
    if _sm90(dev):
        block_sparse_cases(dev, RING_VARIANTS["cp_async"])
    torch.cuda.synchronize()


def main() -> None:
    torch.manual_seed(0)
    if len(sys.argv) == 3 and sys.argv[1] == "--variant":
        run_variant("cuda", sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "--decode":
        run_decode("cuda")
    elif len(sys.argv) == 2 and sys.argv[1] == "--block-sparse":
        run_block_sparse("cuda")
    elif len(sys.argv) == 2 and sys.argv[1] == "--mla-twin":
        run_mla_twin("cuda")
    elif len(sys.argv) == 3 and sys.argv[1] == "--part":
        part, _, parts = sys.argv[2].partition("/")
        if not (part.isdigit() and parts.isdigit() and int(part) < int(parts)):
            sys.exit(f"--part: K/N with 0 <= K < N, not {sys.argv[2]!r}")
        run_all("cuda", int(part), int(parts))
    elif len(sys.argv) == 1:
        run_all("cuda")
    else:
        sys.exit(__doc__)
    print("sanitize cases done")


if __name__ == "__main__":
    main()
