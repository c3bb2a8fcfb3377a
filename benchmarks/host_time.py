"""Where the host time of each eager path goes (what a serving loop pays in Python).

    PYTHONPATH=. python benchmarks/host_time.py [--match TEXT] [--top N]

For each problem and path of ``bench --paths`` (peers left out): the CPU time per call over
200 back-to-back calls (one-shots: 20 calls, each on an idle GPU, as they read metadata on the
host), then the top cProfile entries of those calls by own time. ``bench --paths`` gives the
figures beside the peers; this says which lines cost them.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch

from prims_ts import bench as B
from prims_ts import bench_paths as P


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--match", default=None)
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    for fam, prob in P.problems(None, a.match):
        x = B.FAMILIES[fam].make_inputs(prob, dev)
        for name, fn in P.PATHS[fam][0](prob, x):
            if isinstance(fn, BaseException) or not name.startswith("ours"):
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
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            if idle:  # where a one-shot's host work goes, call by call
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.top)
            body = s.getvalue()
            body = body[body.find("ncalls"):]
            print(f"== {fam} {prob.name} | {name}: host {host * 1e6:.1f} us/call\n{body}")
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
