"""Host-side launch policies: split-KV choice, the heavy-first work list, tile choice per
engine, the tuning value, the kernel catalogue, and plans that agree with their runs."""
import dataclasses
import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import prims_ts
from prims_ts import Tuning
from prims_ts.cuda import catalog, decode, keys, prefill
from prims_ts.cuda.block_sparse import BlockSparseKey
from prims_ts.cuda.decode import MLA_DIM_QK, MLA_DIM_V, DecodeKey, decode_policy
from prims_ts.cuda.prefill import PrefillKey
from prims_ts.ops.prefill import work_list

I32 = torch.int32


@pytest.mark.parametrize("batch,hkv,group,sq,d,length",
                         list(itertools.product([1, 7, 128, 512], [1, 8], [1, 4, 32], [1, 3], [64, 128, 256],
                                                [1, 63, 64, 4097, 131072])))
def test_decode_policy_covers_every_key_once(batch, hkv, group, sq, d, length):
    pol = decode_policy(batch, hkv, group, sq, d, length, sm_count=132)
    assert pol.bm in (16, 32, 64) and pol.rows_max == group * sq
    assert pol.row_tiles * pol.bm >= pol.rows_max > (pol.row_tiles - 1) * pol.bm
    assert pol.chunk % pol.bn == 0, "split boundaries must fall on K/V tile boundaries"
    assert pol.splits >= 1 and pol.splits * pol.chunk >= length, "every key belongs to a split"
    assert pol.splits <= 128
    ws = decode.decode_workspace_bytes(batch, hkv, group, sq, d, length, sm_count=132)
    if pol.splits > 1:
        rows = batch * hkv * pol.splits * pol.rows_max
        assert ws >= rows * (d + 1) * 4
    if sq == 1 and pol.splits == 1:
        assert ws == 0, "a single split needs no partials"


def test_decode_workspace_never_shrinks_as_max_seq_len_grows():
    for batch, hkv, group in ((1, 1, 1), (1, 8, 4), (16, 8, 4)):
        sizes = [decode.decode_workspace_bytes(batch, hkv, group, 1, 128, n, 132) for n in range(1, 20000, 37)]
        assert sizes == sorted(sizes)


def test_decode_policy_splits_long_single_requests():
    pol = decode_policy(1, 8, 4, 1, 128, 131072, sm_count=132)
    assert pol.splits > 1
    assert decode_policy(128, 8, 4, 1, 128, 4096, sm_count=132).splits == 1


def test_decode_policy_splits_one_wave():
    """decode._split_target (benchmarks/NOTES.md, "One wave of splits", "The clusters' placement
    and one CTA an SM"): the most splits (at least two) whose CTAs take an SM each where they
    fill at least ONE_WAVE_FILL of the SMs, else the most that fit one wave of the resident slots where they
    fill that share of it (decode D128 rows of 16: two CTAs an SM, 264 slots on 132 SMs; MLA rows
    of 16: one, 132), else the best fill over several waves; MLA rows of 64 (the twin's) keep the
    best fill."""
    def ctas(pol, batch, hkv):
        return batch * hkv * pol.row_tiles * pol.splits

    # a CTA an SM where that fills ONE_WAVE_FILL of the SMs with at least two splits
    for batch, splits in ((1, 16), (2, 8), (4, 4), (8, 2)):
        pol = decode_policy(batch, 8, 4, 1, 128, 65536, sm_count=132)
        assert pol.splits == splits and decode.ONE_WAVE_FILL * 132 <= ctas(pol, batch, 8) <= 132, (batch, pol)
    # else one wave of the resident slots (B6: 48 units, 96 SMs at two splits; B16: one split a
    # unit would fill the SMs, two fill the slots)
    for batch, splits in ((6, 5), (16, 2)):
        pol = decode_policy(batch, 8, 4, 1, 128, 65536, sm_count=132)
        assert pol.splits == splits and decode.ONE_WAVE_FILL * 264 <= ctas(pol, batch, 8) <= 264, (batch, pol)
    # 96 CTAs: two splits fill 73% of one wave, so the best fill over four waves stands
    assert decode_policy(12, 8, 4, 1, 128, 65536, sm_count=132).splits == 11
    for batch, splits in ((1, 128), (8, 16), (16, 8), (24, 5), (48, 11), (64, 2)):
        assert decode_policy(batch, 1, 16, 1, decode.MLA_DIM_QK, 65536, sm_count=132).splits == splits, batch
    # the twin's rows: the best fill over any waves (launch_shape picks its clusters from it)
    assert decode_policy(8, 1, 128, 1, decode.MLA_DIM_QK, 8192, sm_count=132).splits == 33
    # the rule never passes the kernel's bound, nor the keys' floor a split
    assert decode_policy(1, 1, 16, 1, decode.MLA_DIM_QK, 1 << 20, sm_count=132).splits == decode.DECODE_MAX_SPLITS
    assert decode_policy(2, 8, 4, 1, 128, 1024, sm_count=132).splits == 8


def test_split_sweep_forces_the_count():
    """benchmarks/split_sweep.py's forced policy: the count asked (up to the key tiles), chunks
    of whole tiles that cover the keys (a trailing one may be empty, as the policy's), never
    balanced."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("split_sweep", Path(__file__).parent.parent / "benchmarks" /
                                                  "split_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for splits, length in ((16, 131072), (33, 131072), (5, 1000), (40, 640)):
        pol = sweep.forced(decode_policy, splits)(1, 8, 4, 1, 128, length, 132)
        tiles = -(-length // pol.bn)
        assert pol.splits == min(splits, tiles) and pol.balanced == 0
        assert pol.chunk % pol.bn == 0 and pol.splits * pol.chunk >= length
    assert sweep.forced(decode_policy, None)(1, 8, 4, 1, 128, 131072, 132) == decode_policy(1, 8, 4, 1, 128, 131072,
                                                                                             132)
    # --trace's line: four CTAs (start ns, end ns, SM, 1) on three SMs, two of them on SM 5
    tr = np.array([[0, 10_000, 5, 1], [1_000, 21_000, 5, 1], [0, 30_000, 2, 1], [500, 12_500, 7, 1]])
    assert sweep.placement_line(tr) == ("4 CTAs on 3 SMs (at most 2 an SM, 1 SMs with two or more); CTA us median 16.0 "
                                        "min 10.0 max 30.0; span 30.0 us")


def test_work_list_heavy_first_and_complete():
    q_lens, kv_lens = [1, 300, 129, 1000], [5, 300, 500, 1000]
    items = [tuple(x) for x in work_list(torch.tensor(q_lens), torch.tensor(kv_lens), "causal", -1, 128).tolist()]
    expected = {(b, t) for b, n in enumerate(q_lens) for t in range((n + 127) // 128)}
    assert set(items) == expected and len(items) == len(expected)

    def cost(item):
        b, t = item
        sq, sk = q_lens[b], kv_lens[b]
        return min(sk, sk - sq + min(sq, (t + 1) * 128))

    costs = [cost(i) for i in items]
    assert costs == sorted(costs, reverse=True)
    ties = [i for i in items if cost(i) == costs[0]]
    assert ties == sorted(ties), "equal costs: request, then tile order"


def test_work_list_window_and_dense():
    """With a left window the cost is the band (window + tile rows), not the causal prefix;
    dense costs are the key counts; an empty batch gives an empty list."""
    q_lens, kv_lens = torch.tensor([256, 256]), torch.tensor([256, 4096])
    items = work_list(q_lens, kv_lens, "causal", 10, 128).tolist()
    assert items[:2] == [[0, 0], [0, 1]] or items[0][0] == 0  # both requests' bands are 128 + 10 wide
    dense = work_list(q_lens, kv_lens, "dense", -1, 128).tolist()
    assert [b for b, _ in dense[:2]] == [1, 1] and len(dense) == 4
    assert work_list(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), "dense", -1,
                     128).shape == (0, 2)


def test_uniform_causal_batches_take_the_implicit_order(monkeypatch):
    """plan_work builds no list for a causal problem (no left window) whose requests all have the
    same query bound and K/V length: the kernel's implicit order (item i: request i % B, q tile
    T - 1 - i // B; fmha_prefill.cu) is then the list's, item for item. Requests that differ, a
    window or a dense mask (its list orders by request) get a list."""
    from prims_ts.ops import _validate as V
    from prims_ts.ops import prefill as P

    cuda = torch.device("cuda")
    for batch, sq, sk in ((1, 1, 1), (3, 1000, 1000), (8, 2048, 2048), (2, 300, 4096)):
        q_lens, kv_lens = np.full(batch, sq), np.full(batch, sk)
        assert P.plan_work(cuda, q_lens, kv_lens, sq, True, "causal", -1, torch.bfloat16, 128) is None
        assert P.plan_work(cuda, q_lens, kv_lens, sq, False, "causal", -1, torch.bfloat16, 128) is None
        tiles = (sq + 127) // 128
        implicit = [[i % batch, tiles - 1 - i // batch] for i in range(batch * tiles)]
        assert work_list(q_lens, kv_lens, "causal", -1, 128).tolist() == implicit
    monkeypatch.setattr(P, "tile_m", lambda *a: 128)
    monkeypatch.setattr(V, "to_device", lambda device, a: [torch.from_numpy(a.reshape(-1))])
    for q_lens, kv_lens, mask, window in (([3, 5], [7, 7], "causal", -1), ([4, 4], [7, 9], "causal", -1),
                                          ([1000] * 2, [1000] * 2, "causal", 300), ([64] * 2, [64] * 2, "dense", -1)):
        work = P.plan_work(cuda, np.array(q_lens), np.array(kv_lens), max(q_lens), True, mask, window, torch.bfloat16,
                           128)
        assert work is not None and work.shape[1] == 2
    assert P.plan_work(torch.device("cpu"), np.array([3, 5]), np.array([7, 7]), 5, True, "causal", -1, torch.bfloat16,
                       128) is None  # the CPU runs the reference: no list at all


@pytest.mark.parametrize("batch,heads,sq,length", list(itertools.product([1, 64, 128], [8, 16, 32, 64, 128], [1, 4],
                                                                            [1, 63, 4097, 131072])))
def test_mla_policy_is_the_decode_policy_of_one_latent_head(batch, heads, sq, length):
    """MLA decode = the decode kernel with Hkv = 1, group = H, 576-wide K, 512-wide V."""
    pol = decode_policy(batch, 1, heads, sq, MLA_DIM_QK, length, sm_count=132)
    assert pol.split_o and pol.rows_max == heads * sq and pol.splits * pol.chunk >= length
    assert pol.bn % (16 * pol.warps_n) == 0 and (MLA_DIM_V // 8 // pol.warps_n) % 2 == 0
    for arch in ("sm_80", "sm_90a"):
        key = DecodeKey.of("bf16", MLA_DIM_QK, True, pol, arch)
        assert key.dv == MLA_DIM_V and key.shared_kv and key.smem <= 227 * 1024
        assert key.arch == (90 if arch == "sm_90a" else 80)  # rows of 16/32: the swapped tile
        assert key.swap == (arch == "sm_90a" and pol.bm < 64)
    ws = decode.mla_workspace_bytes(batch, heads, sq, length, 132)
    if pol.splits > 1:
        assert ws >= batch * pol.splits * pol.rows_max * (MLA_DIM_V + 1) * 4


@pytest.mark.parametrize("heads,sq", [(8, 1), (8, 4), (16, 1), (16, 2), (32, 1)])
def test_mla_swapped_tile_key(heads, sq):
    """Rows of 16/32 on sm_90a: the swapped-operand key (one MMA warpgroup + the producer, BN 64
    so the policy's split chunks stay whole tiles) by default; Tuning(mla_swapped=False) takes
    the mma.sync tile; never swapped on other archs."""
    pol = decode_policy(64, 1, heads, sq, MLA_DIM_QK, 8192, sm_count=132)
    assert pol.bm in (16, 32) and pol.bn == decode.SWAP_BN and pol.chunk % decode.SWAP_BN == 0
    key = DecodeKey.of("bf16", MLA_DIM_QK, False, pol, "sm_90a")
    assert key.swap and key.bm == pol.bm and key.threads == 256 and key.smem <= keys.smem_limit("sm_90a")
    assert "SwapConfig" in key.source().source and key.name.endswith(f"_swap_cp{Tuning().copy_for(MLA_DIM_QK)}")
    assert not DecodeKey.of("bf16", MLA_DIM_QK, False, pol, "sm_80").swap
    assert key.stages == 2 and f", {key.stages}, {key.copy_tpr}>" in key.source().source  # two whole tiles
    assert not DecodeKey.of("bf16", MLA_DIM_QK, False, pol, "sm_90a", Tuning(mla_swapped=False)).swap


@pytest.mark.parametrize("heads,sq", [(64, 1), (128, 1), (16, 4), (32, 2)])
def test_mla_twin_tile_key(heads, sq):
    """Rows of 64 on sm_90a: the twin key under every tuning (two MMA warpgroups that issue their
    own TMA copies, the policy's 64-key tiles, two 72 KB stages beside Q within the shared
    memory, the pool's map in its parameters); rows of 16/32 keep the swapped tile; never on
    other archs."""
    t = Tuning()
    pol = decode_policy(64, 1, heads, sq, MLA_DIM_QK, 8192, sm_count=132)
    assert pol.bm == 64 and pol.bn == decode.TWIN_BN
    key = DecodeKey.of("bf16", MLA_DIM_QK, True, pol, "sm_90a", t)
    assert key.twin and not key.swap and key.threads == 256 and key.name.endswith("_twin")
    assert key.tma and key.PARAMS == "DecodeTmaParams" and not key.producer
    assert key.smem == decode.twin_smem_bytes(MLA_DIM_QK) + keys.WGMMA_ALIGN_SLACK <= keys.smem_limit("sm_90a")
    assert "TwinConfig<pt::bf16, 576, 512>" in key.source().source
    for other in (Tuning(flip_copy=True), Tuning(copy_tpr=8), Tuning(mla_swapped=False), Tuning(cluster_merge=False)):
        assert DecodeKey.of("bf16", MLA_DIM_QK, True, pol, "sm_90a", other) == key, other
    assert not DecodeKey.of("bf16", MLA_DIM_QK, True, pol, "sm_80", t).twin
    small = decode_policy(64, 1, 16, 1, MLA_DIM_QK, 8192, sm_count=132)
    swap = DecodeKey.of("bf16", MLA_DIM_QK, True, small, "sm_90a", t)
    assert swap.swap and not swap.twin, swap.name


# ----------------------------------------------------------------------------
# Balanced split-KV: a mirror of fmha_decode.cu's walk (walk_start, walk_next, the merge's parts),
# the same integer arithmetic, checked over many launches: every key tile of every unit in
# exactly one item, a unit's parts and slots as its merger computes them.
# ----------------------------------------------------------------------------


def _walk_items(weights, units, grid, threads=128, row_tiles=1):
    """The items every CTA of a balanced launch walks: weights[b] tiles per unit (K/V head) of
    request b, `units` units a request, `grid` CTAs in groups of `row_tiles` (CTA c: group
    c // row_tiles, row tile c % row_tiles; a group's CTAs walk the same tiles; each CTA scans
    with `threads` threads, each a run of consecutive requests). Returns [(cta, b, j, rt, a, e,
    slot, c0, parts, x)], c0 the unit's first group."""
    B, R = len(weights), row_tiles
    total = units * sum(weights)
    g = min(grid // R, total)
    per = -(-B // threads)
    items = []
    for c in range(g * R):  # the CTAs past the whole groups, and the groups past G', leave
        k, rt = c // R, c % R
        t0, t1 = k * total // g, (k + 1) * total // g
        found = []
        for tid in range(threads):  # the scan's finder: the thread whose run holds tile t0
            b0, b1 = min(B, tid * per), min(B, min(B, tid * per) + per)
            s0 = units * sum(weights[:b0])
            mine = sum(weights[b0:b1])
            if s0 <= t0 < s0 + mine * units:
                s = s0
                for i in range(b0, b1):
                    e = s + weights[i] * units
                    if t0 < e:
                        found.append((i, s))
                        break
                    s = e
        assert len(found) == 1, (c, found)
        b, sreq = found[0]
        wb, pos = weights[b], t0
        while pos < t1 and b < B:  # walk_next
            j = (pos - sreq) // wb
            su, eu = sreq + j * wb, sreq + j * wb + wb
            a, e = pos - su, min(t1, eu) - su
            slot = c0 = parts = x = None
            if not (a == 0 and e == wb):
                first = pos == k * total // g
                slot = 2 * c + (0 if first else 1)
                c0 = ((su + 1) * g - 1) // total
                parts = ((eu - 1 + 1) * g - 1) // total - c0 + 1
                x = int(c0 * total // g != su)
            items.append((c, b, j, rt, a, e, slot, c0, parts, x))
            pos = su + e
            if j + 1 == units and pos < t1:
                sreq = eu
                b += 1
                if b < B:
                    wb = weights[b]
    return items


@pytest.mark.parametrize("seed", range(40))
def test_balanced_walk_covers_each_tile_once(seed):
    """The balanced walk's items cover every unit's key tiles exactly once for each row tile; an
    item holding a whole unit writes the output rows; a cut unit's items of a row tile are its
    parts in groups c0 .. c0 + parts - 1 (consecutive groups, at least two), each at the slot its
    merger reads (part 0 at 2 (c0 R + rt) + x, part s at 2 ((c0 + s) R + rt)), no slot written
    twice; fewer tiles than groups leave the rest idle."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 300))
    units = int(rng.choice([1, 2, 8, 16]))
    kind = seed % 4
    if kind == 0:  # uniform
        weights = [int(rng.integers(1, 200))] * B
    elif kind == 1:  # one long request among short ones
        weights = [int(rng.integers(1, 20)) for _ in range(B)]
        weights[int(rng.integers(0, B))] = 2048
    elif kind == 2:  # empty requests weigh one tile
        weights = [int(rng.choice([1, 1, 3, 70])) for _ in range(B)]
    else:
        weights = [int(rng.integers(1, 5000)) for _ in range(B)]
    grid = int(rng.choice([1, 5, 7, 132, 264, 1000]))
    R = 1 if seed < 20 else int(rng.choice([r for r in (2, 4, 8) if r <= grid] or [1]))
    items = _walk_items(weights, units, grid, threads=int(rng.choice([128, 256])), row_tiles=R)
    total = units * sum(weights)
    assert len({it[0] for it in items}) == min(grid // R, total) * R  # every CTA of G' groups has an item
    cover = {}
    slots = set()
    for c, b, j, rt, a, e, slot, c0, parts, x in items:
        assert 0 <= j < units and 0 <= a < e <= weights[b] and rt == c % R
        cover.setdefault((b, j, rt), []).append((a, e, c, slot, c0, parts, x))
        if slot is not None:
            assert slot not in slots
            slots.add(slot)
    assert len(cover) == B * units * R
    for (b, j, rt), pieces in cover.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == weights[b]
        assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))  # contiguous, disjoint
        if len(pieces) == 1:
            assert pieces[0][3] is None  # the whole unit: the output rows
            continue
        c0, parts, x = pieces[0][4:]
        assert parts == len(pieces) >= 2 and all(p[4:] == (c0, parts, x) for p in pieces)
        for s, (_, _, c, slot, _, _, _) in enumerate(pieces):
            assert c == (c0 + s) * R + rt and slot == 2 * ((c0 + s) * R + rt) + (x if s == 0 else 0)


@pytest.mark.parametrize("seed", range(20))
def test_balanced_merge_tree_groups(seed):
    """A cut MLA unit of more than 2 merge_fan parts merges in two levels (fmha_decode.cu:
    merge_if_last): group j (parts j fan .. j fan + n - 1) by the ticket of its part 0's slot
    (group_ticket: past the B x Hkv x R units' counters), into that slot; then the unit's ticket
    over the groups, whose merge reads each group's part 0. Mirrored on the walk's items, the
    parts arriving in a random order: a group's MergeParts reads its own parts' slots, the top
    merge each group's first slot, each unit merged once, no two groups share a counter, every
    counter inside the workspace's and back at zero."""
    rng = np.random.default_rng(100 + seed)
    B = int(rng.integers(1, 60))
    units = int(rng.choice([1, 2, 8]))
    weights = [int(rng.integers(1, 20)) for _ in range(B)]
    weights[int(rng.integers(0, B))] = int(rng.integers(200, 3000))
    grid = int(rng.choice([41, 132, 264]))
    R = int(rng.choice([1, 2]))
    items = _walk_items(weights, units, grid, row_tiles=R)
    most = max(it[8] or 1 for it in items)
    assert most >= 5  # the long request is cut into 5 parts or more
    fan = min(int(rng.choice([2, 3, 8])), (most - 1) // 2)  # some unit has more than 2 fan parts
    rows = 64  # a slot's rows (any: the counters index slots)
    cut = {}
    for c, b, j, rt, a, e, slot, c0, parts, x in items:
        if slot is not None:
            cut.setdefault((b, j, rt), []).append((c, slot, c0, parts, x))
    counters, group_counters, two_level, merged = {}, set(), 0, []
    arrivals = [(key, piece) for key, pieces in cut.items() for piece in pieces]
    rng.shuffle(arrivals)
    for (b, j, rt), (c, slot, c0, P, x) in arrivals:
        s = c // R - c0  # decode_item's part
        first, second, step = 2 * (c0 * R + rt) + x, 2 * ((c0 + 1) * R + rt), 2 * R
        row = lambda s_: first if s_ == 0 else second + (s_ - 1) * step  # noqa: E731
        assert row(s) == slot  # the part's slot as the merge reads it
        unit = (b * units + j) * R + rt  # the unit's counter
        if P <= 2 * fan:
            counters[unit] = counters.get(unit, 0) + 1
            if counters[unit] == P:
                counters[unit] = 0
                merged.append(((b, j, rt), [row(k) for k in range(P)]))
            continue
        g, groups = s // fan, -(-P // fan)
        n = min(fan, P - g * fan)
        gfirst = row(g * fan) * rows  # the group's first row; its ticket: slot gfirst / rows
        ticket = B * units * R + gfirst // rows
        assert ticket < B * units * R + 2 * grid
        if n > 1:
            group_counters.add((ticket, (b, j, rt), g))
            counters[ticket] = counters.get(ticket, 0) + 1
            if counters[ticket] < n:
                continue
            counters[ticket] = 0
            gsecond = row(g * fan + 1)
            assert [row(g * fan) if i == 0 else gsecond + (i - 1) * step for i in range(n)] == \
                [row(g * fan + i) for i in range(n)]
        counters[unit] = counters.get(unit, 0) + 1
        if counters[unit] == groups:
            counters[unit] = 0
            top_second, top_step = row(fan), fan * step
            merged.append(((b, j, rt), [first if k == 0 else top_second + (k - 1) * top_step for k in range(groups)]))
            assert merged[-1][1] == [row(k * fan) for k in range(groups)]
            two_level += 1
    assert sorted(k for k, _ in merged) == sorted(cut) and not any(counters.values())
    assert len({t for t, _, _ in group_counters}) == len(group_counters)  # no shared group counter
    assert two_level > 0


def test_merge_fan_in_the_workspace():
    """A balanced launch's workspace holds a counter a slot past the units' (the groups'
    tickets); a static one's layout is unchanged; Tuning.merge_fan below 2 or above MERGE_FAN_MAX
    is refused."""
    from prims_ts.cuda.decode import DecodePolicy, decode_partial_layout

    static = decode_policy(4, 2, 4, 1, 128, 8192, sm_count=132)
    bal = decode_policy(4, 2, 4, 1, 128, 8192, sm_count=132, balance=40)
    assert bal.balanced == 40 and static.splits > 1
    _, _, count, end = decode_partial_layout(4, 2, bal, 128)
    assert end - count == (4 * 2 * bal.row_tiles + 2 * 40) * 4
    _, _, count, end = decode_partial_layout(4, 2, static, 128)
    assert end - count == 4 * 2 * static.row_tiles * 4
    assert isinstance(bal, DecodePolicy)
    for bad in (1, (1 << 16) + 1):
        with pytest.raises(ValueError, match="merge_fan"):
            Tuning(merge_fan=bad)
    assert Tuning.decode(Tuning(merge_fan=3).encode()).merge_fan == 3


def _unit_span(sk, sq, window, bn, chunk):
    """A mirror of fmha_decode.cu's unit_span (causal): a request's key tiles, (first, weight)."""
    if not 0 < sk <= chunk:
        return 0, 1
    first = 0
    if window >= 0:
        lo = sk - max(sq, 1) - window
        first = lo // bn if lo > 0 else 0
    return first, -(-sk // bn) - first


def test_balanced_unit_span_holds_every_visible_key():
    """A balanced unit's tiles start at the first tile any of its query rows sees under a causal
    window (bottom-right: token t sees keys [sk - sq + t - window, sk - sq + t]) and end at its
    length: every visible key inside, at most BN - 1 keys before the lowest visible one; no
    window: the whole length; an empty or over-capacity length one (empty) tile."""
    rng = np.random.default_rng(5)
    for _ in range(3000):
        bn = int(rng.choice([32, 64, 128]))
        sk, sq = int(rng.integers(1, 3000)), int(rng.integers(1, 6))
        sq = min(sq, sk)
        window = int(rng.choice([-1, 0, 1, 37, 300, 5000]))
        first, weight = _unit_span(sk, sq, window, bn, chunk=4096)
        assert weight >= 1 and (first + weight) * bn >= sk > (first + weight - 1) * bn
        lows = [max(0, sk - sq + t - window) if window >= 0 else 0 for t in range(sq)]
        assert first * bn <= min(lows) < first * bn + bn
    assert _unit_span(0, 1, 5, 64, 4096) == (0, 1) and _unit_span(5000, 1, 5, 64, 4096) == (0, 1)


def test_balanced_policy():
    """Tuning(balanced_split=True): decode and MLA launches of at least BALANCED_MIN_TILES_PER_SLOT
    key tiles a resident slot take a persistent grid of the slots (splits 1, the capacity in
    keys), the latency rows the static split; balanced_ctas forces it at any size (every tile:
    MLA's rows of 64 on the twin tile too); the workspace holds two slots a CTA (and a group
    ticket a slot)."""
    on = Tuning(balanced_split=True)
    b = decode.balances(on)
    assert b == -1 and decode.balances(Tuning()) == 0
    assert decode.balances(Tuning(balanced_split=True, balanced_ctas=7)) == 7
    wide = decode_policy(128, 1, 128, 1, MLA_DIM_QK, 4096, 132, balance=b)
    assert wide.balanced and DecodeKey.of("bf16", MLA_DIM_QK, False, wide, "sm_90a", on).twin
    big = decode_policy(128, 8, 4, 1, 128, 4096, 132, balance=b)
    slots = 132 * 2
    assert (big.balanced, big.splits, big.chunk) == (slots, 1, 4096)
    small = decode_policy(1, 8, 4, 1, 128, 1024, 132, balance=b)
    assert small.balanced == 0 and small == decode_policy(1, 8, 4, 1, 128, 1024, 132)
    forced = decode_policy(1, 8, 4, 1, 128, 1024, 132, balance=7)
    assert (forced.balanced, forced.splits, forced.chunk) == (7, 1, 1024)
    rows = min(big.bm, big.rows_max)
    lse, o, count, end = decode.decode_partial_layout(128, 8, big, 128)
    assert o >= 2 * slots * rows * 4 and count - o >= 2 * slots * rows * 128 * 4
    assert end - count == (128 * 8 + 2 * slots) * 4  # the units' tickets, then the groups' (a slot each)
    assert decode.decode_workspace_bytes(128, 8, 4, 1, 128, 4096, 132, balance=b) >= end
    key = DecodeKey.of("bf16", 128, False, big, "sm_90a", on)
    assert key.balanced and key.name.endswith("_bal") and key.call().endswith(", true>")
    assert not DecodeKey.of("bf16", 128, False, small, "sm_90a", on).balanced
    mla = decode_policy(64, 1, 16, 1, MLA_DIM_QK, 8192, 132, balance=-1)
    assert mla.balanced == 132 and DecodeKey.of("bf16", MLA_DIM_QK, False, mla, "sm_90a", on).swap
    # the merge's weights (a tile's rows of G parts) must fit the smallest key the policy may
    # launch: MLA rows of 64 the twin's bytes, below the policy tile's
    for g, balanced in ((860, True), (880, False)):
        wide = decode_policy(1, 1, 64, 1, MLA_DIM_QK, 60000, 132, balance=g)
        assert (wide.balanced == g) == balanced and 64 * 860 * 4 + 256 <= decode.twin_smem_bytes(MLA_DIM_QK)


def test_balanced_by_lengths():
    """A plan of the default tuning (balanced_split None) balances split-KV where its lengths make
    the static split wait on a few long requests (ragged_ratio above RAGGED_RATIO; the twin MLA
    tile's charged ratio above RAGGED_RATIO_TWIN), and keeps the tuning itself (the static split) on uniform
    batches, on launches below the balanced size floor, and wherever the tuning says True or
    False."""
    t = Tuning()
    assert t.balanced_split is None and decode.balances(t) == 0

    def by(lens, b, hkv, group, d, max_len, tuning=t, arch="sm_90a"):
        return decode.balanced_by_lengths(tuning, np.asarray(lens), b, hkv, group, 1, d, max_len, 132,
                                          keys.NOMINAL_SMEM_LIMIT, arch)

    def ratio(lens, b, hkv, group, d, max_len, twin=False):
        bal = decode_policy(b, hkv, group, 1, d, max_len, 132, balance=-1)
        return decode.ragged_ratio(np.asarray(lens), decode_policy(b, hkv, group, 1, d, max_len, 132),
                                   bal.balanced, hkv, twin, 132)

    skewed = [32768] + [1024] * 63  # the bench's row: 8 CTAs of 32768 keys, 504 of 1024, on 264 slots
    assert ratio(skewed, 64, 8, 4, 128, 32768) == pytest.approx(32768 / (8 * (32768 + 63 * 1024) / 264))
    assert by(skewed, 64, 8, 4, 128, 32768) == Tuning(balanced_split=True)
    for lens, b in (([4096] * 128, 128), ([32768] * 16, 16), ([131072], 1)):  # the uniform rows
        assert ratio(lens, b, 8, 4, 128, lens[0]) < 1.05
        assert by(lens, b, 8, 4, 128, lens[0]) is t
    # keys an SM: the uniform B8 L16384 row's static launch (2 splits, 128 CTAs, an SM each)
    # against the balanced grid's 264 CTAs (two an SM); counted a CTA, it would read x2.06 and balance
    pol8 = decode_policy(8, 8, 4, 1, 128, 16384, 132)
    assert pol8.splits == 2 and decode.ragged_ratio(np.full(8, 16384), pol8, 264, 8) == pytest.approx(264 / 128)
    assert ratio([16384] * 8, 8, 8, 4, 128, 16384) < 1.05 and by([16384] * 8, 8, 8, 4, 128, 16384) is t
    # two requests of 65536 and two of 4096: the static split's 4 chunks of 16384 keys (a CTA an
    # SM) wait on the long requests, ~x1.94 the balanced grid's keys an SM
    assert by([65536] * 2 + [4096] * 2, 4, 8, 4, 128, 65536).balanced_split
    assert by([1024], 1, 8, 4, 128, 1024) is t  # below the size floor: no balanced policy
    assert ratio([0] * 64, 64, 8, 4, 128, 32768) == 0.0  # no keys: nothing to balance
    for fixed in (Tuning(balanced_split=False), Tuning(balanced_split=True)):
        assert by(skewed, 64, 8, 4, 128, 32768, fixed) is fixed
    # MLA: the swapped rows at the mma.sync bar; the twin's rows of 64 at its own, on sm_90a only
    assert by([8192] + [100] * 15, 16, 1, 16, MLA_DIM_QK, 8192).balanced_split
    # (benchmarks/ragged.py's twin rows on an H100: balanced over static, the uncharged ratio)
    near = [6144] * 8 + [4096] * 56  # H128 at 1.46: balanced lost 4%
    r = ratio(near, 64, 1, 128, MLA_DIM_QK, 6144)
    assert r > decode.RAGGED_RATIO and ratio(near, 64, 1, 128, MLA_DIM_QK, 6144, twin=True) < decode.RAGGED_RATIO_TWIN
    assert by(near, 64, 1, 128, MLA_DIM_QK, 6144) is t
    assert by(near, 64, 1, 128, MLA_DIM_QK, 6144, arch="sm_80").balanced_split
    for lens in ([7168] * 8 + [4096] * 56,  # 1.65: won 8%
                 [8192] * 8 + [4096] * 56,  # 1.83: won 18%
                 [int(x) for x in np.random.default_rng(7).integers(1, 8193, size=64)],  # 1.92: won 11%
                 [8192] * 16 + [2048] * 48):  # 2.36: won 35%
        assert ratio(lens, 64, 1, 128, MLA_DIM_QK, max(lens), twin=True) > decode.RAGGED_RATIO_TWIN
        assert by(lens, 64, 1, 128, MLA_DIM_QK, max(lens)).balanced_split
    assert by([32768] + [2048] * 31, 32, 1, 128, MLA_DIM_QK, 32768).balanced_split  # 11: x2.9
    # H64 (one row tile a request, the static launch in 2 splits as one cluster): balanced lost
    # 26%, 16% and 6% at 1.65, 1.83 and 2.36, and won 10% at 3.00; the static launch of one long
    # request (8 splits as one cluster: 8192 keys a CTA) lost x1.73 to balanced at 2.13
    for lens in ([4096] * 16 + [2048] * 48, [8192] * 8 + [4096] * 56, [8192] * 16 + [2048] * 48):
        assert ratio(lens, 64, 1, 64, MLA_DIM_QK, max(lens)) > 1.6
        assert by(lens, 64, 1, 64, MLA_DIM_QK, max(lens)) is t
    assert by([8192] * 8 + [2048] * 56, 64, 1, 64, MLA_DIM_QK, 8192).balanced_split
    assert by([65536] + [4096] * 15, 16, 1, 64, MLA_DIM_QK, 65536).balanced_split


# ----------------------------------------------------------------------------
# The tuning value
# ----------------------------------------------------------------------------


def test_tuning_encodes_and_decodes():
    """Ops carry a Tuning as a string: the default is "", every other value round-trips;
    unknown fields and bad values are errors naming tuning. A removed field is unknown: the
    staged split merge's (merge_staged), the split-O MLA tile's (mla_twin, whose False chose it),
    the twin tile's panel waits and early copies (mla_panel_wait, mla_early_fill: now the tile's
    only form) and the L2 prefetches (mla_prefetch, decode_prefetch, paged_prefetch) no longer
    decode."""
    assert Tuning().encode() == "" and Tuning.decode("") == Tuning()
    for t in list(catalog.VARIANTS) + [Tuning(copy_tpr=8, probe=1), Tuning(loop=0, flip_copy=True)]:
        assert Tuning.decode(t.encode()) == t, t
    with pytest.raises(ValueError, match="tuning"):
        Tuning.decode("looop=1")
    with pytest.raises(ValueError, match="tuning"):
        Tuning.decode("loop=fast")
    removed_fields = ("merge_staged", "mla_twin", "mla_panel_wait", "mla_early_fill", "mla_prefetch", "decode_prefetch",
                      "paged_prefetch", "mla_even_first", "mla_s_early", "mla_l2_ahead", "mla_stream_p")
    for removed in ("merge_staged=True", "mla_twin=False", "mla_twin=True", "flip_copy=True;mla_twin=False",
                    "mla_panel_wait=True", "mla_panel_wait=False", "mla_prefetch=True", "decode_prefetch=True",
                    "paged_prefetch=True", "loop=1;paged_prefetch=False", "mla_early_fill=True",
                    "mla_early_fill=False", "mla_even_first=1", "mla_s_early=True", "mla_l2_ahead=True",
                    "mla_stream_p=True"):
        with pytest.raises(ValueError, match=rf"tuning: unknown field '({'|'.join(removed_fields)})'"):
            Tuning.decode(removed)
    for bad in (dict(loop=3), dict(copy_tpr=6), dict(probe=5), dict(persistent_ctas=0)):
        with pytest.raises(ValueError, match="tuning"):
            Tuning(**bad)


def test_tuning_defaults_are_the_measured_choices():
    """The consumer loop (pingpong at every head dim) and the producer copy per
    row width (4 threads a row at D128, 8 at D256 and for MLA's 576-wide rows); flip_copy takes
    the other copy; persistence and the probe are off."""
    t = Tuning()
    assert (t.loop_for(128), t.loop_for(256)) == (2, 2)
    assert (t.copy_for(128), t.copy_for(256), t.copy_for(MLA_DIM_QK)) == (4, 8, 8)
    flip = Tuning(flip_copy=True)
    assert (flip.copy_for(128), flip.copy_for(256), flip.copy_for(MLA_DIM_QK)) == (8, 4, 4)
    assert Tuning(copy_tpr=8, flip_copy=True).copy_for(128) == 4
    assert not (t.persistent or t.probe) and t.mla_swapped


@pytest.mark.parametrize("loop", [0, 1, 2])
def test_consumer_loop_choice(loop):
    """Tuning.loop picks the producer ring's consumer loop of the sm_90a prefill-family keys
    (pingpong needs two MMA warpgroups: BM 64 block-sparse tiles stay at loop 1); the
    portable keys have no ring and keep loop 0; every loop is in the variants' catalogue."""
    t = Tuning(loop=loop)
    for d in (128, 256):
        key = PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", tuning=t)
        assert key.loop == loop and ("_l%d" % loop in key.name) == (loop > 0)
        assert key.under_pv == (loop > 0)  # prefill: the softmax under PV with the overlapped loops
        flags = [t.lean_for(d), t.lazy_rescale, key.under_pv]
        while flags and not flags[-1]:
            flags.pop()
        tail = "".join(f", {'true' if f else 'false'}" for f in flags)
        assert f", {loop}, {t.copy_for(d)}{tail}>" in key.source().source
        paged = PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, tuning=t)
        assert paged.under_pv == (loop > 0) and not BlockSparseKey.choose("bf16", d, False, 128, 512, "sm_90a", t).under_pv
        assert PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80", tuning=t).loop == 0
    assert BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", t).loop == loop
    assert BlockSparseKey.choose("bf16", 128, False, 128, 64, "sm_90a", t).loop == min(loop, 1)
    names = {ks.name for ks in catalog.all_keys("sm_90a", variants=True)}
    base = PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a")
    assert dataclasses.replace(base, loop=loop, under_pv=loop > 0).name in names


def test_consumer_loop_default_and_persistent():
    """The default tuning takes the measured loop: pingpong at D128 and D256; BM 64 block-sparse
    tiles take loop 1; persistent keys keep each key's loop, and the variants'
    catalogue holds them."""
    for paged in (False, True):
        assert PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a", paged=paged).loop == 2
        assert PrefillKey.choose(torch.bfloat16, 256, "causal", "sm_90a", paged=paged).loop == 2
        assert PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_80", paged=paged).loop == 0
    assert BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a").loop == 2
    assert BlockSparseKey.choose("bf16", 128, False, 128, 64, "sm_90a").loop == 1
    assert BlockSparseKey.choose("bf16", 256, False, 128, 512, "sm_90a").loop == 2
    defaults = {ks.name for ks in catalog.all_keys("sm_90a")}
    assert PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a").name in defaults
    names = {ks.name for ks in catalog.all_keys("sm_90a", variants=True)}
    p = Tuning(persistent=True)
    chosen = [PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a", tuning=p),
              PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a", paged=True, tuning=p),
              PrefillKey.choose(torch.bfloat16, 256, "causal", "sm_90a", tuning=p),
              BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", p),
              BlockSparseKey.choose("bf16", 128, False, 128, 64, "sm_90a", p)]
    assert [(k.persistent, k.loop) for k in chosen] == [(True, 2), (True, 2), (True, 2), (True, 2), (True, 1)]
    assert {k.name for k in chosen} <= names
    assert not {k.name for k in chosen} & defaults


@pytest.mark.parametrize("tpr", [4, 8])
def test_producer_copy_choice(tpr):
    """Tuning.copy_tpr picks the producer's threads per K/V row in every producer-ring key
    (prefill, paged prefill, block-sparse, the swapped MLA tile) and names it; the portable
    keys and paged decode keep 4; the variants' catalogue holds both."""
    t = Tuning(copy_tpr=tpr)
    chosen = [PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a", tuning=t),
              PrefillKey.choose(torch.bfloat16, 256, "dense", "sm_90a", paged=True, tuning=t),
              BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", t)]
    pol = decode_policy(8, 1, 16, 1, MLA_DIM_QK, 8192, sm_count=132)  # the swapped tile (the twin has no producer)
    chosen.append(DecodeKey.of("bf16", MLA_DIM_QK, False, pol, "sm_90a", t))
    names = {ks.name for ks in catalog.all_keys("sm_90a", variants=True)}
    for key in chosen:
        assert key.copy_tpr == tpr and (f"_cp{tpr}" in key.name) == (tpr != 4), key
        cfg = key.source().source.rsplit("pt::", 2)[-2:]
        assert any(f", {tpr}{tail}>" in c for c in cfg for tail in ("", ", true", ", false, true", ", true, true",
                                                                          ", false, true, true", ", true, true, true")), key.name
        assert {dataclasses.replace(key, copy_tpr=c).name for c in keys.KV_COPY_TPRS} <= names, key.name
    assert PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_80", tuning=t).copy_tpr == 4
    assert BlockSparseKey.choose("bf16", 128, False, 32, 512, "sm_90a", t).copy_tpr == 4
    pol = decode_policy(8, 8, 4, 1, 128, 8192, sm_count=132)
    assert DecodeKey.of("bf16", 128, False, pol, "sm_90a", t).copy_tpr == 4
    assert not any("_cp" in ks.name for ks in catalog.all_keys("sm_80", variants=True))


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_choice_and_grid(persistent):
    """Tuning.persistent picks the persistent kernels of the sm_90a producer-ring keys (prefill,
    paged prefill, block-sparse; never the variable window, never the portable engine), and
    work_grid then caps the launch at the SMs (or persistent_ctas); one CTA per item otherwise."""
    t = Tuning(persistent=persistent, loop=0)
    for d in (128, 256):
        for paged in (False, True):
            key = PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=paged, tuning=t)
            assert key.persistent == persistent and ("_pk" in key.name) == persistent
            # prefill_kernel<cfg, mask, paged, persistent, tma>: TMA boxes, persistent CTAs too
            assert key.source().source.rstrip().endswith(f", {str(persistent).lower()}, true>(p);\n}}")
        assert not PrefillKey.choose(torch.bfloat16, d, "variable_window", "sm_90a", tuning=t).persistent
        assert not PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80", tuning=t).persistent
    bsr = BlockSparseKey.choose("bf16", 128, True, 128, 512, "sm_90a", t)
    assert bsr.persistent == persistent and ("_pk" in bsr.name) == persistent
    assert not BlockSparseKey.choose("bf16", 128, True, 32, 512, "sm_90a", t).persistent  # mma.sync engine
    assert not any("_pk" in ks.name for ks in catalog.all_keys("sm_80", variants=True))
    assert keys.work_grid(5000, True, 132) == 132 and keys.work_grid(40, True, 132) == 40
    assert keys.work_grid(5000, False, 132) == 5000 and keys.work_grid(0, True, 132) == 0
    assert keys.work_grid(5000, True, 132, cap=3) == 3 and keys.work_grid(5000, False, 132, cap=3) == 5000


def test_catalogue_defaults_and_variants():
    """warmup compiles the default tuning's keys; --variants adds every VARIANTS tuning's (each
    tuning of catalog.VARIANTS builds at least one key the default does not); the portable
    engine has no variant keys, and its default keys hold paged decode's balanced split-KV keys
    (plans choose them by their lengths) beside the static ones, a tile each."""
    default = {ks.name for ks in catalog.all_keys("sm_90a")}
    every = {ks.name for ks in catalog.all_keys("sm_90a", variants=True)}
    assert default < every
    for t in catalog.VARIANTS:
        own = {k.name for k in catalog.default_keys("sm_90a", t)}
        assert own <= every
        assert own - default, t
    sm80 = {ks.name for ks in catalog.all_keys("sm_80")}
    assert {ks.name for ks in catalog.all_keys("sm_80", True)} == sm80
    bal = {n for n in sm80 if n.startswith("pt_decode_") and n.endswith("_bal")}
    assert bal and {n.rsplit("_", 1)[0] for n in bal} <= sm80  # the static keys' tiles


def test_page_major_v_keys():
    """Tuning.page_major_v (the default): the sm_90a paged TMA keys lay V out a page a group
    where a page is shorter than BN (a key such a page size), panel-major otherwise; off, under
    cp.async pages, on sm_80 and for contiguous K/V V keeps the panel-major tile."""
    pm = Tuning()
    assert pm.page_major_v
    for d in (128, 256):
        for ps in prefill.PAGE_SIZES:
            key = PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, tuning=pm, page_size=ps)
            want = ps if ps < key.bn else 0
            assert key.vpage == want and (f"_vp{ps}" in key.name) == (want > 0), key.name
            off = Tuning(page_major_v=False)
            assert PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, tuning=off, page_size=ps).vpage == 0
            cp = Tuning(paged_tma=False)
            assert PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, tuning=cp, page_size=ps).vpage == 0
            assert PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80", paged=True, tuning=pm, page_size=ps).vpage == 0
        assert PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", tuning=pm, page_size=16).vpage == 0


def _tile_w(rows, cols):  # pt_sm90.cuh SmemTileW: (offset(row, chunk), LBO, kstep)
    panel = rows * 128
    return (lambda r, c: (c >> 3) * panel + r * 128 + (((c & 7) ^ (r & 7)) << 4)), panel, lambda ks: ks * 16 * 128


def _tile_p(rows, cols, g):  # pt_sm90.cuh SmemTileP
    def offset(r, c):
        return (r // g) * (g * cols * 2) + (c >> 3) * (g * 128) + (r % g) * 128 + (((c & 7) ^ (r & 7)) << 4)
    return offset, g * 128, lambda ks: (ks * 16 // g) * (g * cols * 2) + (ks * 16 % g) * 128


@pytest.mark.parametrize("rows,cols,g", [(128, 128, 16), (128, 128, 32), (128, 128, 64), (128, 128, 128),
                                         (64, 256, 16), (64, 256, 64)])
def test_page_major_v_tile_layout(rows, cols, g):
    """SmemTileP's layout (a model of pt_sm90.cuh): (1) what one TMA box (64, g, cols / 64) of a
    page lands, [panel][row][64 columns] from the group's start with the 128-byte swizzle of the
    line's index, is offset(); (2) what a P V wgmma reads as its N-major operand for k-step ks
    (16 keys: 8-key halves SBO = 1024 bytes apart, 64-column panels LBO apart, each line
    swizzled) is offset() too. The same model read on SmemTileW, whose descriptors run on the
    GPU, checks the model."""
    for offset, lbo, kstep in (_tile_w(rows, cols), _tile_p(rows, cols, g)):
        for ks in range(rows // 16):
            for k in range(16):
                for c in range(cols // 8):
                    desc = kstep(ks) + (k // 8) * 1024 + (c // 8) * lbo + (k % 8) * 128 + (((c % 8) ^ (k % 8)) << 4)
                    assert desc == offset(ks * 16 + k, c), (ks, k, c)
    offset = _tile_p(rows, cols, g)[0]
    for page in range(rows // g):
        base = page * g * cols * 2
        assert base % 1024 == 0
        for p in range(cols // 64):
            for r in range(g):
                line = p * g + r
                for c in range(8):
                    assert base + line * 128 + ((c ^ (line % 8)) << 4) == offset(page * g + r, p * 8 + c)
    assert sorted(offset(r, c) for r in range(rows) for c in range(cols // 8)) == list(range(0, rows * cols * 2, 16))


def _tile_i(rows, cols):  # pt_sm90.cuh SmemTileI: (offset(row, chunk), KSBO, PSTEP)
    ksbo = cols // 64 * 1024
    return (lambda r, c: (r >> 3) * ksbo + (c >> 3) * 1024 + (r & 7) * 128 + (((c & 7) ^ (r & 7)) << 4)), ksbo, 1024


@pytest.mark.parametrize("rows,cols,g", [(128, 128, 16), (128, 128, 32), (128, 128, 64), (64, 256, 16),
                                         (64, 256, 32)])
def test_interleaved_k_tile_layout(rows, cols, g):
    """SmemTileI's layout (a model of pt_sm90.cuh: paged K tiles, Tuning.page_major_k): (1) what S's
    K-major operand reads for k-step ks from a warpgroup's first key (8-row groups KSBO apart, a
    row's 16-byte chunk swizzled by the row, the panel PSTEP after the previous one) is
    offset(); (2) what one TMA box (64, 8, cols / 64, g / 8) of a page lands, [8-row group][panel]
    [8 rows][64 columns] from the page's first row group with the line's swizzle, is offset()
    too. The same read on SmemTileW (KSBO 1024, PSTEP its panel), whose descriptors run, checks
    the model."""
    panel_w = rows * 128
    for offset, sbo, pstep in (_tile_w(rows, cols)[0:1] + (1024, panel_w), _tile_i(rows, cols)):
        row8 = (lambda r: r * 128) if sbo == 1024 else (lambda r: (r >> 3) * sbo)
        for key0 in (0, rows // 2):
            for ks in range(cols // 16):
                start = row8(key0) + (ks >> 2) * pstep
                for n in range(rows - key0):
                    for j in range(2):
                        c = (ks & 3) * 2 + j
                        desc = start + (n // 8) * sbo + (n % 8) * 128 + ((c ^ (n % 8)) << 4)
                        assert desc == offset(key0 + n, (ks >> 2) * 8 + c), (key0, ks, n, j)
    offset = _tile_i(rows, cols)[0]
    panels = cols // 64
    for page in range(rows // g):
        base = (page * g // 8) * panels * 1024
        assert base % 1024 == 0
        for h in range(g // 8):
            for p in range(panels):
                for r in range(8):
                    line = (h * panels + p) * 8 + r
                    for c in range(8):
                        assert base + line * 128 + ((c ^ (line % 8)) << 4) == offset(page * g + h * 8 + r, p * 8 + c)
    assert sorted(offset(r, c) for r in range(rows) for c in range(cols // 8)) == list(range(0, rows * cols * 2, 16))


def test_page_major_k_keys():
    """Tuning.page_major_k (the default): the sm_90a paged TMA keys interleave K's row groups
    where a page is shorter than BN (a `_ki` key beside V's page-major one); never when turned
    off, under cp.async pages, on sm_80 or for contiguous K/V."""
    assert Tuning().page_major_k
    off = Tuning(page_major_k=False)
    for d in (128, 256):
        for ps in prefill.PAGE_SIZES:
            key = PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, page_size=ps)
            assert key.kil == (ps < key.bn) and key.name.endswith("_ki") == key.kil, key.name
            assert (f", {key.vpage}, true>" in key.call()) == key.kil, key.call()  # K_IL after V_PAGE
            assert not PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, tuning=off, page_size=ps).kil
            cp = Tuning(paged_tma=False)
            assert not PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=True, tuning=cp, page_size=ps).kil
            assert not PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80", paged=True, page_size=ps).kil
        assert not PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", page_size=16).kil


def test_twin_copies_both_out_before_s():
    """No result tells how the twin tile orders its copies and waits, so its key's PTX (one copy
    of the pair in the code) does: S's panels are waited for one by one, each just before its
    k-steps (nine mbarrier waits after the pair's last copy, beside the first tile's one loop
    over every panel), and each is a wgmma group of its own (the first tile's group, P(own)
    V(own)'s and P(oth) V(oth)'s, then S's 4 + 4 + 1); both copies of the next tile go out before
    the first of those waits, the second after a wait for every wgmma group (it overwrites what
    P(oth) V read), and no wait lets S's groups run on past a copy (no wait_group 4)."""
    from prims_ts.cuda import runtime

    pol = decode_policy(64, 1, 128, 1, MLA_DIM_QK, 8192, sm_count=132)
    key = DecodeKey.of("bf16", MLA_DIM_QK, True, pol, "sm_90a")
    assert key.twin, key.name
    src = key.source()
    ptx = runtime.compile_ptx(src.source, src.name, "sm_90a")
    assert ptx.count("wgmma.commit_group") == 1 + 2 + 9, ptx.count("wgmma.commit_group")
    assert ptx.count("mbarrier.try_wait") == 1 + 9, ptx.count("mbarrier.try_wait")
    last = ptx.rindex("cp.async.bulk.tensor")
    assert ptx[last:].count("mbarrier.try_wait") == 9, ptx[last:].count("mbarrier.try_wait")
    assert "wgmma.wait_group.sync.aligned 4;" not in ptx
    first = ptx.index("cp.async.bulk.tensor", ptx.rindex("wgmma.wait_group.sync.aligned 1;"))
    assert "wgmma.wait_group.sync.aligned 0;" in ptx[first:last]


def test_twin_model_matches_its_calibration():
    """benchmarks/twin_model.py at the constants its docstring names (the H100 timeline of the
    default twin key) gives the pair length it states (~5,900 clocks, against 6,600 measured),
    the tensor pipe's share is its work over that length, and a shorter softmax or copy latency
    shortens the pair (the levers the NOTES read from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("twin_model", Path(__file__).parent.parent / "benchmarks" / "twin_model.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    sched = model.SCHEDULES["default"]
    per, util = model.run(lambda w, p: sched(w, p, 1250), 32, 1900)
    assert 5800 < per < 6100, per
    assert abs(util - (4 * model.PV + 18 * model.S_PANEL) / per) < 0.02, (per, util)
    assert model.run(lambda w, p: sched(w, p, 600), 32, 1900)[0] < per - 400
    assert model.run(lambda w, p: sched(w, p, 1250), 32, 800)[0] < per - 400
    # an SM intake of 32 bytes a clock (the rate a pair's copies came in at on the H100) stretches
    # the pair, and a halved softmax still shortens it: what the device showed (no gain) is not
    # each SM's own intake in this form
    slow = model.run(lambda w, p: sched(w, p, 1250), 32, 1900, intake=32)[0]
    assert slow > per + 1000, slow
    assert model.run(lambda w, p: sched(w, p, 650), 32, 1900, intake=32)[0] < slow - 300


def test_twin_trace_is_a_key_of_its_own(tmp_path, monkeypatch):
    """Tuning.twin_trace (benchmarks/twin_trace.py) builds the twin's keys again with
    PT_TWIN_TRACE: a key name of its own (a traced kernel never stands in for the default), the
    module's pt_twin_trace sized as the script reads it, no C75xx note; the default key holds no
    trace at all."""
    import importlib.util

    from prims_ts.cuda import runtime

    spec = importlib.util.spec_from_file_location("twin_trace", Path(__file__).parent.parent / "benchmarks" / "twin_trace.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ctas, pairs, events = script.layout()
    monkeypatch.setenv("PRIMS_TS_CACHE_DIR", str(tmp_path))  # compiled here: ptxas's notes reported
    monkeypatch.setattr(runtime, "perf_notes", {})
    pol = decode_policy(64, 1, 128, 1, MLA_DIM_QK, 8192, sm_count=132)
    plain = DecodeKey.of("bf16", MLA_DIM_QK, True, pol, "sm_90a")
    key = DecodeKey.of("bf16", MLA_DIM_QK, True, pol, "sm_90a", Tuning(twin_trace=True))
    assert key.trace and key.name == plain.name + "_trace", key.name
    assert key.source().source.startswith("#define PT_TWIN_TRACE\n")
    ptx = runtime.compile_ptx(key.source().source, key.name, "sm_90a")
    assert f".b8 pt_twin_trace[{ctas * 2 * (pairs + 1) * events * 8}];" in ptx
    assert "pt_twin_trace" not in runtime.compile_ptx(plain.source().source, plain.name, "sm_90a")
    runtime.compile_cubin(key.source(), "sm_90a")
    assert not runtime.perf_notes, runtime.perf_notes


def test_cta_trace_is_a_key_of_its_own(tmp_path, monkeypatch):
    """Tuning.cta_trace (benchmarks/cta_trace.py) builds every decode-shaped key again with
    PT_CTA_TRACE (the mma.sync, swapped and twin tiles alike): a name of its own, the module's
    pt_cta_trace sized as the script reads it (balanced keys' items too), no C75xx note on sm_90a;
    the default keys hold no trace."""
    import importlib.util

    from prims_ts.cuda import runtime

    spec = importlib.util.spec_from_file_location("cta_trace", Path(__file__).parent.parent / "benchmarks" / "cta_trace.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setenv("PRIMS_TS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "perf_notes", {})
    for heads, d, hkv in ((32, 128, 8), (16, MLA_DIM_QK, 1), (128, MLA_DIM_QK, 1)):
        pol = decode_policy(128, hkv, heads, 1, d, 4096, sm_count=132)
        plain = DecodeKey.of("bf16", d, False, pol, "sm_90a")
        key = DecodeKey.of("bf16", d, False, pol, "sm_90a", Tuning(cta_trace=True))
        assert key.cta_trace and key.name == plain.name + "_ctatrace", key.name
        ptx = runtime.compile_ptx(key.source().source, key.name, "sm_90a")
        assert f".b8 pt_cta_trace[{script.trace_rows() * script.trace_words() * 8}];" in ptx, key.name
        assert "pt_cta_trace" not in runtime.compile_ptx(plain.source().source, plain.name, "sm_90a")
        if plain.arch == 90:
            runtime.compile_cubin(key.source(), "sm_90a")
    # a balanced key's items recorded too (the same buffer)
    pol = decode_policy(128, 8, 4, 1, 128, 4096, sm_count=132, balance=-1)
    key = DecodeKey.of("bf16", 128, False, pol, "sm_90a", Tuning(cta_trace=True, balanced_split=True))
    assert key.name.endswith("_bal_ctatrace"), key.name
    ptx = runtime.compile_ptx(key.source().source, key.name, "sm_90a")
    assert f".b8 pt_cta_trace[{script.trace_rows() * script.trace_words() * 8}];" in ptx, key.name
    assert not runtime.perf_notes, runtime.perf_notes


def test_device_split_bound_matches_the_host():
    """The in-kernel merge sizes its shared weights by pt::DECODE_MAX_SPLITS (pt_decode.cuh)."""
    header = (Path(decode.__file__).parent / "include" / "pt_decode.cuh").read_text()
    assert int(re.search(r"constexpr int DECODE_MAX_SPLITS = (\d+);", header).group(1)) == decode.DECODE_MAX_SPLITS


def test_device_cluster_bounds_match_the_host():
    """The cluster merge's split bound and the shared memory its CTAs may take (fmha_decode.cu)
    are the host's; the host clusters only 2-8 splits whose partials fit after the key's bytes
    (and then the kernel's own fit, on the core's bytes without the alignment slack, holds: it
    has the merge), and only where the extra bytes cost no wave. The twin MLA tile's partials lie
    over its own bytes: its 2-8 splits always cluster, with the key's bytes."""
    src = (Path(decode.__file__).parent / "fmha_decode.cu").read_text()
    assert int(re.search(r"constexpr int CLUSTER_MAX_SPLITS = (\d+);", src).group(1)) == decode.CLUSTER_MAX_SPLITS
    limit = keys.SM90_SMEM_LIMIT
    assert int(re.search(r"constexpr int DECODE_SMEM_LIMIT = (\d+);", src).group(1)) == limit
    header = (Path(decode.__file__).parent / "include" / "pt_decode.cuh").read_text()
    assert int(re.search(r"constexpr int CLUSTER_PAD = (\d+);", header).group(1)) == decode.CLUSTER_PAD
    clustered = twins = 0
    for tuning in (Tuning(), Tuning(mla_swapped=False)):
        for batch, hkv, group, d, n in itertools.product((1, 2, 8, 32), (1, 2, 8), (1, 4, 16, 64), (64, 128, 256, 576),
                                                         (100, 1000, 5000, 100000)):
            if d == 576 and hkv != 1:
                continue
            pol = decode.decode_policy(batch, hkv, group, 1, d, n, 132)
            key = decode.DecodeKey.of("bf16", d, False, pol, "sm_90a", tuning)
            ctas = pol.splits * hkv * pol.row_tiles * batch
            cluster, smem = decode.decode_cluster(key, pol, "sm_90a", tuning, limit, 132, ctas)
            part = decode.cluster_part_bytes(pol.bm, key.dv)
            assert cluster in (1, pol.splits) and (smem > key.smem) == (cluster > 1 and not key.twin), (pol, key.name)
            if key.twin:
                assert (cluster > 1) == (2 <= pol.splits <= decode.CLUSTER_MAX_SPLITS) and smem == key.smem
                # the kernel's CLUSTER_FITS for the twin: the partials, at the launch's end, clear of Q
                assert 64 * d * 2 + part <= decode.twin_smem_bytes(d) and key.smem == decode.twin_smem_bytes(d) + 1024
                twins += cluster > 1
            elif cluster > 1:
                clustered += 1
                assert 2 <= pol.splits <= decode.CLUSTER_MAX_SPLITS and -(-key.smem // 16) * 16 + part == smem <= limit
                core = (decode.swap_smem_bytes(key.bm, key.bn, key.head_dim, key.stages) if key.swap else
                        keys.fmha_smem_bytes(key.bm, key.bn, key.head_dim, key.stages, key.warps_n, key.split_o,
                                             key.dv, key.shared_kv, key.producer))
                assert core + part <= limit  # the kernel's CLUSTER_FITS
            elif 2 <= pol.splits <= decode.CLUSTER_MAX_SPLITS and -(-key.smem // 16) * 16 + part <= limit:
                assert ctas > 132 * decode._ctas_per_sm(-(-key.smem // 16) * 16 + part, key.threads), (pol, key.name)
            assert decode.decode_cluster(key, pol, "sm_80", tuning, limit, 132, ctas) == (1, key.smem)
            off = dataclasses.replace(tuning, cluster_merge=False)
            assert decode.decode_cluster(key, pol, "sm_90a", off, limit, 132, ctas) == (1, key.smem)
    assert clustered > 20 and twins > 5
    pol = decode.decode_policy(1, 8, 4, 1, 128, 1024, 132)  # the latency row: one cluster of 8
    assert decode.decode_cluster(decode.DecodeKey.of("bf16", 128, False, pol, "sm_90a"), pol, "sm_90a", Tuning(),
                                 limit, 132, 64) == (8, -(-102400 // 16) * 16 + 16 * (128 + 9) * 4)



def test_launch_shape_fits_the_clusters_in_one_wave():
    """decode.launch_shape: a policy's 2-8 splits as one cluster where the device holds the
    clusters in one wave, else the most splits below whose clusters it does; the twin MLA
    tile's splits (any count) as one cluster or clusters of 2-8 merged in two levels, its CTAs
    in one wave, the count and size of least twin_split_cost; else the policy's with the
    ticket. Fewer splits: equal whole tiles, the grid and workspace of those."""
    limit = keys.SM90_SMEM_LIMIT
    asked = []

    def held_by(per_size):
        def held(grid, cluster, smem):
            asked.append((grid, cluster))
            return per_size.get(cluster, 132 // cluster)
        return held

    pol = decode.decode_policy(16, 1, 128, 1, MLA_DIM_QK, 4096, 132)  # MLA B16 H128: 32 row tiles, 4 splits
    key = decode.DecodeKey.of("bf16", MLA_DIM_QK, False, pol, "sm_90a")
    assert key.twin and pol.splits == 4 and pol.row_tiles == 2
    args = (key, pol, "sm_90a", Tuning(), limit, 132, 1, 16, 4096)
    assert decode.launch_shape(*args, held_by({})) == (pol, 4, key.smem)  # 33 clusters of 4 at once
    # an H100's 30 clusters of 4: 3 splits in one cluster (62 us there), not 4 as two clusters of
    # 2 (74 us: the second level's fixed cost at a full wave)
    got, cluster, smem = decode.launch_shape(*args, held_by({4: 30}))
    assert (got.splits, cluster, smem) == (3, 3, key.smem)
    assert got == dataclasses.replace(pol, splits=3, chunk=22 * 64)
    assert decode.decode_grid(got, 1, 16) == (3, 2, 16)
    assert decode.decode_partial_layout(16, 1, got, 512)[3] < decode.decode_partial_layout(16, 1, pol, 512)[3]
    # no cluster of 3: two levels of 2 over the ticket (84 us there); nothing fits: the ticket
    assert decode.launch_shape(*args, held_by({4: 30, 3: 0})) == (pol, 2, key.smem)
    assert decode.launch_shape(*args, held_by({4: 30, 3: 31, 2: 31})) == (pol, 1, key.smem)
    # a device that holds none (an SM partition) or no query (None): as decode_cluster says
    assert decode.launch_shape(*args, lambda g, c, s: 0) == (pol, 1, key.smem)
    assert decode.launch_shape(*args, lambda g, c, s: None) == (pol, 4, key.smem)
    # MLA B8 H128 (the policy's 32 splits, four waves): one wave, 8 as one cluster (two of 4
    # would cost the second level); where 16 clusters of 8 do not fit (an H100's GPCs), 7 as
    # one (640 keys) over 8 as two of 4 (512 keys a CTA and a second level at 128 CTAs)
    pol = decode.decode_policy(8, 1, 128, 1, MLA_DIM_QK, 4096, 132)
    assert pol.splits > decode.CLUSTER_MAX_SPLITS
    args = (key, pol, "sm_90a", Tuning(), limit, 132, 1, 8, 4096)
    assert decode.launch_shape(*args, held_by({})) == (decode.with_splits(pol, 8, 4096), 8, key.smem)
    got, cluster, _ = decode.launch_shape(*args, held_by({8: 15}))
    assert (got.splits, cluster, got.chunk) == (7, 7, 10 * 64)
    # MLA B1 L4096 H128 (two row tiles, 32 splits): 2 clusters of 8 a row tile (256 keys a CTA,
    # the second level at 32 CTAs), not 4 (128 keys at 64 CTAs) nor one (512 keys)
    pol = decode.decode_policy(1, 1, 128, 1, MLA_DIM_QK, 4096, 132)
    got, cluster, _ = decode.launch_shape(key, pol, "sm_90a", Tuning(), limit, 132, 1, 1, 4096, held_by({}))
    assert (pol.splits, got.splits, got.chunk, cluster) == (32, 16, 256, 8)
    # MLA B1 L32768 H128 (66 splits): 8 clusters of 8 a row tile; where 16 of 8 do not fit, 6
    # of 8 (704 keys a CTA, 96 CTAs) over 11 of 6 (512 keys, 132 CTAs)
    pol = decode.decode_policy(1, 1, 128, 1, MLA_DIM_QK, 32768, 132)
    assert pol.splits == 66
    got, cluster, _ = decode.launch_shape(key, pol, "sm_90a", Tuning(), limit, 132, 1, 1, 32768, held_by({}))
    assert (got.splits, cluster) == (64, 8)
    got, cluster, _ = decode.launch_shape(key, pol, "sm_90a", Tuning(), limit, 132, 1, 1, 32768, held_by({8: 15}))
    assert (got.splits, cluster, got.chunk) == (48, 8, 704)
    # 128K keys: 8 clusters of 8 (2,048 keys a CTA) over the ticket's 66 splits (each CTA's partial written,
    # the last reading all 66), which main took over one cluster of 8 (16,384 keys a CTA)
    pol = decode.decode_policy(1, 1, 128, 1, MLA_DIM_QK, 131072, 132)
    got, cluster, _ = decode.launch_shape(key, pol, "sm_90a", Tuning(), limit, 132, 1, 1, 131072, held_by({}))
    assert (pol.splits, got.splits, got.chunk, cluster) == (66, 64, 2048, 8)
    assert decode.twin_split_cost(2048, 8, 8, 128 / 132) < decode.twin_ticket_cost(pol.chunk, 66, 1.0) < 16384
    # a device that holds two clusters of 8 and none smaller: one cluster a row tile (16,384 keys a CTA) would
    # stream longer than the ticket over the policy's 66 splits costs
    held = {k: 0 for k in range(2, 8)} | {8: 2}
    got, cluster, _ = decode.launch_shape(key, pol, "sm_90a", Tuning(), limit, 132, 1, 1, 131072, held_by(held))
    assert (got, cluster) == (pol, 1)
    assert decode.twin_split_cost(576, 9, 7) < decode.twin_split_cost(640, 7, 8)
    assert decode.twin_split_cost(512, 8, 8) < decode.twin_split_cost(512, 22, 3)  # small clusters read more
    # the second level's fixed cost by the launch's share of a wave; none with one level
    assert decode.twin_split_cost(512, 2, 8, 0.25) < decode.twin_split_cost(512, 2, 8, 1.0)
    assert decode.twin_split_cost(512, 1, 8, 1.0) == 512
    # the keys a CTA streams are its chunk: MLA B1 L3000 H64 (47 tiles, the policy's 23 splits) takes 16 as two
    # clusters of 8, not 21 as three of 7 (the same 192-key chunk, a third part to read)
    pol = decode.decode_policy(1, 1, 64, 1, MLA_DIM_QK, 3000, 132)
    got, cluster, _ = decode.launch_shape(key, pol, "sm_90a", Tuning(), limit, 132, 1, 1, 3000, held_by({}))
    assert (pol.splits, got.splits, got.chunk, cluster) == (23, 16, 192, 8)
    # the other keys (the mma.sync tiles' partials are a row tile of D floats): past a cluster's
    # splits, the policy's, never asked
    pol = decode.decode_policy(1, 8, 4, 1, 128, 131072, 132)
    dkey = decode.DecodeKey.of("bf16", 128, False, pol, "sm_90a")
    assert pol.splits > decode.CLUSTER_MAX_SPLITS and not dkey.twin
    asked.clear()
    assert decode.launch_shape(dkey, pol, "sm_90a", Tuning(), limit, 132, 8, 1, 131072, held_by({})) == (pol, 1,
                                                                                                          dkey.smem)
    assert not asked
    # off sm_90a or without the cluster merge: the policy's, never asked
    pol = decode.decode_policy(16, 1, 128, 1, MLA_DIM_QK, 4096, 132)
    for arch, tuning in (("sm_80", Tuning()), ("sm_90a", Tuning(cluster_merge=False))):
        assert decode.launch_shape(key, pol, arch, tuning, limit, 132, 1, 16, 4096, held_by({})) == (pol, 1, key.smem)
    assert not asked
    # a launch of no more CTAs than SMs keeps its clusters only where, asked with one CTA an SM's
    # shared memory, the device holds enough of them for a CTA an SM: decode B2 L65536 (8 splits,
    # 128 CTAs) on an H100's 15 clusters of 8 (120 SMs) takes the ticket; B8 L16384's clusters of
    # 2 (66 of them) stay
    one = []

    def held_one(per_size):
        def held(grid, cluster, smem):
            one.append(smem >= keys.SM_SMEM_BYTES // 2)
            return per_size.get(cluster, 132 // cluster) if smem >= keys.SM_SMEM_BYTES // 2 else 264 // cluster
        return held

    for b, n, splits, held, cluster in ((2, 65536, 8, {8: 15}, 1), (2, 65536, 8, {8: 16}, 8), (8, 16384, 2, {}, 2)):
        pol = decode.decode_policy(b, 8, 4, 1, 128, n, 132)
        dkey = decode.DecodeKey.of("bf16", 128, False, pol, "sm_90a")
        one.clear()
        got = decode.launch_shape(dkey, pol, "sm_90a", Tuning(), limit, 132, 8, b, n, held_one(held))
        assert pol.splits == splits and got[0] == pol and got[1] == cluster and any(one), (b, got)
    # a policy of splits shorter than TICKET_MIN_KEYS takes up to 8 of them in clusters, spread
    # or not: B1 L8192 (16 splits of 512 keys) as 8 in a cluster; B1 L32768 keeps its ticket
    for n, splits, cluster in ((8192, 8, 8), (32768, 16, 1)):
        pol = decode.decode_policy(1, 8, 4, 1, 128, n, 132)
        dkey = decode.DecodeKey.of("bf16", 128, False, pol, "sm_90a")
        got = decode.launch_shape(dkey, pol, "sm_90a", Tuning(), limit, 132, 8, 1, n, held_one({8: 15}))
        assert pol.splits == 16 and (got[0].splits, got[1]) == (splits, cluster), (n, got)


def test_mla_workspace_never_shrinks():
    for batch, heads in ((1, 16), (64, 16), (2, 128)):
        sizes = [decode.mla_workspace_bytes(batch, heads, 1, n, 132) for n in range(1, 20000, 97)]
        assert sizes == sorted(sizes)
        assert [decode.mla_workspace_bytes(batch, heads, q, 8192, 132) for q in range(1, 6)] == sorted(
            decode.mla_workspace_bytes(batch, heads, q, 8192, 132) for q in range(1, 6))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_86", "sm_89"])
def test_every_kernel_fits_its_arch_shared_memory(arch):
    """Every key the APIs can launch on `arch` fits that arch's per-block shared memory."""
    limit = keys.smem_limit(arch)
    chosen = []
    for d in decode.HEAD_DIMS + (MLA_DIM_QK,):
        for group, sq in itertools.product([1, 4, 16, 32, 128], [1, 4]):
            if d != MLA_DIM_QK and group > 32:
                continue
            pol = decode_policy(8, 1, group, sq, d, 4096, 132, limit)
            chosen.append(DecodeKey.of("bf16", d, True, pol, arch))
    for d in (128, 256):
        for mask in ("dense", "causal", "variable_window"):
            chosen.append(PrefillKey.choose(torch.bfloat16, d, mask, arch))
        for kvb, rows in itertools.product([8, 16, 32, 64, 128], [32, 64, 512]):
            chosen.append(BlockSparseKey.choose("bf16", d, False, kvb, rows, arch))
    too_big = [(k.name, k.smem) for k in chosen if k.smem > limit]
    assert not too_big, f"{arch} allows {limit} bytes per block: {too_big}"


def test_smaller_shared_memory_changes_only_the_tile():
    """The H200's choice is the preferred tile; a smaller limit picks a smaller one, same coverage."""
    for d, group in ((128, 4), (256, 8), (MLA_DIM_QK, 128)):
        big = decode_policy(4, 1, group, 1, d, 8192, 132)
        small = decode_policy(4, 1, group, 1, d, 8192, 132, keys.smem_limit("sm_86"))
        assert small.rows_max == big.rows_max and small.row_tiles * small.bm >= small.rows_max
        assert small.splits * small.chunk >= 8192
        assert decode.decode_tile_smem(d, small.bm, small.bn, small.stages, small.warps_n, small.split_o) <= \
            keys.smem_limit("sm_86")


def test_prefill_tile_m_follows_the_arch():
    """Work lists count the q tiles of the kernel that will run: on sm_90a 128 rows at D256 too
    (the portable engine's 64 elsewhere)."""
    assert prefill.prefill_tile_m(torch.bfloat16, 256, "causal", "sm_90a") == 128
    assert prefill.prefill_tile_m(torch.bfloat16, 256, "causal", "sm_86") == 64
    assert prefill.prefill_tile_m(torch.bfloat16, 128, "causal", "sm_80") == 128


def test_portable_tuning_takes_the_portable_engine_on_sm90a(monkeypatch):
    """Tuning(portable=True): the prefill-family keys of sm_80's engine on an sm_90a device (how
    the grids check it on a Hopper GPU), and the work lists count that engine's q tiles."""
    from prims_ts import Tuning
    from prims_ts.cuda.block_sparse import BlockSparseKey
    from prims_ts.ops import _validate as V
    from prims_ts.ops import prefill as P

    t = Tuning(portable=True)
    for d in (128, 256):
        for kw in (dict(), dict(packed=True), dict(paged=True)):
            assert prefill.PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", tuning=t, **kw) == \
                prefill.PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80", **kw)
        assert BlockSparseKey.choose("bf16", d, True, 128, 128, "sm_90a", t) == \
            BlockSparseKey.choose("bf16", d, True, 128, 128, "sm_80")
    assert prefill.prefill_tile_m(torch.bfloat16, 256, "causal", "sm_90a", paged=True, tuning=t) == 64
    assert Tuning.decode(t.encode()) == t
    # on an sm_90a device a dense D256 work list counts 128-row tiles, under `portable` 64-row ones
    monkeypatch.setattr(P, "device_limits", lambda device: ("sm_90a", 132, 232448))
    monkeypatch.setattr(V, "to_device", lambda device, a: [torch.from_numpy(a.reshape(-1))])
    q_lens, kv_lens, cuda = np.array([300, 200]), np.array([300, 400]), torch.device("cuda")
    assert P.plan_work(cuda, q_lens, kv_lens, 300, True, "dense", -1, torch.bfloat16, 256).shape[0] == 3 + 2
    assert P.plan_work(cuda, q_lens, kv_lens, 300, True, "dense", -1, torch.bfloat16, 256, t).shape[0] == 5 + 4


def test_no_kernel_the_library_compiles_defines_the_probe():
    """PT_PROBE (pt_fmha_config.cuh) is a measurement aid whose kernels compute wrong results
    (Tuning.probe, set by gpu_session.sh `probe`): no catalogued key's source defines it, and
    the header's default is off."""
    from prims_ts.cuda import runtime

    for arch in ("sm_90a", "sm_80"):
        assert not [ks.name for ks in catalog.all_keys(arch, variants=True) if "PT_PROBE" in ks.source]
    assert "#define PT_PROBE 0" in runtime.include_sources()["pt_fmha_config.cuh"]


# ----------------------------------------------------------------------------
# Plans and the ops they call: one static key, one prepared launch
# ----------------------------------------------------------------------------


def _r(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def test_plans_and_ops_agree_on_the_prepared_launch(monkeypatch):
    """A plan's static facts are exactly what its op rebuilds from the op's own arguments, so a
    compiled, exported or captured call finds the plan's prepared launch (same key, same
    kernel, same grid): for every wrapper, with a non-default tuning."""
    from prims_ts.ops import block_sparse as obs
    from prims_ts.ops import decode as odec
    from prims_ts.ops import mla as omla
    from prims_ts.ops import prefill as opre
    from prims_ts.ops import prefill_paged as opag

    t = Tuning(loop=1, cluster_merge=False)
    seen = {}

    def spy(module, name):
        def prepared(static, dev):
            seen[name] = static
            raise _Stop()
        monkeypatch.setattr(module, "prepared", prepared)

    class _Stop(Exception):
        pass

    from prims_ts.cuda import block_sparse as cbs
    from prims_ts.cuda import decode as cdec
    from prims_ts.cuda import prefill as cpre
    spy(cpre, "prefill")
    spy(cdec, "decode")
    spy(cbs, "bsr")

    def op_static(fn, *args):
        """Run an op's CUDA branch on CPU tensors up to the prepared-launch lookup."""
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
            with pytest.raises(_Stop):
                fn(*args)

    # prefill (packed)
    qo, kvo = torch.tensor([0, 3, 7], dtype=I32), torch.tensor([0, 5, 9], dtype=I32)
    q, k, v = _r(7, 8, 128), _r(9, 2, 128), _r(9, 2, 128)
    w = prims_ts.BatchPrefillTSWrapper(tuning=t)
    w.plan(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
    plan = w._plan
    op_static(opre._run, q, k, v, torch.empty_like(q), *plan.op_args(), plan.tuning_code)
    assert seen["prefill"] == plan.static
    # paged prefill
    kc, vc = _r(6, 2, 16, 128), _r(6, 2, 16, 128)
    w = prims_ts.BatchPrefillPagedTSWrapper(tuning=t)
    w.plan(q, kc, vc, qo, torch.tensor([0, 1, 3], dtype=I32), torch.tensor([4, 2, 5], dtype=I32),
           torch.tensor([9, 3], dtype=I32), page_size=16, mask_type="causal")
    plan = w._plan
    op_static(opag._run, q, kc, vc, torch.empty_like(q), *plan.op_args(), plan.tuning_code)
    assert seen["prefill"] == plan.static
    # decode (fixed multi-token)
    w = prims_ts.BatchDecodePagedTSWrapper(tuning=t)
    ip, ids, last = torch.tensor([0, 2, 5], dtype=I32), torch.arange(5, dtype=I32), torch.tensor([3, 16], dtype=I32)
    w.plan(ip, ids, last, 32, 8, 128, 16, seq_len_q=2, mask_type="causal", q_data_type=torch.bfloat16)
    plan, st = w._plan, w._plan.static
    qd, kd = _r(2, 2, 32, 128), _r(6, 8, 16, 128)
    op_static(odec._run, qd, kd, kd, plan.workspace, torch.empty_like(qd), ip, ids, plan.seq_lens, None,
              st.seq_len_q, st.max_seq_len_q, st.max_seq_len, "causal", -1, 0.1, 1.0, plan.tuning_code)
    assert seen["decode"] == st
    # MLA (packed)
    w = prims_ts.BatchMLADecodePagedTSWrapper(tuning=t)
    table, lens = torch.arange(8, dtype=I32).view(2, 4), torch.tensor([40, 60], dtype=I32)
    qom = torch.tensor([0, 1, 3], dtype=I32)
    w.plan(table, lens, 16, 512, 64, 16, qo_indptr=qom)
    plan, st = w._plan, w._plan.static
    qm, cm = _r(3, 16, 576), _r(8, 16, 576)
    op_static(omla._run, qm, cm, plan.workspace, torch.empty(3, 16, 512, dtype=torch.bfloat16), table, lens, qom,
              st.max_seq_len_q, st.max_seq_len, "causal", 0.1, 1.0, plan.tuning_code)
    assert seen["decode"] == st
    # block-sparse
    w = prims_ts.BlockSparsePagedTSWrapper(tuning=t)
    w.plan(torch.tensor([0, 2, 4], dtype=I32), 32, 32, 8, 2, 128, 16, 16, 16, max_blocks_per_row=2,
           use_kv_valid_bits=True, q_data_type=torch.bfloat16)
    plan = w._plan
    qb, kb = _r(2, 32, 8, 128), _r(6, 2, 16, 128)
    bits = torch.zeros(2, 1, dtype=torch.int32)
    op_static(obs._run, qb, kb, kb, torch.empty_like(qb), plan.kv_indptr, ids[:4], torch.zeros(2, 2, 3, dtype=I32),
              torch.zeros(0, dtype=I32), plan.seq_lens, bits, 16, 16, "dense", 0.1, plan.tuning_code)
    assert seen["bsr"] == plan.static


def test_a_failed_plan_leaves_the_previous_plan_whole():
    """A plan validates everything before it changes any state: when planning fails, the wrapper
    keeps its previous plan entirely (no mix of the old checks and the new metadata)."""
    w = prims_ts.BatchPrefillPagedTSWrapper()
    q, kc = _r(7, 8, 128), _r(8, 2, 16, 128)
    qo = torch.tensor([0, 3, 7], dtype=I32)
    w.plan(q, kc, kc, qo, torch.tensor([0, 3, 6], dtype=I32), torch.arange(6, dtype=I32),
           torch.tensor([8, 12], dtype=I32), page_size=16)
    before = w._plan
    with pytest.raises(ValueError, match="paged_kv_indices"):
        w.plan(q, kc, kc, qo, torch.tensor([0, 3, 6], dtype=I32), torch.tensor([0, 1, 2, 3, 4, 99], dtype=I32),
               torch.tensor([8, 12], dtype=I32), page_size=16)
    assert w._plan is before
