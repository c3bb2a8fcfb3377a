"""Every compile test starts and ends with a clean Dynamo state (fresh graphs and counters)."""
import pytest
import torch
from torch._dynamo.utils import counters


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
