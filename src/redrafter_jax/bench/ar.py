"""``python -m redrafter_jax.bench ar``: our AR decoding against transformers' PyTorch ``generate``.

Same machine, same run, same weights (the model's GGUF, dequantized to float32 on both sides;
``--param-dtype bfloat16`` rounds ours to bfloat16, activations staying float32), batch 1,
greedy, chat-formatted Spec-Bench prompts, and exactly ``--max-new-tokens`` new tokens on both
sides (transformers with ``min_new_tokens``, ours without stop tokens). The two run
interleaved prompt by prompt, so changes in machine load hit both alike. tokens/s is new tokens
over the wall time of the whole call (prefill included); our compile time is excluded by an
untimed warm-up call per compiled shape, and transformers gets one warm-up generation too.

A second table gives the cost of ONE forward over T new tokens with the cache already holding a
``--prefix``-token prefix: T=1 is an AR step, larger T what verifying a draft tree costs.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import platform
import sys
import time

from redrafter_jax.helptext import show_defaults

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
DEFAULT_PROMPTS = REPO_ROOT / "data" / "spec_bench.jsonl.gz"


def parse_args(argv):
  p = argparse.ArgumentParser(prog="python -m redrafter_jax.bench ar",
                              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--prompts", type=pathlib.Path, default=DEFAULT_PROMPTS,
                 help="Spec-Bench style jsonl ({'prompt': ...} per line)")
  p.add_argument("--num-prompts", type=int, default=8, help="prompts, spread over the file")
  p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (forced)")
  p.add_argument("--model", default="smollm2-135m", help="known name, .gguf file or HF folder")
  p.add_argument("--prefix", type=int, default=256, help="cached tokens before timed forwards")
  p.add_argument("--forward-tokens", default="1,8,16,32,64", help="T values for forward costs")
  p.add_argument("--reps", type=int, default=10, help="timed repetitions per forward size")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                 help="our LLM's weights (activations stay float32)")
  args = p.parse_args(argv)
  if args.num_prompts < 1 or args.max_new_tokens < 1 or args.reps < 1 or args.prefix < 1:
    p.error("--num-prompts, --max-new-tokens, --reps and --prefix must be >= 1")
  args.forward_tokens = [int(t) for t in args.forward_tokens.split(",")]
  return args


def read_prompts(path: pathlib.Path, n: int | None) -> list[dict]:
  """``n`` rows spread evenly over the file (so several categories are covered); all rows in
  file order when ``n`` is None."""
  from redrafter_jax.jsonl import read_jsonl

  rows = [row for _, row in read_jsonl(path, "prompt", what="prompts file")]
  if not rows:
    raise ValueError(f"{path}: no prompts")
  if n is None:
    return rows
  return [rows[i * len(rows) // min(n, len(rows))] for i in range(min(n, len(rows)))]


def load_hf(path: pathlib.Path):
  """transformers' float32 model for a GGUF file or an HF folder."""
  import torch
  from transformers import AutoModelForCausalLM

  if path.is_dir() and not (path / "config.json").is_file():
    path = next(iter(sorted(path.glob("*.gguf"))), path)
  if path.suffix == ".gguf":
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32)
  else:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
  return model.eval()


def ours_generate(model, ids: list[int], n: int) -> list[int]:
  from redrafter_jax.inference.ar import generate

  return generate(model, [ids], max_new_tokens=n).tokens[0]


def hf_generate(hf, ids: list[int], n: int, pad_id: int) -> list[int]:
  import torch

  with torch.inference_mode():
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
  return out[0, len(ids):].tolist()


def clock(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def same_until_stop(ours: list[int], theirs: list[int], stop_ids) -> bool:
  """Greedy outputs agree up to our first stop token (transformers must not stop early)."""
  end = next((i for i, t in enumerate(ours) if t in stop_ids), len(ours))
  return ours[:end] == theirs[:end]


def decode_table(model, hf, tok, rows, n: int) -> tuple[list[str], float]:
  from redrafter_jax.inference.runtime import cache_size_for, pack_prompts
  from redrafter_jax.weights.tokenizer import encode, stop_token_ids

  stop = stop_token_ids(tok)
  pad = tok.pad_token_id if tok.pad_token_id is not None else stop[0]
  limit = model.config.max_position_embeddings
  compiled = set()
  hf_generate(hf, encode(tok, "Hello", chat=True), 4, pad)  # warm-up
  lines = ["| prompt | category | prompt tokens | ours tok/s | transformers tok/s | ours/HF "
           "| same greedy tokens |", "|---|---|---:|---:|---:|---:|:---:|"]
  totals = [0.0, 0.0]
  agree = 0
  for row in rows:
    ids = encode(tok, row["prompt"], chat=True)
    shape = (pack_prompts([ids])[0].shape, cache_size_for(len(ids), n, 1, limit))
    if shape not in compiled:  # compile outside the timing
      ours_generate(model, ids, n)
      compiled.add(shape)
    ours, t_ours = clock(lambda: ours_generate(model, ids, n))
    theirs, t_hf = clock(lambda: hf_generate(hf, ids, n, pad))
    if len(ours) != n or len(theirs) != n:
      raise RuntimeError(f"expected {n} new tokens, got {len(ours)} (ours), {len(theirs)} (HF)")
    same = same_until_stop(ours, theirs, stop)
    agree += same
    totals[0] += t_ours
    totals[1] += t_hf
    lines.append(f"| {row.get('id', '?')} | {row.get('category', '?')} | {len(ids)} "
                 f"| {n / t_ours:.1f} | {n / t_hf:.1f} | {t_hf / t_ours:.2f}x "
                 f"| {'yes' if same else 'NO'} |")
  k = len(rows)
  ratio = totals[1] / totals[0]
  lines.append(f"| **all {k}** | | | **{k * n / totals[0]:.1f}** | **{k * n / totals[1]:.1f}** "
               f"| **{ratio:.2f}x** | {agree}/{k} |")
  return lines, ratio


@functools.lru_cache(maxsize=None)
def _jitted_forward():
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.models import kv_cache as kvc

  @functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
  def forward(graphdef, state, cache, tokens_BT):
    """T causal new tokens after the committed prefix; they stay uncommitted, so the returned
    cache is ready for the next repetition."""
    model = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    positions_BT = cache.lengths_B[:, None] + jnp.arange(T)
    mask_BTS = kvc.visible_mask(cache.lengths_B, kvc.causal_mask(jnp.ones((B, T), bool)),
                                cache.size)
    logits_BTV, _, cache = model(tokens_BT, positions_BT, mask_BTS, cache)
    return logits_BTV, cache

  return forward


def forward_table(model, hf, prefix: list[int], sizes: list[int], reps: int) -> list[str]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  from flax import nnx

  from redrafter_jax.inference.runtime import cache_size_for, prefill
  from redrafter_jax.inference.timing import median_seconds

  P = len(prefix)
  size = cache_size_for(P, max(sizes), 1, model.config.max_position_embeddings)
  graphdef, state = nnx.split(model)
  prefill_jit = jax.jit(lambda s, t, n, c: prefill(nnx.merge(graphdef, s), t, n, c)[2])
  cache = prefill_jit(state, jnp.asarray([prefix]), jnp.asarray([P]), model.init_cache(1, size))
  forward = _jitted_forward()
  with torch.inference_mode():
    hf_cache = hf(torch.tensor([prefix]), use_cache=True).past_key_values

  lines = ["| T | ours ms | transformers ms | ours/HF | ours ms per token | ours vs T=1 |",
           "|---:|---:|---:|---:|---:|---:|"]
  ms_one = None
  rng = np.random.default_rng(0)
  for T in sizes:
    new = rng.integers(0, model.config.vocab_size, (1, T)).astype(np.int32)
    new_jax, new_torch = jnp.asarray(new), torch.as_tensor(new, dtype=torch.long)

    def ours():
      nonlocal cache
      logits, cache = forward(graphdef, state, cache, new_jax)
      logits.block_until_ready()

    def theirs():
      with torch.inference_mode():
        hf(new_torch, past_key_values=hf_cache, use_cache=True)
      hf_cache.crop(-T)  # drop the T new tokens again

    ms_ours = 1e3 * median_seconds(ours, reps, warmup=2)
    ms_hf = 1e3 * median_seconds(theirs, reps, warmup=2)
    ms_one = ms_ours if T == 1 else ms_one
    lines.append(f"| {T} | {ms_ours:.1f} | {ms_hf:.1f} | {ms_hf / ms_ours:.2f}x "
                 f"| {ms_ours / T:.2f} | {f'{ms_ours / ms_one:.2f}' if ms_one else 'n/a'} |")
  return lines


def load_average() -> str:
  """The 1-minute load average: other work on the machine skews both sides' timings."""
  try:
    return f"{os.getloadavg()[0]:.1f}"
  except OSError:
    return "n/a"


def main(argv=None) -> int:
  import jax
  import torch

  from redrafter_jax.bench._common import load
  from redrafter_jax.weights.llama_weights import resolve_source
  from redrafter_jax.weights.tokenizer import encode

  args = parse_args(argv)
  try:
    rows = read_prompts(args.prompts, args.num_prompts)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  models = load(args.model, param_dtype=args.param_dtype)
  model, tok = models.llm, models.tokenizer
  path = resolve_source(args.model)
  hf = load_hf(path)

  print(f"# AR decoding: redrafter_jax (JAX) vs transformers (PyTorch), {args.model}, ours "
        f"float32 activations with {args.param_dtype} weights, transformers float32, "
        f"batch 1, greedy, {args.max_new_tokens} new tokens per prompt")
  print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; jax {jax.__version__} "
        f"({jax.default_backend()}); torch {torch.__version__} ({torch.get_num_threads()} "
        f"threads); load average {load_average()}; prompts: {args.prompts.name}\n")
  lines, ratio = decode_table(model, hf, tok, rows, args.max_new_tokens)
  print("\n".join(lines))
  print(f"\nours/HF = {ratio:.2f}x overall (goal >= 1.2x: {'met' if ratio >= 1.2 else 'NOT met'})"
        "; tok/s = new tokens / wall time of the whole call incl. prefill, compile excluded\n")

  prefix = []
  for row in rows:
    prefix += encode(tok, row["prompt"], chat=True)
  while len(prefix) < args.prefix:
    prefix += prefix
  prefix = prefix[:args.prefix]
  print(f"# One forward over T new tokens after a {args.prefix}-token cached prefix "
        f"(median of {args.reps}, ms)\n")
  print("\n".join(forward_table(model, hf, prefix, args.forward_tokens, args.reps)))
  print(f"\nload average at the end: {load_average()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
