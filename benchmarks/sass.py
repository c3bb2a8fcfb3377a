"""Kernel keys' SASS on a machine without a GPU: NVRTC (any version, loaded with ctypes) compiles
each key to a CUBIN, `cuobjdump -sass` disassembles it.

    python benchmarks/sass.py [--tuning SPEC] [--filter SUBSTR ...] [--arch sm_90a] [--out DIR]

Setup (the device image's compiler is NVRTC 13.0; the wheels are small):

    pip download --no-deps -d /tmp/cu "nvidia-cuda-nvrtc==13.0.*" nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    cd /tmp/cu && for w in *.whl; do unzip -qo "$w"; done
    export PT_NVRTC=/tmp/cu/nvidia/cu13/lib/libnvrtc.so.13 LD_LIBRARY_PATH=/tmp/cu/nvidia/cu13/lib \
        PATH=/tmp/cu/nvidia/cu13/bin:$PATH

For every key of `catalog.default_keys(arch, tuning)` whose name holds every SUBSTR: ptxas'
registers and spills, the .cubin and .sass under DIR, and for wgmma keys where each wait for
the older of two wgmma groups in flight (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: S^T of tile j landed,
P V of tile j - 1 may run) sits against the wait for both (`0x0`): the exp2 (MUFU.EX2) and other
instructions between them, i.e. what the softmax runs under the P V. Zero exp2 there means
ptxas hoisted the P V wait above the softmax. Also printed: ptxas' wgmma notes (C75xx) and the
count of empty wgmma groups (`HGMMA ... RZ, !UPT`: a commit ptxas could not attach to a wgmma,
which every later wait counts).

`--loops`: each key's loops (backward branches) that hold a tensor instruction (HMMA / HGMMA),
their instruction count and the counts of a few opcodes, where a main loop's length is read.
`--against DIR`: each key's SASS against the same key's in DIR (another run's --out, e.g. from
the committed tree: `git archive HEAD prims_ts benchmarks | tar -x -C /tmp/base`, run there):
identical, the same instructions on other registers, or the count of differing lines (and
whether the instruction count moved). What `ptx_same.py` cannot settle (PTX that differs in
order or naming) this does: ptxas' output is what runs.
"""
import argparse
import ctypes
import difflib
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from prims_ts.cuda import catalog  # noqa: E402
from prims_ts.cuda import runtime as R  # noqa: E402
from prims_ts.cuda.keys import Tuning  # noqa: E402


def nvrtc():
    lib = ctypes.CDLL(os.environ.get("PT_NVRTC", "libnvrtc.so"))
    for name in ("nvrtcCreateProgram", "nvrtcCompileProgram", "nvrtcGetProgramLogSize", "nvrtcGetProgramLog",
                 "nvrtcGetCUBINSize", "nvrtcGetCUBIN", "nvrtcDestroyProgram"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def compile_cubin(lib, src, opts):
    """(cubin bytes, NVRTC log) of one KernelSource; raises with the log on a compile error."""
    headers = R.include_sources()
    prog = ctypes.c_void_p()
    n = len(headers)
    texts = (ctypes.c_char_p * n)(*[v.encode() for v in headers.values()])
    names = (ctypes.c_char_p * n)(*[k.encode() for k in headers])
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src.source.encode(), (src.name + ".cu").encode(), n, texts, names)
    if rc != 0:
        raise RuntimeError(f"{src.name}: nvrtcCreateProgram returned {rc}")
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(f"{src.name}: NVRTC error {rc}\n{log.value.decode()}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin) != 0:
            raise RuntimeError(f"{src.name}: nvrtcGetCUBIN failed")
        return cubin.raw, log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def wait_order(sass: str):
    """For each `DEPBAR.LE gsb0, 0x1`: (exp2, instructions) before the next `DEPBAR.LE gsb0, 0x0`."""
    ins = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    out, i = [], 0
    while i < len(ins):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in ins[i]:
            j, ex2 = i + 1, 0
            while j < len(ins) and "WARPGROUP.DEPBAR.LE gsb0, 0x0" not in ins[j]:
                ex2 += "MUFU.EX2" in ins[j]
                j += 1
            out.append((ex2, j - i - 1))
            i = j
        i += 1
    return out


INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
LOOP_OPS = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDSM", "MUFU", "SYNCS", "BAR", "FFMA", "FMNMX", "IMAD", "R2UR")


def instructions(sass: str):
    """(address, text) of every instruction of a cuobjdump listing."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(INSTRUCTION.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    """The opcode without its predicate and modifiers (`@!P0 HGMMA.64x64x16.F32 ...` -> HGMMA)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def tensor_loops(ins):
    """(start, end, body) of each backward branch whose body holds an HMMA or HGMMA (not the
    branches back from the out-of-line barrier-retry stubs at a kernel's end, which span most of
    it)."""
    out = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) <= len(ins) // 2 and any(opcode(t) in ("HMMA", "HGMMA") for t in body):
                out.append((int(m.group(1), 16), addr, body))
    return out


def compare(sass: str, other: str) -> str:
    """One key's SASS against another build's: identical, other registers, or how much differs."""
    a, b = [t for _, t in instructions(other)], [t for _, t in instructions(sass)]
    if a == b:
        return "identical"
    names = lambda ts: [re.sub(r"\bU?R\d+\b", "R", re.sub(r"\bU?P\d\b", "P", t)) for t in ts]
    if names(a) == names(b):
        return "the same instructions on other registers"
    diff = sum(1 for ln in difflib.unified_diff(names(a), names(b), lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---")))
    return f"{diff} lines differ ({len(a)} -> {len(b)} instructions)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tuning", default="", help="a Tuning.encode() string, e.g. 'loop=1'")
    ap.add_argument("--filter", action="append", default=[], help="a substring every key name must hold")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--out", default="sass_out")
    ap.add_argument("--loops", action="store_true", help="each key's loops that hold tensor instructions")
    ap.add_argument("--against", default="", help="another run's --out: compare each key's SASS with it")
    a = ap.parse_args()
    if not shutil.which("cuobjdump") or not shutil.which("nvdisasm"):
        raise SystemExit("cuobjdump and nvdisasm must be on PATH (see the setup above)")
    lib = nvrtc()
    os.makedirs(a.out, exist_ok=True)
    seen = set()
    for key in catalog.default_keys(a.arch, Tuning.decode(a.tuning)):
        if key.name in seen or not all(f in key.name for f in a.filter):
            continue
        seen.add(key.name)
        cubin, log = compile_cubin(lib, key.source(), R._options(a.arch) + ["--ptxas-options=-v"])
        base = os.path.join(a.out, key.name)
        with open(base + ".cubin", "wb") as f:
            f.write(cubin)
        sass = subprocess.run(["cuobjdump", "-sass", base + ".cubin"], capture_output=True, text=True,
                              check=True).stdout
        with open(base + ".sass", "w") as f:
            f.write(sass)
        info = [re.sub(r"^ptxas\s+(info\s+:|\.)\s*", "", ln.strip()) for ln in log.splitlines()
                if "spill" in ln or "Used" in ln]
        waits = wait_order(sass)
        for ln in log.splitlines():  # ptxas' notes (e.g. wgmma serialised: C75xx)
            if "C75" in ln:
                print("   ", ln.strip())
        # empty wgmma groups: a commit ptxas could not attach to a wgmma (a commit after the join
        # of a branch around wgmma), which every later wait<N> counts as a group
        empty = len(re.findall(r"HGMMA\.\S+ RZ, gdesc\[URZ\], RZ, !UPT", sass))
        if empty:
            print(f"    {empty} empty wgmma groups (HGMMA RZ, !UPT)")
        print(key.name, "|", "; ".join(info), "|" if waits else "",
              " ".join(f"{e} exp2 / {n} ins under PV" for e, n in waits))
        if a.loops:
            for start, end, body in tensor_loops(instructions(sass)):
                counts = {op: 0 for op in LOOP_OPS}
                for t in body:
                    if opcode(t) in counts:
                        counts[opcode(t)] += 1
                print(f"    loop {start:#x}-{end:#x}: {len(body)} instructions;",
                      " ".join(f"{op} {n}" for op, n in counts.items() if n))
        if a.against:
            other = os.path.join(a.against, key.name + ".sass")
            print("    against", other + ":", compare(sass, open(other).read()) if os.path.exists(other) else "missing")


if __name__ == "__main__":
    main()
