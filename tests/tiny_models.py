"""Tiny random models for tests (built in-process, no download): Hugging Face Llama-family models
for parity tests, and ``tiny_llm`` / ``tiny_drafter``, the pair the decoding tests share.

transformers initialises norms to one and biases to zero, which would let a wrong norm or bias
path pass unnoticed; ``hf_model`` therefore redraws every parameter (norm scales around 1, biases
and weights with a visible spread) so each tensor changes the logits.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redrafter_jax.config import DrafterConfig, LlamaConfig
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama

VOCAB = 128

# Small but structurally complete: GQA (4 query heads over 2 kv heads), 2 layers.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32, rope_theta=10000.0)

KINDS = ("llama", "qwen2", "llama3", "untied")

# The decoding tests' LLM and drafter: random, small enough to compile in seconds.
TINY_VOCAB = 64
TINY_LLM = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


def tiny_llm() -> Llama:
  return Llama(TINY_LLM, rngs=nnx.Rngs(0))


def tiny_drafter() -> Drafter:
  return Drafter(DrafterConfig(vocab_size=TINY_VOCAB, hidden_size=TINY_LLM.hidden_size,
                               exit_dim=48), rngs=nnx.Rngs(1))


def hf_config(kind: str = "llama"):
  import transformers

  if kind == "qwen2":
    return transformers.Qwen2Config(**BASE, tie_word_embeddings=True)
  if kind == "llama":
    return transformers.LlamaConfig(**BASE, tie_word_embeddings=True)
  if kind == "llama3":
    return transformers.LlamaConfig(**BASE, tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)
  if kind == "untied":
    return transformers.LlamaConfig(**BASE, tie_word_embeddings=False)
  raise ValueError(kind)


def hf_model(kind: str = "llama", seed: int = 0):
  """A float32 ``*ForCausalLM`` in eval mode with every parameter redrawn from ``seed``."""
  import torch
  import transformers

  cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
  torch.manual_seed(seed)
  model = cls(hf_config(kind)).to(torch.float32).eval()
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * noise)
      elif name.endswith("bias"):
        p.copy_(0.1 * noise)
      elif "embed_tokens" in name or "lm_head" in name:
        p.copy_(0.15 * noise)  # logits of a natural spread (a few units)
      else:
        p.copy_(noise / np.sqrt(p.shape[-1]))
  return model


def random_tokens(seed: int, n: int) -> list[int]:
  """``n`` token ids drawn uniformly from the tiny vocabulary (reproducible per seed)."""
  return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def save(model, folder: pathlib.Path) -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(str(folder), safe_serialization=True)
  return folder


def hf_logits(model, tokens_BT: np.ndarray, positions_BT: np.ndarray | None = None) -> np.ndarray:
  """Float32 logits of a plain causal forward (no cache)."""
  import torch

  with torch.no_grad():
    kwargs = {}
    if positions_BT is not None:
      kwargs["position_ids"] = torch.as_tensor(np.asarray(positions_BT), dtype=torch.long)
    out = model(input_ids=torch.as_tensor(np.asarray(tokens_BT), dtype=torch.long),
                use_cache=False, **kwargs)
  return out.logits.float().numpy()


def rel_err(ours, ref) -> float:
  """Largest absolute difference relative to the reference's largest magnitude."""
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def load_tiny(tmp_path: pathlib.Path, kind: str = "llama", seed: int = 0, **load_kwargs):
  """``(our model, our config, hf model)`` for the same tiny random weights."""
  from redrafter_jax.weights.llama_weights import load_llama

  hf = hf_model(kind, seed)
  folder = save(hf, tmp_path / f"{kind}-{seed}")
  model, cfg = load_llama(folder, **load_kwargs)
  return model, cfg, hf


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BT, positions_BT, valid_BT):
  model = nnx.merge(graphdef, state)
  logits_BTV, _, _ = model(tokens_BT, positions_BT, kvc.causal_mask(valid_BT), None)
  return logits_BTV


def forward(model, tokens_BT, positions_BT=None, valid_BT=None) -> np.ndarray:
  """Our logits of a plain causal forward without a cache."""
  tokens_BT = jnp.asarray(tokens_BT, jnp.int32)
  B, T = tokens_BT.shape
  if positions_BT is None:
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
  if valid_BT is None:
    valid_BT = jnp.ones((B, T), bool)
  graphdef, state = nnx.split(model)
  return np.asarray(_forward(graphdef, state, tokens_BT, jnp.asarray(positions_BT), valid_BT))


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def save_tokenizer(folder: pathlib.Path) -> pathlib.Path:
  """A word-level tokenizer over ``VOCAB`` ids (with a chat template) saved into ``folder``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  special = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
  words = special + [f"w{i}" for i in range(VOCAB - len(special))]
  tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tk.decoder = decoders.WordPiece()  # joins words with spaces
  tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                additional_special_tokens=special[1:])
  tok.chat_template = CHAT_TEMPLATE
  tok.save_pretrained(str(folder))
  return folder


def ancestor_mask(parent) -> np.ndarray:
  """``[n, n]`` bool: node i sees itself and its ancestors (``parent[i]``, -1 at a root); nodes
  come in topological order. A reference written from the definition, for tree tests."""
  n = len(parent)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    j = i
    while j >= 0:
      mask[i, j] = True
      j = parent[j]
  return mask


def bench_inputs(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  """``(model folder, prompts file)`` for the benches' end-to-end tests: a tiny HF Llama with a
  word-level tokenizer, and five Spec-Bench-style prompts of its words in three categories."""
  import json

  model = save_tokenizer(save(hf_model("llama", seed=3), root / "model"))
  lines = [json.dumps(dict(id=f"p{i}", source="test", category=cat,
                           prompt=" ".join(f"w{(7 * i + j) % 100}" for j in range(n))))
           for i, (cat, n) in enumerate([("writing", 9), ("writing", 5), ("qa", 12), ("qa", 6),
                                         ("math", 4)])]
  prompts = root / "prompts.jsonl"
  prompts.write_text("\n".join(lines) + "\n")
  return model, prompts
