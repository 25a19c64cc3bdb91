#!/bin/bash
# usage: c16.sh OUT SRC_A SRC_B [ROUNDS]: `loadtest --compare` (64 requests, 16 clients, the
# ReDrafter server against an AR server, both started by loadtest) with the code in SRC_A, then
# SRC_B, alternating, ROUNDS times (default 2). SRC_*: copies of src/ with checkpoints/ beside.
# The states compared are named in results.md. Run from the repository root on a quiet
# machine (~10 min per round: two servers warm up per run).
OUT=$1; A=$2; B=$3; ROUNDS=${4:-2}
PY=${PY:-.venv/bin/python}
mkdir -p $OUT
for r in $(seq 1 $ROUNDS); do
  for TAG in A B; do
    SRC=$A; [ $TAG = B ] && SRC=$B
    mkdir -p $OUT/tmp-$TAG$r
    PYTHONPATH=$SRC TMPDIR=$OUT/tmp-$TAG$r $PY -m redrafter_jax.serving.loadtest --compare \
        --requests 64 --concurrency 16 --json > $OUT/c16-$TAG$r.txt 2>&1
  done
done
