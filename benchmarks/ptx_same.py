"""Does a source change leave every kernel's PTX as it was? (No GPU needed.)

    python benchmarks/ptx_same.py BASE_TREE [--filter SUBSTR] [--arch sm_90a --arch sm_80] [--dump DIR]

BASE_TREE: a checkout holding the committed package (e.g. `mkdir /tmp/base && git archive HEAD
prims_ts | tar -x -C /tmp/base`). For each arch, every key that `catalog.default_keys` yields
under the default tuning and each variant (names containing SUBSTR, e.g. bf16) is compiled to
PTX by NVRTC in both trees (one subprocess per tree); the PTX is compared without comments,
file/line directives and the definitions of static constexpr members (unread data), with the
names of out-of-line device functions numbered by first appearance (mangled names change when a
template gains a parameter), with the virtual registers renamed in order of first use (NVVM's
numbering moves when an unused value is numbered; the instructions and their dataflow decide;
a run of copies of one source, an array's zeroing, is order-free: its destinations are named by
their first use after it),
and with the two sources of commutative instructions (add, mul, and, or, xor, min, max) sorted.
Prints each key that differs and exits 1 if any does: a refactor whose PTX is unchanged needs
no device run to prove it. --dump DIR writes the compared text of every key under DIR/base and
DIR/new (`diff -r` shows where a key differs).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HASHER = r"""
import hashlib, json, os, re, sys
sys.path.insert(0, sys.argv[1])
import prims_ts
from prims_ts.cuda import catalog, runtime
root = sys.argv[1].rstrip('/')
assert prims_ts.__file__.startswith(root), (prims_ts.__file__, root)
nvrtc, headers = runtime._nvrtc(), runtime.include_sources()
COMMUTATIVE = re.compile(r'^(\s*(?:add|mul\.lo|mul\.wide|mul|and|or|xor|min|max)(?:\.[a-z0-9]+)*\s+[^,\s]+, )'
                         r'([^,;\s]+), ([^,;\s]+);$')
out = {}
for arch in sys.argv[3].split(','):
    virtual = 'compute_' + arch[3:]
    opts = [o.replace(arch, virtual) for o in runtime._options(arch)]
    seen = set()
    for tuning in [catalog.DEFAULT_TUNING] + catalog.VARIANTS:
        for key in catalog.default_keys(arch, tuning):
            if key.name in seen or sys.argv[4] not in key.name:
                continue
            seen.add(key.name)
            src = key.source()
            prog = nvrtc.createProgram(src.source, src.name + '.cu', [v.encode() for v in headers.values()],
                                       [n.encode() for n in headers])
            try:
                nvrtc.compileProgram(prog, opts)
            except Exception:
                print(key.name, nvrtc.getProgramLog(prog), file=sys.stderr)
                raise
            ptx = nvrtc.getPTX(prog)
            nvrtc.destroyProgram(prog)
            ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
            # comments, file / line directives and the definitions of static constexpr members
            # (data no code reads; their mangled names change with a template's parameters;
            # code that did read one names it, and then differs itself)
            lines = [ln for ln in ptx.splitlines() if ln.strip() and not ln.strip().startswith(('//', '.file', '.loc'))
                     and not (ln.startswith('.global .align') and ' _ZN2pt' in ln)]
            # the names of the device functions left out of line, in order of appearance (theirs too
            # change with a template's parameters)
            names = {}
            lines = [re.sub(r'_ZZ?N2pt\w+', lambda m: names.setdefault(m.group(0), 'pt_fn%d' % len(names)), ln)
                     for ln in lines]
            # virtual registers renamed in order of first use, per class (an alpha-renaming: the
            # same program whatever NVVM numbered), their declared counts left out
            regs, counts = {}, {}

            def rename(m):
                v = regs.get(m.group(0))
                if v is None:
                    n = counts[m.group(1)] = counts.get(m.group(1), 0) + 1
                    v = regs[m.group(0)] = '%%%s_%d' % (m.group(1), n)
                return v

            lines = [ln for ln in lines if not ln.strip().startswith('.reg ')]
            # a run of copies of one source into fresh registers (an array's zeroing) may come in
            # any order: such a line does not name its destination, the destination's first use
            # elsewhere does, and each run is sorted once renamed
            copy = re.compile(r'^\s*mov\.\w+\s+(%\w+), (%\w+|[-\w.]+);$')
            runs = [copy.match(ln) for ln in lines]
            fresh = [bool(m) and any(k != i and runs[k] and runs[k].group(2) == m.group(2) for k in (i - 1, i + 1)
                                     if 0 <= k < len(lines)) for i, m in enumerate(runs)]
            # ... and so may the source itself, where the line before the run sets it to a constant
            const = [False] * len(lines)
            for i in range(1, len(lines)):
                if fresh[i] and not fresh[i - 1] and runs[i - 1] and runs[i - 1].group(1) == runs[i].group(2) \
                        and not runs[i - 1].group(2).startswith('%'):
                    const[i - 1] = True
            REG = r'%(rd|rs|r|fd|f|p|hh|h|b)\d+\b'
            for i, ln in enumerate(lines):
                if fresh[i]:
                    if not const[i - 1] and not (i > 0 and fresh[i - 1]):
                        re.sub(REG, rename, runs[i].group(2))  # the source is used here
                elif not const[i]:
                    re.sub(REG, rename, ln)
            lines = [re.sub(REG, rename, ln) for ln in lines]
            i = 0
            while i < len(lines):
                j = i
                while j < len(lines) and fresh[j] and runs[j].group(2) == runs[i].group(2):
                    j += 1
                if j > i:
                    lines[i:j] = sorted(lines[i:j])
                i = max(j, i + 1)
            # the two sources of a commutative instruction in one order (NVVM's operand order
            # follows its canonicalisation, not the program)
            lines = [COMMUTATIVE.sub(lambda m: '%s%s, %s;' % ((m.group(1),) + tuple(sorted(m.group(2, 3)))), ln)
                     for ln in lines]
            out[arch + ':' + key.name] = hashlib.sha256('\n'.join(lines).encode()).hexdigest()
            if sys.argv[5]:  # --dump: the compared text, a file a key
                os.makedirs(sys.argv[5], exist_ok=True)
                with open(os.path.join(sys.argv[5], arch + '_' + key.name + '.ptx'), 'w') as f:
                    f.write('\n'.join(lines) + '\n')
json.dump(out, open(sys.argv[2], 'w'))
"""


def hashes(tree: str, arches, substr: str, dump: str = "") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "h.json")
        subprocess.run([sys.executable, "-c", HASHER, os.path.abspath(tree), path, ",".join(arches), substr,
                        os.path.abspath(dump) if dump else ""], check=True, cwd=tmp)
        with open(path) as f:
            return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base")
    ap.add_argument("--arch", action="append", help="default: sm_90a and sm_80")
    ap.add_argument("--filter", default="", help="only keys whose name contains this")
    ap.add_argument("--dump", default="", help="write the compared text of each key under DIR/base and DIR/new")
    args = ap.parse_args()
    arches = args.arch or ["sm_90a", "sm_80"]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dump = {t: os.path.join(args.dump, t) if args.dump else "" for t in ("base", "new")}
    base, new = hashes(args.base, arches, args.filter, dump["base"]), hashes(here, arches, args.filter, dump["new"])
    differ = sorted(k for k in base.keys() & new.keys() if base[k] != new[k])
    only = sorted(base.keys() ^ new.keys())
    for k in differ:
        print("differs:", k)
    for k in only:
        print("in one tree only:", k)
    print(f"{len(base.keys() & new.keys()) - len(differ)} of {len(base.keys() | new.keys())} keys with the same PTX")
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main())
