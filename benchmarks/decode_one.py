"""Run one decode or MLA bench problem a few times (for ncu / compute-sanitizer):

    python benchmarks/decode_one.py B L Hq Hkv D      paged decode, pages of 32
    python benchmarks/decode_one.py mla B L H         MLA decode, pages of 64
"""
import sys

import torch


def decode(b: int, n: int, hq: int, hkv: int, d: int) -> None:
    import prims_ts

    ps = 32
    dev = torch.device("cuda")
    per = (n + ps - 1) // ps
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(b * per, 2, hkv, ps, d, device=dev, dtype=torch.bfloat16)
    indices = torch.randperm(b * per, device=dev).to(torch.int32)
    indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * per
    lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    ws = torch.zeros(prims_ts.get_prims_ts_batch_decode_workspace_size(b, hq, hkv, d, n), dtype=torch.uint8,
                     device=dev)
    out = torch.empty_like(q)
    for _ in range(3):
        prims_ts.prims_ts_batch_decode_with_kv_cache(q, cache, ws, indptr, indices, lens, n, out=out)


def mla(b: int, n: int, h: int) -> None:
    from prims_ts.cuda import kernels as K

    ps, dev, dt = 64, torch.device("cuda"), torch.bfloat16
    per = (n + ps - 1) // ps
    q = torch.randn(b, 1, h, K.MLA_DIM_QK, device=dev, dtype=dt)
    cache = torch.randn(b * per, ps, K.MLA_DIM_QK, device=dev, dtype=dt)
    bt = torch.randperm(b * per, device=dev).to(torch.int32).view(b, per)
    lens = torch.full((b,), n, device=dev, dtype=torch.int32)
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    out = torch.empty(b, 1, h, 512, device=dev, dtype=dt)
    for _ in range(3):
        K.launch_mla(q, cache, ws, out, bt, lens, None, 1, 1, n, False, K.MLA_DIM_QK ** -0.5, 1.0)


def main() -> None:
    if sys.argv[1] == "mla":
        mla(*(int(x) for x in sys.argv[2:5]))
    else:
        decode(*(int(x) for x in sys.argv[1:6]))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
