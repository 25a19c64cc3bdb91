"""Tokenizer and chat template through transformers (built from the GGUF or an HF folder).

Building a tokenizer from a GGUF takes seconds, so the result is saved once beside the GGUF (in
``tokenizer/``, written to a temporary folder and renamed) and loaded from there afterwards.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile

log = logging.getLogger(__name__)


def load_tokenizer(model_path: str | pathlib.Path):
  """A ``transformers`` tokenizer for a GGUF file or an HF model folder."""
  from transformers import AutoTokenizer

  path = pathlib.Path(model_path)
  if path.is_dir():
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
      return AutoTokenizer.from_pretrained(str(path))
    if len(ggufs) != 1:
      raise FileNotFoundError(f"{path}: no tokenizer files and not exactly one .gguf")
    path = ggufs[0]
  saved = path.parent / "tokenizer"
  if (saved / "tokenizer_config.json").is_file():
    return AutoTokenizer.from_pretrained(str(saved))
  tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  try:
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=".tokenizer-"))
    tok.save_pretrained(str(tmp))
    os.replace(tmp, saved)
  except OSError as e:  # a read-only cache still works, just slower next time
    log.warning("could not save tokenizer beside %s: %s", path, e)
  return tok


def stop_token_ids(tok) -> tuple[int, ...]:
  """EOS plus the end-of-turn / end-of-text tokens the vocabulary has."""
  ids = set()
  if tok.eos_token_id is not None:
    ids.add(int(tok.eos_token_id))
  vocab = tok.get_vocab()
  for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>"):
    if name in vocab:
      ids.add(int(vocab[name]))
  return tuple(sorted(ids))


def encode(tok, text: str, *, chat: bool, system: str | None = None) -> list[int]:
  """Token ids of ``text``; with ``chat`` it becomes a user turn in the model's chat template."""
  if not chat:
    return list(tok(text, add_special_tokens=True)["input_ids"])
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": text}]
  return encode_messages(tok, messages)


def encode_messages(tok, messages: list[dict]) -> list[int]:
  out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
  if hasattr(out, "keys"):
    out = out["input_ids"]
  return [int(t) for t in out]


class ByteTokenizer:
  """UTF-8 bytes as tokens 3..258 (0 pad, 1 turn start, 2 turn end): a tokenizer for random
  test models, with the slice of the ``transformers`` interface ``tokenizer.py`` uses."""

  pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
  vocab_size = 259

  def get_vocab(self) -> dict[str, int]:
    return {"<pad>": 0, "<|im_start|>": 1, "<|im_end|>": 2}

  def _bytes(self, text: str) -> list[int]:
    return [3 + b for b in text.encode("utf-8")]

  def __call__(self, text: str, add_special_tokens: bool = True):
    return {"input_ids": self._bytes(text)}

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
    ids = []
    for m in messages:
      ids += [1] + self._bytes(f"{m['role']}\n{m['content']}") + [2]
    if add_generation_prompt:
      ids += [1] + self._bytes("assistant\n")
    return ids

  def decode(self, ids) -> str:
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")
