"""Test doubles for the serving stack: it runs without real weights or a real tokenizer.

* ``word_tokenizer(V)``: a real ``transformers`` fast tokenizer whose tokens are whole words
  (``w0``, ``w1``, ...), with special tokens and a chat template: text equality is token
  equality, and stop strings are readable.
* ``SelfDrafter``: drafts with the LLM itself (its greedy continuation), with errors planted at
  a depth that cycles with each row's own progress, so every accepted length occurs, acceptance
  is high, and nothing depends on which slot a request sits in (unlike ``tests/oracle.py``,
  which knows each batch row's answer in advance).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redrafter_jax.inference.beam_search import BeamOutput
from redrafter_jax.models import kv_cache as kvc

SPECIALS = ("<pad>", "<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
                 "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
                 "{% endif %}")


def word_tokenizer(vocab_size: int):
  """Token i is ``w{i - 6}`` after 3 special tokens (pad 0, im_start 1, im_end 2 = EOS) and
  the 3 role names; unknown words become pad."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  words = list(SPECIALS) + list(ROLES)
  words += [f"w{i}" for i in range(vocab_size - len(words))]
  tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
  tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<|im_start|>",
                                eos_token="<|im_end|>")
  tok.chat_template = CHAT_TEMPLATE
  return tok


def word_text(ids) -> str:
  """What ``word_tokenizer`` decodes token ids to (special tokens skipped)."""
  names = lambda i: ROLES[i - len(SPECIALS)] if i < len(SPECIALS) + len(ROLES) else \
      f"w{i - len(SPECIALS) - len(ROLES)}"
  return " ".join(names(i) for i in ids if i >= len(SPECIALS))


class SelfDrafter(nnx.Module):
  """Beam 0 = the LLM's own next L-1 greedy tokens, wrong from depth ``e0`` on, where
  ``e0 = num_generated % L + 1`` (``e0 == L``: no error); beam w errs at ``max(1, e0 - w)``."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def propose(self, llm, state, cfg) -> BeamOutput:
    W, L = cfg.beam_width, cfg.beam_length
    B = state.g0_B.shape[0]
    cache = state.cache  # written only in its scratch slots, and then dropped
    tok_B = state.g0_B
    true = []
    for _ in range(L - 1):
      mask_B1S = kvc.visible_mask(cache.lengths_B, jnp.ones((B, 1, 1), bool), cache.size)
      logits_B1V, _, cache = llm(tok_B[:, None], cache.lengths_B[:, None], mask_B1S, cache)
      cache = kvc.advance(cache, jnp.ones((B,), jnp.int32))
      tok_B = jnp.argmax(logits_B1V[:, 0], axis=-1).astype(jnp.int32)
      true.append(tok_B)
    true_BJ = jnp.stack(true, axis=1)
    e0_B = state.out.num_B % L + 1
    err_BW = jnp.maximum(1, e0_B[:, None] - jnp.arange(W)[None, :])
    wrong_BWJ = (true_BJ[:, None, :] + 1 + jnp.arange(W)[None, :, None]) % self.vocab_size
    drafted_BWJ = jnp.where(jnp.arange(1, L)[None, None, :] >= err_BW[:, :, None], wrong_BWJ,
                             true_BJ[:, None, :])
    beams_BWL = jnp.concatenate([jnp.broadcast_to(state.g0_B[:, None, None], (B, W, 1)),
                                 drafted_BWJ], axis=2).astype(jnp.int32)
    zeros_BWJ = jnp.zeros((B, W, L - 1), jnp.float32)
    return BeamOutput(beams_BWL=beams_BWL, logp_BWJ=zeros_BWJ, score_BW=zeros_BWJ.sum(-1))
