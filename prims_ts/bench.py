"""``python -m prims_ts bench``: our ops beside their peers on the same logical problem.

A *family* (one per API: prefill, later paged prefill, decode, MLA, block-sparse)
names its problems, builds their inputs and lists its *runners*: ``prims_ts``
plus peers (torch SDPA with the cuDNN / FLASH backends, FlexAttention, ...).
A runner's ``setup(problem, inputs)`` returns a zero-argument callable that
launches the work once and returns the output; if setup or timing raises, the
cell shows ``n/a`` and the run goes on.

Each row reports ms (the median of ``TIMING_ROUNDS`` rounds over the row's runners in
alternating order, each round's figure a median of repetitions), the achieved rate (TFLOP/s for compute-bound
families, TB/s for memory-bound ones) and that rate as a fraction of the card's
ceiling measured in the same run (an 8192³ bf16 GEMM; a large device copy).
Our output is compared with the reference runner's (relative error) so that a
fast but wrong kernel is visible in the table.

A new API adds a family with ``register_family(Family(...))`` at the bottom of
this module; the driver (:func:`run_bench`) does not change.
"""
from __future__ import annotations

import functools
import json
import math
import platform
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from . import testing

# ----------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------


@dataclass
class Problem:
    family: str
    name: str  # short label, e.g. "B2 S4096 H32/8 D128 causal"
    params: Dict[str, Any]
    work: float  # FLOPs (unit TFLOP/s) or bytes (unit TB/s)
    unit: str = "TFLOP/s"  # "TFLOP/s" | "TB/s"
    quick: bool = False  # part of --quick


@dataclass
class Runner:
    name: str  # column name: "prims_ts", "sdpa_cudnn", ...
    setup: Callable[[Problem, Any], Callable[[], Any]]


@dataclass
class Family:
    name: str
    problems: Callable[[], List[Problem]]
    make_inputs: Callable[[Problem, torch.device], Any]
    runners: List[Runner]
    reference: Optional[str] = None  # runner(s) whose output checks ours, comma-separated by preference
    ours: str = "prims_ts"


FAMILIES: Dict[str, Family] = {}

CEILING_FOR_UNIT = {"TFLOP/s": "gemm_bf16_TFLOPs", "TB/s": "copy_TBps"}


def register_family(family: Family) -> None:
    FAMILIES[family.name] = family


# ----------------------------------------------------------------------------
# Timing and ceilings
# ----------------------------------------------------------------------------


TIMING_ROUNDS = 3  # per row: rounds over its runners, alternating order
TIMING_REP_MS = 40  # repetitions per runner and round (milliseconds)


def _triton_do_bench():
    try:
        from triton.testing import do_bench  # type: ignore

        return do_bench
    except Exception:
        return None


def timer_name() -> str:
    return "triton.testing.do_bench (median)" if _triton_do_bench() is not None else "CUDA events (median)"


def time_ms(fn: Callable[[], Any], rep_ms: int = 100) -> float:
    """Median milliseconds of one call of ``fn`` on the current CUDA stream (about
    ``rep_ms`` of repetitions after a warm-up)."""
    do_bench = _triton_do_bench()
    if do_bench is not None:
        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    est_ms = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    n = int(min(1000, max(10, rep_ms / est_ms)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def measure_gemm_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = time_ms(functools.partial(torch.mm, a, b, out=c))
    del a, b, c
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def measure_copy_tbps(device: torch.device, nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = time_ms(functools.partial(dst.copy_, src))
    del src, dst
    return 2.0 * nbytes / (ms * 1e-3) / 1e12  # read + write


CEILING_MEASURE = {"gemm_bf16_TFLOPs": measure_gemm_tflops, "copy_TBps": measure_copy_tbps}


def relative_error(out, ref) -> Optional[float]:
    """Our output against a peer's; None when the two are not comparable tensors."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor) or out.shape != ref.shape:
        return None
    return testing.relative_error(out, ref)


# ----------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------


def environment(device: Optional[torch.device]) -> Dict[str, Any]:
    env: Dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "timer": timer_name(),
    }
    try:
        import prims_ts

        env["prims_ts"] = prims_ts.__version__
    except Exception:
        pass
    try:
        import cupy

        env["cupy"] = cupy.__version__
    except Exception:
        env["cupy"] = None
    try:
        from .cuda import runtime

        env["nvrtc"] = list(runtime.nvrtc_version())
    except Exception:
        env["nvrtc"] = None
    try:
        import triton  # type: ignore

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if device is not None and device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}",
                   memory_GiB=round(p.total_memory / 2 ** 30, 1))
        try:
            import cupy

            v = cupy.cuda.runtime.driverGetVersion()
            env["driver_cuda"] = f"{v // 1000}.{v % 1000 // 10}"
        except Exception:
            pass
    else:
        env["gpu"] = None
    return env


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------


@dataclass
class Cell:
    ms: Optional[float] = None
    rate: Optional[float] = None  # TFLOP/s or TB/s
    frac: Optional[float] = None  # rate / ceiling
    err: Optional[float] = None  # relative error vs the family's reference runner
    note: str = ""
    error: str = ""
    rounds: List[float] = field(default_factory=list)  # each round's ms, in round order


@dataclass
class Row:
    problem: Problem
    cells: Dict[str, Cell] = field(default_factory=dict)
    orders: List[List[str]] = field(default_factory=list)  # each round's runners, in the order timed


def select_problems(quick: bool, families: Optional[Sequence[str]] = None,
                    match: Optional[str] = None) -> List[Problem]:
    out = []
    for fname, fam in FAMILIES.items():
        if families and fname not in families:
            continue
        for p in fam.problems():
            if quick and not p.quick:
                continue
            if match and match.lower() not in f"{fname} {p.name}".lower():
                continue
            out.append(p)
    return out


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:160]


def _run_problem(fam: Family, prob: Problem, device: torch.device, ceilings: Dict[str, float],
                 runners: Optional[Sequence[str]], tuning=None) -> Row:
    row = Row(prob)
    try:
        inputs = fam.make_inputs(prob, device)
        inputs.tuning = tuning  # what our runners plan their wrappers with
    except Exception as e:
        for r in fam.runners:
            row.cells[r.name] = Cell(error=f"inputs: {_short(e)}")
        return row
    ceiling = ceilings.get(CEILING_FOR_UNIT.get(prob.unit, ""), None)
    refs = [r.strip() for r in (fam.reference or "").split(",") if r.strip()]
    # Peers first, ours last: a fault in our kernel cannot spoil a peer's output of the same row.
    order = sorted(fam.runners, key=lambda r: r.name == fam.ours)
    outputs: Dict[str, Any] = {}
    fns: Dict[str, Callable[[], Any]] = {}

    def failed(name: str, e: BaseException) -> None:
        row.cells[name].error = _short(e)
        fns.pop(name, None)
        try:
            torch.cuda.synchronize(device)
        except Exception:
            pass

    for r in order:
        cell = Cell()
        row.cells[r.name] = cell
        if runners and r.name not in runners:
            cell.error = "skipped"
            continue
        try:
            fn = r.setup(prob, inputs)
            cell.note = getattr(fn, "note", "")
            res = fn()
            torch.cuda.synchronize(device)
            outputs[r.name] = res
            del res
            fns[r.name] = fn
        except Exception as e:
            failed(r.name, e)
        fn = None
    # Timing in rounds, the runners' order reversed each round, each cell the median of its
    # rounds: a clock or power drift during the row then reaches every runner alike (the
    # ratios between runners of one row are what the tables are read for).
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for rnd in range(TIMING_ROUNDS):
        order = list(fns) if rnd % 2 == 0 else list(fns)[::-1]
        row.orders.append(order)
        for name in order:
            try:
                times[name].append(time_ms(fns[name], rep_ms=TIMING_REP_MS))
            except Exception as e:
                failed(name, e)
    for name, ts in times.items():
        cell = row.cells[name]
        if name in fns and ts:
            cell.rounds = ts
            cell.ms = statistics.median(ts)
            cell.rate = prob.work / (cell.ms * 1e-3) / 1e12
            if ceiling:
                cell.frac = cell.rate / ceiling
    fns.clear()
    ref_name = next((n for n in refs if n in outputs), None)
    if ref_name is not None:
        for name, out in outputs.items():
            if name != ref_name:
                row.cells[name].err = relative_error(out, outputs[ref_name])
    ref = None
    del outputs, ref, inputs
    torch.cuda.empty_cache()
    return row


def _fmt_cell(c: Optional[Cell], unit: str) -> str:
    if c is None or c.ms is None:
        return "n/a"
    rate = f"{c.rate:.1f}" if unit == "TFLOP/s" else f"{c.rate:.2f}"
    pct = f" {100 * c.frac:3.0f}%" if c.frac is not None else ""
    return f"{c.ms:.3f}ms {rate}{pct}"


def format_table(rows: List[Row], ceilings: Dict[str, float]) -> str:
    lines = []
    by_family: Dict[str, List[Row]] = {}
    for r in rows:
        by_family.setdefault(r.problem.family, []).append(r)
    for fname, frows in by_family.items():
        fam = FAMILIES[fname]
        names = [r.name for r in fam.runners]
        units = sorted({r.problem.unit for r in frows})
        ceil_txt = ", ".join(f"{CEILING_FOR_UNIT[u]}={ceilings.get(CEILING_FOR_UNIT[u], float('nan')):.1f}"
                             for u in units if u in CEILING_FOR_UNIT)
        lines.append(f"== {fname}: cell = median ms, {'/'.join(units)}, % of measured ceiling ({ceil_txt})")
        cells = [[_fmt_cell(r.cells.get(n), r.problem.unit) for n in names] for r in frows]
        errs = []
        for r in frows:
            c = r.cells.get(fam.ours)
            if c is None or c.err is None:
                errs.append("-")
            elif math.isnan(c.err):
                errs.append("NaN!")
            else:
                errs.append(f"{c.err:.1e}" + (" WRONG" if c.err > 2e-2 else ""))
        w0 = max(len("problem"), *(len(r.problem.name) for r in frows))
        widths = [max(len(n), *(len(cs[i]) for cs in cells)) for i, n in enumerate(names)]
        head = f"{'problem':<{w0}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths)) + "  err(ours)"
        lines.append(head)
        lines.append("-" * len(head))
        for r, cs, e in zip(frows, cells, errs):
            lines.append(f"{r.problem.name:<{w0}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cs, widths))
                         + f"  {e}")
        notes = []
        for r in frows:
            for n in names:
                c = r.cells.get(n)
                if c is None:
                    continue
                if c.error and c.error != "skipped":
                    notes.append(f"  n/a {r.problem.name} / {n}: {c.error}")
                elif c.note:
                    notes.append(f"  note {r.problem.name} / {n}: {c.note}")
                if n != fam.ours and c.err is not None and not (c.err <= 2e-2):
                    notes.append(f"  note {r.problem.name} / {n}: output differs from the reference "
                                 f"(rel err {c.err:.1e})")
        lines.extend(notes)
        lines.append("")
    return "\n".join(lines)


def results_json(env: Dict[str, Any], ceilings: Dict[str, float], rows: List[Row], **extra) -> Dict[str, Any]:
    out_rows = []
    for r in rows:
        out_rows.append({
            "family": r.problem.family,
            "problem": r.problem.name,
            "params": r.problem.params,
            "work": r.problem.work,
            "unit": r.problem.unit,
            "runners": {n: {"ms": c.ms, "rate": c.rate, "frac_of_ceiling": c.frac, "rel_err": c.err,
                            "note": c.note or None, "error": c.error or None, "rounds_ms": c.rounds or None}
                        for n, c in r.cells.items()},
            "round_orders": r.orders or None,  # the runners each round timed, in order (rounds_ms' order)
        })
    return {"env": env, "ceil": ceilings, "rows": out_rows, **extra}


def write_plot(path: str, rows: List[Row], ceilings: Dict[str, float]) -> Optional[str]:
    """PNG grouped bars (one panel per family); returns an error message or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib is not importable ({e}); no plot written"
    by_family: Dict[str, List[Row]] = {}
    for r in rows:
        by_family.setdefault(r.problem.family, []).append(r)
    if not by_family:
        return "no rows to plot"
    fig, axes = plt.subplots(len(by_family), 1, figsize=(max(8, 1.6 * max(map(len, by_family.values()))),
                                                         4.5 * len(by_family)), squeeze=False)
    for ax, (fname, frows) in zip(axes[:, 0], by_family.items()):
        names = [r.name for r in FAMILIES[fname].runners]
        unit = frows[0].problem.unit
        width = 0.8 / len(names)
        for i, n in enumerate(names):
            vals = [(r.cells.get(n).rate if r.cells.get(n) and r.cells.get(n).rate else 0.0) for r in frows]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(frows))]
            ax.bar(xs, vals, width, label=n)
        ceil = ceilings.get(CEILING_FOR_UNIT.get(unit, ""))
        if ceil:
            ax.axhline(ceil, color="k", linestyle="--", linewidth=1, label=f"ceiling {ceil:.0f} {unit}")
        ax.set_xticks(range(len(frows)))
        ax.set_xticklabels([r.problem.name for r in frows], rotation=20, ha="right", fontsize=8)
        top = max([ceil or 0.0] + [c.rate or 0.0 for r in frows for c in r.cells.values()])
        if top > 0:
            ax.set_ylim(0, top * 1.3)  # headroom for the legend
        ax.set_ylabel(unit)
        ax.set_title(f"{fname} (bf16; dashed line: ceiling measured in the same run)")
        ax.legend(fontsize=8, ncol=len(names) + 1, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def run_bench(quick: bool = False, json_path: Optional[str] = None, plot_path: Optional[str] = None,
              families: Optional[Sequence[str]] = None, match: Optional[str] = None,
              runners: Optional[Sequence[str]] = None, printer=print, tuning=None) -> int:
    """``tuning``: the Tuning our runners' wrappers are planned with (A/B runs); None: the default."""
    if not torch.cuda.is_available():
        printer("prims_ts bench: no CUDA GPU is visible (torch.cuda.is_available() is False); "
                "benchmarks need one. Nothing to do.")
        if json_path:
            _write_json(json_path, results_json(environment(None), {}, [], skipped="no CUDA GPU"))
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device)
    problems = select_problems(quick, families, match)
    printer(f"GPU {env.get('gpu')} (cc {env.get('cc')}, {env.get('sms')} SMs), torch {env['torch']}, "
            f"CUDA {env['cuda']}, cupy {env.get('cupy')}, NVRTC {env.get('nvrtc')}; timer: {env['timer']}")
    printer(f"{len(problems)} problems{' (--quick)' if quick else ''}, bf16"
            + (f", tuning {tuning.encode() or 'default'}" if tuning is not None else ""))
    if tuning is not None:
        env["tuning"] = tuning.encode()
    ceilings: Dict[str, float] = {}
    rows: List[Row] = []
    try:
        for unit in sorted({p.unit for p in problems}):
            key = CEILING_FOR_UNIT.get(unit)
            if key:
                try:
                    ceilings[key] = CEILING_MEASURE[key](device)
                    printer(f"ceiling {key}: {ceilings[key]:.1f}")
                except Exception as e:
                    printer(f"ceiling {key}: n/a ({_short(e)})")
        for i, prob in enumerate(problems):
            t0 = time.perf_counter()
            row = _run_problem(FAMILIES[prob.family], prob, device, ceilings, runners, tuning)
            rows.append(row)
            ours = row.cells.get(FAMILIES[prob.family].ours)
            printer(f"[{i + 1:>2}/{len(problems)}] {prob.family} {prob.name}: "
                    f"{_fmt_cell(ours, prob.unit)} ({time.perf_counter() - t0:.1f}s)")
    finally:
        printer("")
        printer(format_table(rows, ceilings))
        if json_path:
            _write_json(json_path, results_json(env, ceilings, rows, quick=quick))
            printer(f"wrote {json_path}")
        if plot_path:
            msg = write_plot(plot_path, rows, ceilings)
            printer(msg if msg else f"wrote {plot_path}")
    return 0


def _tuning(x):
    """The Tuning a run's inputs carry (run_bench's ``tuning``), or the default."""
    from .cuda.keys import DEFAULT_TUNING

    return getattr(x, "tuning", None) or DEFAULT_TUNING


def _write_json(path: str, data: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


# ----------------------------------------------------------------------------
# Family: prefill (batch_prefill, fixed [B, S, H, D], bf16)
# ----------------------------------------------------------------------------


def visible_pairs(sq: int, sk: int, causal: bool, window_left: int = -1) -> int:
    """Exact number of (query, key) pairs the mask lets through (bottom-right causal)."""
    if not causal:
        return sq * sk
    total = 0
    off = sk - sq
    for i in range(sq):
        hi = min(sk - 1, off + i)
        lo = max(0, off + i - window_left) if window_left >= 0 else 0
        total += max(0, hi - lo + 1)
    return total


def _prefill_problems() -> List[Problem]:
    shapes = [
        # (B, S, Hq, Hkv, D, causal, quick)
        (8, 1024, 32, 8, 128, False, False),
        (8, 1024, 32, 8, 128, True, False),
        (2, 4096, 32, 8, 128, False, True),
        (2, 4096, 32, 8, 128, True, True),
        (1, 16384, 32, 8, 128, False, False),
        (1, 16384, 32, 8, 128, True, True),
        (2, 4096, 16, 8, 256, False, False),
        (2, 4096, 16, 8, 256, True, True),
    ]
    out = []
    for b, s, hq, hkv, d, causal, quick in shapes:
        pairs = visible_pairs(s, s, causal)
        out.append(Problem(
            family="prefill",
            name=f"B{b} S{s} H{hq}/{hkv} D{d} {'causal' if causal else 'dense'}",
            params=dict(B=b, Sq=s, Sk=s, Hq=hq, Hkv=hkv, D=d, causal=causal, dtype="bf16"),
            work=4.0 * b * hq * d * pairs,
            quick=quick,
        ))
    return out


class PrefillInputs:
    """q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D] (ours) and contiguous [B, H, S, D] copies (peers)."""

    def __init__(self, prob: Problem, device: torch.device):
        p = prob.params
        g = torch.Generator(device=device)
        g.manual_seed(0)
        dt = torch.bfloat16
        self.causal = p["causal"]
        self.sq, self.sk = p["Sq"], p["Sk"]
        self.q = torch.randn(p["B"], p["Sq"], p["Hq"], p["D"], device=device, dtype=dt, generator=g)
        self.k = torch.randn(p["B"], p["Sk"], p["Hkv"], p["D"], device=device, dtype=dt, generator=g)
        self.v = torch.randn(p["B"], p["Sk"], p["Hkv"], p["D"], device=device, dtype=dt, generator=g)
        self._bhsd = None

    def bhsd(self):
        if self._bhsd is None:
            self._bhsd = tuple(t.transpose(1, 2).contiguous() for t in (self.q, self.k, self.v))
        return self._bhsd


def _to_bshd(o: torch.Tensor) -> torch.Tensor:
    return o.transpose(1, 2)


def _setup_ours_prefill(prob: Problem, x: PrefillInputs):
    import prims_ts

    out = torch.empty_like(x.q)
    w = prims_ts.BatchPrefillTSWrapper(tuning=_tuning(x))
    w.plan(x.q, x.k, x.v, mask_type="causal" if x.causal else "dense")

    def fn():
        return w.run(x.q, x.k, x.v, out=out)

    return fn


def _sdpa_setup(backend_name: str):
    def setup(prob: Problem, x: PrefillInputs):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        q, k, v = x.bhsd()
        if x.causal and x.sq != x.sk:
            raise RuntimeError("SDPA is_causal is top-left aligned; only Sq == Sk is comparable")

        def make(kk, vv, gqa):
            def fn():
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(q, kk, vv, is_causal=x.causal, enable_gqa=gqa)
                return _to_bshd(o)

            return fn

        fn = make(k, v, True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fn()
                return fn
            except RuntimeError as e:
                why = "; ".join(str(w.message).splitlines()[0] for w in caught)[:300]
                first = RuntimeError(f"{str(e).splitlines()[0]}{' (' + why + ')' if why else ''}")
        # Backend without native GQA: expand K/V (same math, more K/V bytes), and say so.
        group = q.shape[1] // k.shape[1]
        if group == 1:
            raise first
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        fn = make(ke, ve, False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                fn()
            except RuntimeError:
                raise first from None
        fn.note = f"no enable_gqa support: K/V expanded x{group} beforehand"
        return fn

    return setup


_flex_compiled = None


def _compiled_flex():
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, knob):
                setattr(cfg, knob, max(getattr(cfg, knob), 64))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def _flex_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
               block_mask: Any = None, kernel_options: Optional[dict] = None) -> Callable[[], Any]:
    """The FlexAttention peer of every family: a zero-argument call of the compiled
    ``flex_attention`` (one compile per shape) on contiguous ``[B, H, S, D]`` tensors,
    GQA through ``enable_gqa=True``, causal (bottom-right aligned) through a block mask
    built here, once, or the caller's ``block_mask`` (block-sparse; ``kernel_options``
    then fits Flex's tiles to blocks smaller than its defaults). Its output is
    ``[B, Hq, Sq, D]``. A failure raises, and the driver shows the cell as ``n/a`` with
    the reason."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _compiled_flex()
    if causal and block_mask is not None:
        raise ValueError("_flex_call: give causal or a block mask, not both")
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        off = sk - sq

        def causal_mod(b, h, q_idx, kv_idx):
            return q_idx + off >= kv_idx

        block_mask = create_block_mask(causal_mod, B=None, H=None, Q_LEN=sq, KV_LEN=sk, device=q.device)

    def fn():
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options)

    return fn


def _setup_flex(prob: Problem, x: PrefillInputs):
    call = _flex_call(*x.bhsd(), causal=x.causal)

    def fn():
        return _to_bshd(call())

    return fn


register_family(Family(
    name="prefill",
    problems=_prefill_problems,
    make_inputs=PrefillInputs,
    runners=[
        Runner("prims_ts", _setup_ours_prefill),
        Runner("sdpa_cudnn", _sdpa_setup("CUDNN_ATTENTION")),
        Runner("sdpa_flash", _sdpa_setup("FLASH_ATTENTION")),
        Runner("flex", _setup_flex),
    ],
    reference="sdpa_flash,sdpa_cudnn",
))


# ----------------------------------------------------------------------------
# paged prefill (SPEC §2): packed Q over HND page pools, beside our own
# contiguous batch_prefill and SDPA cuDNN on the same logical problem
# ----------------------------------------------------------------------------


def _paged_prefill_problems() -> List[Problem]:
    out = []
    for b, s in ((8, 2048), (2, 8192)):
        for causal in (False, True):
            for ps in (16, 32, 64, 128):
                pairs = visible_pairs(s, s, causal)
                out.append(Problem(
                    family="paged_prefill",
                    name=f"B{b} S{s} H32/8 D128 {'causal' if causal else 'dense'} page{ps}",
                    params=dict(B=b, Sq=s, Sk=s, Hq=32, Hkv=8, D=128, causal=causal, page_size=ps, dtype="bf16"),
                    work=4.0 * b * 32 * 128 * pairs,
                    quick=(b == 8 and causal and ps in (16, 128)),
                ))
    return out


class PagedPrefillInputs(PrefillInputs):
    """The prefill inputs plus the same K/V scattered over shuffled pages."""

    def __init__(self, prob: Problem, device: torch.device):
        super().__init__(prob, device)
        p = prob.params
        b, s, ps = p["B"], p["Sk"], p["page_size"]
        per = s // ps
        g = torch.Generator(device="cpu")
        g.manual_seed(1)
        perm = torch.randperm(b * per, generator=g).to(torch.int32)
        self.block_tables = perm.view(b, per).to(device)
        pool = torch.empty(b * per, p["Hkv"], ps, p["D"], device=device, dtype=self.k.dtype)
        self.k_cache, self.v_cache = pool, torch.empty_like(pool)
        src_k = self.k.view(b * per, ps, p["Hkv"], p["D"]).transpose(1, 2)
        src_v = self.v.view(b * per, ps, p["Hkv"], p["D"]).transpose(1, 2)
        idx = perm.to(device).long()
        self.k_cache[idx] = src_k
        self.v_cache[idx] = src_v
        self.qo_indptr = (torch.arange(b + 1, device=device, dtype=torch.int32) * p["Sq"])
        self.seq_lens = torch.full((b,), s, device=device, dtype=torch.int32)
        self.page_indptr = torch.arange(b + 1, device=device, dtype=torch.int32) * per  # the same pages as CSR
        self.last_page_len = self.seq_lens - (per - 1) * ps
        self.q_packed = self.q.reshape(b * p["Sq"], p["Hq"], p["D"])
        self.page_size = ps


def _setup_ours_paged(prob: Problem, x: PagedPrefillInputs):
    import prims_ts

    mask = "causal" if x.causal else "dense"
    w = prims_ts.BatchPrefillPagedTSWrapper(tuning=_tuning(x))
    w.plan(x.q_packed, x.k_cache, x.v_cache, x.qo_indptr, x.page_indptr, x.block_tables.reshape(-1),
           x.last_page_len, page_size=x.page_size, mask_type=mask)
    out = torch.empty_like(x.q_packed)

    def fn():
        return w.run(x.q_packed, x.k_cache, x.v_cache, out=out).view(x.q.shape)

    return fn


register_family(Family(
    name="paged_prefill",
    problems=_paged_prefill_problems,
    make_inputs=PagedPrefillInputs,
    runners=[
        Runner("prims_ts", _setup_ours_paged),
        Runner("prims_ts_contiguous", _setup_ours_prefill),
        Runner("sdpa_cudnn", _sdpa_setup("CUDNN_ATTENTION")),
    ],
    reference="prims_ts_contiguous,sdpa_cudnn",
))


# ----------------------------------------------------------------------------
# paged decode (SPEC §3): TB/s of K/V bytes, beside SDPA and FlexAttention on
# contiguous K/V
# ----------------------------------------------------------------------------


def _decode_lens(p: Dict[str, Any]) -> List[int]:
    """A decode problem's K/V lengths: B of L, or (``short`` given) one request of L and B - 1
    of ``short`` (a serving batch with one long-context request), or ``lens`` itself."""
    if "lens" in p:
        return list(p["lens"])
    b, n = p["B"], p["L"]
    return [n] * b if "short" not in p else [n] + [p["short"]] * (b - 1)


def _decode_problems() -> List[Problem]:
    shapes = [
        # (B, L, Hq, Hkv, D, quick, graph, the other requests' length: None, all L)
        (128, 4096, 32, 8, 128, True, False, None),
        (16, 32768, 32, 8, 128, False, False, None),
        (64, 8192, 64, 8, 128, False, False, None),
        (32, 8192, 16, 8, 256, True, False, None),
        (1, 131072, 32, 8, 128, True, False, None),
        (1, 1024, 32, 8, 128, True, True, None),  # latency: CUDA graphs on both sides
        (64, 32768, 32, 8, 128, False, False, 1024),  # skewed: one request of 32768, 63 of 1024
    ]
    out = []
    for b, n, hq, hkv, d, quick, graph, short in shapes:
        params = dict(B=b, L=n, Hq=hq, Hkv=hkv, D=d, page_size=32, graph=graph, dtype="bf16")
        if short is not None:
            params["short"] = short
        kv_bytes = 2 * sum(_decode_lens(params)) * hkv * d * 2
        size = f"L{n}" if short is None else f"L{n}+{b - 1}x{short}"
        out.append(Problem(
            family="decode",
            name=f"B{b} {size} H{hq}/{hkv} D{d} page32" + (" graphs" if graph else ""),
            params=params,
            work=float(kv_bytes),
            unit="TB/s",
            quick=quick,
        ))
    return out


class DecodeInputs:
    """q [B, Hq, D]; a combined paged cache with shuffled pages (each request its own count);
    the same K/V contiguous for the peers, padded with zeros to the longest request where the
    lengths differ (``ragged``: the peers then mask the padding)."""

    def __init__(self, prob: Problem, device: torch.device):
        import prims_ts

        p = prob.params
        b, n, hq, hkv, d, ps = p["B"], p["L"], p["Hq"], p["Hkv"], p["D"], p["page_size"]
        dt = torch.bfloat16
        g = torch.Generator(device=device)
        g.manual_seed(0)
        self.graph = p["graph"]
        self.lens = _decode_lens(p)
        self.ragged = len(set(self.lens)) > 1
        self.q = torch.randn(b, hq, d, device=device, dtype=dt, generator=g)
        per = [(x + ps - 1) // ps for x in self.lens]
        pages = sum(per)
        self.cache = torch.randn(pages, 2, hkv, ps, d, device=device, dtype=dt, generator=g)
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).to(torch.int32)
        self.indices = perm.to(device)
        self.indptr = torch.tensor(testing.cumsum0(per), device=device, dtype=torch.int32)
        self.seq_lens = torch.tensor(self.lens, device=device, dtype=torch.int32)
        self.max_seq_len = max(self.lens)
        self.ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_workspace_size(b, hq, hkv, d, ps, self.max_seq_len,
                                                                               device=device),
                              dtype=torch.uint8, device=device)
        self._contig = None

    def contiguous(self):
        """K, V as [B, Hkv, L, D] in logical order (zeros past a request's length), and q as
        [B, Hq, 1, D]."""
        if self._contig is None:
            b, ps = self.q.shape[0], self.cache.shape[3]
            hkv, d = self.cache.shape[2], self.cache.shape[4]
            k = self.q.new_zeros(b, hkv, self.max_seq_len, d)
            v = torch.zeros_like(k)
            at = self.indptr.tolist()
            for r, n in enumerate(self.lens):
                pages = self.cache[self.indices[at[r]:at[r + 1]].long()]  # [per, 2, Hkv, ps, D]
                kv = pages.permute(1, 2, 0, 3, 4).reshape(2, hkv, -1, d)[:, :, :n]
                k[r, :, :n], v[r, :, :n] = kv[0], kv[1]
            self._contig = (self.q.unsqueeze(2), k, v)
        return self._contig

    def key_mask(self) -> torch.Tensor:
        """[B, 1, 1, L]: the keys each request holds (the contiguous copies' padding excluded)."""
        keys = torch.arange(self.max_seq_len, device=self.q.device)
        return (keys[None, :] < self.seq_lens[:, None]).view(len(self.lens), 1, 1, -1)


def _graphed(fn, enabled: bool):
    """Capture fn in a CUDA graph (after a warm-up) when enabled: times launch-free replays.

    The replay is checked to be the whole computation: the captured output is poisoned
    with NaN and must be rewritten by ``graph.replay()`` alone. Work that ran eagerly
    during capture (a launch on a stream other than the capturing one) is not in the
    graph, leaves the NaN, and the cell shows ``n/a`` instead of an empty graph's time.
    """
    if not enabled:
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    if not isinstance(res, torch.Tensor) or not res.is_floating_point():
        raise RuntimeError(f"graph row: expected a floating-point tensor output, got {type(res).__name__}")
    res.fill_(float("nan"))
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    if not bool(torch.isfinite(res).all()):
        raise RuntimeError("CUDA graph replay left NaN/Inf in the NaN-poisoned output: the work is not in the "
                           "captured graph (or it computes non-finite values)")

    def replay():
        graph.replay()
        return res

    return replay


def _setup_ours_decode(prob: Problem, x: DecodeInputs):
    import prims_ts

    out = torch.empty_like(x.q)
    b, hq, d = x.q.shape
    ps = x.cache.shape[3]
    last = x.seq_lens - (x.indptr[1:] - x.indptr[:-1] - 1) * ps
    w = prims_ts.BatchDecodePagedTSWrapper(tuning=_tuning(x))
    w.plan(x.indptr, x.indices, last, hq, x.cache.shape[2], d, ps, q_data_type=x.q.dtype)

    def fn():
        return w.run(x.q, x.cache, out=out)

    return _graphed(fn, x.graph)


def _setup_sdpa_decode(prob: Problem, x: DecodeInputs):
    import torch.nn.functional as F

    q, k, v = x.contiguous()
    mask = x.key_mask() if x.ragged else None  # ragged: the padded keys masked (off the flash kernels)

    def fn():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).squeeze(2)

    return _graphed(fn, x.graph)


def _setup_flex_decode(prob: Problem, x: DecodeInputs):
    block_mask = None
    if x.ragged:  # each request's keys: Flex skips the padding's blocks
        from torch.nn.attention.flex_attention import create_block_mask

        lens = x.seq_lens

        def keys_mod(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]

        block_mask = create_block_mask(keys_mod, B=len(x.lens), H=None, Q_LEN=1, KV_LEN=x.max_seq_len,
                                       device=x.q.device)
    call = _flex_call(*x.contiguous(), block_mask=block_mask)

    def fn():
        return call().squeeze(2)

    return _graphed(fn, x.graph)


register_family(Family(
    name="decode",
    problems=_decode_problems,
    make_inputs=DecodeInputs,
    runners=[
        Runner("prims_ts", _setup_ours_decode),
        Runner("sdpa", _setup_sdpa_decode),
        Runner("flex", _setup_flex_decode),
    ],
    reference="sdpa",
))


# ----------------------------------------------------------------------------
# MLA decode (SPEC §4): the standalone path (preallocated workspace and out) over a
# page-64 latent cache with shuffled pages, beside a plain-PyTorch MLA (bmm + softmax
# + bmm) on the same latents stored contiguously. Memory-bound rows count the latent
# cache's bytes (B * L * 576 * 2); compute-bound rows 2 * H * SQ * L * (576 + 512)
# FLOPs per request.
# ----------------------------------------------------------------------------

MLA_DQK, MLA_DV = 576, 512


def _mla_problems() -> List[Problem]:
    shapes = [
        # (B, L, H, SQ, unit, quick, graph)
        (64, 8192, 16, 1, "TB/s", True, False),  # memory-bound (issue 5 floor: 3.5 TB/s)
        (128, 4096, 128, 1, "TFLOP/s", True, False),  # compute-bound (issue 5 floor: 300 TFLOP/s)
        (16, 4096, 128, 1, "TFLOP/s", False, False),  # a small batch: split-KV of the 64-row tile
        (1, 1024, 16, 1, "TB/s", True, True),  # latency: CUDA graphs on both sides
    ]
    out = []
    for b, n, h, sq, unit, quick, graph in shapes:
        work = b * n * MLA_DQK * 2 if unit == "TB/s" else b * 2 * h * sq * n * (MLA_DQK + MLA_DV)
        out.append(Problem(
            family="mla",
            name=f"B{b} L{n} H{h} SQ{sq} page64" + (" graphs" if graph else ""),
            params=dict(B=b, L=n, H=h, SQ=sq, page_size=64, graph=graph, dtype="bf16"),
            work=float(work),
            unit=unit,
            quick=quick,
        ))
    return out


class MLAInputs:
    """q [B, SQ, H, 576]; a latent cache [P, 64, 576] with shuffled pages and its block table;
    the same latents contiguous [B, L, 576] for the plain-PyTorch peer."""

    def __init__(self, prob: Problem, device: torch.device):
        import prims_ts

        p = prob.params
        b, n, h, sq, ps = p["B"], p["L"], p["H"], p["SQ"], p["page_size"]
        dt = torch.bfloat16
        g = torch.Generator(device=device)
        g.manual_seed(0)
        self.graph = p["graph"]
        self.scale = 1.0 / math.sqrt(MLA_DQK)
        self.q = torch.randn(b, sq, h, MLA_DQK, device=device, dtype=dt, generator=g)
        per = (n + ps - 1) // ps
        self.cache = torch.randn(b * per, ps, MLA_DQK, device=device, dtype=dt, generator=g)
        perm = torch.randperm(b * per, generator=torch.Generator().manual_seed(1)).to(torch.int32)
        self.block_tables = perm.view(b, per).to(device)
        self.seq_lens = torch.full((b,), n, device=device, dtype=torch.int32)
        self.max_seq_len = n
        self.ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_mla_workspace_size(
            b, h, 512, 64, ps, n, max_seq_len_q=sq, device=device), dtype=torch.uint8, device=device)
        self._contig = None

    def contiguous(self):
        """q as [B, SQ * H, 576] (rows token-major) and the latents as [B, L, 576] in logical order."""
        if self._contig is None:
            b, sq, h, _ = self.q.shape
            kv = self.cache[self.block_tables.long()]  # [B, per, ps, 576]
            kv = kv.reshape(b, -1, MLA_DQK)[:, : self.max_seq_len].contiguous()
            self._contig = (self.q.reshape(b, sq * h, MLA_DQK), kv)
        return self._contig


def _setup_ours_mla(prob: Problem, x: MLAInputs):
    import prims_ts

    out = torch.empty(tuple(x.q.shape[:-1]) + (MLA_DV,), device=x.q.device, dtype=torch.bfloat16)
    b, sq, h, _ = x.q.shape
    w = prims_ts.BatchMLADecodePagedTSWrapper(tuning=_tuning(x))
    w.plan(x.block_tables, x.seq_lens, h, 512, 64, x.cache.shape[1], seq_len_q=sq, mask_type="causal",
           max_kv_len=x.max_seq_len)

    def fn():
        return w.run(x.q, x.cache, bmm1_scale=x.scale, out=out)

    return _graphed(fn, x.graph)


def _setup_torch_mla(prob: Problem, x: MLAInputs):
    """Plain PyTorch: S = Q K^T (bmm), softmax in float32, O = P V (bmm; V = the latents' first 512
    columns, a strided view). Bottom-right causal for SQ > 1 (the same rule as ours)."""
    q, kv = x.contiguous()
    v = kv[..., :MLA_DV]
    b, sq, h, _ = x.q.shape
    n = kv.shape[1]
    hidden = None
    if sq > 1:
        i = torch.arange(sq, device=q.device).view(sq, 1)
        j = torch.arange(n, device=q.device).view(1, n)
        hidden = (j > n - sq + i).view(1, sq, 1, n)

    def fn():
        s = torch.bmm(q, kv.transpose(1, 2)).float().mul_(x.scale)  # [B, SQ * H, L]
        if hidden is not None:
            s = s.view(b, sq, h, n).masked_fill(hidden, float("-inf")).view(b, sq * h, n)
        p = torch.softmax(s, dim=-1).to(q.dtype)
        return torch.bmm(p, v).view(b, sq, h, MLA_DV)

    return _graphed(fn, x.graph)


register_family(Family(
    name="mla",
    problems=_mla_problems,
    make_inputs=MLAInputs,
    runners=[
        Runner("prims_ts", _setup_ours_mla),
        Runner("torch", _setup_torch_mla),
    ],
    reference="torch",
))


# ----------------------------------------------------------------------------
# block-sparse (SPEC §5): B2 S8192 H32/8 D128 bf16 over page-64 HND pools (shuffled
# pages), BSR routes with q_block = kv_block = 64 or 128 drawn per (request, K/V head,
# row): each block with probability `density`, the diagonal block always; dense inside
# the blocks. Ours: a wrapper planned once, only run(out=) timed. Peer: FlexAttention
# with the same routes as a BlockMask of full blocks (block size = the BSR block size;
# every query head of a K/V head's group gets that head's routes). Useful TFLOP/s =
# 4 * D * (selected (query, key) pairs summed over requests and query heads), i.e.
# 4 * B * Hq * D * the mean selected pairs; the name shows the selected fraction.
# ----------------------------------------------------------------------------

BSR_DENSITIES = (1.0, 0.5, 0.25, 0.1)  # 1.0: every block (the "dense time" of the 10% <= 0.2x rule)
BSR_BLOCK_SIZES = (64, 128)


@functools.lru_cache(maxsize=16)
def bsr_block_mask(batch: int, hkv: int, n_blocks: int, density: float, seed: int) -> torch.Tensor:
    """Routes as a dense bool block table [B, Hkv, R, C] (R = C = n_blocks, Sq = Sk) on the CPU:
    each block with probability ``density``, the diagonal block of every row always. Cached:
    the problem list (work) and the inputs (tensors) see the same table; do not modify it."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(batch, hkv, n_blocks, n_blocks, generator=g) < density
    diag = torch.arange(n_blocks)
    m[:, :, diag, diag] = True
    return m


def _bsr_problems() -> List[Problem]:
    b, s, hq, hkv, d, ps = 2, 8192, 32, 8, 128, 64
    out = []
    for bs in BSR_BLOCK_SIZES:
        for density in BSR_DENSITIES:
            seed = testing.stable_seed("bsr", bs, density)
            m = bsr_block_mask(b, hkv, s // bs, density, seed)
            selected = int(m.sum())
            pairs = selected * bs * bs * (hq // hkv)  # over (request, query head)
            frac = selected / m.numel()
            label = "100%" if density == 1.0 else f"{round(100 * density)}% ({frac:.3f})"
            out.append(Problem(
                family="block_sparse",
                name=f"B{b} S{s} H{hq}/{hkv} D{d} block{bs} {label}",
                params=dict(B=b, Sq=s, Sk=s, Hq=hq, Hkv=hkv, D=d, causal=False, page_size=ps, block_size=bs,
                            density=density, selected=round(frac, 4), seed=seed, dtype="bf16"),
                work=4.0 * d * pairs,
                quick=density == 0.1,
            ))
    return out


class BlockSparseInputs(PagedPrefillInputs):
    """The paged-prefill inputs (q, shuffled page-64 pools, contiguous copies for the peer) plus
    CSR pages, the BSR routes (block_indptr / block_indices from the family's block table) and,
    on demand, the equivalent FlexAttention BlockMask."""

    def __init__(self, prob: Problem, device: torch.device):
        super().__init__(prob, device)
        p = prob.params
        b, s, hkv, bs = p["B"], p["Sq"], p["Hkv"], p["block_size"]
        if p["Sq"] != p["Sk"] or s % bs or s % p["page_size"]:
            raise ValueError("block_sparse family: expects Sq == Sk, multiples of the block and page sizes")
        self.block_size, self.hq, self.hkv = bs, p["Hq"], hkv
        self.routes = bsr_block_mask(b, hkv, s // bs, p["density"], p["seed"])  # [B, Hkv, R, C], CPU
        self.kv_indptr = torch.arange(b + 1, device=device, dtype=torch.int32) * (s // self.page_size)
        self.kv_indices = self.block_tables.reshape(-1)
        counts = self.routes.sum(-1).to(torch.int64)  # [B, Hkv, R]; rows back to back in (b, h, r) order
        ends = counts.flatten().cumsum(0).view(counts.shape)
        starts = ends - counts
        self.block_indptr = torch.cat([starts, ends[..., -1:]], dim=-1).to(torch.int32).to(device)
        self.block_indices = self.routes.nonzero()[:, 3].to(torch.int32).to(device)  # sorted within a row

    def flex_block_mask(self):
        """The same routes for FlexAttention: the K/V head's table repeated for each query head of
        its group, every selected block a full block (the compiled kernel skips the others and
        never calls mask_mod on full blocks); the mask_mod indexes the same table, so that the
        mask is also right where Flex evaluates it elementwise (eager mode ignores block lists)."""
        from torch.nn.attention.flex_attention import BlockMask

        bs = self.block_size
        m = self.routes.to(self.q.device).repeat_interleave(self.hq // self.hkv, dim=1)  # [B, Hq, R, C]
        full_num = m.sum(-1, dtype=torch.int32)
        full_idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # selected first

        def routes_mod(b, h, q_idx, kv_idx):
            return m[b, h, q_idx // bs, kv_idx // bs]

        return BlockMask.from_kv_blocks(torch.zeros_like(full_num), torch.zeros_like(full_idx), full_num, full_idx,
                                        BLOCK_SIZE=bs, mask_mod=routes_mod, seq_lengths=(self.sq, self.sk))


def _setup_ours_bsr(prob: Problem, x: BlockSparseInputs):
    import prims_ts

    p = prob.params
    bs = x.block_size
    w = prims_ts.BlockSparsePagedTSWrapper(tuning=_tuning(x))
    w.plan(x.kv_indptr, p["Sq"], p["Sk"], p["Hq"], p["Hkv"], p["D"], bs, bs, x.page_size,
           max_blocks_per_row=-(-p["Sk"] // bs), use_kv_valid_bits=False, seq_lens_kv=x.seq_lens, mask_type="dense",
           q_data_type=x.q.dtype)
    out = torch.empty_like(x.q)
    cache = (x.k_cache, x.v_cache)

    def fn():
        return w.run(x.q, cache, x.kv_indices, x.block_indptr, x.block_indices, out=out)

    return fn


def _setup_ours_bsr_contiguous(prob: Problem, x: BlockSparseInputs):
    """The same routes over the contiguous K/V [B, S, Hkv, D] (BlockSparseTSWrapper)."""
    import prims_ts

    p = prob.params
    bs = x.block_size
    w = prims_ts.BlockSparseTSWrapper(tuning=_tuning(x))
    w.plan(p["B"], p["Sq"], p["Sk"], p["Hq"], p["Hkv"], p["D"], bs, bs, device=x.q.device,
           max_blocks_per_row=-(-p["Sk"] // bs), use_kv_valid_bits=False, mask_type="dense", q_data_type=x.q.dtype)
    out = torch.empty_like(x.q)

    def fn():
        return w.run(x.q, x.k, x.v, x.block_indptr, x.block_indices, out=out)

    return fn


def _setup_flex_bsr(prob: Problem, x: BlockSparseInputs):
    bs = x.block_size
    # Flex's tiles must divide the mask's blocks: its defaults (BLOCK_M 128) do not divide 64
    opts = {"BLOCK_M": bs, "BLOCK_N": bs} if bs < 128 else None
    call = _flex_call(*x.bhsd(), block_mask=x.flex_block_mask(), kernel_options=opts)

    def fn():
        return _to_bshd(call())

    return fn


register_family(Family(
    name="block_sparse",
    problems=_bsr_problems,
    make_inputs=BlockSparseInputs,
    runners=[
        Runner("prims_ts", _setup_ours_bsr),
        Runner("prims_ts_contiguous", _setup_ours_bsr_contiguous),
        Runner("flex", _setup_flex_bsr),
    ],
    reference="flex",
))
