#!/usr/bin/env bash
# What a GPU session checks, in as few device calls as possible (device time is the
# scarce resource: CPU-only tests are CI's job; `-m cuda` selects the GPU ones).
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh [FILE.py|abtree|mlatree|pathstree|probe|tests|tests1|tests2|prefill|paged|bsr|decode|mla|twin|twintrace|ctatrace|rates|balanced|graphs|second|sweeps|profile|compile|sanitize|memcheck|racecheck|check|bench|quick|paths|ab|abloops|all]...
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh par "tests1" "tests2 sanitize"   (two GPUs)
#
# Each stage writes its log under $OUT (bench also bench.json). One device call is
# limited to 10 minutes: `tests` takes ~3 minutes with pytest-xdist (without, most of the
# 10); `sanitize` runs the small cases under memcheck and racecheck, each tool as
# SANITIZE_PARTS processes at once (sanitize_TOOL_K.log); run `sanitize check` and `quick` (or
# `bench`) in further calls if needed. Each test file gets its own summary line, each stage a
# line with the seconds into the call at its start; GPU_BUDGET_S (below) caps the whole call.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
case "$PY" in */*) PY="$(cd -- "$(dirname -- "$PY")" >/dev/null && pwd -P)/$(basename -- "$PY")" ;; esac  # abtree cds
OUT="${OUT:-/tmp/prims_ts_gpu}"
mkdir -p "$OUT"
OUT="$(cd -- "$OUT" >/dev/null && pwd -P)"  # absolute (a relative one is the repo root's): abtree cds
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(all)

# GPU_BUDGET_S (optional): the seconds this whole script may take. Every step's own limit is cut
# to what is left of it, so that one device call ends in time to pack its logs (a machine goes
# back when the call outruns its limit, and with it what $OUT held).
START_S=$(date +%s)
tl() {  # the limit for a step: its own ($1), or what is left of GPU_BUDGET_S if less (at least 1)
    local n=$1 left
    if [ -n "${GPU_BUDGET_S:-}" ]; then
        left=$((GPU_BUDGET_S - ($(date +%s) - START_S)))
        [ "$left" -lt "$n" ] && n=$left
        [ "$n" -lt 1 ] && n=1
    fi
    echo "$n"
}

# `par "STAGES A" "STAGES B"`: two stage lists at once, one per GPU (an nvidia-h200-x2
# machine), each with its own $OUT/gpu0 or gpu1; then the lists' summaries.
if [ "${stages[0]}" = par ]; then
    [ ${#stages[@]} -eq 3 ] || { echo "usage: par \"STAGES\" \"STAGES\"" >&2; exit 2; }
    for g in 0 1; do
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$g OUT="$OUT/gpu$g" bash "$0" ${stages[$((g + 1))]} >"$OUT/gpu$g.log" 2>&1 &
    done
    wait
    for g in 0 1; do echo "== GPU $g: ${stages[$((g + 1))]}"; cat "$OUT/gpu$g.log"; done
    exit 0
fi

KERNEL_TESTS=(tests/test_prefill_cuda.py tests/test_paged_cuda.py tests/test_decode_cuda.py
              tests/test_mla_cuda.py tests/test_block_sparse_cuda.py tests/test_block_sparse_contiguous.py
              tests/test_fail_closed.py tests/test_read_cuda.py)
COMPILE_TESTS=(compile_tests/test_compile_cuda.py compile_tests/test_paged_compile.py
               compile_tests/test_decode_compile.py compile_tests/test_mla_compile.py
               compile_tests/test_block_sparse_compile.py compile_tests/test_block_sparse_contiguous_compile.py)

# pytest-xdist, where the image has it: NVRTC compiles and the tests of one file spread over
# PYTEST_WORKERS processes sharing the GPU (the five kernel grids: ~2 minutes with 12)
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "${PYTEST_WORKERS:-12}")

run_tests() {  # the cuda-marked tests of each file that exists, one summary line per file
    local f
    for f in "$@"; do
        [ -f "$f" ] || { echo "== $f: no such file"; continue; }
        echo "== $f"
        timeout "$(tl 280)" "$PY" -m pytest "$f" -q -m cuda -rs --maxfail=20 -p no:cacheprovider "${XDIST[@]}" \
            >"$OUT/$(basename "$f" .py).log" 2>&1
        echo "   rc=$? $(tail -1 "$OUT/$(basename "$f" .py).log")"
    done
}

for s in "${stages[@]}"; do
    echo "[$(date +%T), ${s}: $(($(date +%s) - START_S)) s into the call]"
    case "$s" in
    tests) run_tests "${KERNEL_TESTS[@]}" ;;
    # the same in two device calls when one would pass 10 minutes (three consumer loops of the
    # prefill family, a fresh machine compiling every kernel on first use)
    tests1) run_tests tests/test_prefill_cuda.py tests/test_paged_cuda.py tests/test_block_sparse_cuda.py \
                      tests/test_block_sparse_contiguous.py ;;
    tests2) run_tests tests/test_decode_cuda.py tests/test_mla_cuda.py tests/test_fail_closed.py tests/test_read_cuda.py ;;
    # one kernel family each, to balance the two lists of `par`
    prefill) run_tests tests/test_prefill_cuda.py ;;
    paged) run_tests tests/test_paged_cuda.py ;;
    bsr) run_tests tests/test_block_sparse_cuda.py tests/test_block_sparse_contiguous.py ;;
    decode) run_tests tests/test_decode_cuda.py ;;
    mla) run_tests tests/test_mla_cuda.py ;;
    twin)  # the twin MLA tile (rows of 64 on sm_90a): its own tests (the wide-row grid, rerun, epilogues), then its
        # sanitizer cases (the default, balanced, an odd tile count, the rerun's spiked keys) under memcheck and racecheck
        echo "== tests/test_mla_cuda.py -k twin"
        timeout "$(tl 280)" "$PY" -m pytest tests/test_mla_cuda.py -q -m cuda -rs -k twin --maxfail=20 -p no:cacheprovider \
            "${XDIST[@]}" >"$OUT/twin.log" 2>&1
        echo "   rc=$? $(tail -1 "$OUT/twin.log")"
        for tool in memcheck racecheck; do
            echo "== compute-sanitizer $tool --mla-twin"
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(tl 300)" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                "$PY" tests/gpu_sanitize.py --mla-twin >"$OUT/twin_$tool.log" 2>&1
            echo "   rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/twin_$tool.log" | tail -1)"
        done ;;
    balanced)  # balanced split-KV (Tuning.balanced_split; plans take it for uneven lengths): the decode and MLA
        # grids' cells under it (split_merge "balanced": 7 CTAs at every size, and the plans' choice:
        # test_plan_balances_uneven_lengths), then the sanitizer's decode cases
        # (its balanced pass among them) under memcheck and racecheck
        echo "== tests/test_decode_cuda.py tests/test_mla_cuda.py -k balance"
        timeout "$(tl 280)" "$PY" -m pytest tests/test_decode_cuda.py tests/test_mla_cuda.py -q -m cuda -rs -k balance \
            --maxfail=20 -p no:cacheprovider "${XDIST[@]}" >"$OUT/balanced.log" 2>&1
        echo "   rc=$? $(tail -1 "$OUT/balanced.log")"
        for tool in memcheck racecheck; do
            echo "== compute-sanitizer $tool --decode"
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(tl 150)" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                "$PY" tests/gpu_sanitize.py --decode >"$OUT/balanced_$tool.log" 2>&1
            echo "   rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/balanced_$tool.log" | tail -1)"
        done ;;
    second)  # the tests that need two GPUs (tensors on cuda:1), every kernel file
        echo "== tests on cuda:1"
        timeout "$(tl 280)" "$PY" -m pytest "${KERNEL_TESTS[@]}" -q -m cuda -rs -k second_device -p no:cacheprovider \
            >"$OUT/second_device.log" 2>&1
        echo "   rc=$? $(tail -1 "$OUT/second_device.log")" ;;
    graphs) run_tests compile_tests/test_decode_compile.py compile_tests/test_mla_compile.py compile_tests/test_paged_compile.py \
                      compile_tests/test_block_sparse_compile.py compile_tests/test_block_sparse_contiguous_compile.py ;;
    compile) run_tests "${COMPILE_TESTS[@]}" ;;  # torch.compile / export / graphs: ~2 min a file
    sanitize | memcheck | racecheck)
        # No caching allocator: every tensor is its own allocation, so memcheck sees
        # accesses past a tensor's end instead of landing inside a pooled block. A tool's pass
        # over every section (tests/gpu_sanitize.py) takes ~11 (memcheck) and ~15 (racecheck)
        # minutes in one process, so it runs as SANITIZE_PARTS processes at once (default 6,
        # `--part K/N`: every N-th section), both tools together for `sanitize` (16 host cores;
        # the cases are small). One log a tool and part.
        tools="$s"; [ "$s" = sanitize ] && tools="memcheck racecheck"
        nparts="${SANITIZE_PARTS:-6}"; pids=(); names=()
        for tool in $tools; do
            for ((k = 0; k < nparts; k++)); do
                PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(tl 540)" compute-sanitizer --tool "$tool" --error-exitcode 3 \
                    "$PY" tests/gpu_sanitize.py --part "$k/$nparts" >"$OUT/sanitize_${tool}_$k.log" 2>&1 &
                pids+=($!); names+=("${tool}_$k")
            done
        done
        for i in "${!pids[@]}"; do
            wait "${pids[$i]}"; rc=$?
            log="$OUT/sanitize_${names[$i]}.log"
            echo "== compute-sanitizer ${names[$i]/_/ part }/$nparts: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)" \
                "$(grep -c 'rel err' "$log") cases$(grep -q 'sanitize cases done' "$log" && echo ', done')"
        done ;;
    check)
        echo "== check"
        timeout "$(tl 120)" "$PY" -m prims_ts check >"$OUT/check.log" 2>&1
        echo "   rc=$? $(tail -1 "$OUT/check.log")" ;;
    bench | quick)
        echo "== bench $([ "$s" = quick ] && echo --quick)"
        timeout "$(tl 420)" "$PY" -m prims_ts bench $([ "$s" = quick ] && echo --quick) --json "$OUT/bench.json" \
            2>&1 | tee "$OUT/bench.log" | grep -v '^\[' | tail -40
        # the open issues' floors (the H200's) on the full run
        if [ "$s" = bench ] && [ -f "$OUT/bench.json" ]; then
            "$PY" benchmarks/floors.py "$OUT/bench.json" | tee "$OUT/floors.log" | grep -v '^PASS'
        fi ;;
    ab | abloops)
        # tunings in one call, for before/after figures in benchmarks/NOTES.md, each against d
        # (the default Tuning). ab: the other producer copy (c, MLA's swapped tile too), persistent
        # CTAs with the default loops (pd) and with loop 0 (p); a: K/V tiles and pages by
        # cp.async (the default: TMA boxes); ln / pl: the MMA warps' leaner instructions at every head dim /
        # at none (the default: D128); ez: O rescaled on every new running maximum (the default: lazy); up / pf: the
        # softmax under the previous PV everywhere / nowhere (the default: prefill, contiguous and paged); pm: the paged
        # keys' V tiles panel-major at every page size (the default: page-major below BN; AB_FAMILIES=paged_prefill); pk: the
        # paged keys' K tiles panel-major at every page size (the default: row groups interleaved below BN, a box a
        # page; AB_FAMILIES=paged_prefill); bs: balanced split-KV (AB_FAMILIES="decode mla"). abloops: loops 0, 1, 2.
        # Each variant at most 140 s: four fit one device call. AB_VARIANTS (e.g. "d a" or
        # "d pd p") picks some of ab's, AB_FAMILIES (e.g. "paged_prefill block_sparse") the families. A variant may
        # come again ("d pd pd d": base / new / new / base, the last d the drift): the files are numbered in order.
        if [ "$s" = ab ]; then variants="${AB_VARIANTS:-d c pd p}"; else variants="d 0 1 2"; fi
        n=0; files=""
        for v in $variants; do
            n=$((n + 1)); json="$OUT/ab$n$v.json"; files="$files $json"
            fams="--family prefill --family paged_prefill --family block_sparse"
            case "$v" in d | c) fams="$fams --family mla" ;; bs) fams="--family decode --family mla" ;; esac
            if [ -n "${AB_FAMILIES:-}" ]; then fams=""; for f in $AB_FAMILIES; do fams="$fams --family $f"; done; fi
            case "$v" in
                d) spec="" ;; c) spec="flip_copy=True" ;; pd) spec="persistent=True" ;; a) spec="tma=False;paged_tma=False" ;; ln) spec="lean_mma=True" ;;
                pl) spec="lean_mma=False" ;; ez) spec="lazy_rescale=False" ;;
                up) spec="softmax_under_pv=True" ;; pf) spec="softmax_under_pv=False" ;;
                p) spec="persistent=True;loop=0" ;; 0 | 1 | 2) spec="loop=$v" ;; pm) spec="page_major_v=False" ;;
                pk) spec="page_major_k=False" ;;
                bs) spec="balanced_split=True" ;;
                *) echo "unknown variant $v" >&2; continue ;;
            esac
            echo "== bench, variant $v (tuning '${spec:-default}')"
            # shellcheck disable=SC2086
            timeout "$(tl 140)" "$PY" -m prims_ts bench $fams --runners prims_ts,prims_ts_contiguous --tuning "$spec" \
                --json "$json" 2>&1 | tee "${json%.json}.log" | grep -v '^\[' | tail -44
        done
        echo "== speedups over the first variant"
        # shellcheck disable=SC2086
        "$PY" benchmarks/ab_table.py $files | tee "$OUT/${s}_table.txt" ;;
    twintrace)  # the twin MLA tile's pair timeline (benchmarks/twin_trace.py) under each TRACE_TUNINGS spec
        echo "== twin_trace.py"
        specs=(); for t in ${TRACE_TUNINGS:-default}; do specs+=(--tuning "$t"); done
        timeout "$(tl 200)" "$PY" benchmarks/twin_trace.py "${specs[@]}" >"$OUT/twin_trace.log" 2>&1
        echo "   rc=$? (twin_trace.log)"; grep -v '^\[' "$OUT/twin_trace.log" | head -80 ;;
    ctatrace)  # each decode / MLA bench problem's CTAs, start to end by SM (benchmarks/cta_trace.py): the launch's edges
        echo "== cta_trace.py"
        timeout "$(tl 240)" "$PY" benchmarks/cta_trace.py >"$OUT/cta_trace.log" 2>&1
        echo "   rc=$? (cta_trace.log)"; grep -v '^\[' "$OUT/cta_trace.log" | head -150 ;;
    rates)  # whether an SM's streaming rate follows the SM or the pages its CTAs read (cta_trace.py
        # --repeat, then --repeat --reshuffle: the page IDs permuted between the launches) on the
        # one-wave decode rows and MLA H16 (benchmarks/NOTES.md, "The SMs' rates across launches")
        for m in "B16 L32768" "B128 L4096" "B1 L131072" "B64 L8192 H16"; do
            for r in "" --reshuffle; do
                echo "== cta_trace.py --match \"$m\" --repeat 3 $r"
                timeout "$(tl 60)" "$PY" benchmarks/cta_trace.py --match "$m" --repeat 3 $r 2>&1 \
                    | tee -a "$OUT/rates.log" | grep -E "correlation|fastest|span"
            done
        done ;;
    pathstree)
        # host paths before/after in one call: `bench --paths` of the package at ab_base/ (see
        # abtree), then of this tree's, each from its own tree's directory (paths_base.log,
        # paths_new.log and their JSON)
        [ -d ab_base/prims_ts ] || { echo "pathstree: no ab_base/prims_ts" >&2; exit 2; }
        for v in base new; do
            root=.; [ "$v" = base ] && root=ab_base
            echo "== bench --paths, $v tree"
            (cd "$root" && PYTHONPATH=. timeout "$(tl 200)" "$PY" -c "import os, sys; import prims_ts; \
print('prims_ts from', os.path.dirname(os.path.realpath(prims_ts.__file__))); \
from prims_ts.cli import main; sys.exit(main(sys.argv[1:]))" bench --paths --json "$OUT/paths_$v.json") \
                >"$OUT/paths_$v.log" 2>&1
            echo "   rc=$? $(head -1 "$OUT/paths_$v.log")"
            grep -E "ours" "$OUT/paths_$v.log" | cut -c1-160
        done ;;
    abtree)
        # before/after of a kernel change in one call: the package at ab_base/ (e.g. `mkdir ab_base
        # && git archive HEAD prims_ts | tar -x -C ab_base`, carried: it is git-ignored) against
        # this tree's, one process a run in the order AB_ORDER (default "base new new base": the
        # second base shows the drift); AB_FAMILIES picks the families (default: prefill
        # paged_prefill block_sparse mla). Each run starts in its own tree's directory and checks
        # that it imported that tree's package: `python -m` or `-c` put the current directory
        # ahead of PYTHONPATH, so a base run started here would silently run this tree.
        # Up to 140 s a run: four fit one device call with the machine's start.
        [ -d ab_base/prims_ts ] || { echo "abtree: no ab_base/prims_ts" >&2; exit 2; }
        rm -f "$OUT"/abtree*  # a failed run must not leave an older call's results in the table
        fams=""; for f in ${AB_FAMILIES:-prefill paged_prefill block_sparse mla}; do fams="$fams --family $f"; done
        n=0; runs=()
        for v in ${AB_ORDER:-base new new base}; do
            n=$((n + 1)); root=.; [ "$v" = base ] && root=ab_base
            echo "== bench, $v tree (run $n)"
            # shellcheck disable=SC2086
            (cd "$root" && PYTHONPATH=. timeout "$(tl 140)" "$PY" -c "import os, sys; import prims_ts; \
got = os.path.dirname(os.path.realpath(prims_ts.__file__)); want = os.path.realpath('prims_ts'); \
print('prims_ts from', got); assert got == want, ('imported', got, 'not', want); \
from prims_ts.cli import main; sys.exit(main(sys.argv[1:]))" bench $fams --runners prims_ts,prims_ts_contiguous \
                --json "$OUT/abtree$n-$v.json") 2>&1 | tee "$OUT/abtree$n-$v.log" | grep -v '^\[' | tail -30
            rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || echo "== abtree: run $n ($v) failed, rc=$rc"
            runs+=("$OUT/abtree$n-$v.json")
        done
        echo "== speedups over the first run (x = its ms / this run's ms; the imported trees:)"
        grep -h "^prims_ts from" "$OUT"/abtree*-*.log
        "$PY" benchmarks/ab_table.py "${runs[@]}" | tee "$OUT/abtree_table.txt" ;;
    probe)
        # where a prefill kernel's time goes (pt_fmha_config.cuh: PT_PROBE, Tuning.probe): probe 0 as
        # built, 1 without the K/V copies after the first stages (the MMA warps alone), 2 without
        # the math (the data path alone). The results are wrong under 1 and 2: only the times
        # mean anything. PROBE_FAMILIES (default "prefill paged_prefill"; "mla": the twin keys)
        for p in 0 1 2; do
            echo "== bench ${PROBE_FAMILIES:-prefill paged_prefill}, PT_PROBE $p"
            spec=""; [ "$p" != 0 ] && spec="probe=$p"
            fams=""; for f in ${PROBE_FAMILIES:-prefill paged_prefill}; do fams="$fams --family $f"; done
            # shellcheck disable=SC2086
            timeout "$(tl 170)" "$PY" -m prims_ts bench $fams --runners prims_ts \
                --tuning "$spec" --json "$OUT/probe$p.json" 2>&1 | tee "$OUT/probe$p.log" | grep -v '^\[' | tail -30
        done
        echo "== time as built over time with the probe (x > 1: the probed side alone is faster)"
        "$PY" benchmarks/ab_table.py "$OUT/probe0.json" "$OUT/probe1.json" "$OUT/probe2.json" | tee "$OUT/probe_table.txt" ;;
    paths)
        echo "== bench --paths (host us per call and one-call latency of every path, beside the peers)"
        timeout "$(tl 400)" "$PY" -m prims_ts bench --paths --json "$OUT/paths.json" 2>&1 | tee "$OUT/paths.log" | tail -60 ;;
    mlatree)  # MLA decode's library default (its launched splits and cluster) at each MLA_SHAPES "B L H" (default:
        # the small batches and one long request), the package at ab_base/ (see abtree) then this tree's, per shape
        [ -d ab_base/prims_ts ] || { echo "mlatree: no ab_base/prims_ts" >&2; exit 2; }
        shapes="${MLA_SHAPES:-1 4096 128;2 4096 128;4 4096 128;8 4096 128;16 4096 128;32 4096 128;8 4096 64;16 4096 64;32 4096 64;1 32768 128;4 16384 64;1 131072 128}"
        IFS=';' read -ra list <<<"$shapes"
        for a in "${list[@]}"; do
            for root in ab_base .; do
                echo "== mla_sweep $a, $([ "$root" = . ] && echo new || echo base) tree"
                # shellcheck disable=SC2086
                (cd "$root" && PYTHONPATH=. timeout "$(tl 60)" "$PY" "$OLDPWD/benchmarks/mla_sweep.py" $a 2>&1 | grep -v '^\[' \
                    | grep -v '^B') | tee -a "$OUT/mlatree.log"
            done
        done ;;
    sweeps)  # tuning aids: the latency rows' split counts x merges, the MLA rows' tiles and copies
        echo "== latency_sweep"; timeout "$(tl 120)" "$PY" benchmarks/latency_sweep.py 2>&1 | tee "$OUT/latency_sweep.log"
        for a in "64 8192 16" "128 8192 16" "64 8192 32" "1 1024 16"; do
            echo "== mla_sweep $a"; timeout "$(tl 60)" "$PY" benchmarks/mla_sweep.py $a swap swap8 mma 2>&1 | tee -a "$OUT/mla_sweep.log"
        done ;;
    profile)
        # ncu (full set, source counters) of one launch per row: the MLA memory-bound row and
        # the prefill, paged and block-sparse rows furthest from their bar; a details page and
        # the per-SASS-line stall table of each (the .ncu-rep too, where it is small enough)
        for r in ${PROFILE_ROWS:-}; do
            case " mla_b64 mla_b128 prefill_b2c paged_b8c bsr_128_10 prefill_b1d " in *" $r "*) ;; *) echo "== profile: no row $r" ;; esac
        done
        for spec in "mla|B64 L8192 H16|pt_decode|mla_b64" "mla|B128 L4096 H128|pt_decode|mla_b128" \
                    "prefill|B2 S4096 H32/8 D128 causal|pt_prefill|prefill_b2c" \
                    "paged_prefill|B8 S2048 H32/8 D128 causal page64|pt_prefill|paged_b8c" \
                    "block_sparse|block128 10%|pt_bsr|bsr_128_10" "prefill|B1 S16384 H32/8 D128 dense|pt_prefill|prefill_b1d"; do
            IFS='|' read -r fam prob kern name <<<"$spec"
            # PROFILE_ROWS (e.g. "prefill_b2c bsr_128_10") picks some of the rows
            [ -n "${PROFILE_ROWS:-}" ] && [[ " $PROFILE_ROWS " != *" $name "* ]] && continue
            echo "== ncu $name"
            timeout "$(tl 240)" ncu --clock-control none -k "regex:$kern" -s 1 -c 1 --set full -f -o "$OUT/ncu_$name" \
                "$PY" benchmarks/run_one.py "$fam" "$prob" prims_ts 2 >"$OUT/ncu_$name.log" 2>&1
            echo "   rc=$? $(tail -1 "$OUT/ncu_$name.log")"
            ncu --import "$OUT/ncu_$name.ncu-rep" --page details >"$OUT/ncu_$name.txt" 2>&1
            ncu --import "$OUT/ncu_$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu_${name}_sass.csv" 2>&1
            grep -E "Duration|DRAM Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|L2 Hit Rate|Mem Busy|Max Bandwidth|Mem Pipes Busy|Registers Per|Issued Warp" \
                "$OUT/ncu_$name.txt" | sed 's/^/   /'
        done ;;
    all) "$0" tests compile sanitize check quick ;;
    *.py) run_tests "$s" ;;  # one test file (its cuda-marked tests), e.g. compile_tests/test_mla_compile.py
    *) echo "unknown stage $s" >&2; exit 2 ;;
    esac
done
