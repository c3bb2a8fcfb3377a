"""Host time per eager call of the public APIs (what a serving loop pays in Python).

    PYTHONPATH=. python benchmarks/host_time.py

Times N back-to-back calls of the standalone decode on the CPU clock with the GPU kept
busy enough to never stall the host (a launch queue deep enough), then prints the top
cProfile entries (``bench --paths`` times every path of every API).
"""
import cProfile
import pstats
import time

import torch

import prims_ts


def main() -> None:
    dev = torch.device("cuda")
    b, hq, hkv, d, n, ps = 1, 32, 8, 128, 131072, 32
    per = n // ps
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(b * per, 2, hkv, ps, d, device=dev, dtype=torch.bfloat16)
    indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * per
    idx = torch.randperm(b * per, device=dev).to(torch.int32)
    lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_workspace_size(b, hq, hkv, d, ps, n), dtype=torch.uint8,
                     device=dev)
    out = torch.empty_like(q)

    def f():
        prims_ts.prims_ts_batch_decode_with_kv_cache(q, cache, ws, indptr, idx, lens, n, out=out)

    for _ in range(20):
        f()
    torch.cuda.synchronize()
    for reps in (50, 200):
        t = time.perf_counter()
        for _ in range(reps):
            f()
        host = (time.perf_counter() - t) / reps
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / reps
        print(f"decode B1 L131072: host {host * 1e6:.1f} us/call, host+gpu {dt * 1e6:.1f} us/call ({reps} calls)")
    cProfile.runctx("for _ in range(200): f()", globals(), locals(), "/tmp/host.prof")
    torch.cuda.synchronize()
    pstats.Stats("/tmp/host.prof").sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
