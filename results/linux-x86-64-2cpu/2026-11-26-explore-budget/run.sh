#!/bin/bash
# usage: run.sh [OUT] [PARTS]: the server's ReDrafter / AR throughput ratio measured in rounds
# (`loadtest --compare --rounds`: both servers started once, each warmed up alone, then loaded
# in turn, alternating which goes first). PARTS (default "c16 c1"): c16 = 64 requests from 16
# clients, 4 rounds; c1 = 24 chat requests from 1 client, 4 rounds. Real model, shipped
# drafter, 8 slots, the tree `serve` chooses for the machine, --max-tokens 64. Run from the
# repository root on a quiet machine (~25 min for both). Raw outputs (and both servers' logs,
# with the tree chosen and the steps each rows bucket and mode served) in OUT (default: raw/
# beside this script).
set -e
OUT=${1:-$(dirname $0)/raw}
PARTS=${2:-c16 c1}
PY=${PY:-.venv/bin/python}
for PART in $PARTS; do
  mkdir -p $OUT/$PART
  case $PART in
    c16) ARGS="--requests 64 --concurrency 16" ;;
    c1) ARGS="--chat --requests 24 --concurrency 1 --warmup 2" ;;
    *) echo "unknown part $PART"; exit 2 ;;
  esac
  TMPDIR=$OUT/$PART $PY -m redrafter_jax.serving.loadtest --compare $ARGS --rounds 4 --json \
      > $OUT/$PART.txt 2>&1
done
