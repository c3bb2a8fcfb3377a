"""Run an AOTInductor check in a child process (shared by the compile test files).

A crash while loading a compiled AOTInductor package must fail or skip one test, not
kill the whole pytest session, so the check runs in a child that imports the calling
test module and calls its ``_aoti_body(package_path, device)``.

A known environment problem: a C++ compiler that links libstdc++ statically into the
package's wrapper library (seen with the H200 image's default ``/opt/gcc/bin/g++``). The
process already holds the system ``libstdc++.so.6`` through torch; the two copies meet and
*any* package segfaults while its model container is created (in ``std::regex`` inside
``parse_device_str``). When the child dies of a signal, a trivial ``(x * 2).sin()`` package
(the canary) tells the environment's fault from ours: if the canary also crashes and a
system ``g++`` exists, the canary and then the check run again with ``CXX`` set to it; only
when no compiler builds a working canary does the test skip. A crash of our own op, with a
compiler that builds a working canary, is a failure.
"""
import os
import shutil
import subprocess
import sys
from typing import Dict, Optional

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

SYSTEM_CXX = ("/usr/bin/g++", "/usr/bin/c++")

# per device: the CXX that built a working canary in this process (None: the default one)
_working_cxx: Dict[str, Optional[str]] = {}


def _env(cxx: Optional[str]) -> dict:
    env = dict(os.environ)
    if cxx is not None:
        env["CXX"] = cxx
    return env


def _run(args, cxx: Optional[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, timeout=1200,
                          env=_env(cxx))


def _canary_ok(device: str, tmp_path, cxx: Optional[str]) -> bool:
    tag = "default" if cxx is None else os.path.basename(cxx)
    res = _run([_CANARY, str(tmp_path / f"canary_{tag}.pt2"), device], cxx)
    return res.returncode == 0 and "CANARY_OK" in res.stdout


def _system_cxx() -> Optional[str]:
    """A system C++ compiler other than the one already chosen (CXX), if there is one."""
    current = os.environ.get("CXX")
    for c in SYSTEM_CXX:
        if os.path.exists(c) and os.access(c, os.X_OK) and c != current:
            return c
    found = shutil.which("g++")
    return found if found and found != current and found not in SYSTEM_CXX else None


def _log(res: subprocess.CompletedProcess) -> str:
    return f"rc={res.returncode}\n--- stdout ---\n{res.stdout[-4000:]}\n--- stderr ---\n{res.stderr[-8000:]}"


def run_aoti_in_child(module_file: str, device: str, tmp_path) -> None:
    here = os.path.dirname(os.path.abspath(module_file))
    module = os.path.splitext(os.path.basename(module_file))[0]
    code = _CHILD.format(here=here, root=os.path.dirname(here), module=module, device=device,
                         path=str(tmp_path / f"{module}_{device}.pt2"))
    cxx = _working_cxx.get(device)
    res = _run([code], cxx)
    if res.returncode == 0 and "AOTI_OK" in res.stdout:
        return
    if res.returncode < 0 and device not in _working_cxx:  # killed by a signal: the environment's or ours?
        if _canary_ok(device, tmp_path, None):
            _working_cxx[device] = None  # AOTInductor works here: the crash is ours
        else:
            alt = _system_cxx()
            if alt is None or not _canary_ok(device, tmp_path, alt):
                pytest.skip(f"AOTInductor ({device}) is broken in this environment: a trivial (x*2).sin() package "
                            f"also crashes with the default C++ compiler"
                            + (f" and with CXX={alt}" if alt else " (and no system g++ to retry with)")
                            + f" (torch {torch.__version__}); prims_ts run: {_log(res)[:300]}")
            _working_cxx[device] = alt
            res = _run([code], alt)
            if res.returncode == 0 and "AOTI_OK" in res.stdout:
                return
            pytest.fail(f"AOTInductor run of {module} failed with CXX={alt} (whose canary package works):\n"
                        f"{_log(res)}")
    pytest.fail(f"AOTInductor run of {module} failed"
                + (f" with CXX={cxx}" if cxx else "") + f":\n{_log(res)}")
