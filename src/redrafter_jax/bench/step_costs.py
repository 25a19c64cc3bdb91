"""``python -m redrafter_jax.bench step_costs``: what one decode step costs at a real large-model
shape (Llama-3-8B by default), against the time to read its bytes once.

A decode step on a GPU is memory-bound: it should cost about the time to read the weights once
from device memory, and verifying N draft-tree tokens should cost barely more than an AR step
(the same weights read once, N rows instead of one). This benchmark measures that without any
checkpoint: the LLM (``--shape``) and a ReDrafter head are built from random weights ON THE
DEVICE (shape-only modules from ``nnx.eval_shape``, each leaf filled by a jitted random draw), so
no weights cross from the host. The programs timed are the decoder's own code paths:

  ``ar step``     ``ar.one_token_step``: one token per row over a cache holding ``--prefix``
                  tokens (at each ``--batch``)
  ``verify N``    ``step.verify_forward`` of an N-token packed draft tree (``tree.pack``) over
                  the same cache, batch 1
  ``draft``       ``step.draft``: the drafter's beam search (W x L) and the tree packing, batch 1
  ``copy``        a jitted ``x + 1`` over a ``--copy-mib`` bf16 buffer: the bandwidth the read
                  times are computed from

Attention runs on the decoder's backend for the platform (cuDNN on a GPU); should cuDNN refuse a
forward, the run goes on with ``xla`` and the table says so. Each row gives the median wall seconds of ``--reps`` calls (after a compiling call and a
warm-up, results waited for), the seconds its first call spent compiling, the bytes it must read
at least once, the time to read them at the measured bandwidth, and the ratio of the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import pathlib
import sys
import time

from redrafter_jax.helptext import show_defaults

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=8192),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=500000.0,
                 tie_word_embeddings=False, max_position_embeddings=8192),
}
COPY_MIB = {"llama3-8b": 2048, "tiny": 64}  # --copy-mib defaults: >= 1 GiB on the real shape
DTYPES = ("bfloat16", "float32")


class _Parser(argparse.ArgumentParser):
  """Bad arguments end with one line on stderr (and exit status 2), not the usage text."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message}\n")


def _int_list(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
  return values


def parse_args(argv):
  p = _Parser(prog="python -m redrafter_jax.bench step_costs",
              description=__doc__.strip().splitlines()[0])
  show_defaults(p)
  p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                 help="the LLM's architecture (random weights)")
  p.add_argument("--layers", type=int, help="override the shape's layer count (a quick run)")
  p.add_argument("--scan-layers", action="store_true",
                 help="run the decoder as a scan over stacked layers (llama.stack_layers): one "
                 "layer body to compile whatever the depth")
  p.add_argument("--param-dtype", choices=DTYPES, default="bfloat16",
                 help="the LLM's and the drafter's weights")
  p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                 help="activations and KV cache")
  p.add_argument("--attention", choices=("auto", "xla", "cudnn", "pallas"), default="auto",
                 help="attention backend (auto: cudnn on a GPU, else xla)")
  p.add_argument("--context", type=int, default=1024, help="KV-cache slots per row")
  p.add_argument("--prefix", type=int, default=512, help="tokens the cache holds")
  p.add_argument("--batch", type=_int_list, default=[1],
                 help="AR-step batch sizes, comma-separated (batch 1 is always timed)")
  p.add_argument("--verify-tokens", type=_int_list, default=[8, 16, 32, 64],
                 help="tree sizes N of the verification forwards, comma-separated")
  p.add_argument("--beam-width", type=int, default=4, help="the draft's beams W")
  p.add_argument("--beam-length", type=int, default=5, help="the draft's beam length L (incl. g0)")
  p.add_argument("--exit-dim", type=int, help="the drafter's exit dim (default: the LLM's width)")
  p.add_argument("--copy-mib", type=int,
                 help=f"the copied buffer, MiB (default {COPY_MIB['llama3-8b']}; "
                      f"{COPY_MIB['tiny']} for tiny)")
  p.add_argument("--reps", type=int, default=20, help="timed calls per program (median)")
  p.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
  p.add_argument("--out", type=pathlib.Path,
                 help="also write the table (markdown) here, and its numbers as .json beside it")
  args = p.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  for name in ("layers", "exit_dim", "copy_mib"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
  if min(args.context, args.prefix, args.reps, args.beam_width) < 1:
    p.error("--context, --prefix, --reps and --beam-width must be >= 1")
  if args.beam_length < 2:
    p.error(f"--beam-length must be >= 2 (it counts the LLM's own token), got {args.beam_length}")
  need = args.prefix + max(args.verify_tokens)
  if need > args.context:
    p.error(f"--prefix {args.prefix} + the largest --verify-tokens {max(args.verify_tokens)} "
            f"= {need} slots do not fit --context {args.context}")
  args.batch = sorted({1, *args.batch})
  args.copy_mib = args.copy_mib or COPY_MIB[args.shape]
  return args


def shape_config(args):
  """The ``LlamaConfig`` of ``--shape``, with ``--layers`` applied."""
  from redrafter_jax.config import LlamaConfig

  cfg = LlamaConfig(**SHAPES[args.shape])
  return dataclasses.replace(cfg, num_layers=args.layers) if args.layers else cfg


def random_module(make, seed: int):
  """The module ``make()`` builds, with random weights drawn on the device: ``make`` runs
  shape-only (``nnx.eval_shape``), then each leaf is filled by a jitted draw (matrices
  ``N(0, 0.02^2)``, vectors ones, integers zeros), so no weight is built on the host or copied
  to the device, and nothing is drawn twice."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  @functools.partial(jax.jit, static_argnums=(1, 2))
  def fill(key, shape, dtype):
    if not jnp.issubdtype(dtype, jnp.floating):
      return jnp.zeros(shape, dtype)
    if len(shape) < 2:  # norm scales and biases
      return jnp.ones(shape, dtype)
    return jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype)

  graphdef, state = nnx.split(nnx.eval_shape(make))
  leaves, treedef = jax.tree.flatten(state)
  key = jax.random.key(seed)
  filled = [fill(jax.random.fold_in(key, i), leaf.shape, jnp.dtype(leaf.dtype))
            for i, leaf in enumerate(leaves)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, filled))


def param_bytes(module) -> int:
  """Bytes of a module's parameters (``nnx.Param``): what a forward reads once."""
  import jax
  from flax import nnx

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def kv_bytes(cfg, tokens: int, itemsize: int) -> int:
  """Bytes of the keys and values of ``tokens`` cached tokens of one row, all layers."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * itemsize


def _decode_state(cache, h_BD, g0_B):
  """A ``step.DecodeState`` around the given cache and drafter inputs; its other fields are
  placeholders that the forwards timed here do not read."""
  import jax
  import jax.numpy as jnp

  from redrafter_jax.inference.runtime import empty_output
  from redrafter_jax.inference.step import DecodeState, Metrics

  B = g0_B.shape[0]
  return DecodeState(cache=cache, g0_B=g0_B, h_BD=h_BD,
                     context_BS=jnp.zeros((B, 1), jnp.int32), out=empty_output(B, 1),
                     done_B=jnp.zeros((B,), bool), rng=jax.random.key(0),
                     metrics=Metrics.zeros(B, 2))


def ar_program(llm, batch: int, context: int, prefix: int):
  """One AR step per call at ``batch`` rows over a ``context``-slot cache holding ``prefix``
  tokens: the cache is donated and comes back with its lengths unchanged, so every call reads
  the same ``prefix`` keys and writes the same slot."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.inference import sampling
  from redrafter_jax.inference.ar import one_token_step
  from redrafter_jax.models import kv_cache as kvc

  graphdef, state = nnx.split(llm)

  @functools.partial(jax.jit, donate_argnums=(2,))
  def step(state, last_B, cache):
    logits_BV, new = one_token_step(nnx.merge(graphdef, state), last_B, cache)
    return sampling.greedy_tokens(logits_BV), new.replace(lengths_B=cache.lengths_B)

  carry = [jnp.ones((batch,), jnp.int32),
           kvc.advance(llm.init_cache(batch, context), jnp.full((batch,), prefix, jnp.int32))]

  def call():
    carry[:] = step(state, *carry)
    return carry[0]

  return call


def verify_tree(tokens: int, beam_length: int, vocab: int):
  """A packed tree of ``tokens`` nodes (batch 1), from beams of ``beam_length`` whose tokens
  differ from depth 1 on, so every slot holds a real node (``tree.pack``, breadth first)."""
  import jax.numpy as jnp

  from redrafter_jax.inference import tree as tree_lib

  L = beam_length
  W = math.ceil((tokens - 1) / (L - 1)) + 1 if tokens > 1 else 1
  ids_WL = (1 + jnp.arange(W)[:, None] * L + jnp.arange(L)[None, :]) % vocab
  beams_1WL = ids_WL.at[:, 0].set(0)[None].astype(jnp.int32)
  return tree_lib.pack(beams_1WL, tokens)


def verify_program(llm, tree, context: int, prefix: int):
  """The decoder's verification forward (``step.verify_forward``) of ``tree`` per call, reading
  the context bucket the decoder would (``kv_cache.context_bucket``). The tree's K/V land in
  scratch slots past ``prefix`` and nothing is committed, so every call is the same."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.inference import sampling
  from redrafter_jax.inference.step import verify_forward
  from redrafter_jax.models import kv_cache as kvc

  graphdef, state = nnx.split(llm)
  width = kvc.context_bucket(prefix + tree.size, context)
  h_1D = jnp.zeros((1, llm.config.hidden_size), llm.dtype)

  @functools.partial(jax.jit, donate_argnums=(1,))
  def verify(state, cache, tree):
    model = nnx.merge(graphdef, state)
    logits_BNV, _, cache = verify_forward(
        model, _decode_state(cache, h_1D, tree.tokens_BN[:, 0]), tree, width)
    return sampling.greedy_tokens(logits_BNV), cache

  carry = [kvc.advance(llm.init_cache(1, context), jnp.full((1,), prefix, jnp.int32))]

  def call():
    tokens_BN, carry[0] = verify(state, carry[0], tree)
    return tokens_BN

  return call


def draft_program(llm, drafter, decode_cfg, seed: int):
  """``step.draft`` (beam search over the drafter, then the tree packing) at batch 1 per call,
  from a random hidden state, with the embedding table in the activations' dtype as the
  decoder passes it."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.inference.step import draft

  llm_def, llm_state = nnx.split(llm)
  drafter_def, drafter_state = nnx.split(drafter)
  embed_VD = llm.embed_tokens.embedding[...].astype(llm.dtype)
  h_1D = jax.random.normal(jax.random.key(seed), (1, llm.config.hidden_size), llm.dtype)
  g0_1 = jnp.ones((1,), jnp.int32)

  @jax.jit
  def run(llm_state, drafter_state, embed_VD, h_BD, g0_B):
    beams, tree = draft(nnx.merge(llm_def, llm_state), nnx.merge(drafter_def, drafter_state),
                        _decode_state(None, h_BD, g0_B), decode_cfg, embed_VD)
    return beams.beams_BWL, tree.tokens_BN

  return lambda: run(llm_state, drafter_state, embed_VD, h_1D, g0_1)


def copy_program(mib: int):
  """A jitted ``x + 1`` over a bf16 buffer of ``mib`` MiB (it reads and writes every byte, and
  XLA cannot drop it as it could a plain copy); returns the call and the bytes it moves."""
  import jax
  import jax.numpy as jnp

  x = jnp.zeros((mib * 2 ** 20 // 2,), jnp.bfloat16)
  add_one = jax.jit(lambda x: x + jnp.ones((), x.dtype))
  return (lambda: add_one(x)), 2 * x.size * x.dtype.itemsize


def timed(name: str, call, reps: int) -> dict:
  """Median seconds of ``reps`` calls after a compiling call and one warm-up, the first call's
  compile seconds, and how many programs compiled while timing (0 unless shapes changed)."""
  import jax

  from redrafter_jax.bench._compiles import compile_seconds, programs_compiled
  from redrafter_jax.inference.timing import median_seconds

  with compile_seconds() as secs:
    jax.block_until_ready(call())
  before = programs_compiled()
  seconds = median_seconds(call, reps, warmup=1)
  row = dict(program=name, seconds=seconds, compile_s=secs[0],
             recompiled=programs_compiled() - before)
  print(f"step_costs: {name}: {seconds * 1e3:.3f} ms (compile {secs[0]:.1f} s)",
        file=sys.stderr, flush=True)
  return row


def attention_backends(choice: str, platform: str) -> list[str]:
  """The attention backends to try, in order: ``auto`` is the decoder's choice on this
  platform (cudnn on a GPU), then ``xla`` should cuDNN refuse a forward (so that a run on a new
  machine still measures the weights' cost); a named backend is tried alone."""
  if choice != "auto":
    return [choice]
  return ["cudnn", "xla"] if platform == "gpu" else ["xla"]


def time_programs(llm, drafter, args, llm_bytes: int, drafter_bytes: int, prefix_kv: int
                  ) -> list[dict]:
  """One row per program: AR steps, verification forwards, the draft, the copy."""
  from redrafter_jax.config import DecodeConfig

  W, L = args.beam_width, args.beam_length
  rows = []
  for b in args.batch:
    rows.append(dict(timed(f"ar step b={b}", ar_program(llm, b, args.context, args.prefix),
                           args.reps), batch=b, tokens=1, bytes=llm_bytes + b * prefix_kv))
  for n in args.verify_tokens:
    tree = verify_tree(n, L, llm.config.vocab_size)
    rows.append(dict(timed(f"verify N={n}", verify_program(llm, tree, args.context, args.prefix),
                           args.reps), batch=1, tokens=n, bytes=llm_bytes + prefix_kv))
  decode_cfg = DecodeConfig(beam_width=W, beam_length=L, acceptance="greedy")
  rows.append(dict(timed(f"draft W={W} L={L}", draft_program(llm, drafter, decode_cfg, args.seed),
                         args.reps), batch=1, tokens=W, bytes=(L - 1) * drafter_bytes))
  copy_call, moved = copy_program(args.copy_mib)
  rows.append(dict(timed(f"copy {args.copy_mib} MiB", copy_call, args.reps), batch=None,
                   tokens=None, bytes=moved))
  return rows


def measure(args) -> dict:
  """Build the models on the device, time every program, and return the report's numbers."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from redrafter_jax.bench._compiles import compile_seconds
  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.attention import cache_dtype, check_backend
  from redrafter_jax.models.drafter import Drafter
  from redrafter_jax.models.llama import Llama, stack_layers

  cfg = shape_config(args)
  backends = attention_backends(args.attention, jax.default_backend())
  if args.attention != "auto":
    check_backend(args.attention)
  dtype, param_dtype = jnp.dtype(args.dtype), jnp.dtype(args.param_dtype)
  exit_dim = args.exit_dim or cfg.hidden_size
  t0 = time.perf_counter()
  with compile_seconds() as build_compile:
    stack = stack_layers if args.scan_layers else (lambda m: m)
    llm = random_module(lambda: stack(Llama(cfg, dtype=dtype, param_dtype=param_dtype,
                                            backend=backends[0], rngs=nnx.Rngs(0))), args.seed)
    drafter = random_module(lambda: Drafter(
        DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, exit_dim=exit_dim),
        dtype=param_dtype, rngs=nnx.Rngs(0)), args.seed + 1)
    jax.block_until_ready((llm, drafter))
  build_s = time.perf_counter() - t0
  llm_bytes, drafter_bytes = param_bytes(llm), param_bytes(drafter)
  failed = []
  for backend in backends:
    llm.backend = backend  # static: the programs below trace it (and its cache layout) anew
    prefix_kv = kv_bytes(cfg, args.prefix, jnp.dtype(cache_dtype(backend, dtype)).itemsize)
    try:
      rows = time_programs(llm, drafter, args, llm_bytes, drafter_bytes, prefix_kv)
      break
    except Exception as e:  # noqa: BLE001 - reported, then the next backend is tried
      if backend == backends[-1]:
        raise
      reason = (str(e).strip().splitlines() or [""])[0][:200]
      failed.append(f"{backend} failed: {type(e).__name__}: {reason}")
      print(f"step_costs: attention {failed[-1]}; trying {backends[backends.index(backend) + 1]}",
            file=sys.stderr, flush=True)

  moved = rows[-1]["bytes"]
  bandwidth = moved / rows[-1]["seconds"]
  ar_s = rows[0]["seconds"]
  for row in rows:
    row["read_s"] = row["bytes"] / bandwidth
    row["ratio"] = row["seconds"] / row["read_s"]
    row["x_ar"] = row["seconds"] / ar_s
  stats = jax.devices()[0].memory_stats() or {}
  return dict(
      date=str(datetime.date.today()), command=" ".join(["step_costs", *args.argv]),
      device=jax.devices()[0].device_kind, platform=jax.default_backend(), shape=args.shape,
      config=cfg.to_dict(), dtype=args.dtype, param_dtype=args.param_dtype, attention=backend,
      scan_layers=args.scan_layers, attention_failed=failed, context=args.context, prefix=args.prefix, reps=args.reps,
      beam_width=args.beam_width, beam_length=args.beam_length, exit_dim=exit_dim,
      llm_param_bytes=llm_bytes, drafter_param_bytes=drafter_bytes, kv_bytes_per_row=prefix_kv,
      copy_bytes_moved=moved, read_bandwidth_Bps=bandwidth, build_s=build_s,
      build_compile_s=build_compile[0], peak_device_bytes=stats.get("peak_bytes_in_use"),
      rows=rows)


def _size(n: float, unit: str = "B") -> str:
  """``n`` with a decimal prefix: 16.06 GB, 1.57 MB, 8.03 G parameters."""
  for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
    if n >= scale:
      return f"{n / scale:.2f} {prefix}{unit}"
  return f"{n:.0f} {unit}"


def table(r: dict) -> str:
  cfg = r["config"]
  params = r["llm_param_bytes"] // (2 if r["param_dtype"] == "bfloat16" else 4)
  fallback = "".join(f" (after {f})" for f in r["attention_failed"])
  peak = (f"; peak device memory {_size(r['peak_device_bytes'])}"
          if r["peak_device_bytes"] else "")
  lines = [
      f"# Step costs vs bytes read: {r['shape']} on {r['device']} ({r['date']})", "",
      f"`python -m redrafter_jax.bench {r['command']}`".rstrip(), "",
      f"Device **{r['device']}** ({r['platform']}); shape **{r['shape']}**: {cfg['num_layers']} "
      f"layers{' (scanned)' if r.get('scan_layers') else ''}, width {cfg['hidden_size']}, {cfg['num_heads']} heads / {cfg['num_kv_heads']} kv "
      f"heads x {cfg['head_dim']}, ffn {cfg['intermediate_size']}, vocab {cfg['vocab_size']} "
      f"({_size(params, ' parameters')}, {_size(r['llm_param_bytes'])}); "
      f"weights **{r['param_dtype']}**, activations and KV cache **{r['dtype']}**, attention "
      f"{r['attention']}{fallback}; random weights built on the device in {r['build_s']:.1f} s "
      f"({r['build_compile_s']:.1f} s of it compiling).",
      f"KV cache of {r['context']} slots holding {r['prefix']} tokens "
      f"({_size(r['kv_bytes_per_row'])} per row). Draft: a random ReDrafter head of exit dim "
      f"{r['exit_dim']} ({_size(r['drafter_param_bytes'])}), beam search "
      f"W={r['beam_width']} L={r['beam_length']}{peak}.",
      "",
      f"seconds: median of {r['reps']} calls after a compiling call and a warm-up. bytes: what a "
      "call must read at least once: the LLM's parameters plus each row's cached keys and values "
      f"(verify N adds nothing); the draft reads the drafter's parameters once per beam step "
      f"({r['beam_length'] - 1} steps); the copy row counts bytes read + written. read time = "
      f"bytes / **copy bandwidth {r['read_bandwidth_Bps'] / 1e9:.1f} GB/s** (bytes read + "
      "written per second by the copy, used as the read bandwidth). x AR step: seconds over "
      "the batch-1 AR step's.", "",
      "| program | batch | tokens | ms | compile s | bytes | read time ms | s / read time "
      "| x AR step |",
      "|---|---|---|---|---|---|---|---|---|"]
  for row in r["rows"]:
    dash = lambda v: "-" if v is None else str(v)
    lines.append(f"| {row['program']} | {dash(row['batch'])} | {dash(row['tokens'])} | "
                 f"{row['seconds'] * 1e3:.3f} | {row['compile_s']:.1f} | {row['bytes']} | "
                 f"{row['read_s'] * 1e3:.3f} | {row['ratio']:.2f} | {row['x_ar']:.2f} |")
  recompiled = sum(row["recompiled"] for row in r["rows"])
  if recompiled:
    lines += ["", f"WARNING: {recompiled} programs compiled while timing: those times include "
              "compiles."]
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  args = parse_args(argv)
  from redrafter_jax.bench._common import emit

  result = measure(args)
  emit(table(result), args.out)
  if args.out:
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
