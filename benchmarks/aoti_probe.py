"""Where does AOTInductor crash on this machine? (a diagnostic, not a test)

    python benchmarks/aoti_probe.py [cuda|cpu]

The compile tests skip AOTInductor on CUDA where loading even a trivial package crashes
(compile_tests/aoti_child.py). This runs that trivial package in child processes under a
few variants and prints each one's outcome: the plain run, Python's faulthandler stack,
eager CUDA module loading, single-threaded runner, the legacy shared-library path
(aot_compile/aot_load), kernels embedded in the library, and a native backtrace through gdb
when gdb is installed. Each variant compiles for a minute or more: give it 10 minutes.
"""
import os
import shutil
import subprocess
import sys
import tempfile

CANARY = r"""
import sys, torch
class M(torch.nn.Module):
    def forward(self, x):
        return (x * 2).sin()
dev, path, step = sys.argv[1], sys.argv[2], sys.argv[3]
x = torch.randn(64, 128, device=dev)
if step in ("compile", "all"):
    ep = torch.export.export(M(), (x,))
    torch._inductor.aoti_compile_and_package(ep, package_path=path)
    print("compiled", flush=True)
if step == "legacy":  # the pre-package path: a shared library from aot_compile, loaded by aot_load
    so = torch._export.aot_compile(M(), (x,))
    print("compiled", so, flush=True)
    m = torch._export.aot_load(so, dev)
    print("loaded", flush=True)
    torch.testing.assert_close(m(x), M()(x))
    print("ran: CANARY_OK", flush=True)
if step == "embed":  # kernels embedded in the model's shared library instead of separate cubin files
    ep = torch.export.export(M(), (x,))
    torch._inductor.aoti_compile_and_package(ep, package_path=path,
                                             inductor_configs={"aot_inductor.embed_kernel_binary": True})
    print("compiled", flush=True)
    m = torch._inductor.aoti_load_package(path)
    print("loaded", flush=True)
    torch.testing.assert_close(m(x), M()(x))
    print("ran: CANARY_OK", flush=True)
if step in ("load", "all"):
    kw = {"run_single_threaded": True} if len(sys.argv) > 4 and sys.argv[4] == "single" else {}
    m = torch._inductor.aoti_load_package(path, **kw)
    print("loaded", flush=True)
    torch.testing.assert_close(m(x), M()(x))
    print("ran: CANARY_OK", flush=True)
"""


def run(args, env=None, prefix=()):
    res = subprocess.run(list(prefix) + [sys.executable, "-c", CANARY] + args, capture_output=True, text=True,
                         timeout=int(os.environ.get("AOTI_PROBE_TIMEOUT", "900")), env={**os.environ, **(env or {})})
    return res.returncode, (res.stdout[-1500:] + "\n" + res.stderr[-3000:]).strip()


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "canary.pt2")
    rc, log = run([dev, path, "compile"])
    print(f"== compile: rc={rc}\n{log}\n", flush=True)
    if rc != 0:
        return
    variants = [
        # the alternatives first: the single-threaded runner has hung past 4 minutes before
        ("legacy aot_compile + aot_load (.so)", [dev, path + ".legacy", "legacy"], None, ()),
        ("embed_kernel_binary package", [dev, path + ".embed.pt2", "embed"], None, ()),
        ("load + run", [dev, path, "load"], {"PYTHONFAULTHANDLER": "1"}, ()),
        ("run_single_threaded", [dev, path, "load", "single"], None, ()),
    ]
    if shutil.which("gdb"):
        variants.append(("gdb backtrace", [dev, path, "load"], None,
                         ("gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 30", "--args")))
    for name, args, env, prefix in variants:
        rc, log = run(args, env, prefix)
        print(f"== {name}: rc={rc}\n{log}\n", flush=True)


if __name__ == "__main__":
    main()
