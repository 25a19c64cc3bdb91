"""Choosing the draft tree (W, L, lookup, N) for the device at hand.

A tree's speed is tokens per step over seconds per step, and the two come from different places:

- tokens per step belong to the drafter: ``measure_acceptance`` decodes calibration prompts with
  each candidate tree once (greedy) and the result is kept beside the drafter's weights
  (``acceptance.json``). It does not depend on the device (up to the weights' dtype).
- seconds per step belong to the device: ``time_steps`` times one step program of each
  candidate, and the AR step, on the device at hand (batch 1, a fixed context), as EAGLE-2's
  ``total_token=-1`` times its verify budgets. The table is cached per device (CPU model and
  flags or accelerator kind, weight dtype, attention backend, model shape) under the cache folder,
  so a device pays for it once; times taken while other processes kept the CPUs busy are used
  for that run only, not cached.

``choose`` combines them: the candidate with the most tokens per second of predicted speed,
with the predicted speedup over AR (tokens/step x AR step / tree step). ``tuned`` does all of it
for a drafter folder, from the cache when it can; the demo and the server call it.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import pathlib
import platform
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from redrafter_jax.config import ConfigError, DecodeConfig
from redrafter_jax.errors import UserError
from redrafter_jax.inference.timing import OtherLoad


@dataclasses.dataclass(frozen=True)
class Beams:
  """A tree setting, written ``WxL`` (W drafter beams of length L, g0 included), ``WxL+n``
  (plus the context-lookup beam matching up to n tokens: ``DecodeConfig.lookup_ngram``),
  optionally ``+aK`` (the drafter's K best first tokens as beams of their own:
  ``DecodeConfig.first_alternatives``) and ``/N`` (a token budget of N tree tokens:
  ``DecodeConfig.token_budget``)."""

  width: int
  length: int
  lookup: int = 0
  budget: int = 0  # 0: the whole tree
  alternatives: int = 0

  @classmethod
  def parse_list(cls, text: str) -> list["Beams"]:
    """Comma-separated settings; ValueError with the expected form when one is malformed."""
    out = []
    for item in (t.strip().lower() for t in text.split(",")):
      if not item:
        continue
      try:
        rest, _, budget = item.partition("/")
        wl, *extras = rest.split("+")
        w, l = (int(x) for x in wl.split("x"))
        k = int(extras.pop()[1:]) if extras and extras[-1].startswith("a") else 0
        if len(extras) > 1:  # at most the lookup n before +aK
          raise ValueError(item)
        b = cls(w, l, int(extras[0]) if extras else 0, int(budget) if budget else 0, k)
        b.config()  # the budget must fit the tree
      except (ValueError, ConfigError):
        b = None
      if (b is None or b.width < 1 or b.length < 2 or not 0 <= b.lookup <= 8
          or b.alternatives < 0):
        raise ValueError(f"want WxL[+n][+aK][/N] settings with W >= 1, L >= 2 (L counts g0), "
                         f"lookup n-gram n <= 8, K step-1 alternatives and a token budget "
                         f"L <= N <= the tree's size, e.g. 4x4,1x4+3,1x4+3/5,8x5+3+a8; got "
                         f"{item!r}")
      out.append(b)
    if not out:
      raise ValueError(f"no WxL setting in {text!r}")
    return out

  @property
  def key(self) -> str:
    return (f"W{self.width}_L{self.length}" + (f"_lookup{self.lookup}" if self.lookup else "")
            + (f"_alt{self.alternatives}" if self.alternatives else "")
            + (f"_N{self.budget}" if self.budget else ""))

  @property
  def text(self) -> str:
    """The written form ``parse_list`` reads: ``WxL[+n][+aK][/N]``."""
    return (f"{self.width}x{self.length}" + (f"+{self.lookup}" if self.lookup else "")
            + (f"+a{self.alternatives}" if self.alternatives else "")
            + (f"/{self.budget}" if self.budget else ""))

  @property
  def label(self) -> str:
    return (f"W={self.width} L={self.length}" + (f" + lookup {self.lookup}" if self.lookup else "")
            + (f" + {self.alternatives} step-1 alternatives" if self.alternatives else "")
            + (f", N={self.budget}" if self.budget else ""))

  def fields(self) -> dict:
    """The ``DecodeConfig`` fields this setting fixes (all of the tree's, none other)."""
    return dict(beam_width=self.width, beam_length=self.length, lookup_ngram=self.lookup,
                token_budget=self.budget or None, first_alternatives=self.alternatives)

  def config(self, **kwargs) -> DecodeConfig:
    return DecodeConfig(**self.fields(), **kwargs)

  def onto(self, base: DecodeConfig) -> DecodeConfig:
    """``base`` with this tree (its other settings kept)."""
    return dataclasses.replace(base, **self.fields())


ACCEPTANCE_FILE = "acceptance.json"
# The trees measured for a drafter when none are named: one drafter beam to four, with and
# without the context-lookup beam and the drafter's step-1 alternatives, whole trees and token
# budgets that verify fewer tokens.
DEFAULT_CANDIDATES = ("1x2+3/3,1x3+3/4,1x3+3,1x4,1x4+3/5,1x4+3,1x5+3/6,2x4+3/7,2x4+3,2x5+3/9,"
                      "4x4+3/10,4x5+3/16,1x3+3+a3/6,1x4+3+a4/7,4x4+3+a4/14")
TIMING_CONTEXT = 200  # prompt tokens in the cache when steps are timed


class TreeChoiceError(UserError, ValueError):
  """A missing or malformed acceptance table, or candidates that cannot be compared."""


# ----------------------------------------------------------------------------- the drafter's side


def measure_acceptance(llm, drafter, prompts: Sequence[Sequence[int]], candidates: Sequence[Beams],
                       *, max_new_tokens: int, draft_vocab_size: int = 0, batch_size: int = 8,
                       stop_ids: Sequence[int] = (), on_result: Callable | None = None
                       ) -> dict[str, dict]:
  """Greedy tokens per step of each candidate tree on ``prompts`` (token ids), decoded in
  batches of ``batch_size`` (a multiple of it is used; the rest is dropped so every batch has
  one shape). Returns ``{tree text: {tokens_per_step, steps, tokens}}``; ``on_result(text,
  row)`` sees each as it is measured."""
  from redrafter_jax.inference.decode import ReDrafter

  n = len(prompts) // batch_size * batch_size
  if n == 0:
    raise TreeChoiceError(f"need at least batch_size={batch_size} prompts, got {len(prompts)}")
  order = sorted(range(n), key=lambda i: len(prompts[i]))  # similar lengths share a batch
  batches = [[prompts[i] for i in order[k:k + batch_size]] for k in range(0, n, batch_size)]
  out = {}
  for b in candidates:
    rd = ReDrafter(llm, drafter, b.config(max_new_tokens=max_new_tokens,
                                          draft_vocab_size=draft_vocab_size))
    steps = tokens = 0
    for batch in batches:
      m = rd(batch, stop_ids=stop_ids).metrics
      steps += m["steps"]
      tokens += m["steps"] + m["accepted_tokens"]
    out[b.text] = dict(tokens_per_step=tokens / max(steps, 1), steps=steps, tokens=tokens)
    if on_result is not None:
      on_result(b.text, out[b.text])
  return out


def write_acceptance(folder, table: dict[str, dict], measured_with: dict) -> pathlib.Path:
  path = pathlib.Path(folder) / ACCEPTANCE_FILE
  path.write_text(json.dumps({"tokens_per_step": {k: round(v["tokens_per_step"], 4)
                                                  for k, v in table.items()},
                              "counts": {k: {"steps": v["steps"], "tokens": v["tokens"]}
                                         for k, v in table.items()},
                              "measured_with": measured_with}, indent=1) + "\n")
  return path


# What must match for trees measured in two runs to share one table.
_SAME_MEASUREMENT = ("ids", "max_new_tokens", "batch_size", "param_dtype", "decoding")


def add_acceptance(folder, table: dict[str, dict], measured_with: dict) -> pathlib.Path:
  """Add (or replace) ``table``'s trees in the drafter's existing ``acceptance.json``, which must
  have been measured on the same prompts with the same settings (``TreeChoiceError`` if not);
  ``measured_with["added"]`` records each addition's trees and date."""
  path = pathlib.Path(folder) / ACCEPTANCE_FILE
  if read_acceptance(folder) is None:
    raise TreeChoiceError(f"{path} does not exist: measure the whole table first (no --add)")
  old = json.loads(path.read_text())
  before = old.get("measured_with") or {}
  differ = [k for k in _SAME_MEASUREMENT if before.get(k) != measured_with.get(k)]
  if differ:
    raise TreeChoiceError(f"{path} was measured with other {', '.join(differ)} than this run: "
                          "add trees with the same prompts and settings, or measure all again")
  rows = {k: {"tokens_per_step": v, **old["counts"][k]}
          for k, v in old["tokens_per_step"].items()}
  rows.update(table)
  added = list(before.get("added", [])) + [dict(trees=list(table), date=measured_with["date"])]
  return write_acceptance(folder, rows, {**before, "added": added})


def read_acceptance(folder) -> dict[Beams, float] | None:
  """The drafter's tokens per step per tree (``acceptance.json``), None when it has none."""
  path = pathlib.Path(folder) / ACCEPTANCE_FILE
  if not path.is_file():
    return None
  try:
    rows = json.loads(path.read_text())["tokens_per_step"]
    table = {Beams.parse_list(k)[0]: float(v) for k, v in rows.items()}
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise TreeChoiceError(f"{path}: not an acceptance table ({e}); measure it again with "
                          "`redrafter-jax tune-tree`") from None
  if not table or any(not 1.0 <= v for v in table.values()):
    raise TreeChoiceError(f"{path}: want at least one tree, each with tokens_per_step >= 1")
  return table


def tokens_per_step_for(table: dict[Beams, float] | None, cfg: DecodeConfig) -> float | None:
  """The measured tokens/step of ``cfg``'s tree in ``table`` (None when it was not measured)."""
  key = Beams(cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.token_budget or 0,
              cfg.first_alternatives)
  return (table or {}).get(key)


# ----------------------------------------------------------------------------- the device's side


def time_steps(llm, drafter, candidates: Sequence[Beams], *, draft_vocab_size: int = 0,
               context: int = TIMING_CONTEXT, repeat: int = 12) -> dict[str, float]:
  """Median seconds of one step of each candidate (draft, verify, accept, commit: the
  ``ReDrafter.step`` program) at batch 1 with ``context`` tokens in the cache, and of the AR
  one-token step over the same cache slots (key "ar"). Every program is compiled first, then
  timed call by call in ``repeat`` rounds over all of them: a slow spell of a shared machine
  slows every candidate and AR alike instead of the ones timed then (AR's time divides every
  prediction: timed alone in a slow spell, it makes every tree look cheap)."""
  from redrafter_jax.inference.ar import one_token_stepper
  from redrafter_jax.inference.timing import TreeStepper, seconds_in_rounds

  prompt = np.random.default_rng(0).integers(0, llm.config.vocab_size, context).tolist()
  calls, slots = {}, None
  for b in candidates:
    call = TreeStepper(llm, drafter, b.config(draft_vocab_size=draft_vocab_size), prompt, repeat)
    jax.block_until_ready(call())
    slots = call.cache_width()
    calls[b.text] = call
  calls["ar"] = one_token_stepper(llm, 1, slots or 256, context)
  seconds = seconds_in_rounds({name: (None, call) for name, call in calls.items()}, repeat)
  # Free the compiled programs: on XLA:CPU each holds ~900 memory mappings (its kernels'
  # code), and a server that times the trees at start-up compiles its own programs next
  # (``Placement.warmup``; Linux limits a process to vm.max_map_count mappings).
  del calls
  jax.clear_caches()
  gc.collect()
  return seconds


def device_description(llm, drafter, draft_vocab_size: int) -> dict:
  """What a step's cost depends on: the device, the weights and the models' shapes."""
  dev = jax.devices()[0]
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                 cpu)
  except OSError:
    pass
  from redrafter_jax.models.linear import cpu_has_bf16_matmul

  return dict(backend=jax.default_backend(), device_kind=dev.device_kind, cpu=cpu,
              cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count(), cpu_bf16=cpu_has_bf16_matmul(), jax=jax.__version__,
              dtype=jnp.dtype(llm.dtype).name, param_dtype=jnp.dtype(llm.param_dtype).name,
              attention=getattr(llm, "backend", "xla"), llm=repr(llm.config),
              drafter=repr(getattr(drafter, "config", type(drafter).__name__)),
              draft_vocab_size=draft_vocab_size)


# ----------------------------------------------------------------------------- the choice


@dataclasses.dataclass(frozen=True)
class Choice:
  """The chosen tree and, per candidate, its tokens/step, step seconds and predicted speedup
  over AR (best first)."""

  beams: Beams
  rows: tuple[tuple[Beams, float, float, float], ...]
  ar_seconds: float

  @property
  def predicted_speedup(self) -> float:
    return self.rows[0][3]

  @property
  def pays(self) -> bool:
    """Whether the best tree is predicted faster than AR here (where it is not, a decode that
    only wants speed is better off with AR: the same tokens, ``defaults.Settings.decode_ar``)."""
    return self.predicted_speedup > 1.0

  def verdict(self) -> str:
    """One line: the best tree's predicted speed-up, and what to do when it does not pay."""
    best = f"best tree {self.beams.text}, predicted {self.predicted_speedup:.2f}x AR at batch 1"
    return best if self.pays else f"no draft tree is predicted faster than AR here ({best})"

  def config(self, base: DecodeConfig) -> DecodeConfig:
    """``base`` with this tree (its other settings kept)."""
    return self.beams.onto(base)

  def table(self) -> str:
    lines = [f"{'tree':<12} {'tokens/step':>11} {'step ms':>8} {'x AR step':>9} "
             f"{'predicted':>9}"]
    for b, tps, s, speedup in self.rows:
      lines.append(f"{b.text:<12} {tps:>11.2f} {s * 1e3:>8.1f} {s / self.ar_seconds:>9.2f} "
                   f"{speedup:>8.2f}x" + ("  <- chosen" if b == self.beams else ""))
    lines.append(f"{'AR':<12} {1.0:>11.2f} {self.ar_seconds * 1e3:>8.1f} {1.0:>9.2f} "
                 f"{1.0:>8.2f}x")
    return "\n".join(lines)


def choose(tokens_per_step: dict[Beams, float], seconds: dict[str, float]) -> Choice:
  """The candidate with the highest tokens/step / step seconds (both must cover it)."""
  rows = [(b, tps, seconds[b.text], tps * seconds["ar"] / seconds[b.text])
          for b, tps in tokens_per_step.items() if b.text in seconds]
  if not rows or "ar" not in seconds:
    raise TreeChoiceError("no candidate tree has both a measured acceptance and a step time")
  rows.sort(key=lambda r: -r[3])
  return Choice(rows[0][0], tuple(rows), seconds["ar"])


# Step times are cached only when other processes took at most this share of the CPUs while
# they were timed. Beside another job the trees' times relative to AR's come out too low (both
# slow down, unevenly), which predicts too much speed-up and can pick a tree that does not pay; an
# idle machine's background stays well under it.
BUSY_SHARE = 0.2


def timing_cache(root=None) -> pathlib.Path:
  if root is None:
    from redrafter_jax.weights.fetch import cache_dir
    root = cache_dir()
  return pathlib.Path(root) / "trees"


def tuned(folder, llm, drafter, *, draft_vocab_size: int = 0, cache=None,
          log: Callable[[str], None] = print) -> Choice | None:
  """The tree for ``folder``'s drafter on this device: None when the drafter has no
  acceptance table, else ``for_device`` over it."""
  acceptance = read_acceptance(folder)
  if acceptance is None:
    return None
  return for_device(acceptance, llm, drafter, draft_vocab_size=draft_vocab_size, cache=cache,
                    log=log)


def for_device(acceptance: dict[Beams, float], llm, drafter, *, draft_vocab_size: int = 0,
               cache=None, log: Callable[[str], None] = print) -> Choice:
  """``choose`` over the trees of an acceptance table, with step times from the per-device
  cache (``cache``: a folder; None: ``trees/`` in the model cache) or timed now and cached."""
  trees = sorted(acceptance, key=lambda b: b.text)
  desc = device_description(llm, drafter, draft_vocab_size)
  desc["trees"] = [b.text for b in trees]
  # Entries timed one program after another, or cached whatever the machine's load, are
  # measured again.
  desc["timing"] = "interleaved, quiet"
  digest = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
  path = timing_cache(cache) / f"{digest}.json"
  seconds = None
  if path.is_file():
    try:
      seconds = json.loads(path.read_text())["seconds"]
    except (ValueError, KeyError):
      seconds = None  # a damaged cache entry is measured again
  if seconds is None:
    log(f"timing {len(trees)} draft trees on this device (once; cached in {path.parent}) ...")
    with OtherLoad() as load:
      seconds = time_steps(llm, drafter, trees, draft_vocab_size=draft_vocab_size)
    if load.share > BUSY_SHARE:
      log(f"not caching these step times: other processes used {load.share:.0%} of the CPUs "
          "while they were timed, which skews them; the next run times the trees again")
    else:
      path.parent.mkdir(parents=True, exist_ok=True)
      tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
      tmp.write_text(json.dumps({"device": desc, "seconds": seconds,
                                 "other_cpu_share": round(load.share, 3)}, indent=1) + "\n")
      os.replace(tmp, path)
  return choose(acceptance, seconds)
