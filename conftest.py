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


@pytest.fixture(params=[0, 1, 2], ids=["loop0", "loop1", "loop2"])
def fmha_loop(request, monkeypatch):
    """The consumer loops of the prefill-family kernels' producer ring (kernels.FMHA_LOOP):
    the default one and, on sm_90a, the overlapped (1) and pingpong (2) ones, selected
    explicitly until one is the default. Modules opt in with
    ``pytest.mark.usefixtures("fmha_loop")``."""
    from prims_ts.cuda import kernels

    if request.param != kernels.FMHA_LOOP:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the producer ring's other consumer loops are sm_90a kernels")
        monkeypatch.setattr(kernels, "FMHA_LOOP", request.param)
    return request.param
