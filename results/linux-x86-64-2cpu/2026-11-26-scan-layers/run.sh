#!/usr/bin/env bash
# Layers unrolled vs scanned on the real model, bf16 weights (this CPU's "auto") then float32.
# Run from the repository root on a quiet machine: ~4 minutes.
set -euo pipefail
D=results/linux-x86-64-2cpu/2026-11-26-scan-layers
PY=${PY:-.venv/bin/python}
$PY -m redrafter_jax.bench layers --out $D/layers-bf16.md
$PY -m redrafter_jax.bench layers --param-dtype float32 --out $D/layers-f32.md
