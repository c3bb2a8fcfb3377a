"""Time the bandwidth rows of paged decode and MLA decode under forced static split counts (a
tuning aid, not part of the bench), beside SDPA on the decode rows, in one process:

    python benchmarks/split_sweep.py [--rows "decode 1 131072" "mla 64 8192 16" ...] [--splits 16 24 29 33 ...]
        [--tunings "" "cluster_merge=False"] [--trace]

A row: ``decode B L`` (H32/8 D128, page 32, the bench's decode inputs) or ``mla B L H`` (page 64,
the bench's MLA inputs). Each line: the split count (``policy``: the library's), the CTAs it
launches, the bench's time of one call (a graph of one launch, after an L2 flush) and TB/s of
K/V bytes, and the largest difference from the policy's output (a split count moves only the
rounding), under each of ``--tunings`` (``Tuning.encode()`` strings; default: the default
tuning alone). The question it answers: whether a launch that leaves some resident slots empty
(fewer CTAs than slots, so that some SMs hold one CTA, as SDPA's split heuristic does) streams
faster than the one that fills every slot (``decode._split_target``'s choice). With ``--trace``,
each launch once more under ``Tuning.cta_trace`` (cta_trace.py's keys): how its CTAs lay over
the SMs (SMs used, CTAs an SM at most), their times and the launch's span.
"""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prims_ts import bench  # noqa: E402
from prims_ts.cuda import decode as K  # noqa: E402
from prims_ts.cuda.keys import Tuning  # noqa: E402

ROWS = ["decode 1 131072", "decode 16 32768", "decode 64 8192 64", "mla 64 8192 16"]
SPLITS = [None, 1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 26, 29, 31, 33, 40, 48, 66]


def forced(base, splits):
    """decode_policy with `splits` static splits (None: the library's; at most one a key tile),
    the chunk re-derived by decode.with_splits (also latency_sweep.py's)."""
    base = getattr(base, "__wrapped__", base)

    def policy(batch, hkv, group, sq, d, max_seq_len, *rest):
        pol = base(batch, hkv, group, sq, d, max_seq_len, *rest)
        if splits is None:
            return pol
        s = max(1, min(splits, -(-max_seq_len // pol.bn)))
        return K.with_splits(dataclasses.replace(pol, balanced=0), s, max_seq_len)
    return policy


def placement_line(tr) -> str:
    """A traced launch's CTAs over the SMs (cta_trace.read's rows: start ns, end ns, SM, ...): the SMs
    used, the most CTAs an SM held and how many SMs held two or more, the CTAs' times and the span."""
    import numpy as np

    per_sm = np.bincount(tr[:, 2])
    dur = (tr[:, 1] - tr[:, 0]) / 1e3
    return (f"{len(tr)} CTAs on {np.count_nonzero(per_sm)} SMs (at most {per_sm.max()} an SM, {np.sum(per_sm >= 2)} "
            f"SMs with two or more); CTA us median {np.median(dur):.1f} min {dur.min():.1f} max {dur.max():.1f}; "
            f"span {(tr[:, 1].max() - tr[:, 0].min()) / 1e3:.1f} us")


def placement(fn, ws) -> None:
    """One launch of a `_ctatrace` key after an L2 flush (`ws` zeroed): placement_line of its trace."""
    import cupy

    import cta_trace as CT

    rows = CT.trace_rows()
    fn()  # the key loaded
    torch.cuda.synchronize()
    modules = CT.traced_modules()
    for m in modules:
        cupy.cuda.runtime.memset(CT.global_ptr(m), 0, rows * CT.trace_words() * 8)
    ws.zero_()
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    traces = [t for t in (CT.read(m, rows) for m in modules) if len(t)]
    print(f"    trace: {placement_line(traces[0]) if len(traces) == 1 else f'{len(traces)} traced keys recorded'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--splits", nargs="+", type=int, default=None)
    ap.add_argument("--tunings", nargs="+", default=[""])
    ap.add_argument("--trace", action="store_true", help="each launch once more with its CTAs' SMs and clocks")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    print(f"{torch.cuda.get_device_name(dev)}; timer {bench.timer_name()}")
    counts = [None] + args.splits if args.splits else SPLITS
    ws = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)
    default = K.decode_policy
    for row in args.rows:
        fam, *nums = row.split()
        if fam == "decode":
            b, n = int(nums[0]), int(nums[1])
            hq = int(nums[2]) if len(nums) > 2 else 32
            params = dict(B=b, L=n, Hq=hq, Hkv=8, D=128, page_size=32, graph=False, dtype="bf16")
            prob = bench.Problem(family="decode", name=row, params=params, work=float(4 * b * n * 8 * 128),
                                 unit="TB/s")
            x = bench.DecodeInputs(prob, dev)
            sdpa = next(r for r in bench.FAMILIES["decode"].runners if r.name == "sdpa")
            ms = bench.time_ms(sdpa.setup(prob, x))
            print(f"{row}: SDPA {ms * 1e3:8.1f} us {prob.work / ms / 1e9:6.3f} TB/s")
            d, hkv, ps, mq = 128, 8, 32, None
            q, cache, out = x.q, x.cache, torch.empty_like(x.q)
        else:
            b, n, h = int(nums[0]), int(nums[1]), int(nums[2])
            params = dict(B=b, L=n, H=h, SQ=1, page_size=64, graph=False, dtype="bf16")
            prob = bench.Problem(family="mla", name=row, params=params, work=float(b * n * K.MLA_DIM_QK * 2),
                                 unit="TB/s")
            x = bench.MLAInputs(prob, dev)
            d, hq, hkv, ps = K.MLA_DIM_QK, h, 1, 64
            q, cache = x.q, x.cache
            out = torch.empty(*q.shape[:-1], K.MLA_DIM_V, device=dev, dtype=dt)

        def make(launch):  # the row's call of a prepared launch
            if fam == "decode":
                def fn():
                    launch.run(q, cache, None, ws, out, x.indptr, x.indices, x.seq_lens, None, d ** -0.5, 1.0)
                    return out
            else:
                def fn():
                    launch.run(q, cache, None, ws, out, None, x.block_tables, x.seq_lens, None, d ** -0.5, 1.0,
                               bt_stride=x.block_tables.stride(0))
                    return out
            return fn

        ref = None
        for spec, splits in [(t, c) for t in args.tunings for c in counts]:
            K.decode_policy = forced(default, splits)
            try:
                tuning = Tuning.decode(spec)
                launches = [K.PreparedDecode(K.DecodeStatic(dt, d, hq, hkv, ps, False, -1, dt, b, 1, 1, n, False, t),
                                             dev.index or 0)
                            for t in ([tuning, dataclasses.replace(tuning, cta_trace=True)] if args.trace else [tuning])]
                launch = launches[0]
            except Exception as e:  # noqa: BLE001
                print(f"  splits {splits}: {type(e).__name__}: {str(e)[:160]}")
                continue
            finally:
                K.decode_policy = default
            fn = make(launch)
            ws.zero_()
            fn()
            got = out.float().clone()
            ref = got if ref is None else ref
            diff = (got - ref).abs().max().item()
            ms = bench.time_ms(bench._graphed(fn, True))
            pol = launch.policy
            grid = K.decode_grid(pol, hkv, b)
            label = "policy" if splits is None else str(splits)
            print(f"  {spec or 'default':20s} splits {label:>6} ({pol.splits:3d}, grid {grid[0] * grid[1] * grid[2]:5d}, "
                  f"cluster {launch.launch.cluster}) "
                  f"{ms * 1e3:8.1f} us {prob.work / ms / 1e9:6.3f} TB/s  maxdiff {diff:.1e}")
            if args.trace:
                placement(make(launches[1]), ws)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
