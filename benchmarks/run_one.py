"""Run one bench problem's runner a few times and nothing else (for ncu / nsys /
compute-sanitizer), on the bench's own problems and inputs:

    python benchmarks/run_one.py FAMILY "PROBLEM SUBSTRING" [RUNNER] [CALLS]

e.g. `python benchmarks/run_one.py mla "B64 L8192 H16"` or
`python benchmarks/run_one.py prefill "B2 S4096 H32/8 D128 causal" prims_ts 5`.
RUNNER defaults to prims_ts, CALLS to 3; the problem substring must pick exactly one.
PT_TUNING (a `Tuning.encode()` string, e.g. "loop=1") plans our runners with another tuning.
"""
import os
import sys

import torch


def main() -> None:
    from prims_ts import bench

    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    family, match = sys.argv[1], sys.argv[2]
    runner = sys.argv[3] if len(sys.argv) > 3 else "prims_ts"
    calls = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    problems = [p for p in bench.select_problems(False, [family]) if match in p.name]
    if len(problems) != 1:
        raise SystemExit(f"{family} {match!r}: {len(problems)} problems match: {[p.name for p in problems]}")
    prob, fam = problems[0], bench.FAMILIES[family]
    inputs = fam.make_inputs(prob, torch.device("cuda"))
    if os.environ.get("PT_TUNING"):
        from prims_ts.cuda.keys import Tuning

        inputs.tuning = Tuning.decode(os.environ["PT_TUNING"])
    fn = next(r for r in fam.runners if r.name == runner).setup(prob, inputs)
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    print(f"{family}: {prob.name}: {runner} x {calls}, tuning {os.environ.get('PT_TUNING') or 'default'}")


if __name__ == "__main__":
    main()
