"""What stands between AOTInductor and a working package here? (a diagnostic, not a test)

    python benchmarks/aoti_probe.py [cuda|cpu ...]

For each device, in child processes:
1. the C++ compiler Inductor would use (``CXX`` or its default) and whether a shared
   library it links carries libstdc++ inside it (no ``libstdc++.so`` in ``readelf -d``);
2. the trivial ``(x * 2).sin()`` package with that compiler and with ``CXX=/usr/bin/g++``;
3. a toy custom op taking a ``torch.dtype`` and an int, exported and run from a package
   (with the compiler that worked): what dtype the op receives inside the package.
Each package compiles for half a minute or more.
"""
import os
import subprocess
import sys
import tempfile

CANARY = r"""
import sys, torch
class M(torch.nn.Module):
    def forward(self, x):
        return (x * 2).sin()
x = torch.randn(64, 128, device=sys.argv[1])
ep = torch.export.export(M(), (x,))
m = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[2]))
torch.testing.assert_close(m(x), M()(x))
print("CANARY_OK")
"""

DTYPE_OP = r"""
import sys, torch
seen = []
@torch.library.custom_op("aoti_probe::make", mutates_args=())
def make(x: torch.Tensor, dt: torch.dtype, code: int) -> torch.Tensor:
    seen.append((dt, code))
    return x.to(dt) * 2
@make.register_fake
def _(x, dt, code):
    return torch.empty(x.shape, dtype=dt, device=x.device)
class M(torch.nn.Module):
    def forward(self, x):
        return make(x, torch.float32, 2) + 1, make(x, torch.float16, 0)
x = torch.randn(8, 16, device=sys.argv[1], dtype=torch.bfloat16)
ep = torch.export.export(M(), (x,))
m = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[2]))
outs = m(x)
print("op received (dtype, int):", seen)
print("outputs:", [(o.dtype, tuple(o.shape)) for o in outs])
print("DTYPE_OK" if [d for d, _ in seen] == [torch.float32, torch.float16] else "DTYPE_MISMATCH")
"""


def compiler_report(env) -> str:
    code = ("import torch._inductor.cpp_builder as b; print(b.get_cpp_compiler())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    cxx = res.stdout.strip() or f"(unknown: {res.stderr.strip()[-200:]})"
    with tempfile.TemporaryDirectory() as d:
        src, so = os.path.join(d, "t.cpp"), os.path.join(d, "t.so")
        with open(src, "w") as f:
            f.write("#include <string>\nstd::string f() { return std::to_string(42); }\n")
        built = subprocess.run([cxx, "-shared", "-fPIC", src, "-o", so], capture_output=True, text=True)
        if built.returncode:
            return f"{cxx}: could not build a test library ({built.stderr.strip()[-200:]})"
        dyn = subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout
        linked = "libstdc++.so" in dyn
        return f"{cxx}: libstdc++ {'linked dynamically' if linked else 'NOT in NEEDED (linked statically?)'}"


def main(devices) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for dev in devices:
            for cxx in (None, "/usr/bin/g++"):
                env = dict(os.environ)
                if cxx:
                    env["CXX"] = cxx
                tag = cxx or "default"
                print(f"== {dev}, CXX={tag}: {compiler_report(env)}", flush=True)
                res = subprocess.run([sys.executable, "-c", CANARY, dev, os.path.join(tmp, f"c_{dev}_{bool(cxx)}.pt2")],
                                     capture_output=True, text=True, env=env, timeout=900)
                ok = res.returncode == 0 and "CANARY_OK" in res.stdout
                print(f"   canary: rc={res.returncode} {'OK' if ok else res.stderr.strip()[-300:]}", flush=True)
                if not ok:
                    continue
                res = subprocess.run([sys.executable, "-c", DTYPE_OP, dev, os.path.join(tmp, f"d_{dev}.pt2")],
                                     capture_output=True, text=True, env=env, timeout=900)
                print(f"   dtype op: rc={res.returncode}\n" + "\n".join("     " + ln for ln in
                      (res.stdout.strip().splitlines()[-3:] or [res.stderr.strip()[-400:]])), flush=True)
                break


if __name__ == "__main__":
    main(sys.argv[1:] or ["cuda", "cpu"])
