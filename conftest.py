"""Shared pytest setup: the `cuda` marker, skipped on machines without a GPU."""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# (FMHA_LOOP, PERSISTENT, copy); None: the module's default; copy "other": KV_COPY_FLIP, the copy it does not take
RING_VARIANTS = {"loop0": (0, False, None), "loop1": (1, False, None), "loop2": (2, False, None),
                 "loop0_persistent": (0, True, None), "loop2_persistent": (2, True, None),
                 "other_copy": (None, False, "other")}


@pytest.fixture(params=list(RING_VARIANTS))
def ring_variant(request, monkeypatch):
    """The producer-ring variants of the prefill-family kernels (prefill, paged prefill,
    block-sparse) on sm_90a, each selected explicitly: the plain (0), overlapped (1) and
    pingpong (2) consumer loops (kernels.FMHA_LOOP; the default picks per head dim),
    persistent CTAs walking several work items (kernels.PERSISTENT; with the plain loop and
    with pingpong, which BM 64 block-sparse tiles take as loop 1) and the producer's
    copy the default does not take (kernels.KV_COPY_FLIP: 4 <-> 8 per head dim, default loop). Other devices have no
    ring: they run the first variant only. Modules opt in with
    ``pytest.mark.usefixtures("ring_variant")``."""
    from prims_ts.cuda import kernels

    loop, persistent, tpr = RING_VARIANTS[request.param]
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        if request.param != next(iter(RING_VARIANTS)):
            pytest.skip("the producer ring's variants are sm_90a kernels")
        return loop, persistent
    monkeypatch.setattr(kernels, "FMHA_LOOP", loop)
    monkeypatch.setattr(kernels, "PERSISTENT", persistent)
    if tpr == "other":
        monkeypatch.setattr(kernels, "KV_COPY_FLIP", True)
    if persistent:  # three CTAs: every one walks many items, whatever the problem's size
        monkeypatch.setattr(kernels, "PERSISTENT_CTAS", 3)
    return loop, persistent


@pytest.fixture(params=["lanes", "staged"])
def split_merge(request, monkeypatch):
    """The decode-shaped kernels' split-KV merge (kernels.DECODE_MERGE_STAGED): register
    work units over split lanes, or the partials staged through shared memory; both are in
    every decode kernel. Modules opt in with ``pytest.mark.usefixtures("split_merge")``."""
    from prims_ts.cuda import kernels

    monkeypatch.setattr(kernels, "DECODE_MERGE_STAGED", request.param == "staged")
    return request.param
