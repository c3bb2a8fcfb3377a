"""Where a pair of the twin MLA tile spends its clocks (a measurement aid, not part of the bench):

    python benchmarks/twin_trace.py [B L H] [--tuning SPEC]... [--timeline N]

Runs MLA decode (bf16, one query token, page 64, shuffled pages, a request of L keys each) once
per tuning SPEC (a Tuning.encode() string, or `default`: the library's default), each with
Tuning.twin_trace: the `_trace` keys, compiled with PT_TWIN_TRACE, in which the grid's first
and last 8 CTAs record clock64 at each step of their pairs (pt_fmha_twin.cuh: TwinEvent,
TwinItemEvent). Clocks are an SM's: both warpgroups of a CTA run on one SM, so their stamps
compare. Prints, per tuning and warpgroup, the median clocks from a pair's start to each of its
steps and the pair's length (the middle pairs; the grid's first and last CTAs apart), warpgroup
1's lag behind warpgroup 0, the item's prologue and epilogue; then `--timeline` pairs of the
first traced CTA, each step's clock from the item's start; then the kernel's time a call with
and without the trace (the bench's timer, `bench.time_ms`).
"""
import argparse
import ctypes
import dataclasses
import re
from pathlib import Path

import numpy as np
import torch

HEADER = Path(__file__).resolve().parent.parent / "prims_ts" / "cuda" / "include" / "pt_fmha_twin.cuh"
PAIR_STEPS = ["start", "P(own) out", "P(oth) in", "1st PV done", "2nd PV done", "S issued", "S done"]
ITEM_STEPS = ["start", "first S", "reference", "pass done", "end", "smid", "tiles", "globaltimer"]


def layout():
    """(CTAS, PAIRS, EVENTS) as pt_fmha_twin.cuh defines them."""
    text = HEADER.read_text()
    return tuple(int(re.search(rf"#define TWIN_TRACE_{n} (\d+)", text).group(1)) for n in ("CTAS", "PAIRS", "EVENTS"))


def read_trace(module: int, shape) -> np.ndarray:
    import cupy
    from cupy_backends.cuda.api import driver

    ptr = driver.moduleGetGlobal(module, "pt_twin_trace")
    host = np.zeros(shape, dtype=np.int64)
    cupy.cuda.runtime.memcpy(host.ctypes.data_as(ctypes.c_void_p).value, ptr, host.nbytes, 2)  # device to host
    return host


def clear_trace(module: int, nbytes: int) -> None:
    import cupy
    from cupy_backends.cuda.api import driver

    cupy.cuda.runtime.memset(driver.moduleGetGlobal(module, "pt_twin_trace"), 0, nbytes)


def summarize(tr: np.ndarray, pairs_cap: int, timeline: int) -> None:
    """tr: [slot][warpgroup][pair + 1][event] clocks (the last row the item's steps); the slots'
    first half the grid's first CTAs, the second half its last (a partial last wave runs with
    less contention: the halves are reported apart)."""
    item = tr[:, :, pairs_cap]
    half = tr.shape[0] // 2
    for name, group in (("first CTAs", range(half)), ("last CTAs", range(half, tr.shape[0]))):
        slots = [c for c in group if item[c, 0, 6] > 0 and item[c, 1, 6] > 0]
        if slots:
            print(f"  {name}:")
            summarize_slots(tr, item, slots, pairs_cap)
    traced = [c for c in range(tr.shape[0]) if item[c, 0, 6] > 0]
    if not traced:
        print("  no traced CTA ran the twin tile (rows of 64 on sm_90a only)")
    elif timeline:
        c = traced[0]
        base = item[c, 0, 0]
        print(f"  CTA slot {c} (SM {item[c, 0, 5]}, {item[c, 0, 6]} tiles), clocks from the item's start:")
        print("  " + " " * 15 + "".join(f"{s:>13}" for s in PAIR_STEPS))
        for i in range(min(timeline, pairs_cap)):
            for w in (0, 1):
                cells = "".join(f"{(v - base) if v > 0 else '-':>13}" for v in tr[c, w, i, :len(PAIR_STEPS)])
                print(f"    pair {i:>2} wg {w}:{cells}")


def summarize_slots(tr: np.ndarray, item: np.ndarray, slots, pairs_cap: int) -> None:
    steps = {w: {e: [] for e in range(1, len(PAIR_STEPS))} for w in (0, 1)}
    period, lag, prologue, epilogue, items, reruns = {0: [], 1: []}, [], [], [], [], 0
    for c in slots:
        tiles = int(item[c, 0, 6])
        if item[c, 0, 4] == 0:
            reruns += 1  # a rerun (or an unfinished item): its end is not recorded
            continue
        items.append(item[c, 0, 4] - item[c, 0, 0])
        prologue.append(tr[c, 0, 0, 0] - item[c, 0, 0])
        epilogue.append(item[c, 0, 4] - item[c, 0, 3])
        # the middle pairs: not the first (the first tile's S before it), both warpgroups with a
        # next S (2 i + 3 < tiles), and the next pair's start recorded (its length)
        for i in range(1, pairs_cap - 1):
            if 2 * i + 3 >= tiles:
                break
            lag.append(tr[c, 1, i, 0] - tr[c, 0, i, 0])
            for w in (0, 1):
                start = tr[c, w, i, 0]
                period[w].append(tr[c, w, i + 1, 0] - start)
                for e in steps[w]:
                    if tr[c, w, i, e] > 0:
                        steps[w][e].append(tr[c, w, i, e] - start)
    med = lambda xs: f"{int(np.median(xs)):>7d}" if len(xs) else "      -"
    print(f"    {len(slots)} traced CTAs ({reruns} with a rerun or unfinished: left out)")
    if not lag:
        print("    no middle pair (items of fewer than 6 tiles): the item's steps alone")
    else:
        print("    median clocks from a pair's start (its middle pairs):")
        print("    " + " " * 14 + "".join(f"{s:>13}" for s in PAIR_STEPS[1:]) + f"{'pair':>9}")
        for w in (0, 1):
            print(f"    warpgroup {w}:  " + "".join(f"{med(steps[w][e]):>13}" for e in steps[w]) +
                  f"{med(period[w]):>9}")
        print(f"    warpgroup 1's pair start behind warpgroup 0's: {med(lag).strip()} clocks")
    print(f"    item: {med(items).strip()} clocks; start to the first pair {med(prologue).strip()}, "
          f"the first pass's end to the epilogue's {med(epilogue).strip()}")


def main() -> None:
    from mla_sweep import MLA_DQK, MLA_DV, mla_inputs  # this directory's

    from prims_ts import Tuning
    from prims_ts.bench import time_ms, timer_name
    from prims_ts.cuda import decode as K

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", nargs="*", type=int, default=[128, 4096, 128], help="B L H (default 128 4096 128)")
    ap.add_argument("--tuning", action="append", default=None, help="a Tuning.encode() string (repeatable)")
    ap.add_argument("--timeline", type=int, default=4, help="pairs of the first traced CTA to print")
    args = ap.parse_args()
    b, n, h = args.shape
    ctas, pairs_cap, events = layout()
    shape = (ctas, 2, pairs_cap + 1, events)
    ps, dt = 64, torch.bfloat16
    q, cache, bt, lens, ws, out = mla_inputs(b, n, h, ps)
    flops = 2.0 * b * h * n * (MLA_DQK + MLA_DV)
    for spec in args.tuning or ["default"]:
        tuning = dataclasses.replace(Tuning.decode("" if spec == "default" else spec), twin_trace=True)
        static = K.DecodeStatic(dt, MLA_DQK, h, 1, ps, False, -1, dt, b, 1, 1, n, False, tuning)
        launch = K.PreparedDecode(static, 0)

        def run():
            launch.run(q, cache, None, ws, out, None, bt, lens, None, MLA_DQK ** -0.5, 1.0, bt_stride=bt.stride(0))

        run()
        torch.cuda.synchronize()
        print(f"B{b} L{n} H{h}, tuning '{spec}': key {launch.key.name}, grid {launch.launch.grid}")
        loaded = launch.launch.kernel
        if not launch.key.trace:
            print("  not a traced twin key (rows of 64 on sm_90a only)")
            continue
        clear_trace(loaded.module, int(np.prod(shape)) * 8)
        run()
        torch.cuda.synchronize()
        summarize(read_trace(loaded.module, shape), pairs_cap, args.timeline)
        plain = K.PreparedDecode(dataclasses.replace(static, tuning=dataclasses.replace(tuning, twin_trace=False)), 0)
        for label, prepared in (("traced", launch), ("untraced", plain)):
            ms = time_ms(lambda: prepared.run(q, cache, None, ws, out, None, bt, lens, None, MLA_DQK ** -0.5, 1.0,
                                              bt_stride=bt.stride(0)))
            print(f"  kernel {label}: {ms:.4f} ms a call ({timer_name()}), {flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
