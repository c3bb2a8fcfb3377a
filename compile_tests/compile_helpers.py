"""What the compile test files share: dtypes, the device parameters (the CPU always; CUDA under
the ``cuda`` marker), seeded generators and data on either device, int32 metadata, and the
compiled-vs-eager comparison."""
import pytest
import torch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32
NAN = float("nan")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype, g, device):
    return torch.randn(*shape, generator=g, device=device, dtype=FP32).to(dtype)


def ip(values, device):
    return torch.tensor(values, dtype=I32, device=device)


def close(a, b):
    """Compiled vs eager: the same kernel, so equal up to fused surrounding arithmetic."""
    torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=1e-3)
