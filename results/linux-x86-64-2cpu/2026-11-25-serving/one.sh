#!/bin/bash
# usage: one.sh SRC TAG : one request alone through the server vs `redrafter-jax generate`
SRC=$1; TAG=$2; OUT=/tmp/meas/$TAG/one; mkdir -p $OUT
cd /work/wt23
export PYTHONPATH=$SRC
PY=/work/main/.venv/bin/python
$PY -m redrafter_jax.cli generate --prompt "Write a short poem about the sea." --drafter shipped --beam-width 1 --beam-length 4 --lookup-ngram 3 --token-budget 5 --draft-vocab 8192 --max-new-tokens 64 --runs 3 > $OUT/generate.txt 2>&1
$PY -m redrafter_jax.cli serve --config configs/smollm2_135m.yaml --host 127.0.0.1 --port 18778 --slots 8 --max-tokens 64 > $OUT/server.log 2>&1 &
SPID=$!
for i in $(seq 1 900); do curl -sf http://127.0.0.1:18778/health >/dev/null && break; sleep 1; done
$PY -m redrafter_jax.serving.loadtest --url http://127.0.0.1:18778 --requests 3 --concurrency 1 --warmup 1 --prompts /tmp/meas/poem.jsonl --json > $OUT/server.txt 2>&1
kill -TERM $SPID; wait $SPID
