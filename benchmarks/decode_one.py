"""Run one decode bench problem a few times (for ncu / compute-sanitizer): python benchmarks/decode_one.py B L Hq Hkv D."""
import sys

import torch


def main() -> None:
    import prims_ts

    b, n, hq, hkv, d = (int(x) for x in sys.argv[1:6])
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
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
