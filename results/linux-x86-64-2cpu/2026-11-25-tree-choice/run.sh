#!/usr/bin/env bash
# The draft tree chosen per device (issue 22 item 7), measured on a quiet machine:
# the drafter's acceptance table (once per drafter; tune-tree), this device's step times
# (cached per device), then `make demo`'s command with the chosen tree and with decode.json's,
# twice each, alternating. Run from the repository root: results/.../run.sh [OUT]
set -euo pipefail
OUT=${1:-$(dirname "$0")}
PY=${PY:-.venv/bin/python}
$PY -m redrafter_jax.cli tune-tree --time-only 2>&1 | grep -v INFO > "$OUT/tune-tree.txt"
for i in 1 2; do
  for tree in auto recorded; do
    $PY -m redrafter_jax.cli demo --tree $tree 2>&1 | grep -v INFO > "$OUT/demo-$tree-$i.txt"
  done
done
