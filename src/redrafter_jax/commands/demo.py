"""``redrafter-jax demo``: ReDrafter on the real SmolLM2-135M with the shipped drafter.

Generates the answer to a few chat prompts twice, with plain AR greedy decoding and with
ReDrafter greedy decoding, and prints the text, both speeds and the tokens per step. Compilation
is done (and excluded) first; greedy ReDrafter must print exactly the AR text, and says so.
Settings resolve as in ``generate`` and the Python paths (``inference.defaults``), except that
the tree (W, L, lookup, N) is by default the one that predicts the most tokens per second on this
device (``inference.tree_choice``: the drafter's measured tokens/step per tree over step times
taken here once and cached), unless one is given or ``--tree recorded`` asks for decode.json's.
Both run the same model: by default the LLM's weights in the precision the drafter's settings
record (``decode.json``; the shipped one's "auto" picks the platform's faster weights,
``linear.preferred_param_dtype``), activations in float32.
"""

from __future__ import annotations

import logging
import sys
import time

HELP = "run ReDrafter on SmolLM2-135M with the shipped drafter: text, speed, tokens/step"

PROMPTS = (
    "Explain in a short paragraph why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
)


def add_arguments(p) -> None:
  from redrafter_jax.commands import show_defaults
  from redrafter_jax.inference.defaults import TREES

  show_defaults(p)
  p.add_argument("--drafter", default="shipped", help="drafter folder (default: the shipped one)")
  p.add_argument("--max-new-tokens", type=int, default=128,
                 help="tokens to generate at most per prompt")
  p.add_argument("--beam-width", type=int, default=None, help="default: the drafter's own")
  p.add_argument("--beam-length", type=int, default=None, help="default: the drafter's own")
  p.add_argument("--lookup-ngram", type=int, default=None,
                 help="context-lookup beam n-gram (0 = off; default: the drafter's own)")
  p.add_argument("--token-budget", type=int, default=None,
                 help="tree tokens N (default: the drafter's own when W, L and lookup are its "
                 "own too, else the whole tree)")
  p.add_argument("--tree", choices=TREES, default="auto",
                 help="auto: the tree predicted fastest on this device (timed once, cached); "
                 "recorded: the drafter's decode.json tree (either way W/L/lookup/N given "
                 "above win)")
  p.add_argument("--param-dtype", choices=("float32", "bfloat16", "auto"), default=None,
                 help="the LLM's weights (activations stay float32; default: the drafter's own "
                 "setting; auto, the shipped one's, is bfloat16 on accelerators and on CPUs "
                 "with bf16 instructions, float32 on other CPUs)")
  p.add_argument("--prompt", action="append", default=None,
                 help="a chat prompt (repeatable; default: three built-in ones)")


def run(args) -> int:
  import jax.numpy as jnp

  from redrafter_jax.inference import tree_choice
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.inference.decode import ReDrafter
  from redrafter_jax.inference.defaults import decode_settings
  from redrafter_jax.weights import fetch
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.llama_weights import load_llama
  from redrafter_jax.weights.param_dtype import weights_dtype
  from redrafter_jax.weights.shipped import resolve_drafter
  from redrafter_jax.weights.tokenizer import encode, load_tokenizer, stop_token_ids

  logging.getLogger("jax").setLevel(logging.WARNING)
  path = resolve_drafter(args.drafter)
  flags = dict(beam_width=args.beam_width, beam_length=args.beam_length,
               lookup_ngram=args.lookup_ngram, token_budget=args.token_budget,
               max_new_tokens=args.max_new_tokens)
  decode_settings(path, tree="recorded", **flags)  # bad flags fail before the model loads
  param_dtype = weights_dtype(args.param_dtype, drafter=path)
  llm, _ = load_llama("smollm2-135m", param_dtype=jnp.dtype(param_dtype))
  tok = load_tokenizer(fetch.model_path("smollm2-135m"))
  drafter = load_drafter(path)
  resolved = decode_settings(path, tree=args.tree, llm=llm, drafter=drafter, **flags)
  if resolved.choice is not None:
    print(f"draft trees on this device (batch 1, tokens/step from the drafter's "
          f"{tree_choice.ACCEPTANCE_FILE}):\n{resolved.choice.table()}", flush=True)
    if resolved.decode_ar:
      print(f"{resolved.choice.verdict()}: the demo runs it to show ReDrafter; `generate` "
            "decodes with AR here", flush=True)
  cfg = resolved.config
  # Built once: the models are split and the draft vocabulary restricted here, not per call.
  redrafter = ReDrafter(llm, drafter, cfg)
  stops = stop_token_ids(tok)
  prompts = [encode(tok, p, chat=True) for p in (args.prompt or PROMPTS)]
  print(f"SmolLM2-135M-Instruct (float32 activations, {param_dtype} weights, "
        f"CPU={len(__import__('os').sched_getaffinity(0))} cores), "
        f"drafter {path}, W={cfg.beam_width} L={cfg.beam_length} "
        f"lookup={cfg.lookup_ngram or 'off'} N={cfg.num_tree_tokens} "
        f"draft vocab={cfg.draft_vocab_size or 'all'}", flush=True)
  print("compiling ...", flush=True)
  for ids in prompts:  # prompts of other padded lengths compile their own prefill: not timed
    generate(llm, [ids], max_new_tokens=args.max_new_tokens, stop_ids=stops)
    redrafter([ids], stop_ids=stops)
  total = {"ar": [0, 0.0], "rd": [0, 0.0, 0]}
  same = True
  for text, ids in zip(args.prompt or PROMPTS, prompts):
    t = time.perf_counter()
    ar = generate(llm, [ids], max_new_tokens=args.max_new_tokens, stop_ids=stops).tokens[0]
    t_ar = time.perf_counter() - t
    t = time.perf_counter()
    rd = redrafter([ids], stop_ids=stops)
    t_rd = time.perf_counter() - t
    same &= rd.tokens[0] == ar
    total["ar"][0] += len(ar)
    total["ar"][1] += t_ar
    total["rd"][0] += len(rd.tokens[0])
    total["rd"][1] += t_rd
    total["rd"][2] += rd.metrics["steps"]
    answer = tok.decode([x for x in rd.tokens[0] if x not in stops], skip_special_tokens=True)
    print(f"\n>>> {text}\n{answer.strip()}\n"
          f"[AR {len(ar) / t_ar:.1f} tok/s | ReDrafter {len(rd.tokens[0]) / t_rd:.1f} tok/s, "
          f"{rd.metrics['tokens_per_step']:.2f} tokens/step | "
          f"speedup {t_ar / t_rd * len(rd.tokens[0]) / max(len(ar), 1):.2f}x]", flush=True)
  ar_tps = total["ar"][0] / total["ar"][1]
  rd_tps = total["rd"][0] / total["rd"][1]
  print(f"\nall prompts: AR {ar_tps:.1f} tok/s, ReDrafter {rd_tps:.1f} tok/s "
        f"({rd_tps / ar_tps:.2f}x), {total['rd'][0] / max(total['rd'][2], 1):.2f} tokens/step; "
        f"ReDrafter output identical to AR greedy: {'yes' if same else 'NO'}")
  if not same:
    print("warning: greedy outputs differ (see tests/test_decode_real.py for the tie check)",
          file=sys.stderr)
  return 0
