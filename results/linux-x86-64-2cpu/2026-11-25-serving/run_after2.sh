#!/bin/bash
# usage: run_after.sh SRC TAG : the serving measurements with the code in SRC (mix run included)
SRC=$1; TAG=$2; OUT=/tmp/meas/$TAG; mkdir -p $OUT/tmp16 $OUT/tmp1 $OUT/mix
cd /work/wt23
export PYTHONPATH=$SRC
PY=/work/main/.venv/bin/python
date > $OUT/start

TMPDIR=$OUT/tmp1 $PY -m redrafter_jax.serving.loadtest --compare --requests 8 --concurrency 1 --warmup 1 --json > $OUT/c1.txt 2>&1
/tmp/meas/one.sh $SRC $TAG
# cold sampling mode mixed in: one ReDrafter server, greedy load then every 8th request top-k/top-p
$PY -m redrafter_jax.cli serve --config configs/smollm2_135m.yaml --host 127.0.0.1 --port 18777 --slots 8 --max-tokens 64 > $OUT/mix/server.log 2>&1 &
SPID=$!
for i in $(seq 1 600); do curl -sf http://127.0.0.1:18777/health >/dev/null && break; sleep 1; done
$PY -m redrafter_jax.serving.loadtest --url http://127.0.0.1:18777 --requests 64 --concurrency 16 --mix-every 8 --json > $OUT/mix/mixed.txt 2>&1
$PY -m redrafter_jax.serving.loadtest --url http://127.0.0.1:18777 --requests 64 --concurrency 16 --json > $OUT/mix/greedy.txt 2>&1
kill -TERM $SPID; wait $SPID
TMPDIR=$OUT/tmp16 $PY -m redrafter_jax.serving.loadtest --compare --requests 64 --concurrency 16 --json > $OUT/c16.txt 2>&1
date > $OUT/end
