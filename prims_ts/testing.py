"""Accuracy helpers shared by the self-check, the benchmarks and the test suites.

The project's accuracy rule: ‖out − ref‖ / ‖ref‖ against a float64 reference, at most
``TOLERANCE[input dtype]``; NaN or Inf in the output never passes.
"""
from __future__ import annotations

import zlib
from typing import List, Sequence

import torch

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 5e-3}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN/Inf anywhere in ``out`` gives NaN (never passes)."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(device=o.device, dtype=torch.float64)
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} differs from the reference's {tuple(r.shape)}")
    if not bool(torch.isfinite(o).all()):
        return float("nan")
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``relative_error`` for tests: fails outright on NaN/Inf (an unwritten element, a poisoned
    slot read, or bad math) instead of returning NaN."""
    assert not torch.isnan(out).any(), "NaN in the output (an unwritten element, a poisoned slot read, or bad math)"
    assert torch.isfinite(out).all(), "Inf in the output"
    return relative_error(out, ref)


def stable_seed(*parts) -> int:
    """A seed that is stable across processes (``hash()`` of a str is salted per process)."""
    return zlib.crc32(repr(parts).encode())


def cumsum0(xs: Sequence[int]) -> List[int]:
    """Offsets ``[0, x0, x0+x1, ...]`` of a list of lengths (an indptr)."""
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def assert_opcheck_passed(result, names=OPCHECK_TESTS) -> None:
    """``torch.library.opcheck``'s result dict: exactly ``names`` ran, each a SUCCESS."""
    assert set(result) == set(names), result
    bad = {k: v for k, v in result.items() if v != "SUCCESS"}
    assert not bad, bad


def huge_page_stride(pool: torch.Tensor) -> torch.Tensor:
    """A one-page view of a paged pool whose page stride is 2**31 elements (nothing past
    page 0 is touched, so no storage is needed for it): the validation tests' pool whose
    page addresses would overflow int32."""
    return pool.as_strided((1,) + tuple(pool.shape[1:]), (2**31,) + pool.stride()[1:])
