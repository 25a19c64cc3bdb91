"""``redrafter-jax generate``: text for one prompt from the base model, with its speed.

Prints the generated text on stdout and one timing line on stderr. The first call of a shape
includes JAX's compilation, so by default the same generation runs twice and both timings are
reported: ``first call`` (compile + run) and ``steady state`` (the fastest of the later, identical
calls), each as new tokens / wall seconds of the whole call (prefill included).

Settings not given resolve as everywhere else (``inference.defaults``): with ``--drafter``, the
tree predicted fastest on this device (``--tree auto``, as ``demo`` and ``serve``; ``--tree
recorded`` for the drafter's decode.json tree), the drafter's draft vocabulary and weight
precision; "auto" weights otherwise. A flag always wins. Where no tree is predicted faster than
AR on this device, the command says so and decodes with AR: greedy ReDrafter gives AR's tokens,
so AR is the faster way to the same text. ``--compare-ar`` decodes the prompt with AR and with
ReDrafter (the best tree even where it does not pay) on the same loaded model, runs
interleaved, and prints both speeds, the speed-up and whether the tokens are identical.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

HELP = "generate text for a prompt with the base model (greedy or sampled) and report tokens/s"

DTYPES = ("float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16", "auto")


def add_arguments(p) -> None:
  from redrafter_jax.commands import show_defaults
  from redrafter_jax.inference.defaults import TREES
  from redrafter_jax.models.attention import BACKENDS

  show_defaults(p)
  p.add_argument("--prompt", required=True, help="the prompt text")
  p.add_argument("--chat", action="store_true",
                 help="wrap the prompt as a user turn in the model's chat template")
  p.add_argument("--system", default=None, help="system message (with --chat)")
  p.add_argument("--model", default="smollm2-135m",
                 help="a known model name (smollm2-135m) or a path to a .gguf file or an HF folder")
  p.add_argument("--dtype", choices=DTYPES, default="float32",
                 help="activations and KV cache")
  p.add_argument("--param-dtype", choices=PARAM_DTYPES, default=None,
                 help="the LLM's weights; auto: bfloat16 on accelerators and on CPUs with bf16 "
                 "instructions, else float32 (default: the drafter's recorded setting, auto for "
                 "the shipped one; without a drafter auto, or bfloat16 with --dtype bfloat16)")
  p.add_argument("--backend", choices=BACKENDS, default="xla", help="attention implementation")
  p.add_argument("--invariant", action="store_true",
                 help="the invariant mode: the same greedy tokens at any batch and tree, in "
                 "bfloat16 too, at a cost in time (README: what each mode guarantees)")
  p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
  p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
  p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
  p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
  p.add_argument("--seed", type=int, default=0, help="sampling seed")
  p.add_argument("--ignore-eos", action="store_true",
                 help="do not stop at end-of-turn tokens (always max-new-tokens)")
  p.add_argument("--runs", type=int, default=2,
                 help="identical timed runs; the first includes compilation")
  g = p.add_argument_group("ReDrafter (speculative decoding; without --drafter: plain AR)")
  g.add_argument("--drafter", default=None,
                 help="drafter folder (any supported format), or 'shipped' for the trained "
                      "SmolLM2-135M drafter in checkpoints/")
  g.add_argument("--compare-ar", action="store_true",
                 help="also decode with plain AR on the same model (runs interleaved) and print "
                 "both speeds, the speed-up and whether the tokens are identical")
  g.add_argument("--tree", choices=TREES, default="auto",
                 help="the draft tree when W, L, lookup and N are not given: auto = the one "
                 "predicted fastest on this device (its step times are measured once and "
                 "cached; AR where no tree is predicted faster, unless --compare-ar); recorded "
                 "= the drafter's decode.json (else W=4 L=5)")
  g.add_argument("--beam-width", type=int, default=None,
                 help="W: beams drafted per step (default: from --tree)")
  g.add_argument("--beam-length", type=int, default=None,
                 help="L: beam length INCLUDING the LLM's own token, L-1 drafted tokens "
                 "(default: from --tree)")
  g.add_argument("--token-budget", type=int, default=None,
                 help="N: packed tree tokens verified per step (default: the drafter's recorded "
                 "one with its own tree, else the whole tree W*(L-1)+1)")
  g.add_argument("--lookup-ngram", type=int, default=None,
                 help="add one beam copied from the context after the latest match of its last "
                      "1..N tokens (prompt lookup; exact); 0 = off (default: from --tree)")
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
  if args.compare_ar and not args.drafter:
    raise UserError("--compare-ar needs --drafter (e.g. --drafter shipped)")
  check_sampling(args.temperature, args.top_p, args.top_k)
  if args.drafter:
    settings(args, tree="recorded")  # raises ConfigError; a missing drafter, FileNotFoundError


def settings(args, *, tree: str | None = None, llm=None, drafter=None, log=print):
  """The ReDrafter settings: the flags given, the rest from the drafter
  (``inference.defaults.decode_settings``)."""
  from redrafter_jax.inference.defaults import decode_settings
  from redrafter_jax.weights.shipped import resolve_drafter

  return decode_settings(resolve_drafter(args.drafter), tree=tree or args.tree,
                         beam_width=args.beam_width, beam_length=args.beam_length,
                         lookup_ngram=args.lookup_ngram, token_budget=args.token_budget,
                         draft_vocab_size=args.draft_vocab, max_new_tokens=args.max_new_tokens,
                         acceptance=args.acceptance, llm=llm, drafter=drafter, log=log)


def weights_dtype(args) -> str:
  """The LLM's weight dtype (``weights.param_dtype.weights_dtype``): ``--param-dtype``, else the
  drafter's recorded one, else "auto"."""
  from redrafter_jax.weights.param_dtype import weights_dtype as resolve
  from redrafter_jax.weights.shipped import resolve_drafter

  drafter = resolve_drafter(args.drafter) if args.drafter else None
  requested = args.param_dtype if args.param_dtype or drafter else "auto"
  return resolve(requested, dtype=args.dtype, drafter=drafter)


def load_model(args, param_dtype: str):
  """``(model, tokenizer)`` for ``--model`` in ``--dtype`` activations, ``param_dtype`` weights,
  with ``--backend``."""
  import jax.numpy as jnp

  from redrafter_jax.weights.llama_weights import load_llama, resolve_source
  from redrafter_jax.weights.tokenizer import load_tokenizer

  model, _ = load_llama(args.model, dtype=jnp.dtype(args.dtype),
                        param_dtype=jnp.dtype(param_dtype), backend=args.backend,
                        invariant=args.invariant)
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


def redrafter_decoder(model, drafter, cfg, prompt_ids, args, stop_ids
                      ) -> Callable[[], Generation]:
  """ReDrafter decoding of one prompt with ``drafter`` and the settings ``cfg``."""
  from redrafter_jax.inference.decode import ReDrafter

  redrafter = ReDrafter(model, drafter, cfg)  # every run reuses the split models

  def decode() -> Generation:
    r = redrafter([prompt_ids], seed=args.seed, stop_ids=stop_ids,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    m = r.metrics
    return Generation(tokens=r.tokens[0], stopped=r.stopped[0], forwards=r.steps,
                      extra={"tokens/step": f"{m['tokens_per_step']:.2f}",
                             "mean tree tokens": f"{m['mean_tree_tokens']:.1f}"})

  return decode


def redrafter_name(cfg) -> str:
  return f"redrafter W={cfg.beam_width} L={cfg.beam_length}" + (
      f" + lookup {cfg.lookup_ngram}" if cfg.lookup_ngram else "")


def timed_runs(decoders: dict[str, Callable[[], Generation]], runs: int
               ) -> dict[str, tuple[Generation, list[float]]]:
  """Run each decoder ``runs`` times, taking turns (a slow spell of a shared machine slows
  them alike); per name, the last result and every wall time (seconds)."""
  seconds = {name: [] for name in decoders}
  out = {}
  for _ in range(runs):
    for name, decode in decoders.items():
      start = time.perf_counter()
      out[name] = decode()
      seconds[name].append(time.perf_counter() - start)
  return {name: (out[name], seconds[name]) for name in decoders}


def tokens_per_second(out: Generation, seconds: list[float]) -> float:
  """Steady state (the fastest later run) when there are later runs, else the first call."""
  return len(out.tokens) / (min(seconds[1:]) if len(seconds) > 1 else seconds[0])


def speed_line(name: str, out: Generation, seconds: list[float]) -> str:
  n = len(out.tokens)
  parts = [f"{name}: {n} new tokens", f"{out.forwards + 1} forwards",
           f"first call {seconds[0]:.2f} s (incl. compile) = {n / seconds[0]:.1f} tok/s"]
  if len(seconds) > 1:
    best = min(seconds[1:])
    parts.append(f"steady state {best:.2f} s = {n / best:.1f} tok/s")
  parts += [f"{k} {v}" for k, v in out.extra.items()]
  return " | ".join(parts)


def comparison_line(ar: tuple[Generation, list[float]], rd: tuple[Generation, list[float]],
                    greedy: bool) -> str:
  """AR against ReDrafter: both speeds, the speed-up and whether the tokens are identical."""
  ar_tps, rd_tps = tokens_per_second(*ar), tokens_per_second(*rd)
  when = "steady state" if len(ar[1]) > 1 else "first call, incl. compile"
  same = ar[0].tokens == rd[0].tokens
  verdict = "identical" if same else ("DIFFERENT" if greedy else
                                      "different (sampling: the same distribution, not the "
                                      "same draws)")
  return (f"compare ({when}): AR {ar_tps:.1f} tok/s, ReDrafter {rd_tps:.1f} tok/s = "
          f"{rd_tps / ar_tps:.2f}x AR | tokens {verdict}")


def run(args) -> int:
  import logging
  import sys

  from redrafter_jax.inference.runtime import GenerateError, cache_size_for
  from redrafter_jax.weights.tokenizer import stop_token_ids

  def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

  check_arguments(args)
  logging.getLogger("jax").setLevel(logging.WARNING)  # not its INFO notes on absent backends
  param_dtype = weights_dtype(args)
  model, tok = load_model(args, param_dtype)
  prompt_ids = encode_prompt(tok, args)
  if not prompt_ids:
    raise GenerateError("the prompt encodes to no tokens")
  stop_ids = () if args.ignore_eos else stop_token_ids(tok)
  decoders, cfg = {}, None
  if args.drafter:
    from redrafter_jax.weights.drafter_io import load_drafter
    from redrafter_jax.weights.shipped import resolve_drafter

    drafter = load_drafter(resolve_drafter(args.drafter))
    resolved = settings(args, llm=model, drafter=drafter, log=note)
    cfg = resolved.config
    if resolved.decode_ar:
      note(f"{resolved.choice.verdict()}: " + (
          "comparing AR with that tree, as asked" if args.compare_ar else
          "decoding with AR, the same tokens (--tree recorded or a tree flag forces a tree)"))
      if not args.compare_ar:
        cfg = None
  # Fails with the numbers when the prompt + new tokens do not fit the model's context.
  extra = 1 if cfg is None else cfg.beam_length + cfg.num_tree_tokens
  cache_size_for(len(prompt_ids), args.max_new_tokens, extra,
                 model.config.max_position_embeddings)
  note(f"settings: {args.dtype} activations, {param_dtype} weights; "
       + ("AR" if cfg is None else f"ReDrafter {resolved.describe()}"))
  if cfg is None or args.compare_ar:
    decoders["ar"] = ar_decoder(model, prompt_ids, args, stop_ids)
  if cfg is not None:
    decoders[redrafter_name(cfg)] = redrafter_decoder(model, drafter, cfg, prompt_ids, args,
                                                      stop_ids)
  results = timed_runs(decoders, args.runs)
  out, _ = results[list(decoders)[-1]]  # ReDrafter's text when it ran, else AR's
  print(tok.decode([t for t in out.tokens if t not in stop_ids], skip_special_tokens=True))
  for name, (gen, seconds) in results.items():
    note(speed_line(name, gen, seconds))
  if args.compare_ar:
    note(comparison_line(results["ar"], results[redrafter_name(cfg)],
                         greedy=args.temperature == 0))
  return 0
