"""Host-side launch policies: split-KV choice and the heavy-first work list."""
import itertools

import pytest

from prims_ts.cuda import kernels
from prims_ts.ops.prefill import work_list


@pytest.mark.parametrize("batch,hkv,group,sq,d,length",
                         list(itertools.product([1, 7, 128, 512], [1, 8], [1, 4, 32], [1, 3], [64, 128, 256],
                                                [1, 63, 64, 4097, 131072])))
def test_decode_policy_covers_every_key_once(batch, hkv, group, sq, d, length):
    pol = kernels.decode_policy(batch, hkv, group, sq, d, length, sm_count=132)
    assert pol.bm in (16, 32, 64) and pol.rows_max == group * sq
    assert pol.row_tiles * pol.bm >= pol.rows_max > (pol.row_tiles - 1) * pol.bm
    assert pol.chunk % pol.bn == 0, "split boundaries must fall on K/V tile boundaries"
    assert pol.splits >= 1 and pol.splits * pol.chunk >= length, "every key belongs to a split"
    assert pol.splits <= 128
    ws = kernels.decode_workspace_bytes(batch, hkv, group, sq, d, length, sm_count=132)
    if pol.splits > 1:
        rows = batch * hkv * pol.splits * pol.rows_max
        assert ws >= rows * (d + 1) * 4
    if sq == 1 and pol.splits == 1:
        assert ws == 0, "a single split needs no partials"


def test_decode_workspace_never_shrinks_as_max_seq_len_grows():
    for batch, hkv, group in ((1, 1, 1), (1, 8, 4), (16, 8, 4)):
        sizes = [kernels.decode_workspace_bytes(batch, hkv, group, 1, 128, n, 132) for n in range(1, 20000, 37)]
        assert sizes == sorted(sizes)


def test_decode_policy_splits_long_single_requests():
    pol = kernels.decode_policy(1, 8, 4, 1, 128, 131072, sm_count=132)
    assert pol.splits > 1
    assert kernels.decode_policy(128, 8, 4, 1, 128, 4096, sm_count=132).splits == 1


def test_work_list_heavy_first_and_complete():
    q_lens, kv_lens = [1, 300, 129, 1000], [5, 300, 500, 1000]
    items = work_list(q_lens, kv_lens, "causal", -1, 128)
    expected = {(b, t) for b, n in enumerate(q_lens) for t in range((n + 127) // 128)}
    assert set(items) == expected and len(items) == len(expected)

    def cost(item):
        b, t = item
        sq, sk = q_lens[b], kv_lens[b]
        return min(sk, sk - sq + min(sq, (t + 1) * 128))

    costs = [cost(i) for i in items]
    assert costs == sorted(costs, reverse=True)


@pytest.mark.parametrize("batch,heads,sq,length", list(itertools.product([1, 64, 128], [8, 16, 32, 64, 128], [1, 4],
                                                                            [1, 63, 4097, 131072])))
def test_mla_policy_is_the_decode_policy_of_one_latent_head(batch, heads, sq, length):
    """MLA decode = the decode kernel with Hkv = 1, group = H, 576-wide K, 512-wide V."""
    pol = kernels.decode_policy(batch, 1, heads, sq, kernels.MLA_DIM_QK, length, sm_count=132)
    assert pol.split_o and pol.rows_max == heads * sq and pol.splits * pol.chunk >= length
    assert pol.bn % (16 * pol.warps_n) == 0 and (kernels.MLA_DIM_V // 8 // pol.warps_n) % 2 == 0
    for arch in ("sm_80", "sm_90a"):
        key = kernels.DecodeKey.of("bf16", kernels.MLA_DIM_QK, True, pol, arch)
        assert key.dv == kernels.MLA_DIM_V and key.shared_kv and key.smem <= 227 * 1024
        assert key.arch == (90 if arch == "sm_90a" else 80)  # rows of 16/32: the swapped tile
        assert key.swap == (arch == "sm_90a" and pol.bm < 64)
    ws = kernels.mla_workspace_bytes(batch, heads, sq, length, 132)
    if pol.splits > 1:
        assert ws >= batch * pol.splits * pol.rows_max * (kernels.MLA_DIM_V + 1) * 4


@pytest.mark.parametrize("heads,sq", [(8, 1), (8, 4), (16, 1), (16, 2), (32, 1)])
def test_mla_swapped_tile_key(monkeypatch, heads, sq):
    """Rows of 16/32 on sm_90a: the swapped-operand key (one MMA warpgroup + the producer, BN 64
    so the policy's split chunks stay whole tiles) once selected; never on other archs."""
    pol = kernels.decode_policy(64, 1, heads, sq, kernels.MLA_DIM_QK, 8192, sm_count=132)
    assert pol.bm in (16, 32) and pol.bn == kernels.SWAP_BN and pol.chunk % kernels.SWAP_BN == 0
    monkeypatch.setattr(kernels, "MLA_SWAPPED_TILE", True)
    key = kernels.DecodeKey.of("bf16", kernels.MLA_DIM_QK, False, pol, "sm_90a")
    assert key.swap and key.bm == pol.bm and key.threads == 256 and key.smem <= kernels.smem_limit("sm_90a")
    assert "SwapConfig" in key.source().source and key.name.endswith(f"_swap_cp{kernels.kv_copy_tpr(kernels.MLA_DIM_QK)}")
    assert not kernels.DecodeKey.of("bf16", kernels.MLA_DIM_QK, False, pol, "sm_80").swap
    assert key.stages == 2 and f", {key.stages}, {key.copy_tpr}>" in key.source().source  # two whole tiles
    monkeypatch.setattr(kernels, "MLA_SWAPPED_TILE", False)
    assert not kernels.DecodeKey.of("bf16", kernels.MLA_DIM_QK, False, pol, "sm_90a").swap


@pytest.mark.parametrize("loop", [0, 1, 2])
def test_consumer_loop_switch(monkeypatch, loop):
    """FMHA_LOOP picks the producer ring's consumer loop of the sm_90a prefill-family keys
    (pingpong needs two MMA warpgroups: BM 64 block-sparse tiles stay at loop 1); the
    portable keys have no ring and keep loop 0; every loop is compiled by warmup/CI."""
    import dataclasses

    import torch

    monkeypatch.setattr(kernels, "FMHA_LOOP", loop)
    for d in (128, 256):
        key = kernels.PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a")
        assert key.loop == loop and ("_l%d" % loop in key.name) == (loop > 0)
        assert f", {loop}, {kernels.kv_copy_tpr(d)}>" in key.source().source
        assert kernels.PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80").loop == 0
    assert kernels.BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a").loop == loop
    assert kernels.BlockSparseKey.choose("bf16", 128, False, 128, 64, "sm_90a").loop == min(loop, 1)
    names = {ks.name for ks in kernels.all_keys("sm_90a")}
    for lp in kernels.FMHA_LOOPS:
        base = kernels.PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a")
        assert dataclasses.replace(base, loop=lp).name in names


def test_consumer_loop_default(monkeypatch):
    """FMHA_LOOP None (the default) takes the measured loop: pingpong at D128, the plain loop
    at D256 (whose accumulator leaves the overlapped loops no registers); BM 64 block-sparse
    tiles have one MMA warpgroup and take loop 1; PERSISTENT keeps each key's loop, and warmup
    compiles those persistent kernels."""
    import torch

    monkeypatch.setattr(kernels, "FMHA_LOOP", None)
    assert kernels.fmha_loop(128) == 2 and kernels.fmha_loop(256) == 0
    for paged in (False, True):
        assert kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a", paged=paged).loop == 2
        assert kernels.PrefillKey.choose(torch.bfloat16, 256, "causal", "sm_90a", paged=paged).loop == 0
        assert kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_80", paged=paged).loop == 0
    assert kernels.BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a").loop == 2
    assert kernels.BlockSparseKey.choose("bf16", 128, False, 128, 64, "sm_90a").loop == 1
    assert kernels.BlockSparseKey.choose("bf16", 256, False, 128, 512, "sm_90a").loop == 0
    names = {ks.name for ks in kernels.all_keys("sm_90a")}
    assert kernels.PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a").name in names
    monkeypatch.setattr(kernels, "PERSISTENT", True)
    chosen = [kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a"),
              kernels.PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a", paged=True),
              kernels.PrefillKey.choose(torch.bfloat16, 256, "causal", "sm_90a"),
              kernels.BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a"),
              kernels.BlockSparseKey.choose("bf16", 128, False, 128, 64, "sm_90a")]
    assert [(k.persistent, k.loop) for k in chosen] == [(True, 2), (True, 2), (True, 0), (True, 2), (True, 1)]
    assert {k.name for k in chosen} <= names


@pytest.mark.parametrize("tpr", [4, 8])
def test_producer_copy_switch(monkeypatch, tpr):
    """KV_COPY_TPR picks the producer's threads per K/V row in every producer-ring key
    (prefill, paged prefill, block-sparse, both MLA wgmma tiles) and names it; the portable
    keys and paged decode keep 4; warmup compiles both."""
    import dataclasses

    import torch

    monkeypatch.setattr(kernels, "KV_COPY_TPR", tpr)
    keys = [kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a"),
            kernels.PrefillKey.choose(torch.bfloat16, 256, "dense", "sm_90a", paged=True),
            kernels.BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a")]
    for h in (16, 64):
        pol = kernels.decode_policy(8, 1, h, 1, kernels.MLA_DIM_QK, 8192, sm_count=132)
        keys.append(kernels.DecodeKey.of("bf16", kernels.MLA_DIM_QK, False, pol, "sm_90a"))
    names = {ks.name for ks in kernels.all_keys("sm_90a")}
    for key in keys:
        assert key.copy_tpr == tpr and (f"_cp{tpr}" in key.name) == (tpr != 4), key
        cfg = key.source().source.rsplit("pt::", 2)[-2:]
        assert any(f", {tpr}>" in c for c in cfg), key.name
        assert {dataclasses.replace(key, copy_tpr=t).name for t in kernels.KV_COPY_TPRS} <= names, key.name
    assert kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_80").copy_tpr == 4
    assert kernels.BlockSparseKey.choose("bf16", 128, False, 32, 512, "sm_90a").copy_tpr == 4
    pol = kernels.decode_policy(8, 8, 4, 1, 128, 8192, sm_count=132)
    assert kernels.DecodeKey.of("bf16", 128, False, pol, "sm_90a").copy_tpr == 4
    assert not any("_cp" in n for n in {ks.name for ks in kernels.all_keys("sm_80")})


@pytest.mark.parametrize("persistent", [False, True])
def test_persistent_switch_and_grid(monkeypatch, persistent):
    """PERSISTENT picks the persistent kernels of the sm_90a producer-ring keys (prefill,
    paged prefill, block-sparse; never the variable window, never the portable engine),
    and work_grid then caps the launch at the SMs (or PERSISTENT_CTAS); one CTA per item
    otherwise; both kinds are compiled by warmup/CI."""
    import dataclasses

    import torch

    monkeypatch.setattr(kernels, "PERSISTENT", persistent)
    monkeypatch.setattr(kernels, "FMHA_LOOP", 0)
    for d in (128, 256):
        for paged in (False, True):
            key = kernels.PrefillKey.choose(torch.bfloat16, d, "causal", "sm_90a", paged=paged)
            assert key.persistent == persistent and ("_pk" in key.name) == persistent
            assert key.source().source.rstrip().endswith(f", {str(persistent).lower()}>(p);\n}}")
        assert not kernels.PrefillKey.choose(torch.bfloat16, d, "variable_window", "sm_90a").persistent
        assert not kernels.PrefillKey.choose(torch.bfloat16, d, "causal", "sm_80").persistent
    bsr = kernels.BlockSparseKey.choose("bf16", 128, True, 128, 512, "sm_90a")
    assert bsr.persistent == persistent and bsr.name.endswith("_pk") == persistent
    assert not kernels.BlockSparseKey.choose("bf16", 128, True, 32, 512, "sm_90a").persistent  # mma.sync engine
    names = {ks.name for ks in kernels.all_keys("sm_90a")}
    base = kernels.PrefillKey.choose(torch.bfloat16, 128, "dense", "sm_90a")
    assert {dataclasses.replace(base, persistent=p, loop=0).name for p in (False, True)} <= names
    assert not any("_pk" in n for n in {ks.name for ks in kernels.all_keys("sm_80")})

    monkeypatch.setattr(kernels, "FMHA_LOOP", 1)  # any consumer loop: the key keeps it
    for key in (kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a"),
                kernels.BlockSparseKey.choose("bf16", 128, True, 128, 512, "sm_90a")):
        assert key.persistent == persistent and key.loop == 1
    monkeypatch.setattr(kernels, "FMHA_LOOP", 0)

    assert kernels.work_grid(5000, True, 132) == 132 and kernels.work_grid(40, True, 132) == 40
    assert kernels.work_grid(5000, False, 132) == 5000 and kernels.work_grid(0, True, 132) == 0
    monkeypatch.setattr(kernels, "PERSISTENT_CTAS", 3)
    assert kernels.work_grid(5000, True, 132) == 3 and kernels.work_grid(5000, False, 132) == 5000


def test_device_split_bound_matches_the_host():
    """The in-kernel merge sizes its shared weights by pt::DECODE_MAX_SPLITS (pt_decode.cuh)."""
    import re
    from pathlib import Path

    header = (Path(kernels.__file__).parent / "include" / "pt_decode.cuh").read_text()
    assert int(re.search(r"constexpr int DECODE_MAX_SPLITS = (\d+);", header).group(1)) == kernels.DECODE_MAX_SPLITS


def test_mla_workspace_never_shrinks():
    for batch, heads in ((1, 16), (64, 16), (2, 128)):
        sizes = [kernels.mla_workspace_bytes(batch, heads, 1, n, 132) for n in range(1, 20000, 97)]
        assert sizes == sorted(sizes)
        assert [kernels.mla_workspace_bytes(batch, heads, q, 8192, 132) for q in range(1, 6)] == sorted(
            kernels.mla_workspace_bytes(batch, heads, q, 8192, 132) for q in range(1, 6))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80", "sm_86", "sm_89"])
def test_every_kernel_fits_its_arch_shared_memory(arch):
    """Every key the APIs can launch on `arch` fits that arch's per-block shared memory."""
    limit = kernels.smem_limit(arch)
    keys = []
    for dtype in ("bf16",):
        for d in kernels.DECODE_HEAD_DIMS + (kernels.MLA_DIM_QK,):
            for group, sq in itertools.product([1, 4, 16, 32, 128], [1, 4]):
                if d != kernels.MLA_DIM_QK and group > 32:
                    continue
                pol = kernels.decode_policy(8, 1, group, sq, d, 4096, 132, limit)
                keys.append(kernels.DecodeKey.of(dtype, d, True, pol, arch))
    import torch

    for d in (128, 256):
        for mask in ("dense", "causal", "variable_window"):
            keys.append(kernels.PrefillKey.choose(torch.bfloat16, d, mask, arch))
        for kvb, rows in itertools.product([8, 16, 32, 64, 128], [32, 64, 512]):
            keys.append(kernels.BlockSparseKey.choose("bf16", d, False, kvb, rows, arch))
    too_big = [(k.name, k.smem) for k in keys if k.smem > limit]
    assert not too_big, f"{arch} allows {limit} bytes per block: {too_big}"


def test_smaller_shared_memory_changes_only_the_tile():
    """The H200's choice is the preferred tile; a smaller limit picks a smaller one, same coverage."""
    for d, group in ((128, 4), (256, 8), (kernels.MLA_DIM_QK, 128)):
        big = kernels.decode_policy(4, 1, group, 1, d, 8192, 132)
        small = kernels.decode_policy(4, 1, group, 1, d, 8192, 132, kernels.smem_limit("sm_86"))
        assert small.rows_max == big.rows_max and small.row_tiles * small.bm >= small.rows_max
        assert small.splits * small.chunk >= 8192
        assert kernels.decode_tile_smem(d, small.bm, small.bn, small.stages, small.warps_n, small.split_o) <= \
            kernels.smem_limit("sm_86")


def test_prefill_tile_m_follows_the_device_arch(monkeypatch):
    """Work lists count the q tiles of the kernel that will run: on sm_90a 128 rows at D256
    too (the portable engine's 64 only elsewhere; a CPU plan counts sm_80's)."""
    import torch

    monkeypatch.setattr(kernels, "_device", lambda dev: ("sm_90a", 132, kernels.SM90_SMEM_LIMIT))
    cuda = torch.device("cuda", 0)
    assert kernels.prefill_tile_m(torch.bfloat16, 256, "causal", cuda) == 128
    assert kernels.prefill_tile_m(torch.bfloat16, 256, "causal", torch.device("cpu")) == 64
    assert kernels.prefill_tile_m(torch.bfloat16, 256, "causal") == 64
    monkeypatch.setattr(kernels, "_device", lambda dev: ("sm_86", 84, 101376))
    assert kernels.prefill_tile_m(torch.bfloat16, 256, "causal", cuda) == 64


def test_wrapper_plans_load_the_kernel_their_runs_launch(monkeypatch):
    """SPEC: plan chooses and compiles the kernels. Each wrapper's plan loads (through
    kernels.preload) the very key its runs pick from the same static arguments; here the
    plan's device is made to look like an H200 and preload records instead of loading."""
    import torch

    import prims_ts

    loaded = []
    monkeypatch.setattr(kernels, "_cuda_index", lambda device: 0)
    monkeypatch.setattr(kernels, "_device", lambda dev: ("sm_90a", 132, kernels.SM90_SMEM_LIMIT))
    monkeypatch.setattr(kernels, "preload", lambda device, keys: loaded.extend(keys))
    i32 = dict(dtype=torch.int32)

    w = prims_ts.BatchDecodePagedTSWrapper()
    w.plan(torch.tensor([0, 2, 5], **i32), torch.arange(5, **i32), torch.tensor([3, 16], **i32), 32, 8, 128, 16,
           mask_type="causal", q_data_type=torch.float16)
    assert loaded.pop() == kernels.decode_key(torch.float16, 128, True, 2, 8, 4, 1, 48, 0)[1]

    w = prims_ts.BatchMLADecodePagedTSWrapper(device="cpu")
    w.plan(torch.tensor([100, 3000], **i32), 16, 64, max_seq_len_q=2)
    assert loaded.pop() == kernels.decode_key(torch.bfloat16, 576, True, 2, 1, 16, 2, 3000, 0)[1]

    w = prims_ts.BatchPrefillPagedTSWrapper()
    w.plan(torch.tensor([0, 3, 7], **i32), torch.arange(8, **i32).view(2, 4), torch.tensor([40, 60], **i32),
           num_qo_heads=8, num_kv_heads=2, head_dim=256, page_size=16, mask_type="causal")
    key = loaded.pop()
    assert key == kernels.prefill_key(torch.bfloat16, 256, "causal", 0, paged=True) and key.bm == 128

    w = prims_ts.BatchPrefillTSWrapper(device="cpu")
    w.plan(torch.tensor([0, 3, 7], **i32), torch.tensor([0, 5, 9], **i32), num_qo_heads=8, num_kv_heads=8,
           head_dim=128, mask_type="dense")
    assert loaded.pop() == kernels.prefill_key(torch.bfloat16, 128, "dense", 0)

    w = prims_ts.BlockSparsePagedTSWrapper(device="cpu")
    w.plan(2, 300, 32, 8, 128, 64, 64, 128, 4096, mask_type="causal")
    assert loaded.pop() == kernels.block_sparse_key(torch.bfloat16, 128, True, 128, 64 * 4, 0)
    assert not loaded


def test_a_plan_that_fails_to_load_leaves_the_previous_plan_whole(monkeypatch):
    """The kernel is loaded before a plan changes any state: if loading fails, the wrapper
    keeps its previous plan entirely (no mix of the old checks and the new metadata)."""
    import torch

    import prims_ts

    i32 = dict(dtype=torch.int32)
    w = prims_ts.BatchPrefillPagedTSWrapper()
    w.plan(torch.tensor([0, 3, 7], **i32), torch.arange(8, **i32).view(2, 4), torch.tensor([40, 60], **i32),
           num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16)
    before = dict(vars(w))

    def fail(*a, **k):
        raise RuntimeError("NVRTC failed")

    monkeypatch.setattr(kernels, "warm_prefill", fail)
    with pytest.raises(RuntimeError, match="NVRTC"):
        w.plan(torch.tensor([0, 5, 12], **i32), torch.arange(8, **i32).view(2, 4), torch.tensor([100, 120], **i32),
               num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=32)
    assert vars(w).keys() == before.keys() and all(vars(w)[k] is before[k] for k in before)


def test_producer_copy_default_and_flip(monkeypatch):
    """KV_COPY_TPR None (the default) takes the measured copy per K row width: 4 threads a
    row at D128, 8 at D256 and for MLA's 576-wide rows; KV_COPY_FLIP takes the other one in
    every producer-ring key, and warmup compiles both."""
    import torch

    monkeypatch.setattr(kernels, "KV_COPY_TPR", None)

    def chosen():
        keys = {"d128": kernels.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a"),
                "d128_paged": kernels.PrefillKey.choose(torch.float16, 128, "dense", "sm_90a", paged=True),
                "d256": kernels.PrefillKey.choose(torch.bfloat16, 256, "dense", "sm_90a"),
                "bsr_d128": kernels.BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a"),
                "bsr_d256": kernels.BlockSparseKey.choose("bf16", 256, True, 64, 512, "sm_90a")}
        for h in (16, 64):
            pol = kernels.decode_policy(8, 1, h, 1, kernels.MLA_DIM_QK, 8192, sm_count=132)
            keys[f"mla_h{h}"] = kernels.DecodeKey.of("bf16", kernels.MLA_DIM_QK, False, pol, "sm_90a")
        return {k: v.copy_tpr for k, v in keys.items()}

    want = {"d128": 4, "d128_paged": 4, "d256": 8, "bsr_d128": 4, "bsr_d256": 8, "mla_h16": 8, "mla_h64": 8}
    assert chosen() == want
    monkeypatch.setattr(kernels, "KV_COPY_FLIP", True)
    assert chosen() == {k: 12 - v for k, v in want.items()}
    monkeypatch.setattr(kernels, "KV_COPY_TPR", 8)  # forced, then flipped: 4 everywhere
    assert set(chosen().values()) == {4}


def test_no_kernel_the_library_compiles_defines_the_probe():
    """PT_PROBE (pt_fmha.cuh) is a measurement aid whose kernels compute wrong results
    (kernels.PREFILL_PROBE, set by gpu_session.sh `probe`): no key's source defines it, and
    the header's default is off."""
    from prims_ts.cuda import runtime

    for arch in ("sm_90a", "sm_80"):
        assert not [ks.name for ks in kernels.all_keys(arch) if "PT_PROBE" in ks.source]
    assert "#define PT_PROBE 0" in runtime.include_sources()["pt_fmha.cuh"]
