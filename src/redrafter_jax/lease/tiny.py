"""A tiny model that travels and runs like the real one, for the lease's CPU dry-run.

``write_tiny_model`` writes a random Llama as a GGUF file stored the way the real SmolLM2 GGUF is
(Q8_0 embeddings, Q4_1 matrices, F32 norms, Q/K rows in llama.cpp's RoPE order), so the dry-run
packs, splits, ships, reassembles and dequantizes it by the same code as the real model; and a
byte-level tokenizer folder (UTF-8 bytes plus three chat tokens, with a chat template) that
transformers loads without the network. Random weights: the dry-run checks the machinery, not
the model's text.
"""

from __future__ import annotations

import pathlib

import numpy as np

from redrafter_jax.config import LlamaConfig

TINY = LlamaConfig(vocab_size=288, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                   max_position_embeddings=4096, rope_theta=10000.0)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def _permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's row order for Q/K (the inverse of ``gguf_file.unpermute_qk``)."""
  rows, rest = w.shape[0], w.shape[1:]
  return w.reshape(heads, 2, rows // heads // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def write_tiny_model(folder: pathlib.Path, cfg: LlamaConfig = TINY, seed: int = 0) -> pathlib.Path:
  """``folder/tiny.gguf`` and ``folder/tokenizer/``; returns the GGUF's path."""
  import gguf

  folder.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  normal = lambda *shape, s=1.0: (s * rng.standard_normal(shape)).astype(np.float32)
  path = folder / "tiny.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(cfg.num_layers)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_dimension_count(E)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_vocab_size(cfg.vocab_size)
  q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1

  def add(name: str, x: np.ndarray, kind=None):
    if kind is None:
      w.add_tensor(name, x)
    else:
      w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

  add("token_embd.weight", normal(cfg.vocab_size, D, s=0.5), q8)
  add("output_norm.weight", 1 + normal(D, s=0.1))
  for i in range(cfg.num_layers):
    b = f"blk.{i}."
    add(b + "attn_q.weight", _permute_qk(normal(cfg.num_heads * E, D, s=D ** -0.5),
                                         cfg.num_heads), q4)
    add(b + "attn_k.weight", _permute_qk(normal(cfg.num_kv_heads * E, D, s=D ** -0.5),
                                         cfg.num_kv_heads), q4)
    add(b + "attn_v.weight", normal(cfg.num_kv_heads * E, D, s=D ** -0.5), q4)
    add(b + "attn_output.weight", normal(D, cfg.num_heads * E, s=D ** -0.5), q4)
    add(b + "ffn_gate.weight", normal(F, D, s=D ** -0.5), q4)
    add(b + "ffn_up.weight", normal(F, D, s=D ** -0.5), q4)
    add(b + "ffn_down.weight", normal(D, F, s=F ** -0.5), q4)
    add(b + "attn_norm.weight", 1 + normal(D, s=0.1))
    add(b + "ffn_norm.weight", 1 + normal(D, s=0.1))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  write_byte_tokenizer(folder / "tokenizer", cfg.vocab_size)
  return path


def write_byte_tokenizer(folder: pathlib.Path, vocab_size: int) -> pathlib.Path:
  """A byte-level BPE tokenizer with no merges (one token per UTF-8 byte) and chat tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  vocab = {tok: i for i, tok in enumerate([*SPECIAL, *alphabet])}
  if len(vocab) > vocab_size:
    raise ValueError(f"a byte tokenizer needs {len(vocab)} ids, the model has {vocab_size}")
  tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>",
                                eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                additional_special_tokens=list(SPECIAL))
  tok.chat_template = CHAT_TEMPLATE
  tok.save_pretrained(str(folder))
  return folder
