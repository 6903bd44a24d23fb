#!/usr/bin/env bash
# The long fuzz run of issue 15: each target in turn, one process (no -jobs: the build machine is shared), niced,
# until its share of executions is done; appends exec counts and times to tests/fuzz/README.md's log.
#   tests/fuzz/run_long.sh BUILD_DIR [total_runs] [start_corpus_dir]
# default 10000000 runs, split 80:19:1 args:rules:rule_dir (rule_dir writes files on every run: ~100/s);
# -max_len 2048 keeps a run cheap on a loaded machine while the seeds (deep nesting, 1000 ops) stay in.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:?build dir with the fuzz targets (-DJITFUSE_FUZZ=ON, clang)}
total=${2:-10000000}
work=$(mktemp -d /tmp/jf-fuzz-long.XXXXXX)
[[ -n ${3:-} ]] && cp -r "$3"/. "$work"/  # corpora grown by earlier runs
log=tests/fuzz/long_run.log
echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) total=$total binaries $(stat -c %y "$build/tests/fuzz/fuzz_args" | cut -d. -f1)" >>"$log"
run() {  # target runs corpus [dict]
  local t=$1 n=$2 seeds=$3 dict=${4:-}
  mkdir -p "$work/$t"
  local start=$SECONDS
  set +e
  nice -n 10 "$build/tests/fuzz/fuzz_$t" -runs="$n" -max_len=2048 -print_final_stats=1 \
    -artifact_prefix="$work/$t-" ${dict:+-dict=$dict} "$work/$t" "$seeds" >"$work/$t.out" 2>&1
  local rc=$?
  set -e
  local execs=$(grep -a "stat::number_of_executed_units" "$work/$t.out" | awk '{print $2}')
  echo "fuzz_$t rc=$rc executions=${execs:-?} seconds=$((SECONDS - start)) artifacts=$(ls "$work" | grep -c -- "^$t-" || true)" \
    | tee -a "$log"
  [[ $rc == 0 ]] || { tail -40 "$work/$t.out"; exit 1; }
}
run args $((total * 80 / 100)) tests/fuzz/corpus_args
run rules $((total * 19 / 100)) tests/fuzz/corpus tests/fuzz/rules.dict
run rule_dir $((total / 100)) tests/fuzz/corpus_rule_dir tests/fuzz/rules.dict
echo "no findings; work dir $work" | tee -a "$log"
