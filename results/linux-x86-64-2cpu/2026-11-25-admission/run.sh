#!/bin/bash
# usage: run.sh SRC TAG [serve overrides...]: 64 requests from 16 clients, ReDrafter vs AR
# (`loadtest --compare`), with the code in SRC; outputs in OUT/TAG.
SRC=$1; TAG=$2; shift 2
OUT=${OUT:-/tmp/meas}/$TAG; mkdir -p $OUT/tmp
cd /work/main
export PYTHONPATH=$SRC
PY=/work/main/.venv/bin/python
date > $OUT/start
TMPDIR=$OUT/tmp $PY -m redrafter_jax.serving.loadtest --compare --requests 64 --concurrency 16 \
    --json --server-args "$@" > $OUT/c16.txt 2>&1
date > $OUT/end
