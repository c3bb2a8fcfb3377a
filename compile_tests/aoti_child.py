"""Run an AOTInductor check in a child process (shared by the compile test files).

A crash while loading a compiled AOTInductor package (seen on a torch 2.11+cu130
image, where loading *any* package segfaulted) must fail or skip one test, not kill
the whole pytest session. The child imports the calling test module and calls its
``_aoti_body(package_path, device)``.
"""
import os
import subprocess
import sys

import pytest
import torch

_CHILD = """
import sys
sys.path[:0] = [{here!r}, {root!r}]
import {module} as t
t._aoti_body({path!r}, {device!r})
print("AOTI_OK")
"""

_CANARY = """
import sys, torch
class M(torch.nn.Module):
    def forward(self, x):
        return (x * 2).sin()
x = torch.randn(64, 128, device=sys.argv[2])
ep = torch.export.export(M(), (x,))
m = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1]))
torch.testing.assert_close(m(x), M()(x))
print("CANARY_OK")
"""


def run_aoti_in_child(module_file: str, device: str, tmp_path) -> None:
    here = os.path.dirname(os.path.abspath(module_file))
    module = os.path.splitext(os.path.basename(module_file))[0]
    code = _CHILD.format(here=here, root=os.path.dirname(here), module=module, device=device,
                         path=str(tmp_path / f"{module}_{device}.pt2"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    if res.returncode == 0 and "AOTI_OK" in res.stdout:
        return
    log = f"rc={res.returncode}\n--- stdout ---\n{res.stdout[-4000:]}\n--- stderr ---\n{res.stderr[-8000:]}"
    if res.returncode < 0:  # killed by a signal: is AOTInductor usable here at all?
        canary = subprocess.run([sys.executable, "-c", _CANARY, str(tmp_path / "canary.pt2"), device],
                                capture_output=True, text=True, timeout=1200)
        if canary.returncode != 0:
            pytest.skip(f"AOTInductor ({device}) is broken in this environment: a trivial (x*2).sin() package "
                        f"also fails (rc={canary.returncode}, torch {torch.__version__}); prims_ts run: {log[:300]}")
    pytest.fail(f"AOTInductor run of {module} failed:\n{log}")
