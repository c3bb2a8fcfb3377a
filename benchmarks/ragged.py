"""Split-KV on uneven batches (a measurement aid, not part of the bench): paged decode and MLA
decode over batches whose requests differ in length, each under the static split
(``balanced_split=False``), balanced split-KV (``True``) and the default (None: a plan balances
where ``decode.balanced_by_lengths`` finds the lengths uneven), in one process, with the ratio
that decides (``decode.ragged_ratio``: the static split's estimated time over the balanced
grid's, the twin MLA tile's charged with its walk's costs; ``RAGGED_RATIO`` the threshold,
``RAGGED_RATIO_TWIN`` the twin's).

    python benchmarks/ragged.py [--rows "decode B64 32768x1+1024x63" "mla16 B32 rand8192" ...]
        [--tunings "balanced_split=False" "balanced_split=True" "" "balanced_split=False"]

A row: the family (``decode``: Hq 32 / Hkv 8, D128, page 32; ``mlaH``: MLA with H heads, page
64), the batch, and the lengths: ``LENxCOUNT+...`` or ``randMAX`` (uniform in [1, MAX], seeded).
Each line: the median of the bench's timer as TB/s of K/V (latent) bytes. Reading: balanced
should win where the ratio is large and lose by no more than its uniform-row cost (~2-6%)
where it is near 1; the default should take the faster of the two on each row.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prims_ts import bench  # noqa: E402
from prims_ts.cuda import decode as K  # noqa: E402
from prims_ts.cuda.keys import Tuning, device_limits  # noqa: E402

ROWS = [
    "decode B64 32768x1+1024x63", "decode B8 32768x1+2048x7", "decode B32 16384x4+2048x28",
    "decode B128 8192x16+1024x112", "decode B16 131072x1+4096x15", "decode B64 rand8192",
    "decode B256 rand4096", "decode B4 65536x2+4096x2",
    "mla16 B64 32768x1+2048x63", "mla16 B32 rand16384", "mla64 B16 65536x1+4096x15",
    "mla128 B32 32768x1+2048x31", "mla128 B64 rand8192",
    # the twin at H128 and H64 around its bar (RAGGED_RATIO_TWIN): uncharged ratios 1.38, 1.46,
    # 1.65, 1.65, 1.83, 2.36, 3.0 on 132 SMs
    "mla128 B64 6144x16+4096x48", "mla128 B64 6144x8+4096x56", "mla128 B64 7168x8+4096x56",
    "mla128 B64 4096x16+2048x48", "mla128 B64 8192x8+4096x56", "mla128 B64 8192x16+2048x48",
    "mla128 B64 8192x8+2048x56",
    "mla64 B64 6144x16+4096x48", "mla64 B64 6144x8+4096x56", "mla64 B64 4096x16+2048x48",
    "mla64 B64 8192x8+4096x56", "mla64 B64 8192x16+2048x48", "mla64 B64 8192x8+2048x56",
]


def lengths(spec: str, b: int) -> list:
    if spec.startswith("rand"):
        top = int(spec[4:])
        return [int(x) for x in np.random.default_rng(7).integers(1, top + 1, size=b)]
    out = []
    for part in spec.split("+"):
        n, c = part.split("x")
        out += [int(n)] * int(c)
    if len(out) != b:
        raise SystemExit(f"{spec!r}: {len(out)} lengths for B{b}")
    return out


def choice(fam: str, lens: list, dev) -> tuple:
    """(balanced by the default, the ratio balanced_by_lengths weighs) for the row."""
    arch, sms, limit = device_limits(dev)
    a = np.asarray(lens)
    if fam == "decode":
        shape = (len(lens), 8, 4, 1, 128, max(lens), sms, limit)
    else:
        shape = (len(lens), 1, int(fam[3:]), 1, K.MLA_DIM_QK, max(lens), sms, limit)
    bal, pol = K.decode_policy(*shape, -1), K.decode_policy(*shape)
    twin = K.takes_twin(pol, shape[4], arch)  # the twin's charged ratio
    ratio = K.ragged_ratio(a, pol, bal.balanced, shape[1], twin) if bal.balanced else 0.0
    picked = K.balanced_by_lengths(Tuning(), a, *shape, arch).balanced_split
    return bool(picked), ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--tunings", nargs="+",
                    default=["balanced_split=False", "balanced_split=True", "", "balanced_split=False"])
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}; timer {bench.timer_name()}")
    for row in args.rows:
        fam, b, spec = row.split()
        b = int(b[1:])
        lens = lengths(spec, b)
        if fam == "decode":
            family = bench.FAMILIES["decode"]
            params = dict(B=b, L=max(lens), Hq=32, Hkv=8, D=128, page_size=32, graph=False, dtype="bf16", lens=lens)
            prob = bench.Problem(family="decode", name=row, params=params, work=float(4 * sum(lens) * 8 * 128),
                                 unit="TB/s")
            x = bench.DecodeInputs(prob, dev)
        else:
            family = bench.FAMILIES["mla"]
            params = dict(B=b, L=max(lens), H=int(fam[3:]), SQ=1, page_size=64, graph=False, dtype="bf16")
            prob = bench.Problem(family="mla", name=row, params=params, work=float(sum(lens) * K.MLA_DIM_QK * 2),
                                 unit="TB/s")
            x = bench.MLAInputs(prob, dev)
            x.seq_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
        ours = next(r for r in family.runners if r.name == "prims_ts")
        picked, ratio = choice(fam, lens, dev)
        print(f"{row}: ratio {ratio:.2f}, the default {'balances' if picked else 'splits statically'}")
        for spec_t in args.tunings:
            x.tuning = Tuning.decode(spec_t)
            ms = bench.time_ms(ours.setup(prob, x))
            print(f"  {spec_t or 'default':24s} {ms * 1e3:8.1f} us {prob.work / ms / 1e9:6.3f} TB/s")
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
