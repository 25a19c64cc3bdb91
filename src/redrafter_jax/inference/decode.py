"""ReDrafter decoding of a batch of prompts: the ``ReDrafter`` object, and ``decode`` over it.

``ReDrafter(llm, drafter, cfg)`` is built once, in the manner of the Flax gemma example's
``Sampler``: it splits both models (``nnx.split``), restricts the drafter to
``cfg.draft_vocab_size`` tokens, and holds the three jitted programs a decode runs: ``init``
(prefill and the first token), ``loop`` (a ``lax.while_loop`` of ``step.step``, the whole
generation on the device; ``cfg.steps_per_check`` steps per check of its predicate, see
``runtime.checked_loop``) and ``step`` (one step: the Python-loop twin, ``stepwise``, for tests
and debugging). Calling it decodes. A call whose static shapes were seen before (batch, padded
prompt length, cache size, all-greedy or not, top-k/top-p on or off) compiles nothing and splits
nothing; temperatures, top-p/top-k values and seeds travel as arrays.

Attention cost follows the used length: the loop runs in segments, each a compiled program
whose verify forward reads only a context bucket of the cache (``kv_cache.context_bucket``:
powers of two from ``min_bucket`` up to the cache's size). A segment ends when every row is done
or the longest row would outgrow its bucket; the host then picks the next bucket (one small read
of the lengths per segment, a handful per decode). A cache of ``min_bucket`` slots or fewer has
one bucket: one program, as before.

The programs are ``jax.jit`` functions taking the graph definitions and the static settings as
static arguments, so objects built from models of the same structure share them: ``decode()``,
which builds a ``ReDrafter`` per call, recompiles nothing either (but splits and restricts the
models again each time, which is the object's reason to exist).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.config import DecodeConfig
from redrafter_jax.inference import sampling
from redrafter_jax.inference.beam_search import attends_to_context
from redrafter_jax.inference.runtime import (GenerateError, cache_size_for, check_sampling,
                                             checked_loop, keep_unless, mode_jit,
                                             pack_prompts)
from redrafter_jax.inference.step import (SOURCES, DecodeState, Metrics, drafter_layers, init,
                                         step)
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.drafter import Drafter, restrict_vocab
from redrafter_jax.models.llama import Llama

TRACE_COUNT = {"decode": 0}  # incremented when the loop is traced: one trace per static shape


@mode_jit(static_argnames=("llm_def", "cfg", "cache_size", "filtered", "greedy",
                           "feature_layers", "drafter_def"))
def _init_jit(llm_def, llm_state, tokens_BT, lengths_B, params, rng, stop_ids, drafter_state=None,
              *, cfg, cache_size, filtered, greedy, feature_layers=(), drafter_def=None):
  """``drafter_def``/``drafter_state``: only for a drafter with ``context_attention`` (the
  prefill builds its memory); other drafters' init does not depend on them."""
  drafter = None if drafter_def is None else nnx.merge(drafter_def, drafter_state)
  return init(nnx.merge(llm_def, llm_state), tokens_BT, lengths_B, params, rng, stop_ids,
              cache_size=cache_size, max_new_tokens=cfg.max_new_tokens,
              beam_length=cfg.beam_length, filtered=filtered, greedy=greedy,
              feature_layers=feature_layers, drafter=drafter)


# The loop is its own program: it depends on (B, S, cfg) but not on the prompt length, so prompts
# of new lengths only compile the (cheap) prefill again.
_STATIC = ("llm_def", "drafter_def", "cfg", "filtered", "greedy", "width")


@mode_jit(static_argnames=_STATIC + ("steps_per_check",), donate_argnames=("state",))
def _loop_jit(llm_def, llm_state, drafter_def, drafter_state, embed_VD, state, params, stop_ids,
              *, cfg, filtered, greedy, width, steps_per_check):
  TRACE_COUNT["decode"] += 1
  llm, drafter = nnx.merge(llm_def, llm_state), nnx.merge(drafter_def, drafter_state)

  def cond(s):
    go = ~jnp.all(s.done_B)
    if width is None:  # the whole cache: prepare() made it hold every row to the end
      return go
    return go & (jnp.max(s.cache.lengths_B) + cfg.num_tree_tokens <= width)

  def body(s, live):
    # A masked step (past the end, or one that would outgrow the bucket: ``cond`` false)
    # keeps the old state; its writes land on scratch slots (``keep_unless``), so the next
    # segment starts from exactly the state a check after every step would have left.
    new = step(llm, drafter, s, params, stop_ids, cfg, filtered=filtered, greedy=greedy,
               width=width, embed_VD=embed_VD)
    return keep_unless(live, new, s)

  return checked_loop(cond, body, state, steps_per_check)


@mode_jit(static_argnames=_STATIC, donate_argnames=("state",))
def _step_jit(llm_def, llm_state, drafter_def, drafter_state, embed_VD, state, params, stop_ids,
              *, cfg, filtered, greedy, width):
  return step(nnx.merge(llm_def, llm_state), nnx.merge(drafter_def, drafter_state), state,
              params, stop_ids, cfg, filtered=filtered, greedy=greedy, width=width,
              embed_VD=embed_VD)


@dataclasses.dataclass(frozen=True)
class DecodeResult:
  """Host-side result of a decode: tokens per prompt and speculative statistics."""

  tokens: list[list[int]]
  stopped: list[bool]
  steps: int  # loop iterations (verify forwards) for the whole batch
  metrics: dict

  @classmethod
  def from_state(cls, state: DecodeState) -> "DecodeResult":
    out, m = state.out, jax.device_get(state.metrics)
    tokens_BM, num_B = np.asarray(out.tokens_BM), np.asarray(out.num_B)
    return cls(tokens=[tokens_BM[b, :num_B[b]].tolist() for b in range(len(num_B))],
               stopped=np.asarray(out.stopped_B).tolist(), steps=int(out.steps),
               metrics=summarize(m, num_B))


def summarize(m: Metrics, num_B: np.ndarray) -> dict:
  """Run-level metrics. tokens_per_step = (accepted + 1) per verification step."""
  steps = int(np.sum(m.steps_B))
  hist = np.asarray(m.accept_hist_BL).sum(0)
  at_least = hist[::-1].cumsum()[::-1]  # steps that accepted >= d drafted tokens
  return dict(
      steps=steps,
      tokens_per_step=float((np.sum(m.accepted_B) + steps) / max(steps, 1)),
      accepted_tokens=int(np.sum(m.accepted_B)),
      per_depth_acceptance=[float(at_least[d] / max(at_least[d - 1], 1))
                            for d in range(1, len(hist))],
      accepted_length_histogram=hist.tolist(),
      mean_tree_tokens=float(np.sum(m.tree_tokens_B) / max(steps, 1)),
      mean_unique_tokens=float(np.sum(m.unique_tokens_B) / max(steps, 1)),
      dedup_saving=float(1 - np.sum(m.unique_tokens_B) / max(np.sum(m.beam_tokens_B), 1)),
      # tokens_per_step = 1 + the sum of these: accepted drafted tokens per step by the source
      # of the beam that held them (``step.SOURCES``; the drafter's first where several did)
      accepted_per_step_by_source={
          name: float(n / max(steps, 1))
          for name, n in zip(SOURCES, np.asarray(m.accepted_by_source_BK).sum(0))},
      tokens_per_row=np.asarray(num_B).tolist(),
      steps_per_row=np.asarray(m.steps_B).tolist())


def draft_model(drafter, cfg: DecodeConfig):
  """The drafter as decoding uses it: restricted to ``cfg.draft_vocab_size`` tokens if set."""
  if isinstance(drafter, Drafter) and drafter.vocab_ids is None:
    return restrict_vocab(drafter, cfg.draft_vocab_size)
  return drafter


def draft_embedding(llm: Llama) -> jax.Array | None:
  """The embedding table the drafter reads, made once: a copy in the activations' dtype when
  the weights are narrower (bf16 weights, float32 activations), else None (the LLM's own).

  Each compiled call would otherwise convert the whole table before the beam search (XLA does
  not keep a converted weight between calls): once per ``decode`` segment, once per step for
  ``ReDrafter.step`` and for the server, which runs one step per call.
  """
  table = llm.embed_tokens.embedding[...]
  if table.dtype == jnp.dtype(llm.dtype):
    return None
  return table.astype(llm.dtype)


def static_config(cfg: DecodeConfig) -> DecodeConfig:
  """``cfg`` as the compiled programs see it: without the sampling defaults, which travel as
  arrays (changing a temperature must not recompile; only whether every row is greedy is
  static), without the cache size, which the cache's shape carries, and without
  ``steps_per_check``, which only the loop program takes (as its own static argument)."""
  return dataclasses.replace(cfg, temperature=0.0, top_p=1.0, top_k=0, cache_size=None,
                             steps_per_check=1)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """Validated, packed inputs for one decode call."""

  tokens_BT: jax.Array
  lengths_B: jax.Array
  params: sampling.SamplingParams
  rng: jax.Array
  stop_ids: jax.Array
  cache_size: int
  filtered: bool  # some row uses top-k or top-p (static: the filter costs a vocabulary sort)
  greedy: bool  # every row has temperature 0 (static: the argmax fast path)


def check_models(llm: Llama, drafter) -> None:
  """A drafter must read the LLM's hidden states and score the LLM's vocabulary."""
  dcfg = getattr(drafter, "config", None)
  if dcfg is not None and (dcfg.hidden_size, dcfg.vocab_size) != (llm.config.hidden_size,
                                                                  llm.config.vocab_size):
    raise GenerateError(
        f"drafter (hidden_size={dcfg.hidden_size}, vocab_size={dcfg.vocab_size}) does not "
        f"match the LLM (hidden_size={llm.config.hidden_size}, vocab_size="
        f"{llm.config.vocab_size})")
  layers = drafter_layers(drafter)
  if any(i >= llm.config.num_layers for i in layers):
    raise GenerateError(f"drafter reads LLM layers {list(layers)} (feature_layers), but the LLM "
                        f"has {llm.config.num_layers} layers")


class ReDrafter:
  """ReDrafter generation with one LLM, one drafter and fixed decode settings.

  Args:
    llm: the base LLM (verifies the drafts; its greedy output is what greedy decoding returns).
    drafter: the draft head, or any NNX module with a ``propose(llm, state, cfg)`` method (see
      ``step.draft``). It is restricted to ``config.draft_vocab_size`` tokens here, once.
    config: the static settings (tree shape, acceptance rule, ``max_new_tokens``); its
      ``temperature``, ``top_p`` and ``top_k`` are only the defaults of each call.

    min_bucket: the smallest context bucket the verify forward reads (see the module
      docstring); None reads the whole cache at every step.

  The models are split when the object is built: later changes to ``llm`` or ``drafter`` are
  not seen by it (build a new one).
  """

  def __init__(self, llm: Llama, drafter: Drafter, config: DecodeConfig, *,
               min_bucket: int | None = kvc.BUCKET_MIN):
    check_models(llm, drafter)
    self.config = config
    self.min_bucket = min_bucket
    self.static_config = static_config(config)
    self.llm_config = llm.config
    self.llm_def, self.llm_state = nnx.split(llm)
    self.invariant = llm.invariant  # its programs are compiled for the invariant mode
    self.drafter_def, self.drafter_state = nnx.split(draft_model(drafter, config))
    self.draft_embed = draft_embedding(llm)
    self.feature_layers = drafter_layers(drafter)
    # A drafter with a context memory takes part in the prefill (``init``), which builds it.
    self._init_drafter = (((self.drafter_state,), dict(drafter_def=self.drafter_def))
                          if attends_to_context(drafter) else ((), {}))

  def prepare(self, prompts: Sequence[Sequence[int]], *, seed: int = 0,
              stop_ids: Sequence[int] = (), temperature=None, top_p=None, top_k=None,
              cache_size: int | None = None, prompt_multiple: int = 64) -> Prepared:
    """Check the arguments and pack the prompts (host side; raises ``GenerateError``)."""
    cfg = self.config
    temperature = cfg.temperature if temperature is None else temperature
    top_p = cfg.top_p if top_p is None else top_p
    top_k = cfg.top_k if top_k is None else top_k
    check_sampling(temperature, top_p, top_k)
    if cfg.acceptance == "greedy" and not sampling.all_greedy(temperature):
      raise GenerateError(f"acceptance='greedy' decodes greedily; got temperature {temperature} "
                          "(use acceptance='exact' to sample)")
    tokens_BT, lengths_B = pack_prompts(prompts, multiple=prompt_multiple)
    extra = cfg.beam_length + cfg.num_tree_tokens
    size = cache_size or cfg.cache_size or cache_size_for(
        int(lengths_B.max()), cfg.max_new_tokens, extra,
        self.llm_config.max_position_embeddings, multiple=256)
    if size < max(tokens_BT.shape[1], int(lengths_B.max()) + cfg.max_new_tokens + extra):
      raise GenerateError(f"cache_size {size} is too small: need prompt + max_new_tokens + "
                          f"{extra} scratch slots")
    B = len(prompts)
    return Prepared(jnp.asarray(tokens_BT), jnp.asarray(lengths_B),
                    sampling.SamplingParams.make(B, temperature, top_p, top_k),
                    jax.random.key(seed), jnp.asarray(list(stop_ids) or [-1], jnp.int32), size,
                    sampling.needs_filter(top_p, top_k), sampling.all_greedy(temperature))

  def _static(self, p: Prepared) -> dict:
    return dict(cfg=self.static_config, filtered=p.filtered, greedy=p.greedy)

  def start(self, p: Prepared) -> DecodeState:
    """The ``init`` program: prefill the prompts and choose each row's first token."""
    args, kwargs = self._init_drafter
    return _init_jit.of(self.invariant)(
        self.llm_def, self.llm_state, p.tokens_BT, p.lengths_B, p.params, p.rng, p.stop_ids,
        *args, cache_size=p.cache_size, feature_layers=self.feature_layers, **kwargs,
        **self._static(p))

  def width(self, p: Prepared, state: DecodeState) -> int | None:
    """The context bucket the next steps read (host side: reads the rows' lengths); None when
    that is the whole cache."""
    if self.min_bucket is None:
      return None
    need = int(jnp.max(state.cache.lengths_B)) + self.config.num_tree_tokens
    width = kvc.context_bucket(min(need, p.cache_size), p.cache_size, self.min_bucket)
    return None if width == p.cache_size else width

  def loop(self, p: Prepared, state: DecodeState) -> DecodeState:
    """The ``loop`` programs: steps until every row is done (``state`` is donated), one segment
    per context bucket."""
    while True:
      width = self.width(p, state)
      state = _loop_jit.of(self.invariant)(
          self.llm_def, self.llm_state, self.drafter_def, self.drafter_state, self.draft_embed,
          state, p.params, p.stop_ids, width=width,
          steps_per_check=self.config.steps_per_check, **self._static(p))
      if width is None or bool(jnp.all(state.done_B)):
        return state

  def step(self, p: Prepared, state: DecodeState) -> DecodeState:
    """The ``step`` program: one draft -> verify -> accept -> commit (``state`` is donated)."""
    return _step_jit.of(self.invariant)(
        self.llm_def, self.llm_state, self.drafter_def, self.drafter_state, self.draft_embed,
        state, p.params, p.stop_ids, width=self.width(p, state), **self._static(p))

  def __call__(self, prompts: Sequence[Sequence[int]], *, seed: int = 0,
               stop_ids: Sequence[int] = (), temperature=None, top_p=None, top_k=None,
               cache_size: int | None = None, prompt_multiple: int = 64) -> DecodeResult:
    """Decode a batch of token-id prompts.

    Args:
      prompts: B token-id lists (each non-empty); they are right-padded into one batch.
      seed: the PRNG seed of the sampled rows.
      stop_ids: token ids that end a row (the stop token is included in its output).
      temperature, top_p, top_k: sampling settings, a scalar or one value per prompt; None
        takes ``config``'s. Temperature 0 is greedy.
      cache_size: static KV-cache slots per row; None takes ``config.cache_size``, else the
        prompt + ``max_new_tokens`` + one step's scratch, rounded up.
      prompt_multiple: the padded prompt length is a multiple of it (each padded length is its
        own prefill program: a larger multiple compiles fewer, e.g. one cache size's worth).

    Returns:
      A ``DecodeResult``: each row's new tokens, whether it stopped on a stop token, the number
      of loop steps, and the speculative metrics (``summarize``).

    Greedy rows return the LLM's own greedy continuation (docs/decoding.md, "Exactness").
    """
    p = self.prepare(prompts, seed=seed, stop_ids=stop_ids, temperature=temperature,
                     top_p=top_p, top_k=top_k, cache_size=cache_size)
    return DecodeResult.from_state(self.loop(p, self.start(p)))

  def stepwise(self, prompts: Sequence[Sequence[int]], *, on_step=None, **kwargs
               ) -> DecodeResult:
    """The Python-loop twin of a call: the same ``init`` and ``step``, one jitted call per step.

    ``on_step(state)`` (optional) sees the state after every step; other arguments as for a
    call.
    """
    p = self.prepare(prompts, **kwargs)
    state = self.start(p)
    while not bool(jnp.all(state.done_B)):
      state = self.step(p, state)
      if on_step is not None:
        on_step(state)
    return DecodeResult.from_state(state)


def decode(llm: Llama, drafter: Drafter, prompts: Sequence[Sequence[int]], cfg: DecodeConfig,
           *, seed: int = 0, stop_ids: Sequence[int] = (), temperature=None, top_p=None,
           top_k=None) -> DecodeResult:
  """ReDrafter generation in one call: ``ReDrafter(llm, drafter, cfg)(prompts, ...)``.

  Args:
    llm, drafter, cfg: as for ``ReDrafter``.
    prompts, seed, stop_ids, temperature, top_p, top_k: as for a ``ReDrafter`` call.

  Returns:
    A ``DecodeResult`` (tokens per prompt, stop flags, steps, metrics).

  Convenient for one-off use; code that decodes repeatedly with the same models should build
  the ``ReDrafter`` once (this splits the models and restricts the draft vocabulary per call).
  """
  return ReDrafter(llm, drafter, cfg)(prompts, seed=seed, stop_ids=stop_ids,
                                      temperature=temperature, top_p=top_p, top_k=top_k)


def decode_stepwise(llm: Llama, drafter: Drafter, prompts: Sequence[Sequence[int]],
                    cfg: DecodeConfig, *, on_step=None, **kwargs) -> DecodeResult:
  """The Python-loop twin of ``decode`` (``ReDrafter.stepwise``), for tests and debugging."""
  return ReDrafter(llm, drafter, cfg).stepwise(prompts, on_step=on_step, **kwargs)
