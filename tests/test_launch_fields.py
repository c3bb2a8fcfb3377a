"""The launch fields a prepared decode-shaped launch (decode, MLA, block-sparse) writes: the
strides and addresses ``write_rows`` puts into the parameter struct for every pool layout,
and the argument names its errors carry; and ``Accepted``, the memo that lets a plan's run
skip its checks: which operands match the recorded layouts, and which addresses it refuses
(misaligned starts, an output overlapping an operand or the plan's own tensors). Runs on CPU
tensors: the struct is plain ctypes."""

import pytest
import torch

from prims_ts.cuda.decode import DecodeParams, write_rows

BF16 = torch.bfloat16
ES = 2  # bf16 element size


def _fields(p, names):
    return tuple(getattr(p, n) for n in names)


KSTR = ("k_sp", "k_sh", "k_ss")
VSTR = ("v_sp", "v_sh", "v_ss")
QSTR = ("q_sb", "q_st", "q_sh")
OSTR = ("o_sb", "o_st", "o_sh")


def test_separate_pools_and_batched_query():
    q = torch.randn(3, 8, 64, dtype=BF16)
    k = torch.randn(5, 2, 16, 64, dtype=BF16)
    v = torch.randn(5, 2, 16, 64, dtype=BF16)
    o = torch.empty(3, 8, 64, dtype=BF16)
    p = DecodeParams()
    s = write_rows(p, None, q, k, v, o, False)
    assert s == (q.stride(), k.stride(), v.stride(), o.stride())
    assert _fields(p, QSTR) == (8 * 64, 0, 64)
    assert _fields(p, OSTR) == (8 * 64, 0, 64)
    assert _fields(p, KSTR) == (2 * 16 * 64, 16 * 64, 64)
    assert _fields(p, VSTR) == (2 * 16 * 64, 16 * 64, 64)
    assert (p.q, p.k, p.v, p.o) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())


def test_combined_cache_points_v_at_the_second_half():
    kv = torch.randn(4, 2, 2, 16, 128, dtype=BF16)
    q = torch.randn(2, 3, 4, 128, dtype=BF16)  # [B, SQ, Hq, D]
    o = torch.empty_like(q)
    p = DecodeParams()
    write_rows(p, None, q, kv, None, o, False)
    st = kv.stride()
    assert _fields(p, KSTR) == (st[0], st[2], st[3])
    assert _fields(p, VSTR) == (st[0], st[2], st[3])
    assert p.k == kv.data_ptr() and p.v == kv.data_ptr() + st[1] * ES
    assert p.v == kv[:, 1].data_ptr()
    assert _fields(p, QSTR) == q.stride()[:3]


@pytest.mark.parametrize("shape", [(6, 1, 32, 576), (6, 32, 576)])
def test_latent_pool_is_both_k_and_v(shape):
    pool = torch.randn(*shape, dtype=BF16)
    q = torch.randn(2, 16, 576, dtype=BF16)
    o = torch.empty(2, 16, 512, dtype=BF16)
    p = DecodeParams()
    write_rows(p, None, q, pool, None, o, False)
    st = pool.stride()
    want = (st[0], st[1], st[2]) if len(shape) == 4 else (st[0], 0, st[1])
    assert _fields(p, KSTR) == want and _fields(p, VSTR) == want
    assert p.k == p.v == pool.data_ptr()
    assert _fields(p, OSTR) == (16 * 512, 0, 512)


def test_packed_query_and_strided_views():
    big = torch.randn(10, 12, 64, dtype=BF16)
    q = big[:, 2:10]  # packed [T, Hq, D] with a head stride of 64 and token stride 768
    o = torch.empty(10, 8, 64, dtype=BF16)
    kpool = torch.randn(3, 2, 16, 2, 64, dtype=BF16)
    k, v = kpool[:, :, :, 0], kpool[:, :, :, 1]  # slot stride 128
    p = DecodeParams()
    write_rows(p, None, q, k, v, o, True)
    assert _fields(p, QSTR) == (0, 12 * 64, 64)
    assert _fields(p, OSTR) == (0, 8 * 64, 64)
    assert _fields(p, KSTR) == (2 * 16 * 2 * 64, 16 * 2 * 64, 128)
    assert p.v - p.k == 64 * ES


def test_addresses_follow_each_call_strides_only_on_change():
    q = torch.randn(2, 4, 64, dtype=BF16)
    o = torch.empty_like(q)
    kv = torch.randn(3, 2, 1, 16, 64, dtype=BF16)
    p = DecodeParams()
    s = write_rows(p, None, q, kv, None, o, False)
    p.k_sp = -1  # a stale field survives a call with the same strides ...
    q2, o2, kv2 = q.clone(), o.clone(), kv.clone()
    assert write_rows(p, s, q2, kv2, None, o2, False) == s
    assert p.k_sp == -1
    assert (p.q, p.k, p.o) == (q2.data_ptr(), kv2.data_ptr(), o2.data_ptr())
    write_rows(p, None, q2, kv2, None, o2, False)  # ... and is rewritten when they differ
    assert p.k_sp == kv.stride(0)


def test_errors_name_the_callers_arguments():
    q = torch.randn(2, 4, 64, dtype=BF16)
    o = torch.empty_like(q)
    kv = torch.randn(3, 2, 1, 16, 64, dtype=BF16)
    p = DecodeParams()
    with pytest.raises(ValueError, match="paged_kv_cache"):
        write_rows(p, None, q, kv[..., ::2], None, o, False, ("q", "paged_kv_cache"))
    with pytest.raises(ValueError, match="^q"):
        write_rows(p, None, q[..., 1:], kv[..., 1:], None, o, False, ("q", "paged_kv_cache"))
    k, v = kv[:, 0], kv[:, 1]
    with pytest.raises(ValueError, match="v_cache"):
        write_rows(p, None, q, k, v.transpose(-1, -2), o, False)
    flat = torch.randn(3 * 2 * 16 * 64 + 1, dtype=BF16)
    shifted = flat[1:].view(3, 2, 16, 64)
    with pytest.raises(ValueError, match="k_cache"):
        write_rows(p, None, q, shifted, v, o, False)


# ----------------------------------------------------------------------------
# Accepted: what lets a plan's run skip its checks (cuda.keys)
# ----------------------------------------------------------------------------

from prims_ts.cuda.keys import Accepted  # noqa: E402


def _ops():
    q = torch.randn(2, 8, 4, 64, dtype=BF16)
    k = torch.randn(2, 8, 1, 64, dtype=BF16)
    out = torch.empty_like(q)
    ids = torch.arange(5, dtype=torch.int32)
    return [q, k, None, out, ids]


def test_accepted_matches_only_the_recorded_layouts():
    ops = _ops()
    acc = Accepted(4, loose=(4,))
    assert not acc.same(ops)  # nothing recorded yet
    acc.record(ops)
    assert acc.same(ops)
    fresh = [None if t is None else t.clone() for t in ops]
    assert acc.same(fresh)  # other tensors, the same layouts
    fresh[4] = torch.arange(9, dtype=torch.int32)  # a loose operand: any length
    assert acc.same(fresh)
    for i, other in [(0, ops[0][:, :4]), (0, ops[0].transpose(1, 2).contiguous().transpose(1, 2)),
                     (0, ops[0].half()), (1, ops[1].expand(2, 8, 1, 64).clone()[..., :32]),
                     (2, torch.empty(1)), (4, ops[4].long()), (4, torch.arange(10, dtype=torch.int32)[::2]),
                     (0, torch.nn.Parameter(ops[0]))]:
        bad = list(ops)
        bad[i] = other
        assert not acc.same(bad), i


@pytest.fixture(params=["guard", "metas"])
def layouts_mode(request, monkeypatch):
    """Layouts with dynamo's C-level guard (where this torch has it) and without (the metas alone)."""
    from prims_ts.ops import _validate as V

    if request.param == "metas":
        monkeypatch.setattr(V, "_TensorGuards", None)
    elif V._TensorGuards is None:
        pytest.skip("this torch has no TensorGuards")
    return request.param


def test_layouts_match_exactly_the_metas(layouts_mode):
    """``Layouts.matches`` accepts exactly the operands whose metas equal the recorded ones (None
    where None was; any length at a loose position, but a unit stride), with and without the guard."""
    from prims_ts.ops import _validate as V

    ops = _ops()
    lay = V.Layouts.of(ops, loose=(4,))
    assert (lay.guard is not None) == (layouts_mode == "guard")
    assert lay.key == tuple(V.meta_loose(t) if i == 4 else V.meta(t) for i, t in enumerate(ops))
    fresh = [None if t is None else t.clone() for t in ops]
    assert lay.matches(ops) and lay.matches(fresh)
    fresh[4] = torch.arange(11, dtype=torch.int32)
    assert lay.matches(fresh)
    for i, other in [(0, ops[0][:, :4]), (0, ops[0].transpose(1, 2).contiguous().transpose(1, 2)),
                     (0, ops[0].half()), (3, None), (2, torch.empty(1)), (4, ops[4].long()),
                     (4, torch.arange(10, dtype=torch.int32)[::2]), (4, ops[4].view(1, 5)), (1, "k"),
                     (0, torch.nn.Parameter(ops[0]))]:
        bad = list(ops)
        bad[i] = other
        assert not lay.matches(bad), i
        assert V.Layouts.of(bad, loose=(4,)) is None or lay.key != V.Layouts.of(bad, loose=(4,)).key, i
    assert V.Layouts.of([ops[0], torch.nn.Parameter(ops[1])]) is None  # only plain tensors are recorded
    none_loose = V.Layouts.of([ops[0], None], loose=(1,))  # None at a loose position
    assert none_loose.matches([ops[0].clone(), None]) and not none_loose.matches([ops[0], ops[4]])


def test_layouts_follow_a_mode_change(layouts_mode):
    """Operands recorded outside ``inference_mode`` still match inside it (their dispatch keys
    differ there: the guard refuses, the metas accept and the guard is recorded again), and
    then match again outside."""
    from prims_ts.ops import _validate as V

    ops = _ops()
    lay = V.Layouts.of(ops, loose=(4,))
    with torch.inference_mode():
        assert lay.matches(ops)
        if layouts_mode == "guard":
            present = [t for t in ops if t is not None]
            assert lay.guard.check(*present)  # recorded for this mode
    assert lay.matches(ops)
    ops[0].requires_grad_(True)
    assert lay.matches(ops)


def test_accepted_addresses_refuse_misalignment_and_overlap():
    ops = _ops()
    fixed_t = torch.empty(16, dtype=torch.int32)
    acc = Accepted(4, fixed=[(fixed_t.data_ptr(), fixed_t.data_ptr() + fixed_t.nbytes)], loose=(4,))
    acc.record(ops)
    ptrs = acc.addresses(ops, 3)
    assert ptrs == tuple(0 if t is None else t.data_ptr() for t in ops)
    # the output overlapping an input, a loose operand or the plan's own tensor: refused
    bad = list(ops)
    bad[3] = ops[0]  # out = q
    assert acc.addresses(bad, 3) is None
    big = torch.empty(ops[3].numel() + 64, dtype=BF16)
    bad = list(ops)
    bad[3] = big[:ops[3].numel()].view(ops[3].shape)
    n = ops[3].numel()
    bad[4] = big[n - 16:n].view(torch.int32)  # the loose operand inside out's last bytes
    assert acc.addresses(bad, 3) is None
    bad[4] = ops[4]
    assert acc.addresses(bad, 3) is not None
    out_on_fixed = torch.empty(ops[3].numel() + 8, dtype=BF16)
    acc2 = Accepted(4, fixed=[(out_on_fixed.data_ptr() + 2, out_on_fixed.data_ptr() + 6)])
    acc2.record(ops)
    bad = list(ops)
    bad[3] = out_on_fixed[:ops[3].numel()].view(ops[3].shape)
    assert acc2.addresses(bad, 3) is None
    # a misaligned start among the first `aligned` operands: refused; past them: allowed
    bad = list(ops)
    bad[3] = out_on_fixed[1:1 + ops[3].numel()].view(ops[3].shape)
    assert acc.addresses(bad, 3) is None
    odd = torch.arange(7, dtype=torch.int32)[1:6]
    bad = list(ops)
    bad[4] = odd
    assert acc.addresses(bad, 3) is not None


def test_accepted_memo_of_passed_addresses_sees_a_loose_operand_grow():
    """A run whose addresses (and loose lengths) are the last passing run's passes at once; a loose
    operand at the same start but longer, now reaching into the output, is checked and refused."""
    ops = _ops()
    big = torch.empty(64 + ops[3].numel(), dtype=BF16)
    ops[3] = big[64:].view(ops[3].shape)  # out after 128 bytes of room
    room = big[:64].view(torch.int32)  # 32 int32 slots before out
    ops[4] = room[:8]
    acc = Accepted(4, loose=(4,))
    acc.record(ops)
    assert acc.addresses(ops, 3) is not None
    assert acc.passed is not None
    assert acc.addresses(ops, 3) is not None  # the memo
    grown = list(ops)
    grown[4] = big[:96].view(torch.int32)  # the same start, 64 bytes into out
    assert acc.addresses(grown, 3) is None
    assert acc.addresses(ops, 3) is not None
    acc.record(ops)  # a full run: its extents anew, the memo forgotten
    assert acc.passed is None


# ----------------------------------------------------------------------------
# PreparedDecode.rerun: a standalone's later calls write only addresses and scales
# ----------------------------------------------------------------------------


def _stub_prepared(monkeypatch):
    """PreparedDecode on CPU tensors: no kernel is loaded or launched (the struct is plain ctypes)."""
    import types

    from prims_ts.cuda import decode as KD
    from prims_ts.cuda import runtime

    monkeypatch.setattr(KD, "device_info", lambda dev: ("sm_90a", 132, 232448))
    monkeypatch.setattr(KD, "load", lambda dev, key: runtime.LoadedKernel(1, key.smem, key.threads, 0))
    # cuLaunchKernelEx (never called: `launch` is stubbed) so that clusters may be planned; no occupancy query
    monkeypatch.setattr(runtime, "_libcuda", lambda: types.SimpleNamespace(cuLaunchKernelEx=lambda *a: 0,
                                                                           cuLaunchKernel=None,
                                                                           cuOccupancyMaxActiveClusters=None))
    monkeypatch.setattr(runtime, "reserve_smem", lambda kernel, smem, name: None)  # a plan's cluster queries
    launched = []
    monkeypatch.setattr(runtime.PreparedLaunch, "launch", lambda self, stream: launched.append(bytes(self.params)))
    monkeypatch.setattr(runtime, "current_stream", lambda dev: 0)
    return KD, launched


def _addr(t):
    return 0 if t is None else t.data_ptr()


@pytest.mark.parametrize("form", ["combined", "separate", "latent"])
@pytest.mark.parametrize("max_len", [64, 8192])  # one split, several (the workspace pointers)
def test_rerun_writes_what_a_full_run_writes(form, max_len, monkeypatch):
    KD, launched = _stub_prepared(monkeypatch)
    from prims_ts.cuda.keys import DEFAULT_TUNING

    b, ps = 2, 16
    if form == "latent":
        hq, hkv, d, dv = 16, 1, 576, 512
    else:
        hq, hkv, d, dv = 8, 2, 128, 128
    static = KD.DecodeStatic(BF16, d, hq, hkv, ps, False, -1, BF16, b, 1, 1, max_len, False, DEFAULT_TUNING)

    def operands():
        q = torch.randn(b, hq, d, dtype=BF16)
        o = torch.empty(b, hq, dv, dtype=BF16)
        ws = torch.empty(1 << 22, dtype=torch.uint8)
        if form == "combined":
            k, v = torch.randn(6, 2, hkv, ps, d, dtype=BF16), None
        elif form == "separate":
            k, v = torch.randn(6, hkv, ps, d, dtype=BF16), torch.randn(6, hkv, ps, d, dtype=BF16)
        else:
            k, v = torch.randn(6, ps, d, dtype=BF16), None
        ip = torch.tensor([0, 3, 6], dtype=torch.int32)
        ids = torch.arange(6, dtype=torch.int32)
        lens = torch.tensor([40, 48], dtype=torch.int32)
        return q, k, v, ws, o, ip, ids, lens

    first, second = operands(), operands()
    a = KD.PreparedDecode(static, 0).for_plan(None)
    q, k, v, ws, o, ip, ids, lens = first
    a.run(q, k, v, ws, o, ip, ids, lens, None, 0.125, 1.0)
    q, k, v, ws, o, ip, ids, lens = second
    assert a.rerun(_addr(q), _addr(k), _addr(v), _addr(ws), 0, _addr(ip), _addr(ids), _addr(lens), _addr(o),
                   0.25, 0.5)
    fresh = KD.PreparedDecode(static, 0).for_plan(None)
    fresh.run(q, k, v, ws, o, ip, ids, lens, None, 0.25, 0.5)
    assert launched[1] == launched[2]  # the rerun's struct is the full run's, byte for byte
    assert launched[0] != launched[1]
    # a misaligned start: refused, nothing launched (the full run names it)
    assert not a.rerun(_addr(q) + 2, _addr(k), _addr(v), _addr(ws), 0, _addr(ip), _addr(ids), _addr(lens),
                       _addr(o), 0.25, 0.5)
    assert len(launched) == 3


@pytest.mark.parametrize("form", ["combined", "separate", "latent"])
def test_standalone_relaunch_writes_what_a_full_run_writes(form, monkeypatch):
    """A standalone's second call under its key relaunches (``rerun``, its addresses picked from
    the call's operands by ``Standalone.roles``): the struct it launches is the one a full run of
    the same call writes, byte for byte (an operand in the wrong role fails here)."""
    KD, launched = _stub_prepared(monkeypatch)
    import prims_ts
    from prims_ts.ops import _dispatch
    from prims_ts.ops import _validate as V
    from prims_ts.ops import decode as D
    from prims_ts.ops import mla as M

    monkeypatch.setattr(_dispatch, "launchable", lambda query, out, traced=None: True)
    b, ps, pages = 2, 16, 6
    site = M if form == "latent" else D

    def operands():
        ws = torch.empty(1 << 22, dtype=torch.uint8)
        lens = torch.tensor([40, 48], dtype=torch.int32)
        if form == "latent":
            return (torch.randn(b, 1, 16, 576, dtype=BF16), torch.randn(pages, ps, 576, dtype=BF16), ws,
                    torch.randperm(pages).to(torch.int32).view(b, 3), lens, torch.empty(b, 1, 16, 512, dtype=BF16))
        if form == "combined":
            cache = torch.randn(pages, 2, 2, ps, 128, dtype=BF16)
        else:
            cache = (torch.randn(pages, 2, ps, 128, dtype=BF16), torch.randn(pages, 2, ps, 128, dtype=BF16))
        ip = torch.tensor([0, 3, 6], dtype=torch.int32)
        return (torch.randn(b, 8, 128, dtype=BF16), cache, ws, ip, torch.randperm(pages).to(torch.int32), lens,
                torch.empty(b, 8, 128, dtype=BF16))

    def call(ops, scale):
        if form == "latent":
            q, cache, ws, table, lens, o = ops
            prims_ts.prims_ts_batch_decode_with_kv_cache_mla(q, cache, ws, 512, 64, table, lens, 64, bmm1_scale=scale,
                                                             bmm2_scale=0.5, out=o)
        else:
            q, cache, ws, ip, ids, lens, o = ops
            prims_ts.prims_ts_batch_decode_with_kv_cache(q, cache, ws, ip, ids, lens, 64, bmm1_scale=scale,
                                                         bmm2_scale=0.5, out=o)

    monkeypatch.setattr(site, "_CHECKED", V.memo())
    first, second = operands(), operands()
    call(first, 0.125)  # the key's first call: a full run
    call(second, 0.25)  # under the same key: a relaunch with the second call's addresses
    monkeypatch.setattr(site, "_CHECKED", V.memo())
    call(second, 0.25)  # a new memo: a full run of the same call
    assert len(launched) == 3
    assert launched[1] == launched[2]
    assert launched[0] != launched[1]


# ----------------------------------------------------------------------------
# The parameter structs: each ctypes mirror field for field against its C++ struct
# ----------------------------------------------------------------------------


def test_parameter_mirrors_match_the_kernels_structs(tmp_path, monkeypatch):
    """Every parameter struct a launch writes through ctypes (DecodeParams, DecodeTmaParams,
    PrefillParams, PrefillTmaParams, BlockSparseParams, BlockSparseTmaParams) has the size of the
    C++ struct its kernel reads (a field added on one side only, where the tail padding does not
    hide it): NVRTC compiles each kernel source's declarations (the entry cut off) with a
    static_assert a struct. (NVRTC has no constant offsetof: the order of the fields is the GPU
    launch tests' to check.)"""
    import ctypes

    from prims_ts.cuda import block_sparse as BS
    from prims_ts.cuda import decode as KD
    from prims_ts.cuda import prefill as PF
    from prims_ts.cuda import runtime

    monkeypatch.setenv("PRIMS_TS_CACHE_DIR", str(tmp_path))
    pol = KD.decode_policy(1, 1, 4, 1, 128, 1, 132)
    sources = {
        "decode": (KD.DecodeKey.of("bf16", 128, False, pol, "sm_90a").source(),
                   [(KD.DecodeParams, "pt::DecodeParams"), (KD.DecodeTmaParams, "pt::DecodeTmaParams")]),
        "prefill": (PF.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a").source(),
                    [(PF.PrefillParams, "pt::PrefillParams"), (PF.PrefillTmaParams, "pt::PrefillTmaParams")]),
        "block_sparse": (BS.BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a").source(),
                         [(BS.BlockSparseParams, "pt::BlockSparseParams"),
                          (BS.BlockSparseTmaParams, "pt::BlockSparseTmaParams")]),
    }
    for name, (ks, mirrors) in sources.items():
        body = ks.source[:ks.source.rindex('extern "C"')]
        checks = [f'static_assert(sizeof({cname}) == {ctypes.sizeof(cls)}, "sizeof({cname})");' for cls, cname in mirrors]
        src = runtime.KernelSource(f"layout:{name}", f"layout_{name}", body + "\n".join(checks) + "\n")
        runtime.compile_cubin(src, "sm_90a", use_cache=False)  # a failed static_assert names the struct


# ----------------------------------------------------------------------------
# Prefill: the TMA keys' parameter layout and choice
# ----------------------------------------------------------------------------


def test_prefill_tma_params_mirror_the_kernels_layout():
    """pt::PrefillTmaParams: two 64-byte aligned tensor maps, then the PrefillParams, the struct a
    multiple of 64 bytes: the mirror's maps at 0 and 128, the parameters at 256, the size padded;
    a write through the inner struct lands in the outer one's bytes."""
    import ctypes

    from prims_ts.cuda.prefill import PrefillParams, PrefillTmaParams

    assert PrefillTmaParams.tmap_k.offset == 0 and PrefillTmaParams.tmap_v.offset == 128
    assert PrefillTmaParams.p.offset == 256
    size = ctypes.sizeof(PrefillTmaParams)
    assert size % 64 == 0 and size - (256 + ctypes.sizeof(PrefillParams)) < 64
    tp = PrefillTmaParams()
    tp.p.batch = 7
    copy = PrefillTmaParams.from_buffer_copy(tp)
    assert copy.p.batch == 7


@pytest.mark.parametrize("mask", ["dense", "causal", "variable_window"])
def test_prefill_tma_keys_follow_the_tuning(mask):
    from prims_ts import Tuning
    from prims_ts.cuda.prefill import PrefillKey

    tma = Tuning(tma=True)
    assert PrefillKey.choose(BF16, 128, mask, "sm_90a", tuning=tma).tma
    assert PrefillKey.choose(BF16, 256, mask, "sm_90a", tuning=tma).name.endswith("_tma_lz_up")
    assert PrefillKey.choose(BF16, 128, mask, "sm_90a").tma  # the default
    for kw in (dict(packed=True), dict(paged=True, tuning=Tuning(paged_tma=False)),
               dict(tuning=Tuning(tma=True, probe=1)),
               dict(tuning=Tuning(tma=False))):
        kw.setdefault("tuning", tma)
        assert not PrefillKey.choose(BF16, 128, mask, "sm_90a", **kw).tma, kw
    # persistent CTAs take TMA boxes too (the variable window has no persistent keys)
    key = PrefillKey.choose(BF16, 128, mask, "sm_90a", tuning=Tuning(tma=True, persistent=True))
    assert key.tma and key.persistent == (mask != "variable_window")
    assert not PrefillKey.choose(BF16, 128, mask, "sm_80", tuning=tma).tma
    assert Tuning.decode(tma.encode()) == tma


@pytest.mark.parametrize("mask", ["dense", "causal", "variable_window"])
def test_prefill_key_tile_per_head_dim(mask):
    """BN of the sm_90a keys: contiguous K/V in TMA boxes takes TMA_BN (80 keys at D256 where two
    stages fit beside the 64 KB Q tile: not with a variable window's extra bytes), pages and
    packed K/V keep 64 at D256; Tuning.prefill_bn overrides the TMA keys only, where it fits."""
    from prims_ts import Tuning
    from prims_ts.cuda.keys import SM90_SMEM_LIMIT
    from prims_ts.cuda.prefill import PrefillKey

    wide = 64 if mask == "variable_window" else 80
    assert PrefillKey.choose(BF16, 256, mask, "sm_90a").bn == wide
    assert PrefillKey.choose(BF16, 128, mask, "sm_90a").bn == 128
    for kw in (dict(packed=True), dict(paged=True), dict(tuning=Tuning(tma=False))):
        if "paged" in kw and mask == "variable_window":
            continue
        assert PrefillKey.choose(BF16, 256, mask, "sm_90a", **kw).bn == 64, kw
        assert PrefillKey.choose(BF16, 128, mask, "sm_90a", **kw).bn == 128, kw
    narrow = Tuning(prefill_bn=64)
    assert PrefillKey.choose(BF16, 256, mask, "sm_90a", tuning=narrow).bn == 64
    assert PrefillKey.choose(BF16, 128, mask, "sm_90a", tuning=narrow).bn == 64
    assert PrefillKey.choose(BF16, 128, mask, "sm_90a", tuning=Tuning(prefill_bn=80)).bn == 80
    assert PrefillKey.choose(BF16, 256, mask, "sm_90a", tuning=Tuning(prefill_bn=128)).bn == 64  # no 2 stages
    for d in (128, 256):
        key = PrefillKey.choose(BF16, d, mask, "sm_90a")
        assert key.smem <= SM90_SMEM_LIMIT and key.stages >= 2
    with pytest.raises(ValueError, match="prefill_bn"):
        Tuning(prefill_bn=96)
    assert Tuning.decode(Tuning(prefill_bn=80).encode()) == Tuning(prefill_bn=80)


def test_tensor_maps_are_encoded_aligned_and_copied(monkeypatch):
    """The driver writes a tensor map only at a 64-byte (newer drivers: 128) aligned address, which
    a ctypes struct is not: the encoder hands it an aligned scratch map and copies the bytes into
    the parameters. A fake cuTensorMapEncodeTiled records what it is given."""
    import ctypes

    from prims_ts.cuda import runtime
    from prims_ts.cuda.prefill import PrefillTmaParams

    seen = []

    def fake(out, dtype, rank, address, dims, strides, box, elem, interleave, swizzle, l2, oob):
        seen.append((out.value, dtype.value, rank.value, address.value, list(dims), list(strides), list(box),
                     swizzle.value, oob.value))
        ctypes.memmove(out.value, bytes(range(128)), 128)
        return 0

    class FakeLib:
        cuTensorMapEncodeTiled = staticmethod(fake)

    monkeypatch.setattr(runtime, "_libcuda", lambda: FakeLib())
    enc = runtime.TileMapEncoder("bf16", (128, 2, 300, 3), (256, 512, 153600), (64, 1, 128, 1), "k")
    tp = PrefillTmaParams()
    enc.encode(tp.tmap_v, 0x7000)
    out, dtype, rank, address, dims, strides, box, swizzle, oob = seen[0]
    assert out % 128 == 0 and address == 0x7000 and (dtype, rank, swizzle, oob) == (9, 4, 3, 0)
    assert dims == [128, 2, 300, 3] and strides == [256, 512, 153600] and box == [64, 1, 128, 1]
    assert bytes(tp.tmap_v) == bytes(range(128)) and bytes(tp.tmap_k) == bytes(128)


@pytest.mark.parametrize("mask", ["dense", "causal"])
def test_paged_tma_keys_and_pool_maps(mask, monkeypatch):
    """The sm_90a paged prefill keys take TMA pages by default (Tuning.paged_tma; persistent CTAs
    too), never under False or on sm_80; a pool [P, Hkv, page_size, D] is mapped as (D, page_size,
    Hkv, P) in boxes of (64, min(page_size, BN), 1, 1) over its strides in bytes (a combined
    cache's K and V views included)."""
    from prims_ts import Tuning
    from prims_ts.cuda import prefill as K

    t = Tuning()
    for d, bn in ((128, 128), (256, 64)):
        key = K.PrefillKey.choose(BF16, d, mask, "sm_90a", paged=True)
        assert key.tma and key.paged and key.bn == bn and "_tma" in key.name
        assert not K.PrefillKey.choose(BF16, d, mask, "sm_90a", paged=True, tuning=Tuning(paged_tma=False)).tma
    assert K.PrefillKey.choose(BF16, 128, mask, "sm_90a", paged=True, tuning=Tuning(persistent=True)).tma
    assert not K.PrefillKey.choose(BF16, 128, mask, "sm_80", paged=True).tma
    assert K.PrefillKey.choose(BF16, 128, mask, "sm_90a", tuning=Tuning(tma=False)).tma is False
    assert Tuning.decode(Tuning(paged_tma=False).encode()) == Tuning(paged_tma=False)

    made = []

    class FakeEncoder:
        def __init__(self, dtype, dims, strides, box, what):
            made.append((dtype, dims, strides, box, what))

    monkeypatch.setattr(K.runtime, "TileMapEncoder", FakeEncoder)
    for ps in (16, 128):
        cache = torch.zeros(9, 2, 4, ps, 128, dtype=BF16)  # combined [P, 2, Hkv, ps, D]
        pl = object.__new__(K.PreparedPrefill)
        pl.key = K.PrefillKey.choose(BF16, 128, mask, "sm_90a", paged=True, tuning=t)
        made.clear()
        pl._set_maps(cache[:, 0], cache[:, 1], True, min(ps, pl.key.bn))
        es = 2
        for (dtype, dims, strides, box, what), name in zip(made, ("k", "v")):
            assert (dtype, what) == ("bf16", name)
            assert dims == (128, ps, 4, 9) and box == (64, min(ps, 128), 1, 1)
            assert strides == [128 * es, ps * 128 * es, 2 * 4 * ps * 128 * es]
        # Tuning.page_major_v: V's map takes the panel as a dimension of its own (128 bytes apart),
        # a box a page of every panel; K's is as above
        made.clear()
        pl._set_maps(cache[:, 0], cache[:, 1], True, min(ps, pl.key.bn), v_page_major=True)
        (_, kdims, _, kbox, _), (_, vdims, vstrides, vbox, vname) = made
        assert kdims == (128, ps, 4, 9) and kbox == (64, min(ps, 128), 1, 1) and vname == "v"
        assert vdims == (64, ps, 2, 4, 9) and vbox == (64, min(ps, 128), 2, 1, 1)
        assert vstrides == [128 * es, 64 * es, ps * 128 * es, 2 * 4 * ps * 128 * es]


@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_tma_keys_and_maps(causal, monkeypatch):
    """sm_90a block-sparse keys of whole key tiles (blocks of 64+) take TMA boxes: contiguous K/V
    under Tuning.tma, pages under Tuning.paged_tma (both the default; persistent CTAs too), not
    sm_80. A plan maps contiguous K/V [B, Skv, Hkv, D] as (D, Hkv, Skv, B) in (64, 1, BN, 1)
    boxes, a combined cache's halves as pools, and sets them again when the pool's page count
    changes."""
    import ctypes

    from prims_ts import Tuning
    from prims_ts.cuda import block_sparse as K

    choose = K.BlockSparseKey.choose
    for kvb, d, bn in ((64, 128, 64), (128, 128, 128), (128, 256, 64)):
        for ct in (True, False):
            key = choose("bf16", d, causal, kvb, 512, "sm_90a", Tuning(), ct)
            assert key.tma and key.contiguous == ct and key.bn == bn and key.PARAMS == "BlockSparseTmaParams"
        assert not choose("bf16", d, causal, kvb, 512, "sm_90a", Tuning(tma=False), True).tma
        assert choose("bf16", d, causal, kvb, 512, "sm_90a", Tuning(tma=False), False).tma
        assert not choose("bf16", d, causal, kvb, 512, "sm_90a", Tuning(paged_tma=False), False).tma
    assert choose("bf16", 128, causal, 128, 512, "sm_90a", Tuning(persistent=True), True).tma
    assert not choose("bf16", 128, causal, 32, 512, "sm_90a", Tuning(), True).tma
    assert not choose("bf16", 128, causal, 128, 512, "sm_80", Tuning(), True).tma
    size = ctypes.sizeof(K.BlockSparseTmaParams)
    assert size % 64 == 0 and 0 <= size - (256 + ctypes.sizeof(K.BlockSparseParams)) < 64
    assert K.BlockSparseTmaParams.bp.offset == 256

    made = []

    class FakeEncoder:
        def __init__(self, dtype, dims, strides, box, what):
            made.append((dtype, dims, strides, box, what))

        def encode(self, out, address):
            pass

    monkeypatch.setattr(K.runtime, "TileMapEncoder", FakeEncoder)
    pl = object.__new__(K.PreparedBlockSparse)
    pl.key = choose("bf16", 128, causal, 128, 512, "sm_90a", Tuning(), True)
    pl.static = K.BlockSparseStatic(BF16, 128, 8, 2, 0, 3, 256, 128, 128, 0, causal, BF16, contiguous=True,
                                    seq_len_kv=300)
    pl._maps = None
    k, v = torch.zeros(3, 300, 2, 128, dtype=BF16), torch.zeros(3, 300, 2, 128, dtype=BF16)
    pl._tma_views(k, v)
    assert [m[1:4] for m in made] == [((128, 2, 300, 3), [256, 512, 300 * 512], (64, 1, 128, 1))] * 2
    made.clear()
    pl._tma_views(k, v)
    assert made == []  # the same layout: the same maps
    pl.key = choose("bf16", 128, causal, 128, 512, "sm_90a", Tuning(), False)
    pl.static = K.BlockSparseStatic(BF16, 128, 8, 2, 64, 3, 256, 128, 128, 0, causal, BF16)
    for pages in (5, 7):
        made.clear()
        pl._tma_views(torch.zeros(pages, 2, 2, 64, 128, dtype=BF16), None)
        assert [m[1:4] for m in made] == [((128, 64, 2, pages), [256, 64 * 256, 2 * 2 * 64 * 256],
                                           (64, 64, 1, 1))] * 2

def test_lean_mma_keys():
    """The sm_90a prefill, paged and block-sparse keys' MMA warps take the leaner form (FmhaConfig's
    LEAN, `_ln` names) at D128 by default, at D256 under Tuning(lean_mma=True), nowhere under
    False; the sm_80 engine never."""
    from prims_ts import Tuning
    from prims_ts.cuda.block_sparse import BlockSparseKey
    from prims_ts.cuda.prefill import PrefillKey

    on, off = Tuning(lean_mma=True), Tuning(lean_mma=False)
    for paged in (False, True):
        default = PrefillKey.choose(BF16, 128, "causal", "sm_90a", paged=paged)
        assert default.lean and default.name.endswith("_ln_lz_up") and ", 2, 4, true, true, true>" in default.call()
        assert not PrefillKey.choose(BF16, 256, "causal", "sm_90a", paged=paged).lean
        assert PrefillKey.choose(BF16, 256, "causal", "sm_90a", paged=paged, tuning=on).lean
        plain = PrefillKey.choose(BF16, 128, "causal", "sm_90a", paged=paged, tuning=off)
        assert not plain.lean and ", 2, 4, false, true, true>" in plain.call()
        assert not PrefillKey.choose(BF16, 128, "causal", "sm_80", paged=paged, tuning=on).lean
    assert BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", Tuning(), True).lean
    assert not BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", off, True).lean
    assert not BlockSparseKey.choose("bf16", 128, False, 32, 512, "sm_90a", on, True).lean  # mma.sync engine
    assert Tuning.decode(on.encode()) == on and Tuning.decode(off.encode()) == off


def test_lazy_rescale_keys():
    """The default (lazy_rescale) gives the sm_90a prefill, paged and block-sparse keys the lazy
    running maxima (FmhaConfig's LAZY after LEAN, `_lz` names); Tuning(lazy_rescale=False) keeps
    the eager form (no LAZY argument), and the sm_80 engine never takes it."""
    from prims_ts import Tuning
    from prims_ts.cuda.block_sparse import BlockSparseKey
    from prims_ts.cuda.prefill import PrefillKey

    lz, eager = Tuning(), Tuning(lazy_rescale=False)
    for paged in (False, True):
        for d, lean in ((128, "true"), (256, "false")):
            key = PrefillKey.choose(BF16, d, "causal", "sm_90a", paged=paged)
            assert key.lazy and key.name.endswith("_lz_up") and f", {lean}, true, true>" in key.call(), key.call()
            other = PrefillKey.choose(BF16, d, "causal", "sm_90a", paged=paged, tuning=eager)
            assert not other.lazy and "_lz" not in other.name and f", {lean}, false, true>" in other.call()
        assert not PrefillKey.choose(BF16, 128, "causal", "sm_80", paged=paged, tuning=lz).lazy
    assert BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", lz, True).lazy
    assert not BlockSparseKey.choose("bf16", 128, False, 128, 512, "sm_90a", eager, True).lazy
    assert not BlockSparseKey.choose("bf16", 128, False, 32, 512, "sm_90a", lz, True).lazy  # mma.sync engine
    assert Tuning.decode(eager.encode()) == eager


def _standalone_structs(monkeypatch, call, make):
    """The struct a standalone's second direct launch writes (new tensors, the first's layouts),
    and the one a full run of the same operands writes."""
    KD, launched = _stub_prepared(monkeypatch)
    from prims_ts.ops import _dispatch
    from prims_ts.ops import _validate as V
    from prims_ts.ops import decode as decode_ops
    from prims_ts.ops import mla as mla_ops

    monkeypatch.setattr(_dispatch, "launchable", lambda query, out, traced=None: True)
    monkeypatch.setattr(decode_ops, "_CHECKED", V.memo())
    monkeypatch.setattr(mla_ops, "_CHECKED", V.memo())
    full = []
    real_run = KD.PreparedDecode.run
    monkeypatch.setattr(KD.PreparedDecode, "run", lambda self, *a, **k: (full.append((a, k)), real_run(self, *a, **k)))
    call(*make(0))
    second = make(1)  # another address of every operand
    call(*second)
    assert len(launched) == 2 and len(full) == 1  # the second call: the rerun
    memo = decode_ops._CHECKED or mla_ops._CHECKED
    assert len(memo) == 1
    fresh = KD.PreparedDecode(next(iter(memo.values())).static, None).for_plan(None)
    return launched, fresh, second


def _decode_operands(form, packed):
    def make(seed):
        g = torch.Generator().manual_seed(seed)
        hq, hkv, d, ps = 8, 2, 128, 16
        q = torch.randn(5 if packed else 2, hq, d, generator=g).to(BF16)
        if form == "separate":
            cache = (torch.randn(9, hkv, ps, d, generator=g).to(BF16), torch.randn(9, hkv, ps, d, generator=g).to(BF16))
        else:
            cache = torch.randn(9, 2, hkv, ps, d, generator=g).to(BF16)
        ws = torch.zeros(1 << 20, dtype=torch.uint8)
        ip = torch.tensor([0, 3, 6], dtype=torch.int32)
        # a serving loop's kv_indices slice: another length each call, under one static key
        ids = torch.randperm(9, generator=g)[:6 + 3 * seed].to(torch.int32)
        lens = torch.tensor([40, 48], dtype=torch.int32)
        qo = torch.tensor([0, 3, 5], dtype=torch.int32) if packed else None
        out = torch.empty(q.shape, dtype=BF16)
        return q, cache, ws, ip, ids, lens, qo, out
    return make


@pytest.mark.parametrize("form,packed", [("combined", False), ("separate", False), ("combined", True)])
def test_standalone_decode_rerun_is_the_full_runs_struct(form, packed, monkeypatch):
    from prims_ts import prims_ts_batch_decode_with_kv_cache

    make = _decode_operands(form, packed)

    def call(q, cache, ws, ip, ids, lens, qo, out):
        prims_ts_batch_decode_with_kv_cache(q, cache, ws, ip, ids, lens, 64, qo_indptr=qo,
                                            max_seq_len_q=3 if packed else None, bmm1_scale=0.25, out=out)

    launched, fresh, (q, cache, ws, ip, ids, lens, qo, out) = _standalone_structs(monkeypatch, call, make)
    k, v = cache if form == "separate" else (cache, None)
    fresh.run(q, k, v, ws, out, ip, ids, lens, qo, 0.25, 1.0)
    assert launched[1] == launched[2]
    assert launched[0] != launched[1]


def test_standalone_mla_rerun_is_the_full_runs_struct(monkeypatch):
    from prims_ts import prims_ts_batch_decode_with_kv_cache_mla

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(2, 1, 16, 576, generator=g).to(BF16)
        pool = torch.randn(6, 32, 576, generator=g).to(BF16)
        ws = torch.zeros(1 << 22, dtype=torch.uint8)
        table = torch.randperm(6, generator=g).to(torch.int32).view(2, 3)
        lens = torch.tensor([40, 96], dtype=torch.int32)
        out = torch.empty(2, 1, 16, 512, dtype=BF16)
        return q, pool, ws, table, lens, out

    def call(q, pool, ws, table, lens, out):
        prims_ts_batch_decode_with_kv_cache_mla(q, pool, ws, 512, 64, table, lens, 96, bmm1_scale=0.25, out=out)

    launched, fresh, (q, pool, ws, table, lens, out) = _standalone_structs(monkeypatch, call, make)
    fresh.run(q, pool, None, ws, out, None, table, lens, None, 0.25, 1.0, bt_stride=table.stride(0))
    assert launched[1] == launched[2]
    assert launched[0] != launched[1]


def test_twin_key_launches_its_tma_struct(monkeypatch):
    """A TMA decode key (the twin MLA tile, MLA rows of 64 on sm_90a) launches the whole
    DecodeTmaParams (the latent pool's map, then the DecodeParams), not its DecodeParams alone:
    the plan's copy and the launch carry the struct the kernel's signature names; the map is of
    the pool [P, ps, 576] as (576, ps, 1, P) in (64, min(ps, 64), 1, 1) boxes, encoded at the
    pool's address."""
    import ctypes

    from prims_ts import Tuning
    from prims_ts.cuda import keys as KK

    KD, launched = _stub_prepared(monkeypatch)
    made, encoded = [], []

    class FakeEncoder:
        def __init__(self, dtype, dims, strides, box, what):
            made.append((dtype, dims, strides, box, what))

        def encode(self, dst, address):
            encoded.append(address)
            ctypes.memmove(ctypes.addressof(dst), bytes([7]) * ctypes.sizeof(dst), ctypes.sizeof(dst))

    monkeypatch.setattr(KK.runtime, "TileMapEncoder", FakeEncoder)
    ps, b = 32, 2
    static = KD.DecodeStatic(BF16, 576, 128, 1, ps, False, -1, BF16, b, 1, 1, 4096, False, Tuning())
    prepared = KD.PreparedDecode(static, 0)
    assert prepared.key.twin and prepared.key.PARAMS == "DecodeTmaParams"
    plan = prepared.for_plan(None)
    for launch in (prepared.launch, plan.launch):
        assert type(launch.params) is KD.DecodeTmaParams, type(launch.params).__name__
    q = torch.randn(b, 128, 576, dtype=BF16)
    pool = torch.randn(6, ps, 576, dtype=BF16)
    o = torch.empty(b, 128, 512, dtype=BF16)
    ws = torch.zeros(1 << 24, dtype=torch.uint8)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    lens = torch.tensor([40, 96], dtype=torch.int32)
    plan.run(q, pool, None, ws, o, None, table, lens, None, 0.125, 1.0, bt_stride=table.stride(0))
    (dtype, dims, strides, box, what), = made
    assert (dtype, what, dims, box) == ("bf16", "k", (576, ps, 1, 6), (64, ps, 1, 1))
    assert strides[0] == 576 * 2 and encoded == [pool.data_ptr()]
    sent = launched[-1]
    assert len(sent) == ctypes.sizeof(KD.DecodeTmaParams)
    assert sent[:128] == bytes([7]) * 128  # the map first
    off = KD.DecodeTmaParams.p.offset
    assert sent[off:off + ctypes.sizeof(KD.DecodeParams)] == bytes(plan.p)  # then the parameters
    assert plan.p.k == pool.data_ptr()
