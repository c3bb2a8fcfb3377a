#!/bin/bash
# ncu of one bench problem under several tunings: OUT=dir bash benchmarks/ncu_pair.sh FAMILY "PROBLEM" KERNEL_REGEX TUNING...
# ("" is the default tuning). Per tuning: the .ncu-rep, its details page, its raw metrics (CSV), and
# a short summary (duration, tensor pipe, issue slots, the top warp stalls) on stdout.
fam=$1; prob=$2; kern=$3; shift 3
PY="${PYTHON:-python3}"
for t in "$@"; do
    name=$(echo "${t:-default}" | tr -c 'A-Za-z0-9\n' '_')
    PT_TUNING="$t" timeout 240 ncu --clock-control none -k "regex:$kern" -s 1 -c 1 --set full -f -o "$OUT/ncu_$name" \
        "$PY" benchmarks/run_one.py "$fam" "$prob" prims_ts 2 >"$OUT/ncu_$name.log" 2>&1
    echo "== $fam $prob, tuning ${t:-default}: rc=$? $(tail -1 "$OUT/ncu_$name.log")"
    ncu --import "$OUT/ncu_$name.ncu-rep" --page details >"$OUT/ncu_$name.txt" 2>&1
    ncu --import "$OUT/ncu_$name.ncu-rep" --page raw --csv >"$OUT/ncu_${name}_raw.csv" 2>&1
    grep -E "Duration|Registers Per|Issue Slots Busy|Executed Ipc A" "$OUT/ncu_$name.txt" | sed 's/^ */   /'
    "$PY" - "$OUT/ncu_${name}_raw.csv" <<'PYEOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, vals = rows[0], rows[2] if len(rows) > 2 else rows[-1]
m = dict(zip(head, vals))
def f(k):
    try: return float(m[k].replace(',', ''))
    except Exception: return None
for k in ('sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active', 'sm__inst_executed_pipe_tensor_op_hmma.sum',
          'smsp__inst_executed.sum', 'sm__warps_active.avg.pct_of_peak_sustained_active'):
    if k in m: print('   %s = %s' % (k, m[k]))
st = {k: f(k) for k in m if k.startswith('smsp__average_warp_latency_issue_stalled_') and k.endswith('.ratio')}
if not st:
    st = {k: f(k) for k in m if 'warp_latency_issue_stalled' in k or 'pcsamp_warps_issue_stalled' in k}
top = sorted(((v, k) for k, v in st.items() if v), reverse=True)[:8]
print('   stalls: ' + ', '.join('%s %.2f' % (k.replace('smsp__average_warp_latency_issue_stalled_', '').replace('.ratio', '').replace('smsp__pcsamp_warps_issue_stalled_', ''), v) for v, k in top))
PYEOF
done
