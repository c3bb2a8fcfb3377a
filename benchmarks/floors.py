"""The open issues' bench floors, read from one `python -m prims_ts bench --json` run:

    python benchmarks/floors.py BENCH.json [--base BASE.json]

Prints each floor's row, our figure against it and PASS / FAIL, then a line per issue; exit
status 1 when a floor fails or its row is missing. The floors are the H200's (the issues
measure there): a run on another GPU prints a warning first. `--base`: a run of the tree before
(same GPU), for issue 17's "decode and MLA rows no slower than before" (our ms within 2%).
"""
import argparse
import json
import re
import sys
from typing import Dict, List, Optional, Tuple

OURS = "prims_ts"
SLOWER_TOLERANCE = 1.02  # "no slower than before": within the runs' drift

# (issue, family, problem pattern, kind, peer, threshold). Kinds: "speed" ours / peer's speed
# (peer ms / our ms) >= threshold; "time" our ms / peer's ms <= threshold; "rate" our rate
# (the row's unit) >= threshold.
FLOORS: List[Tuple[int, str, str, str, Optional[str], float]] = [
    (17, "prefill", r"^B8 S1024 ", "speed", "sdpa_cudnn", 0.85),
    (17, "prefill", r"^B2 S4096 |^B1 S16384 ", "speed", "sdpa_cudnn", 0.95),
    (17, "paged_prefill", r" page(16|32|64|128)$", "speed", "prims_ts_contiguous", 0.95),
    (17, "block_sparse", r" block128 ", "speed", "flex", 1.25),
    (19, "mla", r"^B128 L4096 H128 ", "rate", None, 550.0),
    (19, "mla", r"^B64 L8192 H16 ", "rate", None, 3.95),
    (19, "decode", r"^B1 L1024 .* graphs$", "time", "sdpa", 1.1),
    (19, "decode", r"^B\d+ L\d+ H\d+/\d+ D\d+ page\d+$", "speed", "sdpa", 1.0),  # the uniform rows
]


def _ms(row: dict, runner: str) -> Optional[float]:
    return (row["runners"].get(runner) or {}).get("ms")


def check(rows: List[dict], base: Optional[Dict[Tuple[str, str], float]] = None) -> List[Tuple[int, str, str, bool]]:
    """(issue, row, what, passed) for every floor's matching rows (a floor that matches no row
    fails: the bench no longer measures it), and with `base` each decode / MLA row's ms."""
    out = []
    for issue, fam, pattern, kind, peer, thr in FLOORS:
        hits = [r for r in rows if r["family"] == fam and re.search(pattern, r["problem"])]
        if not hits:
            out.append((issue, f"{fam} /{pattern}/", "no such row in the run", False))
        for r in hits:
            name, ours = f"{fam} {r['problem']}", _ms(r, OURS)
            other = _ms(r, peer) if peer else None
            if ours is None or (peer and other is None):
                out.append((issue, name, f"no figure ({OURS} or {peer})", False))
            elif kind == "speed":
                x = other / ours
                out.append((issue, name, f"{x:.3f}x {peer} (floor {thr})", x >= thr))
            elif kind == "time":
                x = ours / other
                out.append((issue, name, f"{x:.3f}x {peer}'s time (ceiling {thr})", x <= thr))
            else:
                rate = r["work"] / (ours * 1e-3) / 1e12
                out.append((issue, name, f"{rate:.3g} {r['unit']} (floor {thr})", rate >= thr))
    for r in rows if base else []:
        b, ours = base.get((r["family"], r["problem"])), _ms(r, OURS)
        if r["family"] in ("decode", "mla") and b and ours:
            out.append((17, f"{r['family']} {r['problem']}", f"{ours:.4f} ms, before {b:.4f} (x {b / ours:.3f})",
                        ours <= b * SLOWER_TOLERANCE))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bench")
    ap.add_argument("--base", help="a bench JSON of the tree before, same GPU")
    a = ap.parse_args(argv)
    with open(a.bench) as f:
        run = json.load(f)
    gpu = (run.get("env") or {}).get("gpu", "?")
    if "H200" not in str(gpu):
        print(f"warning: the floors are the H200's; this run is on {gpu}")
    base = None
    if a.base:
        with open(a.base) as f:
            base = {(r["family"], r["problem"]): _ms(r, OURS) for r in json.load(f)["rows"]}
    results = check(run["rows"], base)
    for issue, name, what, ok in results:
        print(f"{'PASS' if ok else 'FAIL'}  #{issue}  {name:52s} {what}")
    for issue in sorted({i for i, *_ in results}):
        fails = sum(1 for i, _, _, ok in results if i == issue and not ok)
        print(f"issue {issue}: {'every floor met' if not fails else f'{fails} floor(s) not met'}")
    return 1 if any(not ok for *_, ok in results) else 0


if __name__ == "__main__":
    sys.exit(main())
