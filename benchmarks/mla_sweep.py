"""Time MLA decode under forced tile policies (a tuning aid, not part of the bench):

    python benchmarks/mla_sweep.py B L H [SPEC ...]

A SPEC is `bm,bn,stages,warps_n,splits` (overrides `decode_policy`; the mma.sync tile for
rows of 16/32; `mma` alone: on the library's policy), `swap` (the default policy on the
swapped-operand tile, sm_90a, its producer copying 4 threads a key row), `swap8` (the
swapped tile with its producer copying 8 threads a key row: Tuning(copy_tpr=8), the default) or
`swap:...` / `swap8:...` with a policy. Each
one's output is compared with the first (the library's default) run's, and its time (CUDA
events, median of 20 x 10 calls) printed with the latent-cache bandwidth and the TFLOP/s.
"""
import sys

import torch

MLA_DQK, MLA_DV = 576, 512


def mla_inputs(b: int, n: int, h: int, ps: int = 64):
    """B requests of n keys, H heads, one query token (bf16): q, the latent pool of shuffled pages,
    its block table, the lengths, a workspace and the output."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    per = (n + ps - 1) // ps
    q = torch.randn(b, 1, h, MLA_DQK, device=dev, dtype=dt)
    cache = torch.randn(b * per, ps, MLA_DQK, device=dev, dtype=dt)
    bt = torch.randperm(b * per, device=dev).to(torch.int32).view(b, per)
    lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    out = torch.empty(b, 1, h, MLA_DV, device=dev, dtype=dt)
    return q, cache, bt, lens, ws, out


def main() -> None:
    from prims_ts import Tuning
    from prims_ts.cuda import decode as K
    from prims_ts.cuda.keys import smem_limit

    b, n, h = (int(x) for x in sys.argv[1:4])
    specs = []
    for arg in sys.argv[4:]:
        if arg == "mma":  # the mma.sync tile on the library's policy
            specs.append(("", None))
            continue
        kind = next((k for k in ("swap8", "swap") if arg.startswith(k)), "")
        shape = arg[len(kind):].lstrip(":")
        specs.append((kind, tuple(int(v) for v in shape.split(",")) if shape else None))
    ps, dt = 64, torch.bfloat16
    q, cache, bt, lens, ws, out = mla_inputs(b, n, h, ps)
    scale = MLA_DQK ** -0.5
    default = K.decode_policy

    def prepare(tuning):
        static = K.DecodeStatic(dt, MLA_DQK, h, 1, ps, False, -1, dt, b, 1, 1, n, False, tuning)
        launch = K.PreparedDecode(static, 0)  # not the per-process cache: each spec its own policy
        wsp = ws if launch.workspace_bytes <= ws.numel() else torch.zeros(launch.workspace_bytes, dtype=torch.uint8,
                                                                          device=ws.device)
        wsp.zero_()  # each policy's split counters live at its own offsets
        fn = lambda: launch.run(q, cache, None, wsp, out, None, bt, lens, None, scale, 1.0,  # noqa: E731
                                bt_stride=bt.stride(0))
        fn.shape = f"splits {launch.policy.splits} cluster {launch.launch.cluster}"
        return fn

    run = prepare(Tuning())
    run()
    ref = out.clone()
    nbytes = b * n * MLA_DQK * 2
    flops = 2.0 * b * h * n * (MLA_DQK + MLA_DV)
    print(f"B{b} L{n} H{h}: default {default(b, 1, h, 1, MLA_DQK, n, 132, smem_limit('sm_90a'))}")
    for kind, spec in [(None, None)] + specs:
        if spec is not None:
            bm, bn, stages, wn, splits = spec
            tiles = (n + bn - 1) // bn
            chunk = ((tiles + splits - 1) // splits) * bn
            pol = K.DecodePolicy(bm, bn, wn, stages, True, (h + bm - 1) // bm, h, splits, chunk)
            K.decode_policy = lambda *a, _p=pol: _p
        tuning = Tuning() if kind is None else Tuning(mla_swapped=kind != "", copy_tpr=8 if kind == "swap8" else 4)
        label = (kind + " " if kind else ("mma.sync " if kind == "" else "library ")) + str(spec or "default")
        try:
            fn = prepare(tuning)
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            times = []
            for _ in range(20):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(10):
                    fn()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) / 10)
            ms = sorted(times)[len(times) // 2]
            print(f"  {label:28s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s  maxdiff {err:.1e}  ({fn.shape})")
        except Exception as e:  # a spec that does not fit: say so and go on
            print(f"  {label}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            K.decode_policy = default


if __name__ == "__main__":
    main()
