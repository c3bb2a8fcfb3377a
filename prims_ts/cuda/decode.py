"""Decode-shaped kernels (paged decode and MLA decode): policy, key, parameters, launch.

MLA decode is the decode kernel with one latent head (Hkv = 1, group = H) of 576-wide K
rows whose first 512 values are V. The policy (tile, row tiles, split-KV) is chosen from
static arguments alone, so a plan, the workspace size and a captured graph agree on it.
``prims_ts/cuda/fmha_decode.cu``; the GQA-row problem in ``include/pt_decode.cuh``.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from . import runtime
from .keys import (DEFAULT_TUNING, DTYPE_CODES, LOG2E, NOMINAL_SMEM_LIMIT, OUT_DTYPE_CODES, SM_SMEM_BYTES,
                   WGMMA_ALIGN_SLACK, KernelKey, Prepared, Tuning, check_rows, check_starts, cpp_bool,
                   device_info, fmha_config, fmha_smem_bytes, load, tag)

HEAD_DIMS = (64, 128, 256)
MLA_DIM_QK = 576
MLA_DIM_V = 512
DECODE_MIN_KEYS_PER_SPLIT = 128
DECODE_MAX_SPLITS = 128
# Split counts a plan launches as one thread block cluster on sm_90a (Tuning.cluster_merge):
# up to the portable cluster size (pt::CLUSTER_MAX_SPLITS)
CLUSTER_MAX_SPLITS = 8
# The cluster merge's partial rows lie DV + CLUSTER_PAD floats apart in shared memory (pt::CLUSTER_PAD)
CLUSTER_PAD = 8
# Balanced split-KV on the MLA tiles (twin and swapped): a unit cut into more than twice this many
# parts merges in groups of this many first (Tuning.merge_fan; DecodeParams.merge_fan): the groups'
# merges run in as many CTAs, the last one reads a part a group
MERGE_FAN = 8

# Per head dim: keys per K/V tile, pipeline depth (32 KB of K+V per stage, three stages) and
# whether the warps split O's columns (D256: o[] would not fit in registers otherwise)
DECODE_TILE = {64: (128, 3, False), 128: (64, 3, False), 256: (32, 3, True)}
# MLA, per row-tile height BM: (keys per tile, stages, warps splitting the keys and O)
MLA_TILE = {16: (64, 2, 4), 32: (64, 2, 4), 64: (64, 2, 2)}  # BM 64: the twin tile on sm_90a
SWAP_BN = 64  # the swapped-operand MLA tile: keys per tile = wgmma's M
SWAP_THREADS = 256  # one MMA warpgroup + the producer warpgroup


@dataclass(frozen=True)
class DecodePolicy:
    """Static launch shape of one decode key: tile, warps, row tiles, split-KV."""

    bm: int  # M rows per CTA (GQA group x query tokens, padded to 16)
    bn: int  # keys per K/V tile
    warps_n: int  # warps splitting each K/V tile's keys (merged in the CTA)
    stages: int  # K/V tiles in flight
    split_o: bool  # the warps_n warps also split O's columns (P shared through smem)
    row_tiles: int  # CTAs along the M rows of one (request, K/V head)
    rows_max: int  # group * max query tokens
    splits: int  # K/V chunks per (request, K/V head), merged through the workspace
    chunk: int  # keys per split (multiple of bn); balanced: the keys a request may hold
    balanced: int = 0  # > 0: balanced split-KV over this many CTAs (splits 1)


def value_dim(head_dim: int) -> int:
    """V/O width of a decode key: the head dim, or 512 for MLA's 576-wide latents."""
    return MLA_DIM_V if head_dim == MLA_DIM_QK else head_dim


# A split count whose CTAs fill at least this share of the resident CTA slots in one wave wins
# over counts that fill several waves better: each wave past the first costs more than the
# slots it fills (decode B2 L65536 on an H100: 16 splits, 256 CTAs, 203 us; 33 splits, 528 CTAs,
# 210 us), while a wave filled below it leaves some SMs with one CTA and others with two (B1
# L131072: 192 CTAs 216 us, 264 CTAs 205; benchmarks/NOTES.md, "One wave of splits"). A CTA an
# SM over that share of the SMs goes first where it gives two splits or more (B16 L32768: one
# split a unit lost 0.2-0.3% to two): an SM's rate is its own, shared by the CTAs it holds
# (B1 L131072: 128 CTAs 195 us, 264 CTAs 199; B8 L16384: 128 CTAs 190 us, 256 CTAs 197; "The
# clusters' placement and one CTA an SM").
ONE_WAVE_FILL = 0.85


def _split_target(ctas: int, slots: int, one_wave: bool = True, sm_count: Optional[int] = None) -> int:
    """Splits per (request, K/V head), with `one_wave`: the most (at least 2) whose CTAs take an
    SM each where they fill at least ONE_WAVE_FILL of the `sm_count` SMs, else the most that fit
    one wave of the resident CTA slots where they fill at least ONE_WAVE_FILL of it; otherwise
    those that fill the slots best over any number of waves (fewest on ties)."""
    if ctas >= slots:
        return 1
    if one_wave and sm_count and 2 * ctas <= sm_count:
        s = min(DECODE_MAX_SPLITS, sm_count // ctas)
        if ctas * s >= ONE_WAVE_FILL * sm_count:
            return s
    if one_wave:
        s = min(DECODE_MAX_SPLITS, slots // ctas)
        if ctas * s >= ONE_WAVE_FILL * slots:
            return s
    best, best_eff = 1, 0.0
    for s in range(1, min(DECODE_MAX_SPLITS, -(-4 * slots // ctas)) + 1):
        total = ctas * s
        eff = total / (-(-total // slots) * slots)
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def _decode_tiles(head_dim: int, bm: int):
    """Tile shapes (bm, bn, stages, warps_n, split_o) for rows that want row tiles of `bm`,
    the preferred (the H200's) first, then ones that fit smaller shared memories:
    fewer stages, then shorter row tiles (more of them), then (MLA) shorter key tiles."""
    mla = head_dim == MLA_DIM_QK
    for b in (64, 32, 16):
        if b > bm:
            continue
        if mla:
            bn, stages, warps_n = MLA_TILE[b]
            yield b, bn, stages, warps_n, True
            yield b, 32, 2, 2, True
            continue
        bn, stages, split_o = DECODE_TILE[head_dim]
        # four warps per CTA where the rows leave room: the extra ones split the keys
        warps_n = max(1, min(4 // (b // 16), bn // 16))
        if split_o:
            warps_n = max(2, warps_n)
        yield b, bn, stages, warps_n, split_o
        yield b, bn, 2, warps_n, split_o


def decode_tile_smem(head_dim: int, bm: int, bn: int, stages: int, warps_n: int, split_o: bool) -> int:
    """Shared memory of a decode tile as the policy counts it. MLA row tiles of 64 are counted as
    the wgmma split-O tile with a producer warpgroup that sm_90a ran before the twin tile (its
    mbarriers and the alignment slack), so that every policy (tile, resident CTAs, splits) stays
    as it was; the keys' own bytes: DecodeKey.smem."""
    wide = head_dim == MLA_DIM_QK and bm == 64
    return fmha_smem_bytes(bm, bn, head_dim, stages, warps_n, split_o, value_dim(head_dim),
                           head_dim == MLA_DIM_QK, wide) + (WGMMA_ALIGN_SLACK if wide else 0)


def _ctas_per_sm(smem: int, threads: int) -> int:
    """Resident CTAs an SM holds by shared memory and threads (decode_policy's estimate)."""
    return max(1, min(SM_SMEM_BYTES // (smem + 1024), 2048 // threads))


# Balanced split-KV: a launch's key tiles (every request at max_seq_len) per resident CTA slot
# from which the persistent grid is taken
BALANCED_MIN_TILES_PER_SLOT = 4


def balances(tuning: Tuning) -> int:
    """decode_policy's `balance` under `tuning`: 0 (static split-KV) unless the tuning asks for
    balanced split-KV (every decode tile can take it); then Tuning.balanced_ctas, or -1 (the
    resident slots)."""
    if not tuning.balanced_split:
        return 0
    return tuning.balanced_ctas or -1


@functools.lru_cache(maxsize=4096)
def decode_policy(batch: int, num_kv_heads: int, group: int, max_seq_len_q: int, head_dim: int,
                  max_seq_len: int, sm_count: int, smem_limit: int = NOMINAL_SMEM_LIMIT,
                  balance: int = 0) -> DecodePolicy:
    """Tile and split-KV choice from the static arguments only (no metadata values): the
    first tile of `_decode_tiles` whose shared memory fits the device's per-block limit.
    `balance` (``balances``): -1, balanced split-KV over the resident CTA slots where the launch
    holds at least BALANCED_MIN_TILES_PER_SLOT key tiles a slot at max_seq_len (the others, the
    latency rows, keep the static split and its cluster merge); n > 0, over n CTAs at any size."""
    rows_max = group * max_seq_len_q
    bm = 16 if rows_max <= 16 else (32 if rows_max <= 32 else 64)
    for bm, bn, stages, warps_n, split_o in _decode_tiles(head_dim, bm):
        if decode_tile_smem(head_dim, bm, bn, stages, warps_n, split_o) <= smem_limit:
            break
    else:
        raise ValueError(f"head_dim {head_dim}: no decode tile fits {smem_limit} bytes of shared memory per block")
    row_tiles = (rows_max + bm - 1) // bm
    ctas = batch * num_kv_heads * row_tiles
    threads = bm // 16 * warps_n * 32
    smem = decode_tile_smem(head_dim, bm, bn, stages, warps_n, split_o)
    per_sm = _ctas_per_sm(smem, threads)
    tiles = (max_seq_len + bn - 1) // bn
    # The split count fills the SMs' resident slots (wave quantisation included) and
    # is capped by the key count only (at least 128 keys per split), so it, and the
    # workspace, never shrink as max_seq_len grows: a workspace sized for the longest
    # key serves all shorter ones; a trailing split may then be empty (merged as nothing).
    if balance:
        g = balance if balance > 0 else sm_count * per_sm
        total = ctas * max(1, tiles)
        # the merge's weights (a tile's rows of up to g parts) fit the shared memory of every
        # key this policy may launch (MLA rows of 64: the twin's, the smaller); the kernel's tile
        # arithmetic stays inside int64
        fits = min(smem, twin_smem_bytes(head_dim)) if head_dim == MLA_DIM_QK else smem
        big = balance > 0 or total >= BALANCED_MIN_TILES_PER_SLOT * g
        # the CTAs walk in groups of row_tiles, a group's CTAs the same keys (fmha_decode.cu:
        # DecodeWalk): at least one whole group
        if big and g >= row_tiles and min(bm, rows_max) * g * 4 + 256 <= fits and total * g < 2 ** 62:
            return DecodePolicy(bm, bn, warps_n, stages, split_o, row_tiles, rows_max, 1, tiles * bn, g)
    # MLA rows of 64 (the twin tile on sm_90a) keep the best fill over any waves: the twin's
    # launch_shape takes its splits in clusters of one wave from up to that count
    one_wave = not (head_dim == MLA_DIM_QK and bm == 64)
    splits = max(1, min(_split_target(ctas, sm_count * per_sm, one_wave, sm_count),
                        tiles // max(1, DECODE_MIN_KEYS_PER_SPLIT // bn)))
    return DecodePolicy(bm, bn, warps_n, stages, split_o, row_tiles, rows_max, splits, split_chunk(tiles, splits, bn))


def takes_twin(pol: DecodePolicy, head_dim: int, arch: str) -> bool:
    """Whether a launch of `pol` takes the twin MLA tile (sm_90a, MLA rows of 64: DecodeKey.of)."""
    return arch == "sm_90a" and head_dim == MLA_DIM_QK and pol.bm == 64


# A plan that read its requests' lengths balances split-KV (Tuning.balanced_split None) where
# the static split's estimated time exceeds the balanced grid's by this factor
# (balanced_by_lengths). Balanced costs the mma.sync and swapped tiles 2-9% on uniform rows and
# won from 1.46 up (benchmarks/ragged.py; benchmarks/NOTES.md, "Balanced split-KV by the plan's
# lengths").
RAGGED_RATIO = 1.25
# The twin MLA tile's ratio (ragged_ratio with `twin`) charges what the twin's walk costs beyond
# its keys: a balanced CTA's items each restart the pair cold (Q, the first tiles, the epilogue:
# ~14 us a CTA) and its cut units merge 64-row partials by the ticket, TWIN_BALANCED_KEYS keys a
# CTA in all; and it takes the static launch's own split (launch_shape: its splits as one cluster
# in one wave). Fitted to ragged.py's twin rows on an H100: at H128 (ratios 1.46-3.00 without the
# charges) the charged ratio is within 0.07 of the measured static / balanced time, at H64
# (1.38-3.00) on the right side of the bar on every row, where the uncharged ratio over a bar of
# 1.6 had balanced three H64 rows that lost 6-26% (benchmarks/NOTES.md, "The twin's bar by a
# charged ratio"). Its bar: between the H64 row that lost 6% (charged 1.01) and the H128 row
# that won 8% (1.08).
TWIN_BALANCED_KEYS = 2300
RAGGED_RATIO_TWIN = 1.05


def ragged_ratio(lens, pol: DecodePolicy, slots: int, num_kv_heads: int, twin: bool = False,
                 sm_count: Optional[int] = None) -> float:
    """The static policy `pol`'s launch time over a balanced grid's of `slots` CTAs, in keys a CTA
    streams, for requests of K/V lengths `lens` (a NumPy vector). Static: its busy CTAs (a
    request's splits that hold keys, each K/V head and row tile) in waves of `slots` at their
    mean keys, or its longest CTA (min(longest request, the chunk)) where that is longer.
    Balanced: the launch's keys over the slots. A uniform batch sits near 1 (wave quantisation
    aside); one long request among short ones far above it (the bench's B64 L32768+63x1024:
    ~11). `twin` (the twin MLA tile, whose slots are the SMs): the static launch's splits as
    launch_shape takes them where one wave holds them (up to CLUSTER_MAX_SPLITS as one cluster a
    row tile), and a balanced CTA charged TWIN_BALANCED_KEYS. `sm_count` (where the slots are
    several CTAs an SM): a static launch whose first wave leaves each busy SM fewer CTAs than the
    balanced grid's streams its keys that much faster (an SM's rate is shared by its CTAs)."""
    lens = np.asarray(lens, dtype=np.int64)
    units = num_kv_heads * pol.row_tiles
    if twin:
        splits = max(1, min(pol.splits, CLUSTER_MAX_SPLITS, slots // max(1, len(lens) * units)))
        if splits != pol.splits:
            pol = with_splits(pol, splits, pol.chunk * pol.splits)  # (the policy's keys, to a tile)
    total = float(lens.sum()) * units
    # a request's busy splits: ceil(length / chunk), at most the splits (one split: any keys)
    busy = int(np.count_nonzero(lens) if pol.splits == 1 else
               np.minimum((lens + (pol.chunk - 1)) // pol.chunk, pol.splits).sum()) * units
    if busy == 0 or total <= 0:  # no keys at all: nothing to balance
        return 0.0
    static = max(min(int(lens.max()), pol.chunk), -(-busy // slots) * total / busy)
    if sm_count and slots > sm_count:
        # the balanced grid shares each SM between slots / sm_count CTAs, a static launch of
        # fewer CTAs than SMs gives each its own: in keys an SM, its CTAs stream that much faster
        static *= min(slots, -(-min(busy, slots) // sm_count) * sm_count) / slots
    return static / (total / slots + (TWIN_BALANCED_KEYS if twin else 0))


def balanced_by_lengths(tuning: Tuning, lens, batch: int, num_kv_heads: int, group: int, max_seq_len_q: int,
                        head_dim: int, max_seq_len: int, sm_count: int, smem_limit: int = NOMINAL_SMEM_LIMIT,
                        arch: str = "sm_90a") -> Tuning:
    """`tuning` as a plan launches it on `arch`, given the requests' K/V lengths `lens` (a NumPy
    vector): where Tuning.balanced_split is None (the default), with balanced split-KV where the
    balanced policy applies and `ragged_ratio` exceeds RAGGED_RATIO (RAGGED_RATIO_TWIN for the
    twin MLA tile); otherwise `tuning` itself (the static split, as where no lengths are known).
    The lengths are weighed whole: a causal window's requests stream fewer keys than the ratio
    counts (balanced split-KV weighs only the window's tiles), so a windowed batch may balance
    where its lengths alone are uneven."""
    if tuning.balanced_split is not None:
        return tuning
    bal = decode_policy(batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sm_count, smem_limit,
                        tuning.balanced_ctas or -1)  # the grid a balanced launch of `tuning` takes
    if not bal.balanced:
        return tuning
    pol = decode_policy(batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sm_count, smem_limit)
    twin = takes_twin(pol, head_dim, arch)
    bar = RAGGED_RATIO_TWIN if twin else RAGGED_RATIO
    if ragged_ratio(lens, pol, bal.balanced, num_kv_heads, twin, sm_count) > bar:
        return dataclasses.replace(tuning, balanced_split=True)
    return tuning


TWIN_BN = 64  # the twin tile's key tiles (MLA rows of 64: the policy's BN there)
TWIN_STAGES = 2  # a tile a warpgroup in flight
TWIN_THREADS = 256  # the two MMA warpgroups, which issue the tile copies themselves


def twin_smem_bytes(head_dim: int) -> int:
    """pt::TwinConfig<...>::SMEM_BYTES: Q (64 rows), two 64-key tiles, six floats a row (two
    warpgroups' first-tile maxima, maxima and sums), a full mbarrier a tile stage and 64-column
    panel."""
    return (64 * head_dim * 2 + TWIN_STAGES * TWIN_BN * head_dim * 2 + 6 * 64 * 4
            + TWIN_STAGES * (head_dim // 64) * 8)


def swap_smem_bytes(bm: int, bn: int, head_dim: int, stages: int) -> int:
    """pt::SwapConfig<...>::SMEM_BYTES: Q, the ring (`stages` shared K/V tiles), Pᵀ, the
    per-warp row reductions and the ring's mbarriers."""
    return bm * head_dim * 2 + stages * bn * head_dim * 2 + bm * bn * 2 + 4 * bm * 4 + 2 * stages * 8


@dataclass(frozen=True)
class DecodeKey(KernelKey):
    PREFIX = "pt_decode"
    SOURCE = "fmha_decode.cu"
    PARAMS = property(lambda self: "DecodeTmaParams" if self.tma else "DecodeParams")

    dtype: str = tag("", always=True)
    head_dim: int = tag("d", always=True)
    causal: bool = tag("c", always=True)
    bm: int = tag("bm", always=True)
    bn: int = tag("bn", always=True)
    warps_n: int = tag("wn", 1, always=True)
    stages: int = tag("s", 2, always=True)
    split_o: bool = tag("so", False)
    arch: int = tag("sm", 80)  # tile engine: 80 = mma.sync; 90 = wgmma (MLA's swapped and twin tiles on sm_90a)
    swap: bool = tag("swap", False)  # the swapped-operand wgmma tile (MLA rows of 16/32 on sm_90a)
    copy_tpr: int = tag("cp", 4)  # the swapped tile's producer threads per K/V row (Tuning.copy_tpr)
    twin: bool = tag("twin", False)  # the twin tile (MLA rows of 64 on sm_90a)
    balanced: bool = tag("bal", False)  # balanced split-KV (the policy's `balanced`: Tuning.balanced_split)
    trace: bool = tag("trace", False)  # PT_TWIN_TRACE (Tuning.twin_trace): a measurement aid
    cta_trace: bool = tag("ctatrace", False)  # PT_CTA_TRACE (Tuning.cta_trace): a measurement aid
    probe: int = tag("probe", 0)  # PT_PROBE in the twin keys (Tuning.probe): a measurement aid, wrong results

    @staticmethod
    @functools.lru_cache(maxsize=4096)  # a key per problem class: plans and one-shots look it up
    def of(dtype: str, head_dim: int, causal: bool, pol: DecodePolicy, arch: str = "sm_80",
           tuning: Tuning = DEFAULT_TUNING) -> "DecodeKey":
        """The tile of each engine for a policy: on sm_90a, MLA rows of 64 take the twin tile and
        rows of 16/32 the swapped-operand tile (Tuning.mla_swapped); everything else the mma.sync
        tile."""
        key = DecodeKey._of(dtype, head_dim, causal, pol, arch, tuning)
        return dataclasses.replace(key, cta_trace=True) if tuning.cta_trace else key

    @staticmethod
    def _of(dtype: str, head_dim: int, causal: bool, pol: DecodePolicy, arch: str, tuning: Tuning) -> "DecodeKey":
        bal = pol.balanced > 0
        if takes_twin(pol, head_dim, arch):
            assert pol.bn == TWIN_BN and pol.warps_n == 2, pol  # 64-key tiles; two MMA warpgroups
            return DecodeKey(dtype, MLA_DIM_QK, causal, 64, TWIN_BN, 2, TWIN_STAGES, False, 90, twin=True,
                             balanced=bal, trace=tuning.twin_trace, probe=tuning.probe)
        if arch == "sm_90a" and tuning.mla_swapped and head_dim == MLA_DIM_QK and pol.bm < 64:
            return DecodeKey.swapped(dtype, causal, pol, tuning)
        return DecodeKey(dtype, head_dim, causal, pol.bm, pol.bn, pol.warps_n, pol.stages, pol.split_o, 80,
                         balanced=bal)

    @staticmethod
    def swapped(dtype: str, causal: bool, pol: DecodePolicy, tuning: Tuning = DEFAULT_TUNING) -> "DecodeKey":
        """The swapped-operand MLA tile for the policy's row tile of 16 or 32 (BN 64: the
        policy's split chunks stay whole tiles): two stages of 72 KB tiles."""
        assert pol.bm in (16, 32) and pol.bn == SWAP_BN, pol
        return DecodeKey(dtype, MLA_DIM_QK, causal, pol.bm, SWAP_BN, 1, 2, False, 90, True,
                         tuning.copy_for(MLA_DIM_QK), balanced=pol.balanced > 0)

    @property
    def producer(self) -> bool:  # the swapped tile's producer warpgroup (the twin tile has none)
        return self.swap

    @property
    def tma(self) -> bool:  # the tiles are TMA boxes of the pool (DecodeTmaParams)
        return self.twin

    @property
    def threads(self) -> int:
        if self.twin:
            return TWIN_THREADS
        if self.swap:
            return SWAP_THREADS
        return self.bm // 16 * self.warps_n * 32

    @property
    def dv(self) -> int:
        return value_dim(self.head_dim)

    @property
    def shared_kv(self) -> bool:
        return self.head_dim == MLA_DIM_QK

    @property
    def smem(self) -> int:
        if self.twin:
            return twin_smem_bytes(self.head_dim) + WGMMA_ALIGN_SLACK
        if self.swap:
            return swap_smem_bytes(self.bm, self.bn, self.head_dim, self.stages) + WGMMA_ALIGN_SLACK
        return fmha_smem_bytes(self.bm, self.bn, self.head_dim, self.stages, self.warps_n, self.split_o, self.dv,
                               self.shared_kv)

    def defines(self) -> str:
        return (("#define PT_TWIN_TRACE\n" if self.trace else "") + ("#define PT_CTA_TRACE\n" if self.cta_trace else "")
                + (f"#define PT_PROBE {self.probe}\n" if self.probe else ""))

    def call(self) -> str:
        if self.twin:
            cfg = f"pt::TwinConfig<pt::{self.dtype}, {self.head_dim}, {self.dv}>"
        elif self.swap:
            cfg = (f"pt::SwapConfig<pt::{self.dtype}, {self.head_dim}, {self.dv}, {self.bm}, {self.stages}, "
                   f"{self.copy_tpr}>")
        else:  # the mma.sync tile (FmhaConfig on sm_90a: the prefill family's keys only)
            assert self.arch == 80 and self.copy_tpr == 4, self
            cfg = fmha_config(self.dtype, self.head_dim, self.bm, self.bn, self.head_dim <= 128, 80, self.warps_n,
                              self.stages, self.split_o, self.dv, self.shared_kv)
        return f"pt::decode_kernel<{cfg}, {cpp_bool(self.causal)}{', true' if self.balanced else ''}>"


# A decode split merged by the ticket streams at least this many keys: the ticket's merge (the
# last CTA reading every split's partial) costs a launch ~4-7 us that a cluster's on-chip merge
# does not, so a policy of shorter splits takes up to CLUSTER_MAX_SPLITS of them in clusters,
# even where the clusters leave some SMs two CTAs (H100: B1 L16384 8 in a cluster 41.8 us, 16 by
# the ticket 45.0; B1 L32768 70.2 / 68.5; benchmarks/NOTES.md, "The clusters' placement and one
# CTA an SM").
TICKET_MIN_KEYS = 2048


def keeps_cluster(held: Optional[int], cluster: int, ctas: int, slots: int) -> bool:
    """Whether a launch of `ctas` CTAs keeps its clusters of `cluster`, the device holding `held`
    of them at once (PreparedLaunch.active_clusters; None: no cluster or no query): not where it
    holds none, nor where the clusters would need a second wave that the CTAs alone (`slots` of
    them at once) do not: a GPC's SMs short of a whole cluster stay idle (MLA B16 H128, 32
    clusters of 4 twin CTAs, 30 at once on an H100)."""
    return held is None or not (held < 1 or held * cluster < ctas <= slots)


def split_chunk(tiles: int, splits: int, bn: int) -> int:
    """Keys a split of `tiles` key tiles of `bn` keys takes: equal whole tiles (the last split's may be short)."""
    return (tiles + splits - 1) // splits * bn


def with_splits(pol: DecodePolicy, splits: int, max_seq_len: int) -> DecodePolicy:
    """`pol` with `splits` K/V chunks a (request, K/V head) of equal whole tiles."""
    return dataclasses.replace(pol, splits=splits, chunk=split_chunk((max_seq_len + pol.bn - 1) // pol.bn, splits,
                                                                     pol.bn))


def decode_grid(pol: DecodePolicy, num_kv_heads: int, batch: int) -> Tuple[int, int, int]:
    """A decode launch's grid: (splits, K/V heads x row tiles, requests), or the balanced CTAs."""
    return (pol.balanced, 1, 1) if pol.balanced else (pol.splits, num_kv_heads * pol.row_tiles, batch)


# The twin's split cost model (launch_shape), in keys a CTA streams (~0.03 us a key on an H100):
# a partial row (512 floats) written or read costs as much as 2048 / 1152 keys (576 bf16 each)
# at the rate a CTA moves either; a merge through the workspace (a ticket, or two levels'
# second) costs besides ~560 keys where the launch fills a wave of CTAs, less in proportion
# where it fills less. Fitted to the choices measured on an H100 (MLA H128: one cluster of 8,
# 4,096 keys a CTA, 122 us, against 66 splits of 512 keys by the ticket, 234 us; B16 3 splits
# in one cluster 62 us, 4 by the ticket 84, 4 as two clusters of 2 74; two levels past one
# level's time at 32-112 CTAs; benchmarks/NOTES.md, "Small-batch MLA", "Two-level cluster
# merge"), not a time: full waves of one level run slower a key than few CTAs do.
TWIN_PART_ROW_KEYS = 2048 / 1152
TWIN_LEVEL_KEYS = 560


def twin_ticket_cost(chunk: int, splits: int, wave: float = 1.0) -> float:
    """The twin's keys a row tile's last CTA streams for `splits` of `chunk` keys merged by the
    ticket: its own chunk, its partial's 64 rows written, every split's read, and the merge's
    fixed cost by `wave`, the launch's CTAs over the SMs (at most 1)."""
    return chunk + (splits + 1) * 64 * TWIN_PART_ROW_KEYS + TWIN_LEVEL_KEYS * min(wave, 1.0)


def twin_split_cost(chunk: int, clusters: int, size: int, wave: float = 1.0) -> float:
    """The twin's keys a CTA streams (`chunk`: a split's keys) for a row tile's splits as
    `clusters` clusters of `size`, with, where there are several, the second level's rows (a
    CTA of a cluster writes 64 / size rows of its cluster's partial, one of the last cluster
    reads them from each of the `clusters` parts) and its fixed cost (by `wave`, as the
    ticket's)."""
    cost = float(chunk)
    if clusters > 1:
        cost += (clusters + 1) * (64 / size) * TWIN_PART_ROW_KEYS + TWIN_LEVEL_KEYS * min(wave, 1.0)
    return cost


def launch_shape(key: "DecodeKey", pol: DecodePolicy, arch: str, tuning: Tuning, smem_limit: int, sm_count: int,
                 num_kv_heads: int, batch: int, max_seq_len: int, held) -> Tuple[DecodePolicy, int, int]:
    """The policy a plan launches, its cluster size and dynamic shared memory.

    `held(grid, cluster, smem)`: how many such clusters the device holds at once
    (PreparedLaunch.active_clusters). Splits merged in a cluster beat the ticket merge, whose
    last CTA reads every split's partial rows alone (MLA B16 H128 on an H100: 4 splits by the
    ticket 84 us, 3 as one cluster 61), unless the clusters would cost a wave that the CTAs
    alone do not (keeps_cluster).

    - The twin MLA tile: `_twin_shape`, where it finds a launch of one wave.
    - Otherwise the most splits up to the policy's (the twin's, and a policy's of splits
      shorter than TICKET_MIN_KEYS: up to 8) launched as one cluster a row tile
      (decode_cluster: 2-8 splits) that keeps_cluster keeps; for the twin, the ticket over the
      policy's splits where its `twin_ticket_cost` over its waves is below that launch's chunk
      over its waves; for the other tiles, the ticket over the policy's splits where splits of
      at least TICKET_MIN_KEYS could take an SM each and their clusters would not (`spreads`).
    - Where nothing fits, the policy's splits (the ticket merge where there are several).
    """
    slots = sm_count * _ctas_per_sm(key.smem, key.threads)
    asked = {}  # (cluster, smem): held, asked once

    def fits(splits: int, size: int):
        """None: no cluster of `size` for `splits`; False: the device does not hold them in one
        wave; else (the policy, the cluster, the shared memory)."""
        cand = pol if splits == pol.splits else with_splits(pol, splits, max_seq_len)
        grid = decode_grid(cand, num_kv_heads, batch)
        ctas = grid[0] * grid[1] * grid[2]
        cluster, smem = decode_cluster(key, cand, arch, tuning, smem_limit, sm_count, ctas, size)
        if cluster == 1:
            return None
        if (cluster, smem) not in asked:
            asked[cluster, smem] = held(grid, cluster, smem)
        return (cand, cluster, smem) if keeps_cluster(asked[cluster, smem], cluster, ctas, slots) else False

    def spreads(got) -> bool:
        """Whether a launch whose CTAs could each take an SM of their own still do in its
        clusters: asked with one CTA an SM's shared memory, a GPC's SMs short of a whole cluster
        take none (an H100's 128 CTAs in clusters of 8 or 4 ran on 120 SMs, 8 of them holding
        two: 204-211 us against the ticket's 194 over 128 SMs)."""
        cand, cluster, smem = got
        grid = decode_grid(cand, num_kv_heads, batch)
        ctas = grid[0] * grid[1] * grid[2]
        one = max(smem, SM_SMEM_BYTES // 2)
        if ctas > sm_count or one > smem_limit:
            return True
        if (cluster, one) not in asked:
            asked[cluster, one] = held(grid, cluster, one)
        return asked[cluster, one] is None or asked[cluster, one] * cluster >= ctas

    units = num_kv_heads * pol.row_tiles * batch  # row tiles of the launch
    if key.twin:
        got = _twin_shape(fits, pol, key.smem, units, slots, sm_count)
        if got is not None:
            return got
    top = min(pol.splits, CLUSTER_MAX_SPLITS) if key.twin or pol.chunk < TICKET_MIN_KEYS else pol.splits
    for s in range(top, 1, -1):
        got = fits(s, s)
        if got is None:
            break
        if got:
            if key.twin and s < pol.splits and (_twin_ticket_keys(pol, units, slots, sm_count)
                                                < -(-units * s // slots) * got[0].chunk):
                break  # the ticket over the policy's splits
            if not key.twin and got[0].chunk >= TICKET_MIN_KEYS and not spreads(got):
                break  # the ticket over the policy's splits, a CTA an SM
            return got
    return pol, 1, key.smem


def _twin_ticket_keys(pol: DecodePolicy, units: int, slots: int, sm_count: int) -> float:
    """The twin's ticket launch over the policy's splits, in keys a CTA streams over its waves
    (`units`: the launch's row tiles; `slots`: its resident CTAs)."""
    ctas = units * pol.splits
    return -(-ctas // slots) * twin_ticket_cost(pol.chunk, pol.splits, ctas / sm_count)


def _twin_shape(fits, pol: DecodePolicy, smem: int, units: int, slots: int,
                sm_count: int) -> Optional[Tuple[DecodePolicy, int, int]]:
    """The twin MLA tile's launch among those of one wave, or None where `fits` (launch_shape's)
    keeps none (`units`: the launch's row tiles; `slots`: its resident CTAs). Its partials (64 x
    512 floats a split) make the ticket the slower the more splits it merges (B8 H128 on an
    H100: 32 splits 381 us, 8 as one cluster 109), and a CTA costs ~14 us beyond its keys (Q,
    the first tiles, the epilogue), so its splits stay in clusters and its CTAs in one wave: up
    to the policy's splits as one cluster a row tile, or as C >= 2 clusters of 2-8 merged in two
    levels (fmha_decode.cu: merge_cluster), the count and size of least `twin_split_cost` (on
    ties the larger clusters); or the ticket over the policy's splits (its launch, of however
    many waves) where that costs less over its waves."""
    best, cost = None, None
    for size in range(min(pol.splits, CLUSTER_MAX_SPLITS), 1, -1):
        for c in range(min(pol.splits, slots // units) // size, 0, -1):
            got = fits(c * size, size)
            if got is None:
                break
            if got:
                t = twin_split_cost(got[0].chunk, c, size, c * size * units / sm_count)
                if cost is None or t < cost:
                    best, cost = got, t
    if best is None:
        return None
    return (pol, 1, smem) if _twin_ticket_keys(pol, units, slots, sm_count) < cost else best


def cluster_part_bytes(bm: int, dv: int) -> int:
    """pt::cluster_part_bytes: a CTA's partial rows (DV + CLUSTER_PAD floats apart) and log-sum-exps."""
    return (bm * (dv + CLUSTER_PAD) + bm) * 4


def decode_cluster(key: DecodeKey, pol: DecodePolicy, arch: str, tuning: Tuning, smem_limit: int,
                   sm_count: int, ctas: int, size: Optional[int] = None) -> Tuple[int, int]:
    """The launch's cluster size and dynamic shared memory: on sm_90a the 2-8 splits of a row
    tile as one cluster (Tuning.cluster_merge), or (`size`, dividing the splits: two levels)
    clusters of `size` of them, each CTA keeping its partial rows and log-sum-exps after the
    core's bytes (fmha_decode.cu: merge_cluster), where that fits the per-block limit and the
    extra bytes cost no wave (the policy counted the resident CTAs of the key's own bytes:
    `ctas` of the launch must still fit one pass of the fewer slots); otherwise (1, the key's).
    The twin MLA tile's partials lie over its own bytes (its stages, free by its epilogue): its
    clusters keep the key's bytes. (launch_shape picks the size and the splits.)"""
    size = pol.splits if size is None else size
    if (arch != "sm_90a" or not tuning.cluster_merge or pol.balanced or not 2 <= size <= CLUSTER_MAX_SPLITS
            or pol.splits % size):
        return 1, key.smem
    if key.twin:  # its partials lie over its own bytes, free by its epilogue (pt_fmha_twin.cuh)
        return size, key.smem
    smem = -(-key.smem // 16) * 16 + cluster_part_bytes(key.bm, key.dv)
    if smem > smem_limit:
        return 1, key.smem
    slots = sm_count * _ctas_per_sm(smem, key.threads)
    if slots < sm_count * _ctas_per_sm(key.smem, key.threads) and ctas > slots:
        return 1, key.smem
    return size, smem


class DecodeParams(ctypes.Structure):
    """Mirror of pt::DecodeParams (prims_ts/cuda/include/pt_decode.cuh)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "o", "ws_o", "ws_lse", "ws_count", "qo_indptr", "kv_indptr", "kv_indices",
        "seq_lens")] + [
        (n, ctypes.c_int64) for n in (
            "q_sb", "q_st", "q_sh", "o_sb", "o_st", "o_sh", "k_sp", "k_sh", "k_ss", "v_sp", "v_sh", "v_ss",
            "bt_stride")] + [
        (n, ctypes.c_int32) for n in (
            "sq", "rows_max", "row_tiles", "splits", "chunk", "group", "hkv", "page_shift", "window_left",
            "out_dtype", "num_pages", "num_indices", "total_q", "balanced", "batch")] + [
        ("scale_log2", ctypes.c_float),
        ("out_scale", ctypes.c_float),
        ("merge_fan", ctypes.c_int32),
    ]


class _DecodeTmaParams(ctypes.Structure):
    """Mirror of pt::DecodeTmaParams: the latent pool's tensor map and a second (unused) map slot
    (64-byte aligned, so the struct is a multiple of 64 bytes), then the DecodeParams."""

    _fields_ = [("tmap_k", runtime.TensorMap), ("tmap_v", runtime.TensorMap), ("p", DecodeParams)]


DecodeTmaParams = runtime.padded_to(_DecodeTmaParams, 64)

# DecodeParams' leading pointers, q to seq_lens, written at once (PreparedDecode.rerun)
_POINTERS = struct.Struct("=11Q")
assert DecodeParams.q.offset == 0 and DecodeParams.seq_lens.offset == 10 * 8


# ----------------------------------------------------------------------------
# Workspace
# ----------------------------------------------------------------------------


def decode_partial_layout(batch: int, num_kv_heads: int, pol: DecodePolicy, dv: int) -> Tuple[int, int, int, int]:
    """Workspace layout of a split launch, byte offsets of: lse rows, partial outputs, the
    per-row-tile arrival counters (sections 256-byte aligned; balanced: then a counter a slot, its
    group's arrivals where a unit merges in two levels), and the end. Balanced: two slots a CTA of
    min(BM, rows_max) rows."""
    if pol.balanced:
        rows = 2 * pol.balanced * min(pol.bm, pol.rows_max)
    else:
        rows = batch * num_kv_heads * pol.splits * pol.rows_max
    align = lambda n: (n + 255) // 256 * 256  # noqa: E731
    o = align(rows * 4)
    count = o + align(rows * dv * 4)
    counters = batch * num_kv_heads * pol.row_tiles + (2 * pol.balanced if pol.balanced else 0)
    return 0, o, count, count + counters * 4


def _decode_partial_bytes(batch: int, num_kv_heads: int, pol: DecodePolicy, head_dim: int) -> int:
    """Workspace bytes of one launch (0 without split-KV)."""
    if pol.splits == 1 and not pol.balanced:
        return 0
    return decode_partial_layout(batch, num_kv_heads, pol, value_dim(head_dim))[3]


@functools.lru_cache(maxsize=4096)
def decode_workspace_bytes(batch: int, num_kv_heads: int, group: int, max_seq_len_q: int, head_dim: int,
                           max_seq_len: int, sm_count: int, smem_limit: int = NOMINAL_SMEM_LIMIT,
                           balance: int = 0) -> int:
    """Workspace bytes for these static arguments.

    Taller row tiles mean more CTAs and so fewer splits; the size is the largest over
    every query length up to max_seq_len_q (the last one of each row-tile shape is
    enough), so that it never shrinks as max_seq_len_q or max_seq_len grows.
    """
    def need(sq: int) -> int:
        pol = decode_policy(batch, num_kv_heads, group, sq, head_dim, max_seq_len, sm_count, smem_limit, balance)
        return _decode_partial_bytes(batch, num_kv_heads, pol, head_dim)

    # the last sq of each (bm, row_tiles) shape: group * sq just below each multiple of 16
    edges = {max_seq_len_q} | {16 * k // group for k in range(1, (group * max_seq_len_q) // 16 + 1)}
    return max(need(sq) for sq in edges if 1 <= sq <= max_seq_len_q)


def mla_workspace_bytes(batch: int, num_heads: int, max_seq_len_q: int, max_seq_len: int, sm_count: int,
                        smem_limit: int = NOMINAL_SMEM_LIMIT, balance: int = 0) -> int:
    """Workspace bytes of MLA decode (never shrinks as max_seq_len or max_seq_len_q grows)."""
    return decode_workspace_bytes(batch, 1, num_heads, max_seq_len_q, MLA_DIM_QK, max_seq_len, sm_count, smem_limit,
                                  balance)


# ----------------------------------------------------------------------------
# Prepared launches
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeStatic:
    """Everything a decode-shaped launch needs besides tensor addresses (paged decode; MLA is
    head_dim 576 with one K/V head)."""

    dtype: torch.dtype
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    page_size: int
    causal: bool
    window_left: int
    out_dtype: torch.dtype
    batch: int
    seq_len_q: int  # fixed queries per request (1 for [B, Hq, D]); packed: 1
    max_seq_len_q: int
    max_seq_len: int
    packed: bool
    tuning: Tuning = DEFAULT_TUNING


def decode_query_strides(t: torch.Tensor, packed: bool) -> Tuple[int, int, int]:
    """(request, token, head) strides of [B,Hq,D], [B,SQ,Hq,D] or packed [T,Hq,D]."""
    s = t.stride()
    if packed:
        return 0, s[0], s[1]
    if t.dim() == 3:
        return s[0], 0, s[1]
    return s[0], s[1], s[2]


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


class PreparedDecode(Prepared):
    """The loaded kernel, policy, grid and parameter struct of one DecodeStatic on one device."""

    __slots__ = ("policy", "p", "tp", "workspace_bytes", "_ws_offsets", "_v_off", "_map_layout")

    def __init__(self, static: DecodeStatic, dev: int):
        arch, sms, limit = device_info(dev)
        group = static.num_qo_heads // static.num_kv_heads
        balance = balances(static.tuning)
        pol = decode_policy(static.batch, static.num_kv_heads, group, static.max_seq_len_q, static.head_dim,
                            static.max_seq_len, sms, limit, balance)
        key = DecodeKey.of(DTYPE_CODES[static.dtype], static.head_dim, static.causal, pol, arch, static.tuning)
        kernel = load(dev, key)
        self.tp = DecodeTmaParams() if key.tma else None  # a TMA key's whole struct (p: its DecodeParams)
        p = self.tp.p if key.tma else DecodeParams()
        params = self.tp if key.tma else p  # the struct the kernel takes (a TMA key's: the maps, then p)

        def held(grid, cluster, smem):
            if smem > key.smem:  # the load reserved the key's own
                runtime.reserve_smem(kernel, smem, key.name)
            return runtime.PreparedLaunch(kernel, key.name, grid, params, cluster, smem).active_clusters()

        pol, cluster, smem = launch_shape(key, pol, arch, static.tuning, limit, sms, static.num_kv_heads,
                                          static.batch, static.max_seq_len, held)
        p.sq = static.seq_len_q
        p.rows_max, p.row_tiles, p.splits, p.chunk = pol.rows_max, pol.row_tiles, pol.splits, pol.chunk
        p.group, p.hkv = group, static.num_kv_heads
        p.page_shift = static.page_size.bit_length() - 1
        p.window_left = static.window_left
        p.out_dtype = OUT_DTYPE_CODES[static.out_dtype]
        p.balanced, p.batch = pol.balanced, static.batch
        p.merge_fan = static.tuning.merge_fan or MERGE_FAN
        self._ws_offsets = decode_partial_layout(static.batch, static.num_kv_heads, pol, key.dv) \
            if pol.splits > 1 or pol.balanced else None
        self.workspace_bytes = self._ws_offsets[3] if self._ws_offsets else 0
        self.static, self.dev, self.policy, self.key, self.p = static, dev, pol, key, p
        self.launch = runtime.PreparedLaunch(kernel, key.name, decode_grid(pol, static.num_kv_heads, static.batch),
                                             params, cluster, smem)
        self._strides = None
        self.accepted = None
        self._v_off = 0
        self._maps = self._maps_at = self._map_layout = None

    def _map_pool(self, pool: torch.Tensor, address: int) -> None:
        """A TMA key: the latent pool's map (``[P, ps, D]`` or ``[P, 1, ps, D]``; boxes of 64
        columns and a page's rows, at most a tile's), built when its layout changed and encoded
        when its address did (V is K's prefix: no map of its own)."""
        layout = (tuple(pool.shape), pool.stride())
        if layout != self._map_layout:
            k = pool.unsqueeze(1) if pool.dim() == 3 else pool
            self._set_maps(k, None, True, min(self.static.page_size, self.key.bn))
            self._map_layout = layout
        self._encode_maps(self.tp, address, None)

    def run(self, query, k_cache, v_cache, workspace, out, kv_indptr, kv_indices, seq_lens, qo_indptr,
            sm_scale: float, output_scale: float, bt_stride: int = 0) -> None:
        """Write the live fields (addresses, strides, scales) and launch on the current stream.
        The pools as ``write_rows`` takes them; pages from CSR (kv_indptr, kv_indices) or, with
        kv_indptr None, a block table of row stride bt_stride."""
        p = self.p
        self._strides = write_rows(p, self._strides, query, k_cache, v_cache, out, self.static.packed)
        if self._ws_offsets is not None:
            ws = workspace.data_ptr()
            if ws & 15:
                check_starts((("workspace_buffer", workspace),))
            lse, o, count, _ = self._ws_offsets
            p.ws_lse, p.ws_o, p.ws_count = ws + lse, ws + o, ws + count
        p.qo_indptr = _ptr(qo_indptr)
        p.kv_indptr, p.kv_indices, p.seq_lens = _ptr(kv_indptr), kv_indices.data_ptr(), seq_lens.data_ptr()
        p.bt_stride = bt_stride
        write_bounds(p, k_cache, kv_indptr, kv_indices, query if self.static.packed else None)
        p.scale_log2 = sm_scale * LOG2E
        p.out_scale = output_scale
        if self.tp is not None:
            self._map_pool(k_cache, p.k)
        self.launch.launch(runtime.current_stream(self.dev))
        self._v_off = (p.v or 0) - (p.k or 0)
        if self.accepted is not None:
            self.accepted.record((query, k_cache, v_cache, out))

    def rerun(self, q: int, k: int, v: int, ws: int, qo_indptr: int, kv_indptr: int, kv_indices: int,
              seq_lens: int, o: int, sm_scale: float, output_scale: float, num_indices: int = -1) -> bool:
        """The last full ``run``'s launch again with new addresses (ints, 0 for None; ``v`` 0: the
        pool's V at its offset from K in that run), scales and, unless -1, CSR ``kv_indices``'
        length: the caller vouches that every other operand is laid out as in that run (a
        standalone's own copy under its static key). False: a start is not 16-byte aligned and
        nothing was launched (the full ``run`` names it)."""
        if not v:
            v = k + self._v_off
        if (q | k | v | o) & 15:
            return False
        p = self.p
        if self._ws_offsets is not None:
            if ws & 15:
                return False
            lse, wo, count, _ = self._ws_offsets
            _POINTERS.pack_into(p, 0, q, k, v, o, ws + wo, ws + lse, ws + count, qo_indptr, kv_indptr, kv_indices,
                                seq_lens)
        else:
            _POINTERS.pack_into(p, 0, q, k, v, o, 0, 0, 0, qo_indptr, kv_indptr, kv_indices, seq_lens)
        if num_indices >= 0:
            p.num_indices = num_indices
        p.scale_log2 = sm_scale * LOG2E
        p.out_scale = output_scale
        if self.tp is not None:  # the pool laid out as in that run
            self._encode_maps(self.tp, k, None)
        self.launch.launch(runtime.current_stream(self.dev))
        return True

    def again(self, query, k_cache, v_cache, out, sm_scale: float, output_scale: float) -> bool:
        """A plan's launch with new query, pool and output addresses and scales, when the
        operands are laid out as in its last full ``run`` (``Accepted``; metadata and workspace
        are the plan's own). False: nothing was launched, take the full path."""
        a = self.accepted.admit((query, k_cache, v_cache, out))
        if a is None:
            return False
        p = self.p
        p.q, p.k, p.o = a[0], a[1], a[3]
        p.v = a[2] if v_cache is not None else a[1] + self._v_off
        p.scale_log2 = sm_scale * LOG2E
        p.out_scale = output_scale
        if self.tp is not None:  # the pool laid out as in that run
            self._encode_maps(self.tp, a[1], None)
        self.launch.launch(runtime.current_stream(self.dev))
        return True


def write_bounds(p: DecodeParams, pool, kv_indptr, kv_indices, packed_query) -> None:
    """What the kernels check the live metadata against (they fail closed): the pools' page
    count, kv_indices' length (CSR) or the block table's columns, a packed query's rows."""
    p.num_pages = pool.shape[0]
    p.num_indices = 0 if kv_indices is None else (kv_indices.shape[0] if kv_indptr is not None
                                                   else kv_indices.shape[1])
    p.total_q = 0 if packed_query is None else packed_query.shape[0]


def write_rows(p: DecodeParams, last_strides, query, k_cache, v_cache, out, packed: bool,
               names: Tuple[str, str] = ("query", "kv_cache")):
    """The query, the K/V pools and the output of a decode-shaped launch (decode, MLA,
    block-sparse) into ``p``: their strides when they differ from ``last_strides`` (checked for
    the kernels' vector accesses first), their addresses every call (starts checked for 16-byte
    alignment). The pools: K and V ``[P, Hkv, ps, D]`` tensors; or, with ``v_cache`` None, one
    tensor: a combined ``[P, 2, Hkv, ps, D]`` cache, or a latent pool ``[P, 1, ps, D]`` /
    ``[P, ps, D]`` whose rows are both K and (their prefix) V. Errors name the query and the
    one-tensor cache by ``names`` (the caller's argument names). Returns the strides written."""
    qn, cn = names
    strides = (query.stride(), k_cache.stride(), None if v_cache is None else v_cache.stride(), out.stride())
    ks = strides[1]
    if strides != last_strides:
        p.q_sb, p.q_st, p.q_sh = decode_query_strides(query, packed)
        p.o_sb, p.o_st, p.o_sh = decode_query_strides(out, packed)
        if v_cache is not None:
            check_rows(((qn, query), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)))
            vs = strides[2]
            p.k_sp, p.k_sh, p.k_ss = ks[0], ks[1], ks[2]
            p.v_sp, p.v_sh, p.v_ss = vs[0], vs[1], vs[2]
        else:
            check_rows(((qn, query), (cn, k_cache), ("out", out)))
            if len(ks) == 5:  # combined: page, K/V, head, slot
                p.k_sp, p.k_sh, p.k_ss = ks[0], ks[2], ks[3]
            elif len(ks) == 4:  # one latent head: page, head, slot
                p.k_sp, p.k_sh, p.k_ss = ks[0], ks[1], ks[2]
            else:  # latent rows: page, slot
                p.k_sp, p.k_sh, p.k_ss = ks[0], 0, ks[1]
            p.v_sp, p.v_sh, p.v_ss = p.k_sp, p.k_sh, p.k_ss
    kp = k_cache.data_ptr()
    if v_cache is not None:
        vp = v_cache.data_ptr()
    else:
        vp = kp + ks[1] * k_cache.element_size() if len(ks) == 5 else kp
    p.q, p.k, p.v, p.o = a = query.data_ptr(), kp, vp, out.data_ptr()
    if (a[0] | a[1] | a[2] | a[3]) & 15:
        check_starts(((qn, query), (cn if v_cache is None else "k_cache", k_cache), ("out", out))
                     + ((("v_cache", v_cache),) if v_cache is not None else ()))
        if vp & 15:
            raise ValueError(f"{cn}: the V half of a combined cache must start 16-byte aligned")
    return strides


prepared = PreparedDecode.shared  # the shared prepared launch of a static key on a device


def decode_key(dtype: torch.dtype, head_dim: int, causal: bool, batch: int, num_kv_heads: int, group: int,
               max_seq_len_q: int, max_seq_len: int, dev: int,
               tuning: Tuning = DEFAULT_TUNING) -> Tuple[DecodePolicy, DecodeKey]:
    """The policy and kernel of a decode-shaped launch on CUDA device `dev`."""
    arch, sms, limit = device_info(dev)
    pol = decode_policy(batch, num_kv_heads, group, max_seq_len_q, head_dim, max_seq_len, sms, limit,
                        balances(tuning))
    return pol, DecodeKey.of(DTYPE_CODES[dtype], head_dim, causal, pol, arch, tuning)
