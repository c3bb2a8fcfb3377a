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


@pytest.fixture(params=["loop", "overlap"])
def fmha_loop(request, monkeypatch):
    """The wgmma consumer loops of the prefill-family kernels: the plain one and, on sm_90a,
    the software-pipelined one (kernels.FMHA_OVERLAP), selected explicitly until it is the
    default. Modules opt in with ``pytest.mark.usefixtures("fmha_loop")``."""
    if request.param == "overlap":
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the overlapped consumer loop is an sm_90a kernel")
        from prims_ts.cuda import kernels

        monkeypatch.setattr(kernels, "FMHA_OVERLAP", True)
    return request.param
