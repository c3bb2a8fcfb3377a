"""Every kernel the public APIs can launch: what ``python -m prims_ts warmup`` compiles.

``default_keys(arch)`` are the keys of the default tuning; ``VARIANTS`` the other tunings
that tests and A/B runs select (each builds some keys the default does not), compiled by
``warmup --variants``.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List

from . import runtime
from .block_sparse import block_sparse_keys
from .decode import HEAD_DIMS as DECODE_HEAD_DIMS
from .decode import MLA_DIM_QK, DecodeKey, decode_policy
from .keys import DEFAULT_TUNING, DTYPE_CODES, NOMINAL_SMS, KernelKey, Tuning, smem_limit
from .prefill import HEAD_DIMS as PREFILL_HEAD_DIMS
from .prefill import MASK_CODES, PAGE_SIZES, PrefillKey

# The producer-ring variants of the prefill-family kernels on sm_90a (each selects some keys
# the default does not): the plain (0) and overlapped (1) consumer loops (the default: pingpong),
# persistent CTAs with the plain loop and with pingpong (a few CTAs walk many items), the
# producer copy the default does not take (the swapped MLA tile's too), every producer by
# cp.async (the default: TMA boxes), the MMA warps' leaner instructions everywhere and nowhere
# (Tuning.lean_mma; the default: at D128), the online softmax rescaling on every new running
# maximum (the default keeps a maximum within 2^8: Tuning.lazy_rescale), the overlapped loops'
# softmax under the previous PV everywhere and nowhere (Tuning.softmax_under_pv; the default:
# the prefill keys). The default paged keys lay V out page-major and interleave K's row groups
# where a page is shorter than the key tile (Tuning.page_major_v, Tuning.page_major_k: a key
# per such page size); page 128 checks the panel-major layouts.
RING_VARIANTS: Dict[str, Tuning] = {
    "loop0": Tuning(loop=0),
    "loop1": Tuning(loop=1),
    "loop0_persistent": Tuning(loop=0, persistent=True, persistent_ctas=3),
    "loop2_persistent": Tuning(loop=2, persistent=True, persistent_ctas=3),
    "other_copy": Tuning(flip_copy=True),
    "cp_async": Tuning(tma=False, paged_tma=False),
    "lean_mma": Tuning(lean_mma=True),
    "plain_mma": Tuning(lean_mma=False),
    "eager_rescale": Tuning(lazy_rescale=False),
    "under_pv": Tuning(softmax_under_pv=True),
    "pv_first": Tuning(softmax_under_pv=False),
    "portable": Tuning(portable=True),
}
# The decode-shaped kernels' variants: MLA rows of 16/32 on the mma.sync tile. (The swapped MLA
# tile's other producer copy: RING_VARIANTS' other_copy; split-KV balanced over a persistent
# grid is among the default keys: plans choose it by their lengths.)
DECODE_VARIANTS: Dict[str, Tuning] = {
    "mla_mma": Tuning(mla_swapped=False),
}
VARIANTS: List[Tuning] = list(RING_VARIANTS.values()) + list(DECODE_VARIANTS.values())


def default_keys(arch: str, tuning: Tuning = DEFAULT_TUNING) -> Iterator[KernelKey]:
    """The keys that the public APIs choose on a device of `arch` under `tuning`."""
    for dtype in DTYPE_CODES:
        for d in PREFILL_HEAD_DIMS:
            for mask in MASK_CODES:
                yield PrefillKey.choose(dtype, d, mask, arch, tuning=tuning)
                yield PrefillKey.choose(dtype, d, mask, arch, tuning=tuning, packed=True)
            for mask in ("dense", "causal"):
                for ps in PAGE_SIZES if tuning.page_major_v else (0,):  # page_major_v: a key a short page size
                    yield PrefillKey.choose(dtype, d, mask, arch, paged=True, tuning=tuning, page_size=ps)
    def decode_keys(dt: str, d: int, group: int):
        # one policy per row-tile height (BM 16, 32, 64); where the tuning may balance split-KV
        # (a plan's uneven lengths, or always), the balanced key besides the static one
        pol = decode_policy(1, 1, group, 1, d, 1, NOMINAL_SMS, smem_limit(arch))
        pols = [pol] + ([dataclasses.replace(pol, splits=1, balanced=NOMINAL_SMS)]
                        if tuning.balanced_split is not False else [])
        for p in pols:
            for causal in (False, True):
                yield DecodeKey.of(dt, d, causal, p, arch, tuning)

    for dt in DTYPE_CODES.values():
        for d in DECODE_HEAD_DIMS:
            for group in (1, 32, 64):
                yield from decode_keys(dt, d, group)
        for heads in (16, 32, 64):  # MLA: H rows
            yield from decode_keys(dt, MLA_DIM_QK, heads)
    yield from block_sparse_keys(arch, tuning)


def all_keys(arch: str = "sm_90a", variants: bool = False) -> List[runtime.KernelSource]:
    """The kernel sources of `arch`, one per distinct key: the default tuning's, and with
    `variants` every tuning of VARIANTS too; and the metadata read's kernel (runtime.read_int32)."""
    tunings = [DEFAULT_TUNING] + (VARIANTS if variants else [])
    seen, out = set(), [runtime.read_source()]
    for tuning in tunings:
        for key in default_keys(arch, tuning):
            if key not in seen:
                seen.add(key)
                out.append(key.source())
    return out
