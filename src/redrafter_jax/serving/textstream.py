"""Incremental detokenization with stop strings, on the host.

Tokens arrive a few at a time; the text they add is only released once it is final:
  * a trailing incomplete character (the tokenizer yields U+FFFD for a partial UTF-8 sequence)
    waits for the next token, and is dropped if the request ends before it is complete (a
    ``max_tokens`` cut inside a multi-byte character gives no U+FFFD);
  * text that could be the start of a stop string waits until it is clearly not one.
Decoding re-reads a short window of recent tokens (``prefix`` .. end) rather than the whole
output, and takes the difference to the window's earlier text: tokenizers that merge spaces or
bytes across token boundaries then still give the same text as decoding everything at once.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

REPLACEMENT = "\ufffd"


def decoder_for(tokenizer) -> Callable[[Sequence[int]], str]:
  """``ids -> text`` without special tokens, for a ``transformers`` tokenizer or a look-alike."""
  try:
    takes_flag = "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters
  except (TypeError, ValueError):
    takes_flag = False
  if takes_flag:
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
  return lambda ids: tokenizer.decode(list(ids))


class TextStream:
  """Text of one request's tokens as it grows, cut at the first stop string."""

  def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
    self._decode = decode
    self._stop = tuple(s for s in stop if s)
    self._longest = max((len(s) for s in self._stop), default=0)
    self._ids: list[int] = []
    self._prefix = 0  # window start: tokens before it are settled
    self._read = 0  # tokens whose text is already in ``text``
    self.text = ""  # all final text so far (stop string excluded)
    self._sent = 0  # characters of ``text`` handed out
    self.stopped = False  # a stop string was found; nothing more will come

  def push(self, ids: Sequence[int]) -> str:
    """Add tokens; returns the newly released text (possibly empty)."""
    if self.stopped:
      return ""
    self._ids.extend(int(i) for i in ids)
    before = self._decode(self._ids[self._prefix:self._read])
    now = self._decode(self._ids[self._prefix:])
    if len(now) > len(before) and not now.endswith(REPLACEMENT):
      searched = len(self.text)
      self.text += now[len(before):]
      self._prefix, self._read = self._read, len(self._ids)
      self._find_stop(max(0, searched - self._longest + 1))
    return self._release(final=False)

  def flush(self) -> str:
    """The rest of the text at the end of generation (a trailing partial character dropped)."""
    if not self.stopped:
      now = self._decode(self._ids[self._prefix:])
      before = self._decode(self._ids[self._prefix:self._read])
      if len(now) > len(before):
        searched = len(self.text)
        self.text += now[len(before):].rstrip(REPLACEMENT)
        self._read = len(self._ids)
        self._find_stop(max(0, searched - self._longest + 1))
    return self._release(final=True)

  def _find_stop(self, start: int) -> None:
    hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
    if hits:
      self.text = self.text[:min(hits)]
      self.stopped = True

  def _release(self, *, final: bool) -> str:
    end = len(self.text)
    if not (final or self.stopped):
      end -= self._held_back()
    out = self.text[self._sent:end]
    self._sent = max(self._sent, end)
    return out

  def _held_back(self) -> int:
    """Length of the longest tail of ``text`` that begins some stop string."""
    for k in range(min(self._longest - 1, len(self.text)), 0, -1):
      tail = self.text[-k:]
      if any(s.startswith(tail) for s in self._stop):
        return k
    return 0
