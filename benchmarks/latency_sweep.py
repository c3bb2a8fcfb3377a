"""Time the small-batch latency rows under forced split-KV counts and every split merge (a
tuning aid, not part of the bench): paged decode B1 L1024 H32/8 D128 (page 32) and MLA B1
L1024 H16 (page 64), each as CUDA-graph replays of 20 calls.

    python benchmarks/latency_sweep.py [SPLITS ...]      (default: 1 2 4 8 16)

Two times a line: *back to back*, the median call of a graph of 20 calls (L2 warm), and
*one call*, the bench's figure (a graph of one call, ``prims_ts.bench.time_ms``: each replay
after an L2 flush). SDPA's lines time its call the same two ways. The first line of each
problem is the library's own policy. Merges: ``cluster`` (the default: on sm_90a 2-8 splits
as one thread block cluster, merging through distributed shared memory) and ``ticket`` (the
ticket merge at every split count). With few CTAs the ticket
merge (the last split CTA reads every split's partial rows) is on the critical path,
so fewer, longer splits may win here where the bandwidth rows want many.
"""
import sys

import torch

from split_sweep import forced  # noqa: E402 (benchmarks/ is the script's own directory)


def graph_us(fn, calls: int = 20, reps: int = 30) -> float:
    """Median microseconds of one call, from replays of a graph of `calls` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def one_call_us(fn) -> float:
    """The bench's figure: a graph of one call replayed after an L2 flush (median us)."""
    from prims_ts.bench import _graphed, time_ms

    return time_ms(_graphed(fn, True)) * 1e3


def main() -> None:
    from prims_ts import Tuning
    from prims_ts.cuda import decode as K

    counts = [int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16]
    dev, dt = torch.device("cuda"), torch.bfloat16
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    default = K.decode_policy

    # paged decode B1 L1024 H32/8 D128, page 32
    n, hq, hkv, d, ps = 1024, 32, 8, 128, 32
    q = torch.randn(1, hq, d, device=dev, dtype=dt)
    cache = torch.randn(n // ps, 2, hkv, ps, d, device=dev, dtype=dt)
    indptr = torch.tensor([0, n // ps], device=dev, dtype=torch.int32)
    indices = torch.randperm(n // ps, device=dev).to(torch.int32)
    lens = torch.tensor([n], device=dev, dtype=torch.int32)
    out = torch.empty_like(q)

    # MLA B1 L1024 H16, page 64
    h, mps = 16, 64
    mq = torch.randn(1, 1, h, 576, device=dev, dtype=dt)
    mcache = torch.randn(n // mps, mps, 576, device=dev, dtype=dt)
    bt = torch.randperm(n // mps, device=dev).to(torch.int32).view(1, -1)
    mout = torch.empty(1, 1, h, 512, device=dev, dtype=dt)

    import torch.nn.functional as F
    k = cache[indices.long(), 0].permute(1, 0, 2, 3).reshape(1, hkv, n, d)
    v = cache[indices.long(), 1].permute(1, 0, 2, 3).reshape(1, hkv, n, d)
    qs = q.unsqueeze(2)
    for label, backend in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                           ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION), ("default", None)):
        def sdpa(backend=backend):
            if backend is None:
                return F.scaled_dot_product_attention(qs, k, v, enable_gqa=True).squeeze(2)
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qs, k, v, enable_gqa=True).squeeze(2)
        try:
            print(f"decode B1 L1024 H32/8 D128: SDPA {label:8}  {graph_us(sdpa):7.2f} us back to back  "
                  f"{one_call_us(sdpa):7.2f} us one call")
        except Exception as e:
            print(f"SDPA {label}: {type(e).__name__}: {str(e)[:160]}")

    def problems(tuning):
        """(name, launch, output) of each row under `tuning`, prepared now (the forced policy)."""
        dec = K.PreparedDecode(K.DecodeStatic(dt, d, hq, hkv, ps, False, -1, dt, 1, 1, 1, n, False, tuning), 0)
        mla = K.PreparedDecode(K.DecodeStatic(dt, 576, h, 1, mps, False, -1, dt, 1, 1, 1, n, False, tuning), 0)
        return (("decode B1 L1024 H32/8 D128",
                 lambda: dec.run(q, cache, None, ws, out, indptr, indices, lens, None, d ** -0.5, 1.0), out),
                ("MLA B1 L1024 H16",
                 lambda: mla.run(mq, mcache, None, ws, mout, None, bt, lens, None, 576 ** -0.5, 1.0,
                                 bt_stride=bt.stride(0)), mout))

    refs = {}
    for splits in [None] + counts:
        for merge in ("cluster", "ticket"):
            label = f"splits {'policy' if splits is None else splits:>6} merge {merge:7}"
            K.decode_policy = forced(default, splits)
            try:
                rows = problems(Tuning(cluster_merge=merge == "cluster"))
            except Exception as e:
                print(f"{label}: {type(e).__name__}: {str(e)[:160]}")
                continue
            finally:
                K.decode_policy = default
            for name, fn, res in rows:
                try:
                    ws.zero_()  # the split counters of each policy start at zero
                    fn()
                    got = res.clone()
                    ref = refs.setdefault(name, got)
                    err = (got.float() - ref.float()).abs().max().item()
                    us, one = graph_us(fn), one_call_us(lambda: (fn(), res)[1])
                    print(f"{name}: {label}  {us:7.2f} us back to back  {one:7.2f} us one call  maxdiff {err:.1e}")
                except Exception as e:
                    print(f"{name}: {label}: {type(e).__name__}: {str(e)[:160]}")


if __name__ == "__main__":
    main()
