#!/usr/bin/env bash
# The long fuzz run on a machine with cores to spare: N independent processes per target (each with its
# own copy of the corpus), for SECONDS, then the summed executions per target and any artifacts.
#   tests/fuzz/run_parallel.sh BIN_DIR SECONDS OUT_DIR [args_procs rules_procs rule_dir_procs] [corpus_dir]
# BIN_DIR holds fuzz_args, fuzz_rules, fuzz_rule_dir; corpus_dir (optional) corpora grown earlier.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=$1 secs=$2 out=$3
np=(${4:-9} ${5:-5} ${6:-2})
grown=${7:-}
mkdir -p "$out"
targets=(args rules rule_dir)
seeds=(tests/fuzz/corpus_args tests/fuzz/corpus tests/fuzz/corpus_rule_dir)
dicts=("" "-dict=tests/fuzz/rules.dict" "-dict=tests/fuzz/rules.dict")
pids=()
for k in 0 1 2; do
  t=${targets[$k]}
  for ((i = 0; i < ${np[$k]}; i++)); do
    c=$(mktemp -d /tmp/jf-fuzz-$t.XXXXXX)
    [[ -n $grown && -d $grown/$t ]] && cp -r "$grown/$t"/. "$c"/
    "$bin/fuzz_$t" -max_total_time="$secs" -max_len=2048 -print_final_stats=1 -seed=$((1000 * k + i + 1)) \
      -artifact_prefix="$out/$t-$i-" ${dicts[$k]} "$c" "${seeds[$k]}" >"$out/$t-$i.log" 2>&1 &
    pids+=($!)
  done
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for t in "${targets[@]}"; do
  n=$(cat "$out/$t"-*.log | grep -a "stat::number_of_executed_units" | awk '{s += $2} END {print s + 0}')
  echo "fuzz_$t: $n executions in ${secs}s"
done | tee "$out/summary.txt"
total=$(awk '{s += $2} END {print s}' "$out/summary.txt")
arts=$(ls "$out" | grep -v '\.log$' | grep -vc summary.txt)
echo "total: $total executions, $arts artifacts, exit status $rc" | tee -a "$out/summary.txt"
exit $rc
