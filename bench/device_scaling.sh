#!/usr/bin/env bash
# Issue 22's many-core checks on a machine without network. First use: `bench_tokenize.py
# --first-use` over 20 MB with Qwen2-style NFC and GPT-2 at the default --workers (every core):
# a fresh tokenizer cache vs a cached run, alternating, the reference's own load beside it and
# a cProfile of each verification child (first-use.txt, tokenize-first-use.json,
# device-profile-*.txt).
# Scaling: ~320 MB of stdlib sources as JSONL, then `bench_tokenize.py --scaling` (one run at
# --workers 1, 2, 4 ... up to the usable cores vs as many independent --workers 1 runs over equal
# parts; tokenize-scaling-device.json, saved after each worker count, and scaling.txt). Writes
# to $OUT (default bench/out/device), with the machine's description and load (machine.txt).
#
#   bench/device_scaling.sh                      # the lead's run: 320 MB, 3 repetitions
#   MB=5 REPEAT=1 PYTHON=/path/to/python bench/device_scaling.sh    # a quick local check
#
# Needs the repo's .venv (PYTHON overrides: numpy, orjson, zstandard, psutil, gigatoken and
# transformers) and .tokenizers/gpt2 and qwen2 (built from the test extras' wheels when absent).
# FIRST_USE_REPEAT=0 skips the first-use step. Bounded by 150 s + 330 s of timeouts;
# seven files come back.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/device}"
PYTHON="${PYTHON:-.venv/bin/python}"
MB="${MB:-320}"
REPEAT="${REPEAT:-3}"
FIRST_USE_REPEAT="${FIRST_USE_REPEAT:-3}"
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
# Bytecode compiled once up front, as after an install: no run pays for it.
"$PYTHON" -m compileall -q tokenmill bench > /dev/null || true
if [ "$FIRST_USE_REPEAT" -gt 0 ]; then
    timeout 150 "$PYTHON" bench/bench_tokenize.py --first-use --tokenizers qwen2-nfc,gpt2 \
        --repeat "$FIRST_USE_REPEAT" --name device --profile 2>&1 | tee "$OUT/first-use.txt"
    cp bench/out/device-first-use.json "$OUT/tokenize-first-use.json"
    cp bench/out/device-profile-qwen2-nfc.txt bench/out/device-profile-gpt2.txt "$OUT/"
fi
"$PYTHON" bench/corpus.py "bench/out/corpus-${MB}mb.jsonl" --mb "$MB" 2>&1 | tee "$OUT/scaling.txt"
timeout 330 "$PYTHON" bench/bench_tokenize.py --scaling --mb "$MB" --repeat "$REPEAT" \
    --tokenizers gpt2 --name tokenize-scaling-device 2>&1 | tee -a "$OUT/scaling.txt"
{ echo "after: $(uptime)"; echo "seconds: $(( $(date +%s) - start ))"; } >> "$OUT/machine.txt"
