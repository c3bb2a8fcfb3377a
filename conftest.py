"""Shared pytest setup: the `cuda` marker, skipped on machines without a GPU."""
import pytest
import torch

from prims_ts.cuda.catalog import RING_VARIANTS


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=list(RING_VARIANTS))
def ring_variant(request):
    """A Tuning of the prefill-family kernels' producer ring on sm_90a (prefill, paged prefill,
    block-sparse; ``prims_ts.cuda.catalog.RING_VARIANTS``): the plain (0) and overlapped (1)
    consumer loops (the default: pingpong), persistent CTAs walking several work items (with the plain
    loop and with pingpong, which BM 64 block-sparse tiles take as loop 1; three CTAs, so
    each walks many items), the producer copy the default does not take, and K/V tiles by
    cp.async everywhere (the default: TMA boxes for contiguous K/V and pages), the MMA warps'
    leaner instructions (fmax row maxima, descriptors advanced by adds) at every head dim and at
    none (the default: D128), O rescaled whenever a running maximum moves (the default keeps a
    maximum while within 2^8), the softmax under the previous PV everywhere and nowhere (the
    default: the prefill keys, not block-sparse) and the portable engine (sm_80's mma.sync tiles, no
    ring), which the grids check on a Hopper GPU this way. Tests pass it to a wrapper
    (``tuning=``). Other devices have no ring (the portable engine is theirs): they run the first
    variant only."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        if request.param != "loop0":
            pytest.skip("the producer ring's variants are sm_90a kernels")
    return RING_VARIANTS[request.param]


@pytest.fixture(params=["cluster", "ticket", "balanced"])
def split_merge(request):
    """A Tuning of the decode-shaped kernels' split-KV merge: the static split (never balanced by
    the plan's lengths) with the default merge (on sm_90a the 2-8 splits launched as one
    cluster, merging through distributed shared memory, where the partials fit; the ticket
    merge above), or with the ticket merge at every split count; or balanced
    split-KV (Tuning.balanced_split) over 7 CTAs at every size, so that the grid's small
    problems walk several items a CTA and merge units cut into many parts (sm_90a's MLA tiles'
    of 5 parts or more in two levels: merge_fan 2). Tests pass it to a wrapper (``tuning=``)."""
    from prims_ts import Tuning

    if request.param == "cluster":
        return Tuning(balanced_split=False)
    if request.param == "balanced":
        return Tuning(balanced_split=True, balanced_ctas=7, merge_fan=2)
    return Tuning(cluster_merge=False, balanced_split=False)
