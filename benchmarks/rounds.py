"""A bench run's timing rounds, row by row: each runner's ms in each round with the runner
timed just before it, and each runner's mean ratio to its own median after each predecessor.

    python benchmarks/rounds.py BENCH.json [--family F] [--match SUBSTR]

What it is for: whether the runner timed before another slows it (a heavy kernel's power or
clock state outliving its turn), which the rows' medians cannot tell. Needs a run that kept its
rounds (`round_orders`, `rounds_ms`: bench.py since the thirty-ninth session).
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def rounds(row: dict):
    """[(round, runner, predecessor, ms)] of one row, in timing order (the predecessor of a
    round's first runner is the previous round's last; None: the row's first)."""
    orders = row.get("round_orders") or []
    seen = defaultdict(int)
    out = []
    prev = None
    for k, order in enumerate(orders):
        for name in order:
            ms = (row["runners"].get(name) or {}).get("rounds_ms") or []
            if seen[name] < len(ms):
                out.append((k, name, prev, ms[seen[name]]))
                seen[name] += 1
            prev = name
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench")
    ap.add_argument("--family")
    ap.add_argument("--match", default="")
    a = ap.parse_args(argv)
    with open(a.bench) as f:
        rows = json.load(f)["rows"]
    after = defaultdict(list)  # (runner, predecessor) -> ms / the runner's median in its row
    for row in rows:
        if (a.family and row["family"] != a.family) or a.match not in row["problem"]:
            continue
        rs = rounds(row)
        if not rs:
            continue
        print(f"{row['family']} {row['problem']}")
        for k, name, prev, ms in rs:
            med = row["runners"][name]["ms"]
            print(f"  round {k}  {name:22s} after {str(prev):22s} {ms:9.4f} ms  x {ms / med:.3f} of its median")
            after[name, prev].append(ms / med)
    if not after:
        print("no rounds in this run (a bench from before rounds were kept?)")
        return 1
    print("mean time over the runner's median, by the runner timed before it:")
    for (name, prev), xs in sorted(after.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        print(f"  {name:22s} after {str(prev):22s} {statistics.mean(xs):.3f} ({len(xs)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
