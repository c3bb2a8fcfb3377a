"""The NVRTC runtime on the CPU machine: compile, disk cache, corrupt entries, errors."""
import pytest
import torch

from prims_ts import Tuning
from prims_ts.cuda import block_sparse, catalog, decode, prefill, runtime
from prims_ts.cuda.keys import read_source


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMS_TS_CACHE_DIR", str(tmp_path))
    return tmp_path


def _small_key():
    return prefill.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a").source()


def test_arch_for_capability():
    assert runtime.arch_for_capability(9, 0) == "sm_90a"
    assert runtime.arch_for_capability(8, 0) == "sm_80"
    assert runtime.arch_for_capability(8, 9) == "sm_89"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_compile_writes_cache_and_reuses_it(cache, arch):
    ks = prefill.PrefillKey.choose(torch.float16, 128, "dense", arch).source()
    data = runtime.compile_cubin(ks, arch)
    assert data[:4] == b"\x7fELF"
    path = runtime.cache_path(ks, arch)
    assert path.exists() and path.read_bytes() == data
    assert not list(path.parent.glob(".tmp-*")), "temporary files must be renamed away"
    mtime = path.stat().st_mtime_ns
    assert runtime.compile_cubin(ks, arch) == data
    assert path.stat().st_mtime_ns == mtime  # served from the cache


def test_cache_key_depends_on_arch_and_source(cache):
    ks = _small_key()
    other = runtime.KernelSource(ks.key, ks.name, ks.source + "\n// changed\n")
    assert runtime.cache_path(ks, "sm_90a") != runtime.cache_path(ks, "sm_80")
    assert runtime.cache_path(ks, "sm_90a") != runtime.cache_path(other, "sm_90a")


def test_corrupt_cache_entry_is_recompiled(cache):
    ks = _small_key()
    good = runtime.compile_cubin(ks, "sm_90a")
    path = runtime.cache_path(ks, "sm_90a")
    path.write_bytes(b"garbage")
    assert runtime.compile_cubin(ks, "sm_90a") == good
    assert path.read_bytes() == good


def test_compile_error_carries_key_and_log(cache):
    bad = runtime.KernelSource("broken:key", "pt_broken", 'extern "C" __global__ void pt_broken() { undefined_thing(); }')
    with pytest.raises(runtime.KernelCompileError) as e:
        runtime.compile_cubin(bad, "sm_90a")
    assert "broken:key" in str(e.value) and "undefined_thing" in str(e.value)


def test_every_key_names_a_distinct_kernel():
    """One name per distinct key (names derive from the fields): the variants' keys too."""
    for arch in ("sm_90a", "sm_80"):
        keys = catalog.all_keys(arch, variants=True)
        assert len({k.name for k in keys}) == len(keys)
        assert len({k.source for k in keys}) == len(keys)
        assert "pt_read_int32" in {k.name for k in catalog.all_keys(arch)}  # the metadata read's kernel


SERIALISED_SRC = r'''
#include "pt_sm90.cuh"
using namespace pt;
extern "C" __global__ void pt_serialised(float* out, int n) {
  float d[2][4] = {};
  float sum = 0.f;
  for (int i = 0; i < n; ++i) {
    wgmma_fence();
    Wgmma<bf16, 16>::ss(d, desc_kmajor(0), desc_kmajor(4096), 1);
    wgmma_commit();
    sum += d[0][0];  // an accumulator read while its wgmma is in flight
    wgmma_wait<0>();
  }
  out[threadIdx.x] = sum + d[1][3];
}
'''


def test_serialised_wgmma_pipeline_is_reported(cache, monkeypatch):
    """ptxas's C75xx notes (a wgmma pipeline serialised) become a KernelPerformanceWarning and
    runtime.perf_notes; warmup --strict fails on them; our own kernels compile without."""
    monkeypatch.setattr(runtime, "perf_notes", {})
    ks = runtime.KernelSource("serialised:test", "pt_serialised", SERIALISED_SRC)
    with pytest.warns(runtime.KernelPerformanceWarning, match="serialised:test.*C751"):
        runtime.compile_cubin(ks, "sm_90a")
    notes = runtime.perf_notes[("sm_90a", "pt_serialised")]
    assert any("C7514" in n for n in notes), notes

    from prims_ts import cli

    monkeypatch.setattr(cli, "_kernel_keys", lambda arch, variants=False: [ks])
    monkeypatch.setattr(runtime, "perf_notes", {})
    assert cli.main(["warmup", "--arch", "sm_90a"]) == 0  # reported, not fatal
    monkeypatch.setattr(runtime, "perf_notes", {})
    monkeypatch.setenv("PRIMS_TS_CACHE_DIR", str(cache / "cold"))  # a cold cache: compiled again
    assert cli.main(["warmup", "--arch", "sm_90a", "--strict"]) == 1


def test_overlapped_consumer_loops_keep_the_wgmma_pipeline(cache, monkeypatch):
    """The software-pipelined consumer loops (Tuning.loop 1, 2) read no accumulator in flight:
    ptxas serialised every wgmma of them while the first tile's waits sat under `if (it > 0)`."""
    monkeypatch.setattr(runtime, "perf_notes", {})
    for loop in (1, 2):
        key = prefill.PrefillKey.choose(torch.bfloat16, 128, "causal", "sm_90a", tuning=Tuning(loop=loop))
        assert key.loop == loop, key
        runtime.compile_cubin(key.source(), "sm_90a")
    assert not runtime.perf_notes, runtime.perf_notes


@pytest.mark.parametrize("probe", [1, 2])
def test_prefill_probes_compile_and_probe_2_refuses_persistent_ctas(cache, monkeypatch, probe):
    """Tuning.probe (gpu_session.sh `probe`) defines PT_PROBE in the sm_90a prefill keys
    (pt_fmha_config.cuh): each probe compiles for the default keys; probe 2 (one item per CTA)
    refuses the persistent kernels at compile time."""
    import dataclasses

    for mask, paged in (("causal", False), ("dense", True)):
        key = prefill.PrefillKey.choose(torch.bfloat16, 128, mask, "sm_90a", paged=paged, tuning=Tuning(probe=probe))
        assert f"_probe{probe}" in key.name and key.source().source.startswith(f"#define PT_PROBE {probe}\n")
        assert runtime.compile_cubin(key.source(), "sm_90a")[:4] == b"\x7fELF"
    persistent = dataclasses.replace(key, persistent=True)
    if probe == 2:
        with pytest.raises(runtime.KernelCompileError, match="PT_PROBE 2"):
            runtime.compile_cubin(persistent.source(), "sm_90a")
    else:
        runtime.compile_cubin(persistent.source(), "sm_90a")


@pytest.mark.parametrize("probe", [1, 2])
def test_twin_probes_compile_as_keys_of_their_own(cache, monkeypatch, probe):
    """Tuning.probe defines PT_PROBE in the twin MLA keys too (gpu_session.sh `probe` with
    PROBE_FAMILIES=mla): a name of its own, each probe compiling for sm_90a without a C75xx note
    (the math alone keeps its wgmma groups; the copies alone have none); the default key holds
    no probe."""
    monkeypatch.setattr(runtime, "perf_notes", {})
    pol = decode.decode_policy(64, 1, 128, 1, catalog.MLA_DIM_QK, 8192, sm_count=132)
    for causal in (False, True):
        plain = decode.DecodeKey.of("bf16", catalog.MLA_DIM_QK, causal, pol, "sm_90a")
        key = decode.DecodeKey.of("bf16", catalog.MLA_DIM_QK, causal, pol, "sm_90a", Tuning(probe=probe))
        assert plain.twin and key.name == plain.name + f"_probe{probe}", key.name
        assert key.source().source.startswith(f"#define PT_PROBE {probe}\n")
        assert "PT_PROBE" not in plain.source().source
        assert runtime.compile_cubin(key.source(), "sm_90a")[:4] == b"\x7fELF"
    assert not runtime.perf_notes, runtime.perf_notes


@pytest.mark.parametrize("mirror,source,cname", [
    (prefill.PrefillParams, "fmha_prefill.cu", "pt::PrefillParams"),
    (decode.DecodeParams, "fmha_decode.cu", "pt::DecodeParams"),
    (block_sparse.BlockSparseParams, "fmha_block_sparse.cu", "pt::BlockSparseParams"),
    (runtime._ReadParams, "read_int32.cu", "pt::ReadParams"),
    (prefill.PrefillTmaParams, "fmha_prefill.cu", "pt::PrefillTmaParams"),
    (block_sparse.BlockSparseTmaParams, "fmha_block_sparse.cu", "pt::BlockSparseTmaParams"),
], ids=["prefill", "decode", "block_sparse", "read", "prefill_tma", "block_sparse_tma"])
def test_param_structs_match_their_ctypes_mirrors(mirror, source, cname):
    """Every field of a kernel's parameter struct sits where its ctypes mirror puts it: a
    probe kernel stores each field's offset and the struct's size (constants once compiled;
    NVRTC has no constant offsetof) through a volatile pointer, read back from the PTX."""
    import ctypes
    import re

    cls = mirror
    names = [n for n, _ in cls._fields_ if n != "_tail"]  # runtime.padded_to's tail is no C++ field
    body = "".join(f"  out[{i}] = (int)((const char*)&p.{n} - (const char*)&p);\n" for i, n in enumerate(names))
    body += f"  out[{len(names)}] = (int)sizeof({cname});\n"
    src = (read_source(source) + f'\nextern "C" __global__ void pt_layout_probe(const __grid_constant__ {cname} p, '
           f"volatile int* out) {{\n{body}}}\n")
    ptx = runtime.compile_ptx(src, "probe", "sm_80")
    consts = dict(re.findall(r"mov\.[ub]32\s+(%r\d+),\s*(\d+);", ptx))
    stored = {}
    for reg, off, val in re.findall(r"st\.volatile\.global\.[ub]32\s+\[(%rd\d+)(?:\+(\d+))?\],\s*(%r\d+|\d+);", ptx):
        stored[int(off or 0) // 4] = int(consts.get(val, val))
    want = [getattr(cls, n).offset for n in names] + [ctypes.sizeof(cls)]
    got = [stored.get(i) for i in range(len(want))]
    assert got == want, [(n, g, w) for n, g, w in zip(names + ["sizeof"], got, want) if g != w]


def test_host_values_from_spans_of_vectors_and_row_strided_tables():
    """What a metadata read copies (each tensor's span: a vector, or a row-strided table's rows
    and the gaps between them) gives back each tensor's values in order; other layouts have
    no span (they take the concatenated copy)."""
    import numpy as np

    from prims_ts.ops import _validate as V

    wide = torch.arange(5 * 9, dtype=torch.int32).view(5, 9) * 7 - 100
    table = wide[1:, 2:6]  # row stride 9, 4 columns, an offset start
    tensors = [torch.tensor([3, -1, 8], dtype=torch.int32), table, torch.zeros(0, dtype=torch.int32),
               wide[:1, :1], wide[2]]
    spans = [V._span(t) for t in tensors]
    assert spans == [3, 3 * 9 + 4, 0, 1, 9]
    got = np.concatenate([t.as_strided((n,), (1,)).numpy() for t, n in zip(tensors, spans)])
    for t, v in zip(tensors, V.values_of_spans(tensors, spans, got)):
        assert v.dtype == np.int64 and v.tolist() == t.reshape(-1).tolist()
    assert V._span(wide.t()) is None and V._span(wide[:, ::2]) is None


@pytest.mark.parametrize("header", sorted(h for h in runtime.include_sources() if h.startswith("pt_fmha")))
def test_core_headers_stand_alone(cache, header):
    """Each of the FMHA core's headers compiles on its own: it includes what it uses."""
    ks = runtime.KernelSource(f"header:{header}", "pt_header_alone",
                              f'#include "{header}"\nextern "C" __global__ void pt_header_alone() {{}}\n')
    assert runtime.compile_cubin(ks, "sm_90a")[:4] == b"\x7fELF"


def test_bounded_memo_forgets_its_oldest_entries():
    """The memos keyed by per-call facts stay bounded (first in, first out); the shared prepared
    launches and the static-check memos are such memos."""
    from prims_ts.cuda.keys import MEMO_LIMIT, BoundedMemo, Prepared
    from prims_ts.ops import decode as decode_ops
    from prims_ts.ops import mla as mla_ops
    from prims_ts.ops import prefill_paged

    m = BoundedMemo(3)
    for i in range(5):
        assert m.put(i, str(i)) == str(i)
    assert list(m) == [2, 3, 4] and m.get(4) == "4" and m.get(0) is None
    for memo in (Prepared._SHARED, decode_ops._CHECKED, mla_ops._CHECKED, prefill_paged._ONESHOT_CHECKED):
        assert isinstance(memo, BoundedMemo) and memo.limit == MEMO_LIMIT


def test_checked_once_keys_on_static_facts_and_types():
    """checked_once runs the checks once per key (a tensor's ``meta``: type, shape, dtype, strides
    and device; another value with its type), keeps no failed check, and checks every time a key
    cannot be hashed."""
    from prims_ts.ops import _validate as V

    memo, calls = V.memo(), []

    def check(t, n):
        calls.append(n)
        if n == 0:
            raise ValueError("n: zero")
        return (t.shape[0], n)

    def once(t, n, check=check):
        return V.checked_once(memo, (t,), (n,), check, t, n)

    x = torch.zeros(4)
    assert once(x, 1) == (4, 1)
    assert once(torch.ones(4), 1) == (4, 1) and calls == [1]  # the same static facts
    assert once(x, True) == (4, True) and calls == [1, True]  # True is not 1
    once(torch.zeros(4, dtype=torch.float64), 1)
    once(x[::2], 1)
    assert len(calls) == 4
    for _ in range(2):
        with pytest.raises(ValueError, match="n: zero"):
            once(x, 0)
    assert calls[-2:] == [0, 0]
    seen = []
    for _ in range(2):
        assert once(x, {1: 2}, lambda t, n: seen.append(n) or "checked") == "checked"
    assert len(seen) == 2  # a dict cannot be a key: checked every time


def test_checked_once_takes_the_last_key_by_one_compare(monkeypatch):
    """A call with the last call's layouts and scalars returns its result without building a
    key (no ``meta``); other layouts, another scalar type (True is not 1) or a mode change still
    find their own results; a traced call is checked every time."""
    from prims_ts.ops import _validate as V

    memo, calls = V.memo(), []

    def check(t, n, ids):
        calls.append(n)
        return (tuple(t.shape), n)

    def once(t, n, ids, **kw):
        return V.checked_once(memo, (t, None, ids), (n,), check, t, n, ids, loose=(2,), **kw)

    x, ids = torch.zeros(4, 2), torch.arange(3, dtype=torch.int32)
    assert once(x, 1, ids) == ((4, 2), 1) and calls == [1]
    real_meta, metas = V.meta, []
    monkeypatch.setattr(V, "meta", lambda t: metas.append(t) or real_meta(t))
    assert once(torch.ones(4, 2), 1, torch.arange(7, dtype=torch.int32)) == ((4, 2), 1)
    assert calls == [1] and metas == []  # the last key, matched without a meta
    assert once(x, True, ids) == ((4, 2), True) and calls == [1, True]
    assert once(x, 1, ids) == ((4, 2), 1) and calls == [1, True]  # the memo's entry
    assert once(torch.zeros(2, 4), 1, ids) == ((2, 4), 1) and calls == [1, True, 1]
    with torch.inference_mode():
        assert once(torch.zeros(2, 4), 1, ids) == ((2, 4), 1) and len(calls) == 3
    assert once(x, 1, ids, traced=True) == ((4, 2), 1) and len(calls) == 4
