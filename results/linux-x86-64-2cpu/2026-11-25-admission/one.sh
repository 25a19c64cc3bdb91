#!/bin/bash
# usage: one.sh SRC TAG: with the code in SRC, one ReDrafter server (8 slots, --max-tokens 64)
#  1. one chat request at a time, 3 times (after 1 warm-up), the prompt of `generate` below;
#  2. 8 chat requests from 1 client;  3. 64 requests / 16 clients, every 8th top-k/top-p
#     (a cold sampling mode), then all greedy;  then an AR server for 2 (the ReDrafter / AR ratio
#     at 1 client); and `redrafter-jax generate --chat` on the same prompt (3 runs).
SRC=$1; TAG=$2
OUT=${OUT:-/tmp/meas}/$TAG; mkdir -p $OUT
cd /work/main
export PYTHONPATH=$SRC
PY=/work/main/.venv/bin/python
PROMPT="Write a story about a lighthouse keeper who finds a message in a bottle."
echo "{\"prompt\": \"$PROMPT\"}" > $OUT/one.jsonl
date > $OUT/start
for MODE in redrafter ar; do
  FLAG=""; [ $MODE = ar ] && FLAG=--ar
  $PY -m redrafter_jax.cli serve --config configs/smollm2_135m.yaml --host 127.0.0.1 \
      --port 18779 --slots 8 --max-tokens 64 $FLAG > $OUT/server-$MODE.log 2>&1 &
  SPID=$!
  for i in $(seq 1 900); do curl -sf http://127.0.0.1:18779/health >/dev/null && break; sleep 1; done
  LT="$PY -m redrafter_jax.serving.loadtest --url http://127.0.0.1:18779 --json"
  if [ $MODE = redrafter ]; then
    $LT --chat --requests 3 --concurrency 1 --warmup 1 --prompts $OUT/one.jsonl > $OUT/one-$MODE.txt 2>&1
  fi
  $LT --chat --requests 8 --concurrency 1 --warmup 1 > $OUT/c1-$MODE.txt 2>&1
  if [ $MODE = redrafter ]; then
    $LT --requests 64 --concurrency 16 --mix-every 8 > $OUT/mixed.txt 2>&1
    $LT --requests 64 --concurrency 16 > $OUT/greedy.txt 2>&1
  fi
  kill -TERM $SPID; wait $SPID
done
# generate does not read decode.json: the shipped drafter's settings and the server's weights
$PY -m redrafter_jax.cli generate --chat --prompt "$PROMPT" --drafter shipped --beam-width 1 \
    --beam-length 4 --lookup-ngram 3 --token-budget 5 --draft-vocab 8192 --param-dtype bfloat16 \
    --max-new-tokens 64 --runs 3 > $OUT/generate.txt 2>&1
date > $OUT/end
