"""Small prefill (contiguous and paged) cases for compute-sanitizer (not collected by pytest).

    compute-sanitizer --tool memcheck python tests/gpu_sanitize.py
"""
import torch

import prims_ts
from prims_ts import reference as R


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    for d in (128, 256):
        for mask, window in (("dense", -1), ("causal", -1), ("causal", 5), ("variable_window", -1)):
            q = torch.randn(2, 70, 4, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(2, 133, 2, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            s = e = None
            if mask == "variable_window":
                a = torch.randint(0, 133, (2, 70), device=dev, dtype=torch.int32)
                b = torch.randint(0, 133, (2, 70), device=dev, dtype=torch.int32)
                s, e = torch.minimum(a, b), torch.maximum(a, b)
            out = prims_ts.batch_prefill(q, k, v, mask_type=mask, window_left=window, variable_window_token_starts=s,
                                         variable_window_token_ends=e, out_dtype=torch.float32)
            ref = R.batch_prefill(q, k, v, mask_type=mask, window_left=window, window_starts=s, window_ends=e,
                                  compute_dtype=torch.float64)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"d={d} {mask}{window}: rel err {err:.2e}")
            assert err < 2e-2
        qo = torch.tensor([0, 1, 60, 129], dtype=torch.int32, device=dev)
        kvo = torch.tensor([0, 5, 70, 200], dtype=torch.int32, device=dev)
        q = torch.randn(129, 4, d, device=dev, dtype=torch.float16)
        k = torch.randn(200, 1, d, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        out = prims_ts.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal")
        ref = R.batch_prefill(q, k, v, qo_indptr=qo, kv_indptr=kvo, mask_type="causal", compute_dtype=torch.float64)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3
    # paged prefill: shuffled pages, a padded row-strided table, lengths not page multiples
    for ps in (16, 128):
        pool = 12
        kc = torch.randn(pool, 2, ps, 128, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        wide = torch.randperm(pool, device=dev).to(torch.int32).view(2, 6)
        table = wide[:, :4]
        lens = torch.tensor([3 * ps + 1, 2 * ps - 5], dtype=torch.int32, device=dev)
        qo = torch.tensor([0, 20, 45], dtype=torch.int32, device=dev)
        q = torch.randn(45, 8, 128, device=dev, dtype=torch.bfloat16)
        out = prims_ts.batch_prefill_with_paged_kv_cache(q, kc, vc, qo, table, lens, page_size=ps, mask_type="causal")
        ref = R.batch_prefill_paged(q, kc, vc, qo, table, lens, mask_type="causal", compute_dtype=torch.float64)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"paged ps={ps}: rel err {err:.2e}")
        assert err < 2e-2
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
