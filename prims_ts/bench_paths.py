"""``python -m prims_ts bench --paths``: what each way of calling each API costs a user.

For each problem, every path of ours (one-shot, wrapper ``run``, the standalone function where
there is one, CUDA-graph replay) and the peers' own calls, on the bench's problems and inputs:

* ``lat_ms``: one call on an idle GPU (synchronize, event, call, event, synchronize; median of 7);
* ``tput_ms``: 20 calls back to back between two events, per call (median of 5): the host may
  run ahead of the GPU;
* ``host_us``: CPU time per call over those 20 calls, before the final synchronize (what the
  Python path costs while the GPU queue absorbs the work; a one-shot that reads metadata on
  the host waits for the queue, so its figure includes the GPU's time). Each burst starts
  with one untimed call: the first call after a synchronize costs several times a later one
  on the device host (30-130 µs against 15, graph replays 35 against 5), a cost a serving
  step pays once for all its launches and ``host_idle_us`` reports;
* ``host_idle_us``: CPU time of one call that starts on an idle GPU, to its return (a one-shot's
  own host cost, its metadata read included).

Rates are the work over ``tput_ms`` (and over ``lat_ms``). JSON with ``--json``.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional, Sequence

import torch

from . import bench as B

LAT_REPS, TPUT_ROUNDS, TPUT_CALLS = 7, 5, 20


@dataclass
class PathRow:
    problem: str
    path: str
    lat_ms: Optional[float] = None
    tput_ms: Optional[float] = None
    host_us: Optional[float] = None
    host_idle_us: Optional[float] = None
    rate: Optional[float] = None
    unit: str = ""
    error: str = ""


def measure(fn: Callable[[], object]) -> dict:
    """The four figures of one path (fn launches one call)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    lat, idle = [], []
    for _ in range(LAT_REPS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        e0.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        lat.append(e0.elapsed_time(e1))
        idle.append((t1 - t0) * 1e6)
    tput, host = [], []
    for _ in range(TPUT_ROUNDS):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        fn()  # the burst's first call (see the module docstring): outside both figures
        e0.record()
        t0 = time.perf_counter()
        for _ in range(TPUT_CALLS):
            fn()
        t1 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        tput.append(e0.elapsed_time(e1) / TPUT_CALLS)
        host.append((t1 - t0) * 1e6 / TPUT_CALLS)
    return dict(lat_ms=statistics.median(lat), host_idle_us=statistics.median(idle),
                tput_ms=statistics.median(tput), host_us=statistics.median(host))


class Later:
    """A path set up only when its turn comes: a peer that compiles (FlexAttention) must not
    leave its compile workers starting up beside the rows measured before it."""

    def __init__(self, setup: Callable[[], Callable[[], object]]):
        self.setup = setup


def _stop_compile_workers() -> None:
    """End the compile worker processes a compiled peer (FlexAttention) started: left running
    they take CPU time beside the next problems' rows (a block-sparse run's host figure read
    20-28 µs after Flex's compile against 15 before it)."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:  # pragma: no cover - a torch without the pool
        return
    shutdown_compile_workers()


def _replay(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """One call of fn captured in a CUDA graph: its replay, checked to recompute the output."""
    return B._graphed(fn, True)


# ----------------------------------------------------------------------------
# The paths of each API (ours, then the peers'), on the bench's inputs
# ----------------------------------------------------------------------------


def _prefill_paths(prob, x):
    import prims_ts

    mask = "causal" if x.causal else "dense"
    out = torch.empty_like(x.q)
    w = prims_ts.BatchPrefillTSWrapper()
    w.plan(x.q, x.k, x.v, mask_type=mask)
    run = lambda: w.run(x.q, x.k, x.v, out=out)  # noqa: E731
    return [("ours one-shot", lambda: prims_ts.batch_prefill(x.q, x.k, x.v, mask_type=mask, out=out)),
            ("ours wrapper.run", run),
            ("ours graph replay", _replay(run)),
            ("sdpa cudnn", B._sdpa_setup("CUDNN_ATTENTION")(prob, x)),
            ("sdpa flash", B._sdpa_setup("FLASH_ATTENTION")(prob, x))]


def _paged_paths(prob, x):
    import prims_ts

    mask = "causal" if x.causal else "dense"
    out = torch.empty_like(x.q_packed)
    w = prims_ts.BatchPrefillPagedTSWrapper()
    w.plan(x.q_packed, x.k_cache, x.v_cache, x.qo_indptr, x.page_indptr, x.block_tables.reshape(-1),
           x.last_page_len, page_size=x.page_size, mask_type=mask)
    run = lambda: w.run(x.q_packed, x.k_cache, x.v_cache, out=out)  # noqa: E731
    one = lambda: prims_ts.batch_prefill_with_paged_kv_cache(  # noqa: E731
        x.q_packed, x.k_cache, x.v_cache, x.qo_indptr, x.block_tables, x.seq_lens, page_size=x.page_size,
        mask_type=mask, out=out)
    return [("ours one-shot", one), ("ours wrapper.run", run), ("ours graph replay", _replay(run))]


def _decode_paths(prob, x):
    import prims_ts

    x.graph = False  # the peers' plain calls; each graph row is captured here
    out = torch.empty_like(x.q)
    b, hq, d = x.q.shape
    ps = x.cache.shape[3]
    last = x.seq_lens - (x.indptr[1:] - x.indptr[:-1] - 1) * ps
    w = prims_ts.BatchDecodePagedTSWrapper()
    w.plan(x.indptr, x.indices, last, hq, x.cache.shape[2], d, ps, q_data_type=x.q.dtype)
    std = lambda: prims_ts.prims_ts_batch_decode_with_kv_cache(  # noqa: E731
        x.q, x.cache, x.ws, x.indptr, x.indices, x.seq_lens, x.max_seq_len, out=out)
    one = lambda: prims_ts.batch_decode_with_paged_kv_cache(x.q, x.cache, x.indptr, x.indices, last,  # noqa: E731
                                                            out=out)
    sdpa = B._setup_sdpa_decode(prob, x)
    return [("ours standalone (out=)", std), ("ours wrapper.run", lambda: w.run(x.q, x.cache, out=out)),
            ("ours one-shot", one), ("ours graph replay", _replay(std)),
            ("sdpa (contiguous)", sdpa), ("sdpa graph replay", _replay(sdpa))]


def _mla_paths(prob, x):
    import prims_ts

    x.graph = False
    out = torch.empty(tuple(x.q.shape[:-1]) + (B.MLA_DV,), device=x.q.device, dtype=torch.bfloat16)
    b, sq, h, _ = x.q.shape
    ps = x.cache.shape[1]
    w = prims_ts.BatchMLADecodePagedTSWrapper()
    w.plan(x.block_tables, x.seq_lens, h, 512, 64, ps, seq_len_q=sq, max_kv_len=x.max_seq_len)
    run = lambda: w.run(x.q, x.cache, bmm1_scale=x.scale, out=out)  # noqa: E731
    std = lambda: prims_ts.prims_ts_batch_decode_with_kv_cache_mla(  # noqa: E731
        x.q, x.cache, x.ws, 512, 64, x.block_tables, x.seq_lens, x.max_seq_len, bmm1_scale=x.scale, out=out)
    one = lambda: prims_ts.batch_mla_decode_with_paged_kv_cache(  # noqa: E731
        x.q, x.cache, x.block_tables, x.seq_lens, bmm1_scale=x.scale, out=out)
    return [("ours one-shot", one), ("ours standalone (out=)", std), ("ours wrapper.run(validate=False)", run),
            ("ours graph replay", _replay(run)), ("torch", B._setup_torch_mla(prob, x))]


def _bsr_paths(prob, x):
    import prims_ts

    p = prob.params
    bs = x.block_size
    out = torch.empty_like(x.q)
    cache = (x.k_cache, x.v_cache)
    w = prims_ts.BlockSparsePagedTSWrapper()
    w.plan(x.kv_indptr, p["Sq"], p["Sk"], p["Hq"], p["Hkv"], p["D"], bs, bs, x.page_size,
           max_blocks_per_row=-(-p["Sk"] // bs), use_kv_valid_bits=False, seq_lens_kv=x.seq_lens,
           q_data_type=x.q.dtype)
    run = lambda: w.run(x.q, cache, x.kv_indices, x.block_indptr, x.block_indices, out=out)  # noqa: E731
    one = lambda: prims_ts.block_sparse_attention_with_paged_kv_cache(  # noqa: E731
        x.q, cache, x.kv_indptr, x.kv_indices, x.block_indptr, x.block_indices, bs, bs, max_seq_len_kv=p["Sk"],
        seq_lens_kv=x.seq_lens, out=out)
    return [("ours one-shot", one), ("ours wrapper.run", run), ("ours graph replay", _replay(run)),
            ("flex", Later(lambda: B._setup_flex_bsr(prob, x)))]


PATHS = {
    "prefill": (_prefill_paths, ("B8 S1024 H32/8 D128 dense", "B2 S4096 H32/8 D128 causal")),
    "paged_prefill": (_paged_paths, ("B8 S2048 H32/8 D128 causal page16", "B2 S8192 H32/8 D128 causal page128")),
    "decode": (_decode_paths, ("B1 L1024 H32/8 D128 page32", "B128 L4096 H32/8 D128 page32")),
    "mla": (_mla_paths, ("B1 L1024 H16", "B64 L8192 H16", "B128 L4096 H128")),
    "block_sparse": (_bsr_paths, ("block128 10%", "block128 100%")),
}


def problems(families: Optional[Sequence[str]] = None, match: Optional[str] = None):
    """(family, problem) pairs of the paths table: the bench's problems that PATHS names."""
    out = []
    for fam, (_, names) in PATHS.items():
        if families and fam not in families:
            continue
        for prob in B.FAMILIES[fam].problems():
            if any(n in prob.name for n in names) and (not match or match in f"{fam} {prob.name}"):
                out.append((fam, prob))
    return out


def run(json_path: Optional[str] = None, match: Optional[str] = None, families: Optional[Sequence[str]] = None,
        printer=print) -> int:
    if not torch.cuda.is_available():
        printer("prims_ts bench --paths: no CUDA GPU is visible; nothing to do.")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    rows: List[PathRow] = []
    for fam, prob in problems(families, match):
        label = f"{fam} {prob.name}"
        try:
            x = B.FAMILIES[fam].make_inputs(prob, device)
            paths = PATHS[fam][0](prob, x)
        except Exception as e:
            rows.append(PathRow(label, "setup", error=B._short(e)))
            printer(f"{label}: setup failed: {B._short(e)}")
            continue
        for name, fn in paths:
            row = PathRow(label, name, unit=prob.unit)
            compiled = isinstance(fn, Later)  # a peer that compiles (see Later)
            try:
                if isinstance(fn, BaseException):
                    raise fn
                if isinstance(fn, Later):  # FlexAttention missing or failing: the row says so
                    fn = fn.setup()
                for k, val in measure(fn).items():
                    setattr(row, k, val)
                row.rate = prob.work / (row.tput_ms * 1e-3) / 1e12
            except Exception as e:
                row.error = B._short(e)
                torch.cuda.synchronize()
            rows.append(row)
            printer(_fmt(row))
            if compiled:
                _stop_compile_workers()
        del x, paths
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"what": "prims_ts bench --paths", "environment": B.environment(device),
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
        printer(f"wrote {json_path}")
    return 0


def _fmt(r: PathRow) -> str:
    if r.error:
        return f"{r.problem:<48} {r.path:<34} n/a ({r.error})"
    return (f"{r.problem:<48} {r.path:<34} lat {r.lat_ms:8.4f} ms  tput {r.tput_ms:8.4f} ms  "
            f"host {r.host_us:8.1f} us  idle-host {r.host_idle_us:8.1f} us  {r.rate:7.2f} {r.unit}")
