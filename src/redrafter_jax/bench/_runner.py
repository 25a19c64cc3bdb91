"""How the benchmark suite runs one method on a batch of prompts and times it.

A helper of ``suite`` (the leading underscore keeps it out of the benchmark list). Timing is of
whole calls; a call during which JAX compiled anything is timed again, so compile time never
counts. Each prompt gets a static cache size (its need rounded up to ``CACHE_MULTIPLE`` slots,
or the one ``--cache-size`` for every prompt) shared by all our methods, which keeps the number
of compiled programs small.
"""

from __future__ import annotations

import copy
import datetime
import os
import platform

from redrafter_jax.bench._compiles import programs_compiled
from redrafter_jax.bench.ar import clock, load_average, load_hf
from redrafter_jax.errors import UserError

CACHE_MULTIPLE = 512


class RunnerError(UserError, ValueError):
  """Settings the runner cannot use (a ``--cache-size`` past the model's context)."""


def timed(fn, tries: int = 3):
  """``(fn(), seconds)`` of a call that compiled nothing (the first call of a shape compiles)."""
  for _ in range(tries):
    before = programs_compiled()
    out, secs = clock(fn)
    if programs_compiled() == before:
      return out, secs
  raise RuntimeError(f"JAX still compiled on call {tries}: shapes are not static")


class Runner:
  """Runs one method on a batch of token-id prompts and measures it."""

  def __init__(self, o, llm, drafter, tok, hf, llm_fp32=None, hf_bf16=None):
    from redrafter_jax.config import DecodeConfig
    from redrafter_jax.inference.decode import draft_model
    from redrafter_jax.weights.tokenizer import stop_token_ids

    self.o, self.llm, self.hf = o, llm, hf
    self.llm_fp32 = llm_fp32  # float32 weights, for methods that ask for them
    self.hf_bf16 = hf_bf16  # transformers in bfloat16, for methods that ask for it
    self.stops = stop_token_ids(tok)
    self.pad = tok.pad_token_id if tok.pad_token_id is not None else self.stops[0]
    # Restrict the draft vocabulary once for all methods; each method's ReDrafter is built once.
    self.drafter = draft_model(drafter, DecodeConfig(draft_vocab_size=o.draft_vocab))
    self._redrafters = {}
    self.scratch = max(b.length + b.config().num_tree_tokens for b in o.beams + [o.main_beams])
    self.forwards = [0]
    self.multiple = getattr(o, "prompt_multiple", 64)  # padded prompt lengths (prefill programs)
    fixed = o.cache_size
    if fixed is not None and not 1 <= fixed <= self.limit:
      raise RunnerError(f"--cache-size {fixed} is outside 1..{self.limit} (the model's context)")
    for model in (hf, hf_bf16):
      if model is None:
        continue
      # transformers' forward calls: its tokens/step
      model.register_forward_hook(lambda *_: self.forwards.__setitem__(0, self.forwards[0] + 1))
      for lookup in (0, o.prompt_lookup_tokens):  # warm-up
        self._transformers(model, [self.stops[0]] * 8, lookup, 4)

  @property
  def limit(self) -> int:
    """The model's context: the most cache slots a row may have."""
    return self.llm.config.max_position_embeddings

  def need(self, prompt_len: int) -> int:
    """Cache slots a prompt needs: itself, the new tokens and one forward's scratch, and at
    least its padded length (the prefill writes every padded position)."""
    from redrafter_jax.inference.runtime import pack_prompts

    padded = pack_prompts([[0] * prompt_len], multiple=self.multiple)[0].shape[1]
    return max(prompt_len + self.o.max_new_tokens + self.scratch, padded)

  def cache_size(self, prompt_len: int) -> int | None:
    """Static cache slots for a prompt: ``o.cache_size`` when set (one size for every method,
    prompt and batch: one compiled program per method), else its need rounded up to
    ``CACHE_MULTIPLE``. None: it does not fit (that size, or the model's context)."""
    need, fixed = self.need(prompt_len), self.o.cache_size
    if fixed is not None:
      return fixed if need <= fixed else None
    return None if need > self.limit else min(-(-need // CACHE_MULTIPLE) * CACHE_MULTIPLE,
                                              self.limit)

  def measure(self, m, prompts: list[list[int]], cache_size: int, seed: int, *,
              batch: bool = False) -> dict:
    """One timed call; a ``batch`` record has per-row token counts instead of the tokens."""
    (tokens, stats), secs = timed(lambda: self.call(m, prompts, cache_size, seed))
    n = sum(len(t) for t in tokens)
    rec = dict(new_tokens=n, seconds=secs, tokens_per_s=n / secs, **stats,
               cache_size=cache_size, load_average=load_average())
    if batch:
      rec.update(row_tokens=[len(t) for t in tokens],
                 per_request_tokens_per_s=n / len(tokens) / secs)
    else:
      rec["output_ids"] = tokens[0]
    return rec

  def redrafter(self, cfg):
    """The ``ReDrafter`` of one decode setting, built on first use (models split once)."""
    from redrafter_jax.inference.decode import ReDrafter

    if cfg not in self._redrafters:
      self._redrafters[cfg] = ReDrafter(self.llm, self.drafter, cfg)
    return self._redrafters[cfg]

  def call(self, m, prompts, cache_size: int, seed: int):
    from redrafter_jax.inference.ar import generate

    o = self.o
    if m.kind == "ar":
      llm = self.llm_fp32 if m.param_dtype == "float32" else self.llm
      r = generate(llm, prompts, max_new_tokens=o.max_new_tokens, temperature=m.temperature,
                   seed=seed, stop_ids=self.stops, cache_size=cache_size,
                   prompt_multiple=self.multiple)
      return r.tokens, dict(steps=r.steps, tokens_per_step=1.0)
    if m.kind == "redrafter":
      cfg = m.beams.config(max_new_tokens=o.max_new_tokens, draft_vocab_size=o.draft_vocab,
                           acceptance=m.acceptance)
      r = self.redrafter(cfg)(prompts, seed=seed, stop_ids=self.stops,
                              temperature=m.temperature, cache_size=cache_size,
                              prompt_multiple=self.multiple)
      s = r.metrics
      return r.tokens, dict(steps=s["steps"], tokens_per_step=s["tokens_per_step"],
                            accepted_histogram=s["accepted_length_histogram"],
                            per_depth_acceptance=s["per_depth_acceptance"],
                            accepted_per_step_by_source=s["accepted_per_step_by_source"],
                            mean_tree_tokens=s["mean_tree_tokens"], dedup_saving=s["dedup_saving"])
    if len(prompts) != 1:
      raise ValueError("transformers peers run at batch 1 only")
    lookup = o.prompt_lookup_tokens if m.kind == "prompt_lookup" else 0
    hf = self.hf_bf16 if m.param_dtype == "bfloat16" else self.hf
    self.forwards[0] = 0
    new = self._transformers(hf, prompts[0], lookup, o.max_new_tokens)
    return [new], dict(steps=self.forwards[0], tokens_per_step=len(new) / max(self.forwards[0], 1))

  def _transformers(self, hf, ids: list[int], lookup: int, max_new: int) -> list[int]:
    import torch

    dev = hf.device
    kwargs = dict(prompt_lookup_num_tokens=lookup) if lookup else {}
    with torch.inference_mode():
      out = hf.generate(torch.tensor([ids], device=dev),
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                        do_sample=False, max_new_tokens=max_new, eos_token_id=list(self.stops),
                        pad_token_id=self.pad, **kwargs)
    return out[0, len(ids):].tolist()


def environment(o, hf) -> dict:
  import jax

  env = dict(started=datetime.datetime.now().isoformat(timespec="seconds"),
             machine=platform.machine(), system=platform.system(), cpus=os.cpu_count(),
             python=platform.python_version(), jax=jax.__version__, backend=jax.default_backend(),
             device=jax.devices()[0].device_kind, load_average_start=load_average(),
             argv=o.argv)
  if hf is not None:
    import torch
    import transformers

    env.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
               transformers=transformers.__version__, transformers_device=str(hf.device))
  return env


def adds_fp32_ar(o) -> bool:
  """Whether the run adds our float32-weight AR as a baseline: its LLM has lower-precision
  weights under float32 activations."""
  return o.param_dtype != "float32" and o.dtype == "float32"


def hf_dtype(o) -> str:
  """transformers' dtype in this run: the run's own on a GPU, float32 on a CPU (the dtype its
  GGUF loader gives, and the precision our float32 runs compute in)."""
  return o.dtype if o.gpu else "float32"


def adds_hf_bf16(o) -> bool:
  """Whether the run adds transformers in bfloat16 (weights and activations) as a second peer
  baseline: the setting a user tries to make it faster, when the run's own is not bfloat16."""
  return not o.no_transformers and hf_dtype(o) != "bfloat16"


def load_models(o):
  """``(llm, llm with float32 weights or None, drafter, tokenizer, transformers model or None,
  transformers in bfloat16 or None, note on skipped peers)``; the second LLM only when
  ``adds_fp32_ar(o)``, the second transformers model only when ``adds_hf_bf16(o)``."""
  from redrafter_jax.bench._common import load
  from redrafter_jax.weights.llama_weights import resolve_source

  models = load(o.model, dtype=o.dtype, param_dtype=o.param_dtype, backend=o.attention,
                drafter=o.drafter, exit_dim=o.exit_dim)
  llm_fp32 = (load(o.model, dtype=o.dtype, backend=o.attention, tokenizer=False).llm
              if adds_fp32_ar(o) else None)
  path = resolve_source(o.model)
  hf, hf_bf16, note = None, None, ""
  if not o.no_transformers:
    import torch

    if o.gpu and not torch.cuda.is_available():
      note = "transformers peers not measured: this torch build has no CUDA device"
    else:
      torch.set_num_threads(o.torch_threads)
      hf = load_hf(path)
      if o.gpu:
        hf = hf.to(device="cuda", dtype=getattr(torch, o.dtype))
      if adds_hf_bf16(o):
        hf_bf16 = copy.deepcopy(hf).to(dtype=torch.bfloat16)
  return models.llm, llm_fp32, models.drafter, models.tokenizer, hf, hf_bf16, note
