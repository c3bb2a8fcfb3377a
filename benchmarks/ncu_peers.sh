#!/bin/bash
# ncu of one bench problem under several runners (ours and the peers' kernels side by side):
#   OUT=dir [KERNELS=REGEX] bash benchmarks/ncu_peers.sh FAMILY "PROBLEM" RUNNER...
# e.g. OUT=/tmp/n bash benchmarks/ncu_peers.sh prefill "B8 S1024 H32/8 D128 dense" prims_ts sdpa_cudnn
# Per runner: the first 2 kernels of two calls whose names match KERNELS (default: ours, cuDNN's and
# FLASH's attention kernels, not the inputs' set-up), --set full; its raw metrics (CSV) and its SASS
# with per-line stall samples (CSV), and a line a kernel on stdout: grid, block, registers, shared
# memory, duration, tensor pipe, issue slots (and a line of the shared-memory port's use). NCU_ARGS adds ncu options (e.g. "--cache-control
# none --warp-sampling-interval 0": warm caches, a sample every 32 cycles for short kernels).
fam=$1; prob=$2; shift 2
PY="${PYTHON:-python3}"
for r in "$@"; do
    name=$(echo "${fam}_${prob}_$r" | tr -c 'A-Za-z0-9\n' '_')
    timeout 300 ncu --clock-control none -k "regex:${KERNELS:-pt_|sdpa|fmha|cudnn|flash|attn|sm90}" -c 2 --set full --import-source yes ${NCU_ARGS:-} -f -o "/tmp/ncu_$name" \
        "$PY" benchmarks/run_one.py "$fam" "$prob" "$r" 2 >"/tmp/ncu_$name.log" 2>&1
    echo "== $fam $prob, $r: rc=$? $(tail -1 "/tmp/ncu_$name.log")"
    ncu --import "/tmp/ncu_$name.ncu-rep" --page raw --csv >"$OUT/ncu_${name}_raw.csv" 2>&1
    ncu --import "/tmp/ncu_$name.ncu-rep" --page source --print-source sass --csv >"$OUT/ncu_${name}_sass.csv" 2>&1
    "$PY" - "$OUT/ncu_${name}_raw.csv" <<'PYEOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    print("   no kernels"); sys.exit()
head = rows[0]
def g(m, *keys):
    for k in keys:
        if k in m and m[k] not in ("", "n/a"):
            return m[k]
    return "?"
for vals in rows[2:]:
    m = dict(zip(head, vals))
    print(f"   {g(m, 'Kernel Name')[:70]} | grid {g(m, 'launch__grid_size')} block {g(m, 'launch__block_size')} "
          f"regs {g(m, 'launch__registers_per_thread')} smem {g(m, 'launch__shared_mem_per_block_dynamic')} "
          f"| {g(m, 'gpu__time_duration.sum')} us "
          f"| tensor {g(m, 'sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active')}% "
          f"xu {g(m, 'sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active')}% "
          f"issue {g(m, 'smsp__issue_active.avg.pct_of_peak_sustained_active')}%")
    # the shared-memory port: its banks (wgmma operand reads and TMA writes count there) and the
    # LSU's shared wavefronts (loads, stores, mbarrier polls)
    print(f"     shared memory: bank reads {g(m, 'l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed')}% "
          f"writes {g(m, 'l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed')}% "
          f"lsu wavefronts {g(m, 'l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed')}%")
PYEOF
done
