#!/bin/bash
# usage: run.sh [OUT]: the server's ReDrafter / AR throughput ratio measured in rounds
# (`loadtest --compare --rounds`: both servers started once, each warmed up alone, then loaded
# in turn, alternating which goes first): 64 requests from 16 clients, 4 rounds; then 24 chat
# requests from 1 client, 4 rounds. Real model, shipped drafter, 8 slots, the tree `serve`
# chooses for the machine, --max-tokens 64. Run from the repository root on a quiet machine
# (~25 min). Raw outputs (and both servers' logs, with the steps each rows bucket and mode
# served) in OUT (default: raw/ beside this script).
set -e
OUT=${1:-$(dirname $0)/raw}
PY=${PY:-.venv/bin/python}
mkdir -p $OUT/c16 $OUT/c1
TMPDIR=$OUT/c16 $PY -m redrafter_jax.serving.loadtest --compare --requests 64 --concurrency 16 \
    --rounds 4 --json > $OUT/c16.txt 2>&1
TMPDIR=$OUT/c1 $PY -m redrafter_jax.serving.loadtest --compare --chat --requests 24 \
    --concurrency 1 --warmup 2 --rounds 4 --json > $OUT/c1.txt 2>&1
