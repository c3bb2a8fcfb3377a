"""Time MLA decode under forced tile policies (a tuning aid, not part of the bench):

    python benchmarks/mla_sweep.py B L H [bm,bn,stages,warps_n,splits ...]

Each policy spec overrides `decode_policy` for one launch shape; its output is compared
with the default policy's, and its time (CUDA events, median of 20 x 10 calls) printed
with the latent-cache bandwidth and the TFLOP/s. Without specs, a built-in list is swept.
"""
import sys

import torch

MLA_DQK, MLA_DV = 576, 512


def main() -> None:
    from prims_ts.cuda import kernels as K

    b, n, h = (int(x) for x in sys.argv[1:4])
    specs = [tuple(int(v) for v in s.split(",")) for s in sys.argv[4:]]
    ps, dev, dt = 64, torch.device("cuda"), torch.bfloat16
    per = (n + ps - 1) // ps
    q = torch.randn(b, 1, h, MLA_DQK, device=dev, dtype=dt)
    cache = torch.randn(b * per, ps, MLA_DQK, device=dev, dtype=dt)
    bt = torch.randperm(b * per, device=dev).to(torch.int32).view(b, per)
    lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    out = torch.empty(b, 1, h, MLA_DV, device=dev, dtype=dt)
    scale = MLA_DQK ** -0.5
    default = K.decode_policy

    def run():
        K.launch_mla(q, cache, ws, out, bt, lens, None, 1, 1, n, False, scale, 1.0)

    run()
    ref = out.clone()
    nbytes = b * n * MLA_DQK * 2
    flops = 2.0 * b * h * n * (MLA_DQK + MLA_DV)
    print(f"B{b} L{n} H{h}: default {default(b, 1, h, 1, MLA_DQK, n, 132, K.smem_limit('sm_90a'))}")
    for spec in [None] + specs:
        if spec is not None:
            bm, bn, stages, wn, splits = spec
            tiles = (n + bn - 1) // bn
            chunk = ((tiles + splits - 1) // splits) * bn
            pol = K.DecodePolicy(bm, bn, wn, stages, True, (h + bm - 1) // bm, h, splits, chunk)
            K.decode_policy = lambda *a, _p=pol: _p
        else:
            K.decode_policy = default
        try:
            out.fill_(float("nan"))
            run()
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            times = []
            for _ in range(20):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(10):
                    run()
                e1.record()
                torch.cuda.synchronize()
                times.append(e0.elapsed_time(e1) / 10)
            ms = sorted(times)[len(times) // 2]
            print(f"  {str(spec or 'default'):28s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s  maxdiff {err:.1e}")
        except Exception as e:  # a spec that does not fit: say so and go on
            print(f"  {spec}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            K.decode_policy = default


if __name__ == "__main__":
    main()
