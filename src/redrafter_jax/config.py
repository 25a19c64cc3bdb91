"""Typed, frozen configuration: model, drafter, decoding, training; YAML presets.

Configs are plain frozen dataclasses so they can be static arguments of ``jax.jit``. Every loader
rejects unknown keys with a message naming the key and the valid ones (a typo in a YAML preset
must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import pathlib
from typing import Any, Mapping

import yaml

from redrafter_jax.errors import UserError

log = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
  """A configuration is malformed, inconsistent, or names something unsupported."""


def _from_dict(cls, data: Mapping[str, Any], where: str):
  if not isinstance(data, Mapping):
    raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - names)
  if unknown:
    hints = []
    for key in unknown:
      close = difflib.get_close_matches(key, sorted(names), n=1)
      hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}; valid keys: {sorted(names)}")
  kwargs = {}
  for f in dataclasses.fields(cls):
    if f.name in data:
      value = data[f.name]
      if isinstance(value, list):
        value = tuple(value)
      kwargs[f.name] = value
  try:
    return cls(**kwargs)
  except TypeError as e:
    raise ConfigError(f"{where}: {e}") from e


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling (``rope_type: llama3``)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Architecture of a Llama-family decoder (Llama 1-3, Mistral, Qwen2, SmolLM2)."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # q/k/v projection biases (Qwen2)
  max_position_embeddings: int = 8192

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling",
                         _from_dict(RopeScaling, self.rope_scaling, "rope_scaling"))

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "LlamaConfig":
    return _from_dict(cls, data, "model config")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "LlamaConfig":
    """From a Hugging Face ``config.json`` dict (llama, mistral, qwen2)."""
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mistral", "qwen2"):
      raise ConfigError(
          f"unsupported architecture model_type={model_type!r}; supported: llama, mistral, qwen2")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise ConfigError(f"unsupported hidden_act {act!r} (Llama-family MLPs here use silu)")
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
      scaling = RopeScaling(
          factor=float(rope["factor"]),
          low_freq_factor=float(rope["low_freq_factor"]),
          high_freq_factor=float(rope["high_freq_factor"]),
          original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
      raise ConfigError(f"unsupported rope scaling type {rope_type!r} (supported: default, llama3)")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    context = int(hf.get("max_position_embeddings", 8192))
    window = hf.get("sliding_window")
    if window and (model_type == "mistral" or hf.get("use_sliding_window")) and window < context:
      # Full attention equals sliding-window attention within the window: cap the context there
      # rather than silently attend further than the model was trained to.
      log.warning("%s uses sliding-window attention (%d); capping the context at %d tokens",
                  model_type, window, window)
      context = int(window)
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        max_position_embeddings=context,
    )

  def to_hf(self) -> dict[str, Any]:
    """A transformers ``LlamaConfig``/``Qwen2Config`` dict with the same architecture."""
    out = dict(
        model_type="qwen2" if self.attention_bias else "llama",
        vocab_size=self.vocab_size, hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim, rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps,
        tie_word_embeddings=self.tie_word_embeddings,
        max_position_embeddings=self.max_position_embeddings, hidden_act="silu")
    if not self.attention_bias:
      out["attention_bias"] = False
    if self.rope_scaling is not None:
      out["rope_scaling"] = dict(rope_type="llama3", **dataclasses.asdict(self.rope_scaling))
    return out


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
  """The ReDrafter head; field names follow the reference's ``config.json``."""

  vocab_size: int
  hidden_size: int  # D of the base LLM
  exit_dim: int | None = None  # C; None means 2 * hidden_size (no input_proj)
  num_draft_layers: int = 2
  rnn: bool = True
  # The reference subtracts the row max and keeps only the top-k logits before log_softmax
  # (k=50, others set to -5e4). None disables the cut (the exact distribution).
  logit_top_k: int | None = None
  # The LLM layers (0-based decoder-layer indices, low to high) whose outputs, each put through
  # the LLM's final norm, are concatenated and projected to D by ``feature_proj`` to make the
  # drafter's context vector (EAGLE-3's multi-layer features). Empty: the last hidden state
  # only (the reference drafter). A drafter with layers needs the "redrafter-jax" format.
  feature_layers: tuple[int, ...] = ()
  # The copy hint (``models/context_copy.py``): at each draft step the drafter also reads the
  # token that followed the latest earlier occurrence of the longest suffix (up to this many
  # tokens) of the text so far, and that match's length, into its recurrent state and as a
  # gated boost of that token's logit. 0: off (the reference drafter). Needs the
  # "redrafter-jax" format.
  copy_ngram: int = 0
  # Attention over the committed context (``models/context_attention.py``): at each draft step
  # the drafter's state queries keys and values projected from its context vector and the
  # tokens at every committed position, in ``context_heads`` heads of this total width, and adds
  # the result to its head's input. 0: off (the reference drafter). Needs the "redrafter-jax"
  # format.
  context_attention: int = 0
  context_heads: int = 2

  # The options above that only the "redrafter-jax" format holds (reference drafters lack them).
  OWN_OPTIONS = ("feature_layers", "copy_ngram", "context_attention")

  def __post_init__(self):
    if (not isinstance(self.copy_ngram, int) or isinstance(self.copy_ngram, bool)
        or not 0 <= self.copy_ngram <= 8):
      raise ConfigError(f"drafter.copy_ngram must be an integer in 0..8 (0: off), got "
                        f"{self.copy_ngram!r}")
    A, H = self.context_attention, self.context_heads
    if not isinstance(H, int) or isinstance(H, bool) or H < 1:
      raise ConfigError(f"drafter.context_heads must be an integer >= 1, got {H!r}")
    if (not isinstance(A, int) or isinstance(A, bool) or not 0 <= A <= 1024 or A % H):
      raise ConfigError(f"drafter.context_attention must be an integer in 0..1024 (0: off) that "
                        f"context_heads={H} divides, got {A!r}")
    layers = self.feature_layers
    if isinstance(layers, list):
      object.__setattr__(self, "feature_layers", tuple(layers))
      layers = self.feature_layers
    if (not isinstance(layers, tuple)
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        or len(set(layers)) != len(layers)):
      raise ConfigError(f"drafter.feature_layers must be distinct layer indices >= 0, got "
                        f"{layers!r}")
    if self.exit_dim is None:
      object.__setattr__(self, "exit_dim", 2 * self.hidden_size)
    for name in ("vocab_size", "hidden_size", "exit_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"DrafterConfig.{name} must be a positive integer, got {value!r}")
    if not isinstance(self.num_draft_layers, int) or self.num_draft_layers < 0:
      raise ConfigError(f"num_draft_layers must be >= 0, got {self.num_draft_layers!r}")

  @property
  def has_input_proj(self) -> bool:
    return self.exit_dim != 2 * self.hidden_size

  @property
  def context_width(self) -> int:
    """Width of the LLM context the drafter reads per token: D, or D per feature layer."""
    return self.hidden_size * max(1, len(self.feature_layers))

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "DrafterConfig":
    data = dict(data)
    for ignored in ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version",
                    "_name_or_path"):
      data.pop(ignored, None)
    return _from_dict(cls, data, "drafter config")

  def to_dict(self) -> dict[str, Any]:
    out = dict(model_type="recurrent_drafting_drafter", **dataclasses.asdict(self))
    out["feature_layers"] = list(self.feature_layers)
    if not self.feature_layers:  # the reference's config.json has no such key
      del out["feature_layers"]
    if not self.copy_ngram:
      del out["copy_ngram"]
    if not self.context_attention:  # the heads mean nothing without it
      del out["context_attention"], out["context_heads"]
    return out

  @property
  def own_options(self) -> dict[str, Any]:
    """The options set here that only the "redrafter-jax" format holds (name: value)."""
    out = {}
    if self.feature_layers:
      out["feature_layers"] = list(self.feature_layers)
    if self.copy_ngram:
      out["copy_ngram"] = self.copy_ngram
    if self.context_attention:
      out["context_attention"] = self.context_attention
      out["context_heads"] = self.context_heads
    return out


ACCEPTANCE_RULES = ("greedy", "exact", "typical", "reference")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Static decoding settings (one compiled program per distinct value).

  ``beam_length`` counts the LLM's own token g0 (the reference's convention): L=5 drafts 4 tokens.
  Sampling settings here are defaults; per-row values may be passed to ``decode``.
  """

  beam_width: int = 4
  beam_length: int = 4
  max_new_tokens: int = 128
  temperature: float = 0.0  # 0 means greedy
  top_p: float = 1.0
  top_k: int = 0  # 0 disables
  # How drafted tokens are accepted: "exact" (exact for any temperature; greedy rows take the
  # argmax walk), "greedy" (the argmax walk; temperature must be 0), "typical" (Medusa's, lossy),
  # "reference" (Apple's rule, not exact for beam-search drafts; for comparison).
  acceptance: str = "exact"
  typical_eps: float = 0.09
  typical_delta: float = 0.3
  token_budget: int | None = None  # N; None: the whole tree (``whole_tree_tokens``, never cut)
  # One more beam copied from the context after the latest match of its last 1..n tokens
  # (prompt lookup; ``inference/lookup.py``); 0 = off. Exact: the tree is verified as usual.
  lookup_ngram: int = 0
  # Also put the drafter's K best first tokens in the tree, each as a 2-token beam [g0, token]
  # (``inference/step.py``): beam search keeps the beams of highest joint probability, which
  # often all start with the same token, and drops the step-1 alternatives; 0 = off. Adds at
  # most K tree tokens (fewer where a kept beam starts with the same token). Exact as any tree.
  first_alternatives: int = 0
  # Draft only the R most frequent tokens (the drafter's token ranking); 0 = the whole vocab.
  draft_vocab_size: int = 0
  cache_size: int | None = None  # S; None means prompt + max_new_tokens + L, rounded up
  # Decode steps the jitted loop runs per check of its stop predicate. 1: a plain
  # ``lax.while_loop``, one check per step (on a GPU XLA copies each check to the host, so the
  # next step cannot be launched before the current one ends). k > 1: each iteration runs k
  # steps in a loop of fixed trip count and checks once; steps after the batch is done (or past
  # a context bucket) change nothing, so tokens and metrics equal k=1's. The Python-loop twin
  # and the server run one step per call and ignore it.
  steps_per_check: int = 1

  def __post_init__(self):
    if (not isinstance(self.steps_per_check, int) or isinstance(self.steps_per_check, bool)
        or self.steps_per_check < 1):
      raise ConfigError(f"steps_per_check must be an integer >= 1, got {self.steps_per_check!r}")
    if not isinstance(self.beam_width, int) or self.beam_width < 1:
      raise ConfigError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
    if not isinstance(self.beam_length, int) or self.beam_length < 2:
      raise ConfigError(
          f"beam_length must be an integer >= 2 (it counts the LLM's own token), got "
          f"{self.beam_length!r}")
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
    if self.temperature < 0:
      raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0:
      raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
    if self.acceptance not in ACCEPTANCE_RULES:
      raise ConfigError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {self.acceptance!r}")
    if self.acceptance == "greedy" and self.temperature > 0:
      raise ConfigError(f"acceptance='greedy' decodes greedily, so temperature must be 0, got "
                        f"{self.temperature} (acceptance='exact' samples exactly)")
    if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
      raise ConfigError(f"draft_vocab_size must be an integer >= 0, got {self.draft_vocab_size!r}")
    if self.draft_vocab_size and self.acceptance == "reference":
      raise ConfigError("acceptance='reference' needs the drafter's full-vocabulary distribution; "
                        "set draft_vocab_size=0")
    if self.draft_vocab_size and self.draft_vocab_size < self.beam_width:
      raise ConfigError(f"draft_vocab_size ({self.draft_vocab_size}) must be >= beam_width "
                        f"({self.beam_width})")
    if not isinstance(self.lookup_ngram, int) or not 0 <= self.lookup_ngram <= 8:
      raise ConfigError(f"lookup_ngram must be an integer in [0, 8] (0 = off), got "
                        f"{self.lookup_ngram!r}")
    if self.lookup_ngram and self.acceptance == "reference":
      raise ConfigError("acceptance='reference' needs a drafter distribution for every beam; "
                        "the context-lookup beam has none: set lookup_ngram=0")
    if (not isinstance(self.first_alternatives, int) or isinstance(self.first_alternatives, bool)
        or self.first_alternatives < 0):
      raise ConfigError(f"first_alternatives must be an integer >= 0 (0 = off), got "
                        f"{self.first_alternatives!r}")
    if self.first_alternatives and self.acceptance == "reference":
      raise ConfigError("acceptance='reference' needs a drafter distribution along every beam; "
                        "the step-1 alternatives have none: set first_alternatives=0")
    if self.draft_vocab_size and self.draft_vocab_size < self.first_alternatives:
      raise ConfigError(f"draft_vocab_size ({self.draft_vocab_size}) must be >= "
                        f"first_alternatives ({self.first_alternatives})")
    if self.token_budget is not None:
      lo = self.beam_length
      hi = self.whole_tree_tokens
      if not lo <= self.token_budget <= hi:
        raise ConfigError(
            f"token_budget must be in [{lo}, {hi}] for beam_width={self.beam_width}, "
            f"beam_length={self.beam_length}, lookup_ngram={self.lookup_ngram}, "
            f"first_alternatives={self.first_alternatives} (one full beam must fit), got "
            f"{self.token_budget}")

  @property
  def num_beams(self) -> int:
    """Beams in the tree: the drafter's W, plus the context-lookup beam when on."""
    return self.beam_width + (1 if self.lookup_ngram else 0)

  @property
  def whole_tree_tokens(self) -> int:
    """Tree tokens when no prefix is shared: the root, the beams' drafted tokens and the step-1
    alternatives."""
    return self.num_beams * (self.beam_length - 1) + 1 + self.first_alternatives

  @property
  def num_tree_tokens(self) -> int:
    if self.token_budget is not None:
      return self.token_budget
    return self.whole_tree_tokens

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "DecodeConfig":
    return _from_dict(cls, data, "decode config")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Distillation recipe (DESIGN §7); defaults are the reference recipe."""

  # Folder written by ``redrafter-jax distill-data``, or a list of them (read as one data set).
  data: str | tuple[str, ...] = "runs/distill_data"
  # The LLM's hidden states over ``data``, precomputed by ``redrafter-jax features`` (one folder
  # per data folder): steps then run no LLM forward. None computes them in every step.
  features: str | tuple[str, ...] | None = None
  # Read only the first N completed shards of each data folder (0: all), so that a run on a
  # folder that keeps growing stays the same run; eval_shards holds out the last of those N.
  data_shards: int = 0
  output_dir: str = "runs/train"
  seq_len: int = 512
  batch_size: int = 8  # global batch, sequences
  num_steps: int = 1000
  # A time budget in seconds (null: none), counted from the start of training (loading and
  # compiling included): the run times its first steps and fits its step count, at most
  # num_steps, and the warmup + cosine schedule to what the budget holds, so that a run on a
  # lease of unknown speed still ends its schedule instead of being cut off at a high learning
  # rate (training.trainer; the decision goes to schedule.json).
  max_seconds: float | None = None
  num_draft_steps: int = 5  # n: drafter steps per position (beam_length - 1 at decode)
  learning_rate: float = 1e-3
  warmup_fraction: float = 0.1
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  seed: int = 0
  checkpoint_every: int = 200
  log_every: int = 10
  keep_checkpoints: int = 2
  mesh_data: int = -1  # devices on the data axis; -1 means all
  mesh_model: int = 1  # devices on the model axis (tensor parallel for the frozen LLM)
  pack: bool = True  # pack several sequences per row (else pad each row to seq_len)
  loss_chunk: int = 64  # positions per chunk of drafter logits (bounds [B, chunk, n, V] memory)
  init_drafter: str | None = None  # start from this drafter folder (any drafter_io format)
  # How a fresh drafter's head starts: "random" (the reference) or "llm" (from the LLM's output
  # projection, like Medusa; see models.drafter.init_head_from_llm). Ignored with init_drafter.
  head_init: str = "random"
  # Cross-entropy against the LLM's next-token distribution instead of the data token
  # (knowledge distillation; see losses.py). False is the reference loss.
  soft_targets: bool = False
  # Held-out evaluation: the last eval_shards shards of train.data are not trained on; every
  # eval_every steps (0: only at the end) every greedy answer of them is scored, in fixed batches
  # that no seed changes (eval.csv; ``data.held_out_batches``); a run from init_drafter also
  # scores its starting drafter, as step 0. eval_batches is no longer read (older presets carry
  # it).
  eval_shards: int = 0
  eval_every: int = 0
  eval_batches: int = 8
  # Train the head on the R most frequent response tokens only (0: all V); decode with
  # ``restrict_vocab(drafter, R)`` to match. Cuts the dominant [C, V] cost of a step by V/R.
  vocab_limit: int = 0
  # Draft step i (1..n) weighs decay**(i-1) in the loss (Medusa weighs later heads less: a
  # later step only counts when every earlier one was accepted). 1.0 is the reference's sum.
  step_weight_decay: float = 1.0
  # Training-time test: the share of positions (drawn per position and step) whose draft step
  # i > 1 reads the drafter's own argmax at step i-1 instead of the data token, as beam search
  # does at decode time; the target stays the data token. 0.0 is pure teacher forcing.
  self_feed: float = 0.0
  # HASS-style ranking loss: the Plackett-Luce log-likelihood of the LLM's own top-k tokens, in
  # the LLM's order, under the drafter's logits (it rewards ranking the LLM's runners-up the
  # way the LLM does, which is what beam search's W children need), added to the loss with
  # weight ``rank_loss_weight``. 0 turns it off.
  rank_loss_weight: float = 0.0
  rank_top_k: int = 8
  # The loss weight of positions where decoding's context-lookup beam (decode.lookup_ngram) has
  # the next token right: the tree accepts that token whatever the drafter says there, so a
  # weight below 1 spends the drafter's capacity on what the lookup cannot give (losses.py).
  # 1.0 weighs every position the same.
  lookup_covered_weight: float = 1.0
  # The drafter's matmuls in a training step: "float32", or "bfloat16" (operands rounded to
  # bfloat16, accumulated in float32, forward and backward; parameters, optimizer state, softmax
  # and loss stay float32: models.bf16_matmul). bfloat16 is the fast setting where the hardware
  # multiplies bfloat16 natively (GPU tensor cores; CPUs with AMX or AVX512-BF16). Held-out
  # evaluation and the exported drafter are float32 either way.
  matmul_dtype: str = "float32"

  def __post_init__(self):
    if self.matmul_dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"train.matmul_dtype must be 'float32' or 'bfloat16', got "
                        f"{self.matmul_dtype!r}")
    for name in ("self_feed", "rank_loss_weight", "lookup_covered_weight"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
          name == "self_feed" and value > 1):
        limit = "in [0, 1]" if name == "self_feed" else ">= 0"
        raise ConfigError(f"train.{name} must be a number {limit}, got {value!r}")
    if not isinstance(self.rank_top_k, int) or isinstance(self.rank_top_k, bool) or (
        self.rank_top_k < 1):
      raise ConfigError(f"train.rank_top_k must be an integer >= 1, got {self.rank_top_k!r}")
    if (not isinstance(self.step_weight_decay, (int, float)) or isinstance(self.step_weight_decay, bool)
        or not 0.0 < self.step_weight_decay <= 1.0):
      raise ConfigError(f"train.step_weight_decay must be in (0, 1], got {self.step_weight_decay!r}")
    for name in ("seq_len", "batch_size", "num_steps", "num_draft_steps", "checkpoint_every",
                 "log_every", "loss_chunk"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ConfigError(f"train.{name} must be an integer >= 1, got {getattr(self, name)!r}")
    for name in ("vocab_limit", "eval_shards", "eval_every", "data_shards"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise ConfigError(f"train.{name} must be an integer >= 0, got {getattr(self, name)!r}")
    if not isinstance(self.eval_batches, int) or self.eval_batches < 1:
      raise ConfigError(f"train.eval_batches must be an integer >= 1, got {self.eval_batches!r}")
    if not (isinstance(self.data, str) and self.data) and not (
        isinstance(self.data, tuple) and self.data and all(isinstance(d, str) for d in self.data)):
      raise ConfigError(f"train.data must be a folder or a non-empty list of folders, got "
                        f"{self.data!r}")
    if not isinstance(self.soft_targets, bool):
      raise ConfigError(f"train.soft_targets must be true or false, got {self.soft_targets!r}")
    if self.head_init not in ("random", "llm"):
      raise ConfigError(f"train.head_init must be 'random' or 'llm', got {self.head_init!r}")
    if not 0.0 <= self.warmup_fraction <= 1.0:
      raise ConfigError(f"train.warmup_fraction must be in [0, 1], got {self.warmup_fraction}")
    if self.max_seconds is not None and (
        not isinstance(self.max_seconds, (int, float)) or isinstance(self.max_seconds, bool)
        or not self.max_seconds > 0):
      raise ConfigError(f"train.max_seconds must be a number of seconds > 0 (or null: no time "
                        f"budget), got {self.max_seconds!r}")

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
    return _from_dict(cls, data, "train config")


def _int_at_least(cfg, name: str, low: int, none_ok: bool = False) -> None:
  value = getattr(cfg, name)
  if value is None and none_ok:
    return
  if not isinstance(value, int) or isinstance(value, bool) or value < low:
    raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")


def _names(cfg, name: str) -> None:
  """A list field given as one string or a list of strings, kept as a tuple of strings."""
  value = getattr(cfg, name)
  if isinstance(value, str):
    value = tuple(v.strip() for v in value.split(",") if v.strip())
  if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
    raise ConfigError(f"{name} must be a list of strings, got {value!r}")
  object.__setattr__(cfg, name, tuple(value))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """A server's settings: what its engine runs and how it listens. A preset's ``serve:`` section
  fills it, and ``redrafter-jax serve``'s flags override that (``serving.server.build`` reads
  it; ``docs/serving.md`` says what each setting costs)."""

  # The engine.
  slots: int = 8  # requests decoded together (batch rows)
  max_context: int | None = None  # cache slots per request (None: min(2048, the model's))
  min_context_bucket: int = 512  # smallest context bucket a step reads (max_context: none)
  prefill_tokens: int = 1024  # padded prompt tokens one admission call prefills
  max_tokens: int = 512  # the largest max_tokens a request may ask for
  default_max_tokens: int | None = None  # a request that gives none (None: decode's)
  max_queue: int = 64  # requests waiting for a slot; more get HTTP 429
  speculative: bool = True  # False: plain autoregressive steps (for comparison)
  random_drafter: bool = False  # a randomly initialised drafter, not the preset's (tests)
  # "auto": the draft tree predicted fastest on this device for the drafter (the preset's when
  # the drafter has no acceptance table); "preset": the preset's decode settings.
  tree: str = "auto"
  trees: tuple[str, ...] = ()  # smaller trees the policy may run instead (``WxL[+n][+aK][/N]``)
  devices: int | None = None  # devices on the model axis (None: all local ones)
  # Compile before serving: a covering set of programs (ready sooner; the rest compile in the
  # background), or with warmup_all every prompt bucket and step mode; False: none (each
  # program compiles when first needed).
  warmup: bool = True
  warmup_all: bool = False
  compile_cache: str | None = None  # compiled-program cache folder (None: the default; "off")
  # The background compile stops before resident memory would pass this many GB (None: no
  # limit; the programs not compiled are served padded to larger ones).
  memory_limit_gb: float | None = None
  # HTTP.
  host: str = "127.0.0.1"
  port: int = 8000
  model_name: str | None = None  # the model id clients use (None: the preset's model)
  max_body_bytes: int = 1 << 20  # larger request bodies get HTTP 413
  api_key: str | None = None  # required as 'Authorization: Bearer KEY' on /v1 when set
  cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API ('*': any)
  allowed_hosts: tuple[str, ...] = ()  # accepted Host headers ('*.example.com' patterns)
  shutdown_grace: float = 30.0  # seconds in-flight requests get after SIGTERM/SIGINT

  def __post_init__(self):
    for name, low in (("slots", 1), ("min_context_bucket", 1), ("prefill_tokens", 1),
                      ("max_tokens", 1), ("max_queue", 0), ("max_body_bytes", 1),
                      ("port", 0)):
      _int_at_least(self, name, low)
    for name in ("max_context", "default_max_tokens", "devices"):
      _int_at_least(self, name, 1, none_ok=True)
    if self.port > 65535:
      raise ConfigError(f"port must be in [0, 65535], got {self.port}")
    for name in ("speculative", "random_drafter", "warmup", "warmup_all"):
      if not isinstance(getattr(self, name), bool):
        raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
    if self.tree not in ("auto", "preset"):
      raise ConfigError(f"tree must be 'auto' or 'preset', got {self.tree!r}")
    for name in ("trees", "cors_origins", "allowed_hosts"):
      _names(self, name)
    m = self.memory_limit_gb
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or m <= 0):
      raise ConfigError(f"memory_limit_gb must be a number of GB > 0 (or absent), got {m!r}")
    if not isinstance(self.shutdown_grace, (int, float)) or self.shutdown_grace < 0:
      raise ConfigError(f"shutdown_grace must be a number of seconds >= 0, got "
                        f"{self.shutdown_grace!r}")

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> "ServeConfig":
    return _from_dict(cls, data, "serve config")


@dataclasses.dataclass(frozen=True)
class Preset:
  """A YAML preset: which base model, the drafter, decoding, training and serving settings."""

  model: str = "smollm2-135m"  # a known name (see weights.fetch) or a path to GGUF / HF folder
  dtype: str = "float32"  # the LLM's activations and KV cache (the drafter computes in it too)
  # The LLM's weights (None: ``dtype``; a server takes its drafter's decode.json value then).
  # bfloat16 with float32 activations: half the bytes per step and XLA:CPU's bf16 GEMM path,
  # the fast setting on CPUs with bf16 instructions (``models/linear.py``); "auto": that one
  # where it is faster, float32 elsewhere (``linear.preferred_param_dtype``).
  param_dtype: str | None = None
  # The invariant mode (``models.invariant``): identical greedy tokens at any batch, tree and
  # cache, bfloat16 included, at a cost in time. The server and the CLI load the LLM with it.
  invariant: bool = False
  drafter: Mapping[str, Any] | None = None  # DrafterConfig fields beyond vocab/hidden size
  drafter_path: str | None = None  # a trained drafter folder, or "shipped" (checkpoints/)
  decode: DecodeConfig = DecodeConfig()
  train: TrainConfig = TrainConfig()
  serve: ServeConfig = ServeConfig()  # ``redrafter-jax serve``'s settings (its flags override)

  def __post_init__(self):
    if self.dtype not in ("float32", "bfloat16"):
      raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
    if self.param_dtype not in (None, "float32", "bfloat16", "auto"):
      raise ConfigError(f"param_dtype must be float32, bfloat16 or auto (or absent: dtype), got "
                        f"{self.param_dtype!r}")
    if not isinstance(self.invariant, bool):
      raise ConfigError(f"invariant must be true or false, got {self.invariant!r}")
    if isinstance(self.decode, Mapping):
      object.__setattr__(self, "decode", DecodeConfig.from_dict(self.decode))
    if isinstance(self.train, Mapping):
      object.__setattr__(self, "train", TrainConfig.from_dict(self.train))
    if isinstance(self.serve, Mapping):
      object.__setattr__(self, "serve", ServeConfig.from_dict(self.serve))
    if self.train.lookup_covered_weight != 1.0 and not self.decode.lookup_ngram:
      raise ConfigError("train.lookup_covered_weight weighs the positions decoding's lookup beam "
                        "covers, and this preset decodes without one: set decode.lookup_ngram")
    if self.drafter is not None:
      # Every DrafterConfig field but the two the LLM sets.
      allowed = {f.name for f in dataclasses.fields(DrafterConfig)} - {"vocab_size",
                                                                        "hidden_size"}
      unknown = sorted(set(self.drafter) - allowed)
      if unknown:
        raise ConfigError(f"drafter: unknown key(s) {unknown}; valid keys: {sorted(allowed)}")

  def drafter_config(self, llm: LlamaConfig) -> DrafterConfig:
    return DrafterConfig(vocab_size=llm.vocab_size, hidden_size=llm.hidden_size,
                         **dict(self.drafter or {}))


def read_yaml(path: pathlib.Path, what: str) -> Any:
  """The YAML document at ``path`` (None as {}); a ``ConfigError`` naming ``what`` if the file
  is missing or not YAML."""
  if not path.is_file():
    raise ConfigError(f"{what} not found: {path}")
  try:
    return yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"{path}: invalid YAML: {e}") from e


def load_preset(path: str | pathlib.Path, overrides: Mapping[str, Any] | None = None) -> Preset:
  """Load a YAML preset; ``overrides`` maps dotted keys (``train.num_steps``) to values."""
  path = pathlib.Path(path)
  data = read_yaml(path, "config file")
  for dotted, value in (overrides or {}).items():
    node = data
    *parents, leaf = dotted.split(".")
    for p in parents:
      node = node.setdefault(p, {})
      if not isinstance(node, dict):
        raise ConfigError(f"override {dotted}: '{p}' is not a section")
    node[leaf] = value
  try:
    return _from_dict(Preset, data, str(path))
  except ConfigError as e:  # a nested section's error names the section: add the file
    if str(e).startswith(str(path)):
      raise
    raise ConfigError(f"{path}: {e}") from None


def parse_overrides(items: list[str]) -> dict[str, Any]:
  """Parse ``key.sub=value`` command-line overrides; values are YAML scalars."""
  out = {}
  for item in items:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like section.key=value")
    key, value = item.split("=", 1)
    out[key.strip()] = yaml.safe_load(value)
  return out
