#!/bin/bash
# usage: serve.sh SRC TAG: with the code in SRC (a copy of src/, checkpoints beside it), the
# server with the tree chosen for this machine (serve's default --tree auto), 8 slots,
# --max-tokens 64, bf16 weights (the drafter's auto):
#  1. one chat request at a time, 3 times (after 1 warm-up);  2. 8 chat requests from 1 client;
#  then an AR server for 2 (the ReDrafter / AR ratio at 1 client); `redrafter-jax generate
#  --chat` with the same tree on the same prompt (3 runs); then `loadtest --compare`, 64
#  requests from 16 clients. Outputs in ${OUT:-/tmp/meas}/TAG. Run from the repository root.
SRC=$1; TAG=$2
OUT=${OUT:-/tmp/meas}/$TAG; mkdir -p $OUT/tmp
export PYTHONPATH=$SRC
PY=${PY:-.venv/bin/python}
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
  kill -TERM $SPID; wait $SPID
done
TREE=$(grep -o "draft tree for this device: W=[0-9]* L=[0-9]*[^,]*, N=[0-9]*" $OUT/server-redrafter.log | head -1)
W=$(echo "$TREE" | sed -n 's/.*W=\([0-9]*\).*/\1/p'); L=$(echo "$TREE" | sed -n 's/.* L=\([0-9]*\).*/\1/p')
LK=$(echo "$TREE" | sed -n 's/.*lookup \([0-9]*\).*/\1/p'); N=$(echo "$TREE" | sed -n 's/.*N=\([0-9]*\).*/\1/p')
echo "tree: W=$W L=$L lookup=${LK:-0} N=$N" > $OUT/tree.txt
$PY -m redrafter_jax.cli generate --chat --prompt "$PROMPT" --drafter shipped --beam-width $W \
    --beam-length $L --lookup-ngram ${LK:-0} --token-budget $N --draft-vocab 8192 \
    --param-dtype bfloat16 --max-new-tokens 64 --runs 3 > $OUT/generate.txt 2>&1
TMPDIR=$OUT/tmp $PY -m redrafter_jax.serving.loadtest --compare --requests 64 --concurrency 16 \
    --json > $OUT/c16.txt 2>&1
date > $OUT/end
