#!/bin/bash
# usage: run.sh SRC TAG ; runs the serving measurements with code from SRC
SRC=$1; TAG=$2; OUT=/tmp/meas/$TAG; mkdir -p $OUT/tmp16 $OUT/tmp1
cd /work/wt23
export PYTHONPATH=$SRC
PY=/work/main/.venv/bin/python
date > $OUT/start
TMPDIR=$OUT/tmp16 $PY -m redrafter_jax.serving.loadtest --compare --requests 64 --concurrency 16 --json > $OUT/c16.txt 2>&1
TMPDIR=$OUT/tmp1 $PY -m redrafter_jax.serving.loadtest --compare --requests 8 --concurrency 1 --warmup 1 --json > $OUT/c1.txt 2>&1
$PY -m redrafter_jax.cli generate --prompt "Explain why the sky is blue in two sentences." --drafter shipped --beam-width 1 --beam-length 4 --lookup-ngram 3 --token-budget 5 --draft-vocab 8192 --max-new-tokens 64 > $OUT/generate.txt 2>&1
date > $OUT/end
