"""``redrafter-jax generate``: text for one prompt from the base model, with its speed.

Prints the generated text on stdout and one timing line on stderr. The first call of a shape
includes JAX's compilation, so by default the same generation runs twice and both timings are
reported: ``first call`` (compile + run) and ``steady state`` (the fastest of the later, identical
calls), each as new tokens / wall seconds of the whole call (prefill included).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

HELP = "generate text for a prompt with the base model (greedy or sampled) and report tokens/s"

DTYPES = ("float32", "bfloat16")


def add_arguments(p) -> None:
  from redrafter_jax.models.attention import BACKENDS

  p.add_argument("--prompt", required=True, help="the prompt text")
  p.add_argument("--chat", action="store_true",
                 help="wrap the prompt as a user turn in the model's chat template")
  p.add_argument("--system", default=None, help="system message (with --chat)")
  p.add_argument("--model", default="smollm2-135m",
                 help="a known model name (smollm2-135m) or a path to a .gguf file or an HF folder")
  p.add_argument("--dtype", choices=DTYPES, default="float32",
                 help="activations and KV cache")
  p.add_argument("--param-dtype", choices=DTYPES, default=None,
                 help="weights (default: --dtype); bfloat16 with float32 activations is the "
                 "fast CPU setting")
  p.add_argument("--backend", choices=BACKENDS, default="xla", help="attention implementation")
  p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
  p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
  p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--ignore-eos", action="store_true",
                 help="do not stop at end-of-turn tokens (always max-new-tokens)")
  p.add_argument("--runs", type=int, default=2,
                 help="identical timed runs; the first includes compilation (default 2)")
  g = p.add_argument_group("ReDrafter (speculative decoding; without --drafter: plain AR)")
  g.add_argument("--drafter", default=None,
                 help="drafter folder (any supported format), or 'shipped' for the trained "
                      "SmolLM2-135M drafter in checkpoints/")
  g.add_argument("--beam-width", type=int, default=4, help="W: beams drafted per step")
  g.add_argument("--beam-length", type=int, default=5,
                 help="L: beam length INCLUDING the LLM's own token (L-1 drafted tokens)")
  g.add_argument("--token-budget", type=int, default=None,
                 help="N: packed tree tokens verified per step (default beams*(L-1)+1)")
  g.add_argument("--lookup-ngram", type=int, default=0,
                 help="add one beam copied from the context after the latest match of its last "
                      "1..N tokens (prompt lookup; exact); 0 = off (default)")
  g.add_argument("--draft-vocab", type=int, default=None,
                 help="draft only the R most frequent tokens (default: the drafter's own "
                      "recommendation, else the whole vocabulary)")
  g.add_argument("--acceptance", default="exact", choices=("exact", "typical", "reference"),
                 help="rule for temperature > 0: exact (default), typical (lossy), reference")


def check_arguments(args) -> None:
  """Reject bad arguments before any model is loaded."""
  from redrafter_jax.errors import UserError
  from redrafter_jax.inference.runtime import check_sampling

  if not args.prompt.strip():
    raise UserError("--prompt is empty")
  if args.max_new_tokens < 1:
    raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  if args.runs < 1:
    raise UserError(f"--runs must be >= 1, got {args.runs}")
  if args.system is not None and not args.chat:
    raise UserError("--system needs --chat")
  check_sampling(args.temperature, args.top_p, args.top_k)
  if args.drafter:
    decode_config(args, args.draft_vocab or 0)  # raises ConfigError


def decode_config(args, draft_vocab: int):
  """The ReDrafter settings the arguments ask for."""
  from redrafter_jax.config import DecodeConfig

  return DecodeConfig(beam_width=args.beam_width, beam_length=args.beam_length,
                      max_new_tokens=args.max_new_tokens, token_budget=args.token_budget,
                      lookup_ngram=args.lookup_ngram, draft_vocab_size=draft_vocab,
                      acceptance=args.acceptance)


def load_model(args):
  """``(model, tokenizer)`` for ``--model`` in ``--dtype`` / ``--param-dtype`` with
  ``--backend``."""
  import jax.numpy as jnp

  from redrafter_jax.weights.llama_weights import load_llama, resolve_source
  from redrafter_jax.weights.tokenizer import load_tokenizer

  model, _ = load_llama(args.model, dtype=jnp.dtype(args.dtype),
                        param_dtype=jnp.dtype(args.param_dtype or args.dtype),
                        backend=args.backend)
  return model, load_tokenizer(resolve_source(args.model))


def encode_prompt(tok, args) -> list[int]:
  from redrafter_jax.weights.tokenizer import encode

  return encode(tok, args.prompt, chat=args.chat, system=args.system)


@dataclasses.dataclass
class Generation:
  """What one decoding call produced, for the report."""

  tokens: list[int]
  stopped: bool  # ended on a stop token
  forwards: int  # LLM forward passes after the prefill
  extra: dict = dataclasses.field(default_factory=dict)  # decoder-specific counters


def ar_decoder(model, prompt_ids: list[int], args, stop_ids) -> Callable[[], Generation]:
  """Plain autoregressive decoding of one prompt (the baseline every decoder must match)."""
  from redrafter_jax.inference.ar import generate

  def decode() -> Generation:
    r = generate(model, [prompt_ids], max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                 seed=args.seed, stop_ids=stop_ids)
    return Generation(tokens=r.tokens[0], stopped=r.stopped[0], forwards=r.steps)

  return decode


def redrafter_decoder(model, prompt_ids, args, stop_ids) -> Callable[[], Generation]:
  """ReDrafter decoding of one prompt with the drafter and beam settings of ``args``."""
  from redrafter_jax.inference.decode import ReDrafter
  from redrafter_jax.weights.drafter_io import load_drafter
  from redrafter_jax.weights.shipped import draft_vocab_for, resolve_drafter

  path = resolve_drafter(args.drafter)
  cfg = decode_config(args, draft_vocab_for(path, args.draft_vocab))
  redrafter = ReDrafter(model, load_drafter(path), cfg)  # every run reuses the split models

  def decode() -> Generation:
    r = redrafter([prompt_ids], seed=args.seed, stop_ids=stop_ids,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    m = r.metrics
    return Generation(tokens=r.tokens[0], stopped=r.stopped[0], forwards=r.steps,
                      extra={"tokens/step": f"{m['tokens_per_step']:.2f}",
                             "mean tree tokens": f"{m['mean_tree_tokens']:.1f}"})

  return decode


def make_decoder(model, prompt_ids, args, stop_ids) -> tuple[str, Callable[[], Generation]]:
  """(name, zero-argument decode function) for the decoding the arguments ask for."""
  if args.drafter:
    name = f"redrafter W={args.beam_width} L={args.beam_length}" + (
        f" + lookup {args.lookup_ngram}" if args.lookup_ngram else "")
    return name, redrafter_decoder(model, prompt_ids, args, stop_ids)
  return "ar", ar_decoder(model, prompt_ids, args, stop_ids)


def timed_runs(decode: Callable[[], Generation], runs: int) -> tuple[Generation, list[float]]:
  """Run ``decode`` ``runs`` times; the last result and every wall time (seconds)."""
  seconds = []
  for _ in range(runs):
    start = time.perf_counter()
    out = decode()
    seconds.append(time.perf_counter() - start)
  return out, seconds


def speed_line(name: str, out: Generation, seconds: list[float]) -> str:
  n = len(out.tokens)
  parts = [f"{name}: {n} new tokens", f"{out.forwards + 1} forwards",
           f"first call {seconds[0]:.2f} s (incl. compile) = {n / seconds[0]:.1f} tok/s"]
  if len(seconds) > 1:
    best = min(seconds[1:])
    parts.append(f"steady state {best:.2f} s = {n / best:.1f} tok/s")
  parts += [f"{k} {v}" for k, v in out.extra.items()]
  return " | ".join(parts)


def run(args) -> int:
  import logging
  import sys

  from redrafter_jax.inference.runtime import GenerateError, cache_size_for
  from redrafter_jax.weights.tokenizer import stop_token_ids

  check_arguments(args)
  logging.getLogger("jax").setLevel(logging.WARNING)  # not its INFO notes on absent backends
  model, tok = load_model(args)
  prompt_ids = encode_prompt(tok, args)
  if not prompt_ids:
    raise GenerateError("the prompt encodes to no tokens")
  # Fails with the numbers when the prompt + new tokens do not fit the model's context.
  extra = 1 if not args.drafter else args.beam_length + decode_config(args, 0).num_tree_tokens
  cache_size_for(len(prompt_ids), args.max_new_tokens, extra,
                 model.config.max_position_embeddings)
  stop_ids = () if args.ignore_eos else stop_token_ids(tok)
  name, decode = make_decoder(model, prompt_ids, args, stop_ids)
  out, seconds = timed_runs(decode, args.runs)
  text_ids = [t for t in out.tokens if t not in stop_ids]
  print(tok.decode(text_ids, skip_special_tokens=True))
  print(speed_line(name, out, seconds), file=sys.stderr)
  return 0
