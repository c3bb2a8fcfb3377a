"""Command line: ``python -m prims_ts {info,check,bench,warmup}``.

* ``info``   — GPU(s), torch / CuPy / NVRTC versions, kernel cache directory.
* ``check``  — every public API on random problems vs. the float64 reference
               (GPU if available, else CPU with small sizes); exit 1 on any failure.
* ``bench``  — our ops beside torch SDPA (cuDNN, FLASH) and FlexAttention on the GPU.
* ``warmup`` — NVRTC-compiles every kernel specialisation of the default tuning
               (``--variants``: the other tunings' too) into the disk cache (no GPU
               needed); exit 1 on a compile error (with ``--strict``, also when ptxas
               serialised a kernel's wgmma pipeline).

The case and problem lists live in ``prims_ts/check.py`` and ``prims_ts/bench.py``
(one registry entry per API); this module only parses arguments and reports.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings
from typing import List, Optional


def _gpu_lines() -> List[str]:
    import torch

    if not torch.cuda.is_available():
        return ["no GPU (torch.cuda.is_available() is False)"]
    from .cuda import runtime

    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {p.name}, cc {p.major}.{p.minor} -> {runtime.arch_for_capability(p.major, p.minor)}, "
                     f"{p.multi_processor_count} SMs, {p.total_memory / 2 ** 30:.1f} GiB")
    return lines


def cmd_info(args) -> int:
    import torch

    import prims_ts
    from .cuda import runtime

    rows = [("prims_ts", f"{prims_ts.__version__} ({prims_ts.__path__[0]})"),
            ("python", platform.python_version()),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")]
    try:
        import cupy

        rows.append(("cupy", cupy.__version__))
    except Exception as e:
        rows.append(("cupy", f"not importable ({type(e).__name__}: {e})"))
    try:
        rows.append(("nvrtc", ".".join(map(str, runtime.nvrtc_version()))))
    except Exception as e:
        rows.append(("nvrtc", f"unavailable ({e})"))
    if torch.cuda.is_available():
        try:
            import cupy

            v = cupy.cuda.runtime.driverGetVersion()
            rows.append(("driver", f"CUDA {v // 1000}.{v % 1000 // 10}"))
        except Exception:
            pass
    for i, line in enumerate(_gpu_lines()):
        rows.append(("gpu" if i == 0 else "", line))
    cdir = runtime.cache_dir()
    n = len(list(cdir.glob("*/*.cubin"))) if cdir.is_dir() else 0
    rows.append(("cache", f"{cdir} ({n} cubins; $PRIMS_TS_CACHE_DIR overrides)"))
    try:
        archs = sorted({_default_arch(), "sm_90a", "sm_80"})
        counts = ", ".join(f"{len(_kernel_keys(a))} for {a} ({len(_kernel_keys(a, True))} with variants)"
                           for a in archs)
        rows.append(("kernels", f"{counts} (python -m prims_ts warmup [--arch A] [--variants] compiles them)"))
    except Exception as e:
        rows.append(("kernels", f"could not list ({e})"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def cmd_check(args) -> int:
    import torch

    from . import check

    if args.list:
        for api, cases in check.REGISTRY.items():
            for c in cases:
                print(f"{api}: {c.name}")
        return 0
    if args.device:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("check: --device cuda requested but no CUDA GPU is visible", file=sys.stderr)
            return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        print("GPU: " + _gpu_lines()[device.index or 0])
    results = check.run_checks(device, apis=args.api, match=args.k)
    if not results:
        print("check: no case matched the selection", file=sys.stderr)
        return 1
    return 0 if all(r.ok for r in results) else 1


def cmd_bench(args) -> int:
    from . import bench

    if args.list:
        for p in bench.select_problems(args.quick, args.family, args.k):
            print(f"{p.family}: {p.name}{'  [quick]' if p.quick else ''}")
        return 0
    runners = [r.strip() for r in args.runners.split(",")] if args.runners else None
    tuning = None
    if args.tuning is not None:
        from .cuda.keys import Tuning

        tuning = Tuning.decode(args.tuning)
    if args.paths:
        from . import bench_paths

        return bench_paths.run(json_path=args.json, match=args.k, families=args.family)
    return bench.run_bench(quick=args.quick, json_path=args.json, plot_path=args.plot, families=args.family,
                           match=args.k, runners=runners, tuning=tuning)


def _default_arch() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            from .cuda import runtime

            return runtime.device_arch(torch.cuda.current_device())
    except Exception:
        pass
    return "sm_90a"


def _kernel_keys(arch: str, variants: bool = False):
    """Every kernel specialisation for `arch`: the default tuning's, and with `variants` the
    tunings that tests and A/B runs select (``cuda.catalog``)."""
    from .cuda import catalog

    return catalog.all_keys(arch, variants=variants)


def _compile_one(arch: str, ks):
    """Compile one kernel (a warmup job; also run in worker processes): (how, seconds, ptxas
    notes, error or None)."""
    from .cuda import runtime

    warnings.simplefilter("ignore", runtime.KernelPerformanceWarning)  # reported by the caller
    cached = runtime.cache_path(ks, arch).exists()
    t0 = time.perf_counter()
    try:
        runtime.compile_cubin(ks, arch)
    except Exception as e:
        return "FAILED", time.perf_counter() - t0, [], f"{e}"
    notes = runtime.perf_notes.get((arch, ks.name), [])
    return ("cached" if cached else "compiled"), time.perf_counter() - t0, notes, None


def cmd_warmup(args) -> int:
    from .cuda import runtime

    archs = args.arch or [_default_arch()]
    plan = [(arch, ks) for arch in archs for ks in _kernel_keys(arch, args.variants)]
    total = len(plan)
    width = len(str(total))
    try:
        nvrtc = ".".join(map(str, runtime.nvrtc_version()))
    except Exception as e:
        print(f"warmup: NVRTC is not available: {e}", file=sys.stderr)
        return 1
    jobs = max(1, args.jobs)
    print(f"warmup: {total} kernels for {', '.join(archs)} with NVRTC {nvrtc} -> {runtime.cache_dir()}"
          + (f" ({jobs} processes)" if jobs > 1 else ""))
    failures, slow = [], set()
    t_all = time.perf_counter()
    if jobs == 1:
        results = (_compile_one(arch, ks) for arch, ks in plan)
    else:
        import concurrent.futures as cf

        pool = cf.ProcessPoolExecutor(jobs)
        results = pool.map(_compile_one, [a for a, _ in plan], [k for _, k in plan])
    for i, ((arch, ks), (how, secs, notes, err)) in enumerate(zip(plan, results), 1):
        if err is not None:
            failures.append((arch, ks.key))
            print(f"[{i:>{width}}/{total}] {arch} {ks.key} FAILED {secs:.1f}s", flush=True)
            print(err, file=sys.stderr, flush=True)
            continue
        if notes:
            slow.add(ks.name)
        print(f"[{i:>{width}}/{total}] {arch} {ks.key} {secs:.1f}s {how}" + (" SERIALISED WGMMA" if notes else ""),
              flush=True)
        for n in notes:
            print(f"    {n}", flush=True)
    print(f"warmup: {total - len(failures)}/{total} ok in {time.perf_counter() - t_all:.1f}s")
    if slow:
        print(f"warmup: ptxas serialised the wgmma pipeline of {len(slow)} kernel(s): {', '.join(sorted(slow))}",
              file=sys.stderr)
    if failures:
        print(f"warmup: {len(failures)} kernel(s) failed to compile: "
              + ", ".join(f"{k} ({a})" for a, k in failures), file=sys.stderr)
        return 1
    return 1 if slow and args.strict else 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m prims_ts", description="prims_ts attention kernels: tools")
    sub = ap.add_subparsers(dest="command", metavar="{info,check,bench,warmup}")
    sub.required = True

    p = sub.add_parser("info", help="GPU, versions, kernel cache")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("check", help="correctness vs. the float64 reference (GPU if available, else CPU)")
    p.add_argument("--device", help="cpu | cuda | cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--api", action="append", help="only this API (repeatable), e.g. batch_prefill")
    p.add_argument("-k", metavar="SUBSTR", help="only cases whose 'api name' contains SUBSTR")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("bench", help="side-by-side benchmark vs. torch SDPA and FlexAttention (GPU)")
    p.add_argument("--quick", action="store_true", help="a representative subset")
    p.add_argument("--json", metavar="PATH", help="write machine-readable results here")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart here (needs matplotlib)")
    p.add_argument("--family", action="append", help="only this problem family (repeatable), e.g. prefill")
    p.add_argument("-k", metavar="SUBSTR", help="only problems whose 'family name' contains SUBSTR")
    p.add_argument("--runners", metavar="A,B", help="only these runners, e.g. prims_ts,sdpa_cudnn")
    p.add_argument("--tuning", metavar="SPEC", help="plan our wrappers with this Tuning (Tuning.encode() form, "
                   "e.g. 'loop=1' or 'persistent=True;loop=0'): A/B runs")
    p.add_argument("--paths", action="store_true", help="the call paths instead: host us per call and one-call "
                   "latency of each way to call each API (one-shot, wrapper run, standalone, graph replay) and "
                   "of the peers'")
    p.add_argument("--list", action="store_true", help="list the problems and exit")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("warmup", help="NVRTC-compile every kernel into the disk cache (no GPU needed)")
    p.add_argument("--arch", action="append",
                   help="target, e.g. sm_90a or sm_80 (repeatable; default: this GPU's, else sm_90a)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when ptxas serialised a kernel's wgmma pipeline (CI; needs a cold cache)")
    p.add_argument("--variants", action="store_true",
                   help="also the kernels of the non-default tunings that tests and A/B runs select")
    p.add_argument("--jobs", type=int, default=1, metavar="N", help="compile in N processes (default 1)")
    p.set_defaults(func=cmd_warmup)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
