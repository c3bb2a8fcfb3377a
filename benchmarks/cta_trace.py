"""A decode launch's edges from its CTAs' clocks (a measurement aid, not part of the bench):

    python benchmarks/cta_trace.py [--family decode] [--family mla] [--match TEXT] [--tuning SPEC] [--repeat N [--reshuffle]]

For each bench problem of the decode and MLA families (or those whose name holds TEXT), plans our
wrapper as the bench does, with Tuning.cta_trace (the `_ctatrace` keys, PT_CTA_TRACE in
fmha_decode.cu: each CTA stores %globaltimer at its start and at its last warp's end, and its
SM, and each of its first items' clocks), and runs it once after a 256 MB write that evicts L2,
as the bench times one call. Prints the launch's span (the first CTA's start to the last one's
end), its CTAs' durations by wave of starts, and each SM's share of the span: busy (a CTA
resident), before its first CTA (the head), after its last (the tail), and between CTAs; the
first wave's CTA times by SM (the slower over the faster CTA of one SM, the share of the
variance between SMs); then the items (a static key's one a CTA, a balanced key's walk): before each one's core (metadata,
page check), its core, after it (the merge). With `--repeat N` (N >= 2) the launch runs N times
and the first wave's mean CTA time by SM is compared between the launches (whether an SM's rate
is the chip's, the same SMs slow every time, or the launch's); `--reshuffle` permutes the page
IDs before each launch after the first (does a rate follow the SM or the pages its CTAs read?).
Then the key's time a call with the trace and without, by the bench's timer (`bench.time_ms`).
"""
import argparse
import ctypes
import dataclasses
import re
from pathlib import Path

import numpy as np
import torch

SOURCE = Path(__file__).resolve().parent.parent / "prims_ts" / "cuda" / "fmha_decode.cu"


def trace_rows() -> int:
    return int(re.search(r"#define CTA_TRACE_MAX (\d+)", SOURCE.read_text()).group(1))


def trace_items() -> int:
    """The items a CTA records (CTA_TRACE_ITEMS); a row is 5 + 4 x that words."""
    return int(re.search(r"#define CTA_TRACE_ITEMS (\d+)", SOURCE.read_text()).group(1))


def trace_words() -> int:
    return 5 + 4 * trace_items()


def traced_modules() -> list:
    """The modules of every `_ctatrace` key loaded so far (a problem's key may have been loaded
    by an earlier problem: the buffer that fills tells which one ran)."""
    from prims_ts.cuda import runtime

    return [k.module for (dev, name), k in runtime._loaded.items() if name.endswith("_ctatrace")]


def global_ptr(module: int) -> int:
    from cupy_backends.cuda.api import driver

    return driver.moduleGetGlobal(module, "pt_cta_trace")


def read(module: int, rows: int) -> np.ndarray:
    import cupy

    host = np.zeros((rows, trace_words()), dtype=np.uint64)
    cupy.cuda.runtime.memcpy(host.ctypes.data_as(ctypes.c_void_p).value, global_ptr(module), host.nbytes, 2)
    return host[host[:, 3] == 1].astype(np.int64)


def summarize(tr: np.ndarray) -> None:
    """tr: [CTA][start ns, end ns, SM, 1, items, then per item: tiles, core start, core end,
    end], the CTAs that recorded."""
    if len(tr) == 0:
        print("    no CTA recorded")
        return
    t0, t1 = tr[:, 0].min(), tr[:, 1].max()
    span = t1 - t0
    dur = tr[:, 1] - tr[:, 0]
    print(f"    {len(tr)} CTAs recorded on {len(set(tr[:, 2]))} SMs; span {span / 1e3:.1f} us")
    # waves of starts: a CTA starts in wave k if k CTAs of its SM started before it and ended
    # before it started (the SM's slots refilled k times)
    starts = np.sort(tr[:, 0])
    resident = int(np.max([np.sum((tr[:, 0] <= s) & (tr[:, 1] > s)) for s in starts]))
    order = np.argsort(tr[:, 0], kind="stable")
    wave = np.zeros(len(tr), dtype=int)
    wave[order] = np.arange(len(tr)) // max(resident, 1)
    print(f"    at most {resident} CTAs resident at once; CTA time by wave of starts (us: median / min / max):")
    for k in range(wave.max() + 1):
        d = dur[wave == k]
        s = tr[wave == k, 0] - t0
        print(f"      wave {k}: {len(d):>5} CTAs, {np.median(d) / 1e3:8.1f} / {d.min() / 1e3:8.1f} / "
              f"{d.max() / 1e3:8.1f}; starts {s.min() / 1e3:.1f}-{s.max() / 1e3:.1f} us into the span")
    head, tail, gaps, busy = [], [], [], []
    for sm in sorted(set(tr[:, 2])):
        rows = tr[tr[:, 2] == sm]
        iv = sorted(zip(rows[:, 0], rows[:, 1]))
        head.append(iv[0][0] - t0)
        covered, end = 0, iv[0][0]
        gap = 0
        cur_s, cur_e = iv[0]
        for s, e in iv[1:]:  # the union of the SM's CTA intervals
            if s > cur_e:
                covered += cur_e - cur_s
                gap += s - cur_e
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        covered += cur_e - cur_s
        tail.append(t1 - cur_e)
        gaps.append(gap)
        busy.append(covered)
    n = len(busy)
    pct = lambda xs: 100.0 * float(np.sum(xs)) / (n * span)
    print(f"    the SMs' time over the span: busy {pct(busy):.1f}%, head {pct(head):.1f}% (median "
          f"{np.median(head) / 1e3:.1f} us), tail {pct(tail):.1f}% (median {np.median(tail) / 1e3:.1f} us), "
          f"between CTAs {pct(gaps):.1f}%")
    print(f"    slot occupancy: the CTAs' time over {resident} slots x the span: "
          f"{100.0 * float(dur.sum()) / (resident * span):.1f}%")
    co_resident(tr)
    items(tr)


def first_wave(tr: np.ndarray) -> tuple:
    """The first wave's CTAs (started within 1 us of the launch's first): their times (ns) and SMs."""
    first = tr[tr[:, 0] - tr[:, 0].min() < 1000]
    return (first[:, 1] - first[:, 0]).astype(float), first[:, 2]


def co_resident(tr: np.ndarray) -> None:
    """Whether the CTAs' unequal times belong to the SM or to the CTA: the CTAs of the first
    wave (started within 1 us of the launch's first) grouped by SM; the slower over the faster
    of each SM's group (two or more CTAs a slot share it), and how much of the first wave's
    variance of CTA time lies between the SMs' means (100%: an SM's CTAs all take its time)."""
    dur, sms = first_wave(tr)
    groups = [dur[sms == sm] for sm in np.unique(sms)]
    if len(dur) < 4 or max(len(g) for g in groups) < 2:
        return
    ratio = np.asarray([g.max() / g.min() for g in groups if len(g) >= 2])
    means = np.asarray([g.mean() for g in groups])
    between = float(sum(len(g) * (g.mean() - dur.mean()) ** 2 for g in groups))
    total = float(((dur - dur.mean()) ** 2).sum()) or 1.0
    print(f"    the first wave by SM: {len(dur)} CTAs on {len(groups)} SMs; slower / faster CTA of an SM "
          f"median {np.median(ratio):.2f} (p90 {np.percentile(ratio, 90):.2f}, max {ratio.max():.2f}); "
          f"the SMs' mean CTA time {means.min() / 1e3:.1f}-{means.max() / 1e3:.1f} us; "
          f"{100.0 * between / total:.0f}% of the variance between SMs")


def sm_means(tr: np.ndarray) -> dict:
    """Each SM's mean CTA time (ns) over the first wave."""
    dur, sms = first_wave(tr)
    return {int(sm): float(dur[sms == sm].mean()) for sm in np.unique(sms)}


def sm_repeat(runs: list) -> None:
    """Whether an SM's rate belongs to the SM (the chip) or to the launch: the first wave's mean
    CTA time by SM in each of several launches of one problem, and the correlation of those
    means between the launches (near 1: the same SMs are slow in every launch, a rate a
    schedule could know ahead; near 0: the launch's own noise)."""
    common = sorted(set.intersection(*(set(r) for r in runs)))
    if len(runs) < 2 or len(common) < 8:
        return
    m = np.asarray([[r[sm] for sm in common] for r in runs])
    rank = np.argsort(np.argsort(m, axis=1), axis=1).astype(float)
    pairs = [(i, j) for i in range(len(runs)) for j in range(i + 1, len(runs))]
    pear = [float(np.corrcoef(m[i], m[j])[0, 1]) for i, j in pairs]
    spear = [float(np.corrcoef(rank[i], rank[j])[0, 1]) for i, j in pairs]
    mean = m.mean(axis=0)
    order = np.argsort(mean)
    print(f"    the SMs' mean CTA time over {len(runs)} launches ({len(common)} SMs): correlation between "
          f"launches {min(pear):.2f}-{max(pear):.2f} (by rank {min(spear):.2f}-{max(spear):.2f}); "
          f"the SMs' means {mean.min() / 1e3:.1f}-{mean.max() / 1e3:.1f} us (spread within an SM across launches: "
          f"median {np.median(m.max(axis=0) / m.min(axis=0)):.3f}x)")
    print(f"    fastest SMs {[common[i] for i in order[:8]]}, slowest {[common[i] for i in order[-8:]]}")


def items(tr: np.ndarray) -> None:
    """Each CTA's items (a static key's one, a balanced key's walk): how many a CTA walks, and
    an item's time in three parts: before its core (the page check; a balanced item also the
    CTA barrier and the walk), its core (the tile: Q, the keys, the epilogue), after its core
    (the merge, where the item's part arrived last); the core's time fitted as a fixed cost
    plus a cost a key tile."""
    n_items = tr[:, 4]
    if not n_items.any():
        return
    k = trace_items()
    counts = {int(c): int(np.sum(n_items == c)) for c in np.unique(n_items)}
    print(f"    items a CTA: {counts}")
    rows = []  # tiles, before, core, after, first
    for row in tr:
        prev = row[0]
        for i in range(min(int(row[4]), k)):
            tiles, c0, c1, end = row[5 + 4 * i: 9 + 4 * i]
            rows.append((tiles, c0 - prev, c1 - c0, end - c1, i == 0))
            prev = end
    a = np.asarray(rows, dtype=float)
    ts, pre, core, post, first = a[:, 0], a[:, 1] / 1e3, a[:, 2] / 1e3, a[:, 3] / 1e3, a[:, 4] > 0
    if len(set(ts)) > 1:
        slope, fixed = np.polyfit(ts, core, 1)
        print(f"    an item's core: {fixed:.2f} us fixed + {slope:.3f} us a tile (fit over {len(ts)} items)")
    q = lambda x: f"{np.median(x):.2f} ({np.percentile(x, 10):.2f}-{np.percentile(x, 90):.2f})"
    for label, sel in (("first items", first), ("later items", ~first)):
        if sel.any():
            print(f"    {label}: {int(sel.sum())}, tiles median {np.median(ts[sel]):.0f} (min {ts[sel].min():.0f}); "
                  f"us median (p10-p90): before the core {q(pre[sel])}, core {q(core[sel])} "
                  f"({q(core[sel] / np.maximum(ts[sel], 1))} a tile), after {q(post[sel])}")
    last = np.minimum(n_items, k)
    gap = (tr[:, 1] - tr[np.arange(len(tr)), 4 + 4 * last]) / 1e3
    print(f"    from the last recorded item's end to the CTA's end: median {np.median(gap):.2f} us")


def reshuffle(x, seed: int) -> None:
    """The inputs' page IDs permuted among themselves (decode's CSR indices, MLA's block table):
    the same requests and lengths over other pages of the pool."""
    name = "indices" if hasattr(x, "indices") else "block_tables"
    ids = getattr(x, name)
    perm = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(1000 + seed)).to(ids.device)
    setattr(x, name, ids.flatten()[perm].view_as(ids).contiguous())


def main() -> None:
    import cupy

    from prims_ts import Tuning
    from prims_ts import bench as B

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", choices=["decode", "mla"], default=None)
    ap.add_argument("--match", default=None, help="only the problems whose name holds this text")
    ap.add_argument("--tuning", default="", help="a Tuning.encode() string, cta_trace added")
    ap.add_argument("--repeat", type=int, default=1,
                    help="launches traced a problem (the first summarised; with 2 or more, the SMs' rates compared)")
    ap.add_argument("--reshuffle", action="store_true",
                    help="with --repeat: the page IDs permuted again (and the launch planned again) before each "
                         "launch after the first, so that each CTA reads other pages on the same SM")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = trace_rows()
    base = Tuning.decode(args.tuning)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for fname in args.family or ["decode", "mla"]:
        fam = B.FAMILIES[fname]
        for prob in fam.problems():
            if args.match and args.match not in prob.name:
                continue
            x = fam.make_inputs(prob, dev)
            runner = next(r for r in fam.runners if r.name == fam.ours)
            print(f"{fname} {prob.name}:")
            fns = {}
            for label, tuning in (("traced", dataclasses.replace(base, cta_trace=True)),
                                  ("untraced", dataclasses.replace(base, cta_trace=False))):
                x.tuning = tuning
                fns[label] = runner.setup(prob, x)
                fns[label]()
                torch.cuda.synchronize()
            modules = traced_modules()
            runs = []
            for rep in range(max(1, args.repeat)):
                if rep and args.reshuffle:
                    reshuffle(x, rep)
                    x.tuning = dataclasses.replace(base, cta_trace=True)
                    fns["traced"] = runner.setup(prob, x)
                for m in modules:
                    cupy.cuda.runtime.memset(global_ptr(m), 0, rows * trace_words() * 8)
                flush.zero_()
                torch.cuda.synchronize()
                fns["traced"]()
                torch.cuda.synchronize()
                traces = [t for t in (read(m, rows) for m in modules) if len(t)]
                if len(traces) != 1:
                    print(f"    {len(traces)} traced keys recorded (expected one): skipped")
                    break
                if rep == 0:
                    summarize(traces[0])
                runs.append(sm_means(traces[0]))
            sm_repeat(runs)
            for label, fn in fns.items():
                print(f"    {label}: {B.time_ms(fn) * 1e3:.1f} us a call ({B.timer_name()})")


if __name__ == "__main__":
    main()
