"""The open issues' bench floors, read from one `python -m prims_ts bench --json` run:

    python benchmarks/floors.py BENCH.json [--base BASE.json]

Prints each floor's row, our figure against it and PASS / FAIL (SKIP: not checked), then a
line per issue; exit status 1 when a floor fails or its row is missing. The floors are the
H200's (the issues measure there): a run on another GPU prints a warning first. `--base`: a
run of the tree before, on the same GPU, for issue 17's "decode and MLA rows no slower than
before" (our ms within the runs' drift, 3%; a verdict near it wants `gpu_session.sh abtree`);
without it that floor is SKIP.
"""
import argparse
import json
import re
import sys
from typing import Dict, List, Optional, Tuple

OURS = "prims_ts"
SLOWER_TOLERANCE = 1.03  # "no slower than before": within the runs' drift (MLA B128 moves ~3%)

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


def check(rows: List[dict], base: Optional[Dict[Tuple[str, str], float]] = None) -> List[Tuple[int, str, str, Optional[bool]]]:
    """(issue, row, what, passed) for every floor's matching rows (a floor that matches no row
    fails: the bench no longer measures it), and with `base` each decode / MLA row's ms against
    it (a row of `base` the run lacks fails); without `base` that floor's one entry has passed
    None (not checked)."""
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
    if base is None:
        out.append((17, "decode / MLA rows", "no slower than before: not checked (no --base)", None))
        return out
    now = {(r["family"], r["problem"]): _ms(r, OURS) for r in rows}
    for (fam, prob), b in base.items():
        if fam not in ("decode", "mla") or not b:
            continue
        ours = now.get((fam, prob))
        if ours is None:
            out.append((17, f"{fam} {prob}", f"no figure now (before {b:.4f} ms)", False))
        else:
            out.append((17, f"{fam} {prob}", f"{ours:.4f} ms, before {b:.4f} (x {b / ours:.3f})",
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
            before = json.load(f)
        other = (before.get("env") or {}).get("gpu", "?")
        if other != gpu:
            print(f"warning: --base ran on {other}, this run on {gpu}: 'no slower' compares two GPUs")
        base = {(r["family"], r["problem"]): _ms(r, OURS) for r in before["rows"]}
    results = check(run["rows"], base)
    for issue, name, what, ok in results:
        print(f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}  #{issue}  {name:52s} {what}")
    for issue in sorted({i for i, *_ in results}):
        fails = sum(1 for i, _, _, ok in results if i == issue and ok is False)
        skips = sum(1 for i, _, _, ok in results if i == issue and ok is None)
        met = "every floor met" if not fails else f"{fails} floor(s) not met"
        print(f"issue {issue}: {met}" + (f"; {skips} not checked" if skips else ""))
    return 1 if any(ok is False for *_, ok in results) else 0


if __name__ == "__main__":
    sys.exit(main())
