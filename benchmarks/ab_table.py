"""Compare bench JSON runs row by row (the `gpu_session.sh ab` variants, or any runs):

    python benchmarks/ab_table.py BASE.json OTHER.json [OTHER.json ...] [--runner prims_ts]

For each problem in BASE, prints the runner's ms in BASE and, for each OTHER, its ms and the
speedup BASE / OTHER (> 1: the other is faster), then the geometric mean speedup per family.
Rows a run lacks, or where the runner failed, print "-".
"""
import argparse
import json
import math
import os
from collections import defaultdict
from typing import Dict, List, Optional, Tuple


def load(path: str, runner: str) -> Dict[Tuple[str, str], Optional[float]]:
    """(family, problem) -> the runner's ms; a run that left no readable file has no rows."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["family"], r["problem"]): (r["runners"].get(runner) or {}).get("ms") for r in rows}


def table(base: Dict, others: List[Dict], names: List[str]) -> str:
    lines = [f"{'problem':48s} {'base ms':>9s}" + "".join(f" {n[:14]:>14s} {'x':>6s}" for n in names)]
    logs = defaultdict(lambda: defaultdict(list))
    for (fam, prob), b in base.items():
        cells = []
        for i, o in enumerate(others):
            v = o.get((fam, prob))
            if b and v:
                cells.append(f" {v:14.4f} {b / v:6.3f}")
                logs[fam][i].append(math.log(b / v))
            else:
                cells.append(f" {'-':>14s} {'-':>6s}")
        lines.append(f"{fam + ' ' + prob:48s} {b if b else float('nan'):9.4f}" + "".join(cells))
    for fam, per in logs.items():
        lines.append(f"{'geomean x, ' + fam:48s} {'':9s}" + "".join(
            f" {'':14s} {math.exp(sum(per[i]) / len(per[i])):6.3f}" if per[i] else f" {'':14s} {'-':>6s}"
            for i in range(len(others))))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("others", nargs="+")
    ap.add_argument("--runner", default="prims_ts")
    a = ap.parse_args(argv)
    names = [os.path.splitext(os.path.basename(p))[0] for p in a.others]
    print(table(load(a.base, a.runner), [load(p, a.runner) for p in a.others], names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
