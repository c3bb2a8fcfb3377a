"""Where paged decode's bandwidth rows lose to SDPA (a measurement aid, not part of the bench):
the bench's decode problems with the page table shuffled (the bench's) and in order (each
request's pages consecutive in the pool), at page sizes 16-128, under each tuning given, beside
SDPA on the contiguous copy, in one process. In order is not SDPA's layout: the pool stays
[page, K/V, Hkv, slot, D], so one head's rows come in page-sized runs a pool page apart; what
the two orders differ in is the pages' order alone.

    python benchmarks/decode_pages.py [--rows "B128 L4096" ...] [--tunings "" "balanced_split=True" ...]
        [--pages 16 32 64 128] [--batches 64 128 256]

Each line: the median of the bench's timer (``prims_ts.bench.time_ms``) as TB/s of K/V bytes,
and the ratio to SDPA's. Reading: in-order pages faster than shuffled ones say the pages' order
(DRAM rows, address translations) costs part of the gap; the rest is the page layout or the
kernel's stream (the page sizes tell those apart: larger pages, longer runs).
The tunings (``Tuning.encode()`` strings, "" the default) run in the order given (e.g. ""
"balanced_split=True" "balanced_split=True" "" for base / new / new / base).
``--batches`` runs each row at these batch sizes instead of its own (the same lengths), beside
SDPA at each: a gap against SDPA that stays the same in microseconds as the batch grows is a
cost of the launch's start or tail; one that grows with it is the stream's.
"""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prims_ts import bench  # noqa: E402
from prims_ts.cuda.keys import Tuning  # noqa: E402


def ordered(x: "bench.DecodeInputs") -> "bench.DecodeInputs":
    """The same inputs with each request's pages consecutive in the pool (indices 0, 1, 2, ...):
    the cache's page p then holds what the shuffled table's entry p pointed at."""
    y = bench.DecodeInputs.__new__(bench.DecodeInputs)
    y.__dict__.update(x.__dict__)
    y.cache = x.cache[x.indices.long()].contiguous()
    y.indices = torch.arange(len(x.indices), device=x.indices.device, dtype=torch.int32)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["B128 L4096", "B16 L32768"])
    ap.add_argument("--tunings", nargs="+", default=[""],
                    help='Tuning.encode() strings, run in the order given ("": the default)')
    ap.add_argument("--pages", nargs="+", type=int, default=[16, 32, 64, 128])
    ap.add_argument("--batches", nargs="+", type=int, default=None,
                    help="batch sizes to run each row at (default: the row's own)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    fam = bench.FAMILIES["decode"]
    ours = next(r for r in fam.runners if r.name == "prims_ts")
    sdpa = next(r for r in fam.runners if r.name == "sdpa")
    print(f"{torch.cuda.get_device_name(dev)}; timer {bench.timer_name()}")
    for row in args.rows:
        probs = [p for p in fam.problems() if row in p.name]
        if len(probs) != 1:
            raise SystemExit(f"{row!r}: {len(probs)} decode problems match")
        for b in args.batches or [probs[0].params["B"]]:
            run_row(batched(probs[0], b), args, dev, ours, sdpa)


def batched(prob: "bench.Problem", b: int) -> "bench.Problem":
    """The row at batch size b: every request as long as the row's (uniform rows only)."""
    p = prob.params
    if p.get("short") is not None:
        raise SystemExit(f"{prob.name!r}: --batches takes rows of one length")
    old = p["B"]
    name = prob.name.replace(f"B{old} ", f"B{b} ", 1)
    return dataclasses.replace(prob, name=name, params={**p, "B": b}, work=prob.work * b / old)


def run_row(base: "bench.Problem", args, dev, ours, sdpa) -> None:
    ref_ms = None
    for ps in args.pages:
        prob = dataclasses.replace(base, params={**base.params, "page_size": ps})
        x = bench.DecodeInputs(prob, dev)
        if ref_ms is None:  # SDPA reads the contiguous copy: the page size does not matter
            ref_ms = bench.time_ms(sdpa.setup(prob, x))
            print(f"{base.name.rsplit(' page', 1)[0]}: sdpa {ref_ms * 1e3:8.1f} us "
                  f"{prob.work / ref_ms / 1e9:6.3f} TB/s")
        for order, inputs in (("shuffled", x), ("in order", ordered(x))):
            for spec in args.tunings:
                inputs.tuning = Tuning.decode(spec)
                ms = bench.time_ms(ours.setup(prob, inputs))
                print(f"  page {ps:3d} {order:8s} {spec or 'default':28s} {ms * 1e3:8.1f} us "
                      f"{prob.work / ms / 1e9:6.3f} TB/s  x{ref_ms / ms:5.3f} of sdpa  "
                      f"{(ms - ref_ms) * 1e3:+7.1f} us")
        del x, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
