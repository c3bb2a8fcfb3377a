"""Where the host time of each eager path goes (what a serving loop pays in Python).

    PYTHONPATH=. python benchmarks/host_time.py [--match TEXT] [--path TEXT] [--top N]

For each problem and path of ``bench --paths`` (peers left out): the CPU time per call over
200 back-to-back calls (one-shots: 20 calls, each on an idle GPU, as they read metadata on the
host), then the top cProfile entries of those calls by own time. ``bench --paths`` gives the
figures beside the peers; this says which lines cost them.
"""
import argparse
import cProfile
import pstats
import time

import torch

from prims_ts import bench as B
from prims_ts import bench_paths as P


def table(stats: pstats.Stats, calls: int, top: int, key: str) -> str:
    """The top entries by `key` (tottime or cumtime), per call of the path in microseconds
    (under the profiler, which inflates small functions): calls made, own time, inclusive time."""
    rows = []
    for (file, line, fn), (_, nc, tt, ct, _) in stats.stats.items():
        where = f"{file.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}({fn})"
        rows.append((tt if key == "tottime" else ct, nc / calls, tt / calls * 1e6, ct / calls * 1e6, where))
    rows.sort(reverse=True)
    head = f"  by {key}:   calls    own us    incl us  function"
    return "\n".join([head] + [f"  {nc:16.1f} {tt:9.1f} {ct:10.1f}  {w}" for _, nc, tt, ct, w in rows[:top]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--match", default=None)
    ap.add_argument("--path", default=None, help="only the paths whose name holds this text (e.g. one-shot)")
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    for fam, prob in P.problems(None, a.match):
        x = B.FAMILIES[fam].make_inputs(prob, dev)
        for name, fn in P.PATHS[fam][0](prob, x):
            if isinstance(fn, BaseException) or not name.startswith("ours") or (a.path and a.path not in name):
                continue
            n, idle = (20, True) if "one-shot" in name else (200, False)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            host = 0.0
            for _ in range(n):
                t = time.perf_counter()
                fn()
                host += time.perf_counter() - t
                if idle:
                    torch.cuda.synchronize()
            host /= n
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            for _ in range(n):
                prof.enable()
                fn()
                prof.disable()
                if idle:
                    torch.cuda.synchronize()
            torch.cuda.synchronize()
            print(f"== {fam} {prob.name} | {name}: host {host * 1e6:.1f} us/call")
            print(table(pstats.Stats(prof), n, a.top, "tottime"))
            if idle:  # where a one-shot's host work goes, call by call
                print(table(pstats.Stats(prof), n, a.top, "cumtime"))
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
