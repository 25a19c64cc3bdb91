"""Self-written prompts: the LLM writes user turns for its own teacher data (Magpie-style).

The training prompts (GSM8K, GPTeacher code/roleplay) cover few of the kinds of requests a chat
model gets, and a drafter trained on the LLM's answers to them is accepted far less often on
other kinds (``python -m redrafter_jax.bench acceptance``; the numbers are in checkpoints/README).
Given only the chat template up to the start of a user turn, an instruction-tuned LLM samples a
user request from its own idea of what users ask; answering those
(``distill-data --prompts`` on the file written here) widens the teacher data to the model's own
distribution without touching any evaluation set.

The output is a JSON-lines prompts file like ``train_prompts.jsonl``. It is written one batch at
a time and resumed from its last complete batch; batch ``b`` always draws with the same seed, so
a resumed file equals an uninterrupted one. A request counts only if the LLM closed the turn
(a stop token) and it is not blank or a repeat. ``max_seconds`` time-boxes a call: it draws no
batch that its drawn batches say would not end in time, so the file stops on a complete batch
and a rerun continues it. The batch size sets only how many requests one ``generate`` call
draws (and, with ``seeds`` below, which seed each row starts from), so a GPU's large batch
writes the same kind of file.

Unsteered, a small model asks mostly the same few kinds of things. With ``seeds`` (rows of
``prompt_mix.self_prompt_seeds``: a task opening and a topic, e.g. "Write a persuasive essay
on renewable energy") the user turn starts with a seed and the LLM writes the rest of the
request; draw ``i`` of batch ``b`` uses seed ``(b * batch_size + i) % len(seeds)``, and the row
keeps the seed's category.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Sequence

from tqdm.auto import tqdm

from redrafter_jax.config import ConfigError
from redrafter_jax.models.llama import Llama
from redrafter_jax.training.data import DataError

clock = time.perf_counter  # the time budget's clock (tests replace it)
CATEGORY = "self"
MIN_CHARS = 10  # shorter requests are mostly fragments ("Hi", "?")


def user_turn_prefix(tokenizer) -> list[int]:
  """Token ids of the chat template up to where a user's text begins (system turn included).

  Found as the common prefix of two one-message templates that differ only in the message, so it
  needs nothing from the tokenizer beyond ``apply_chat_template``.
  """
  a, b = ([int(t) for t in _template_ids(tokenizer, text)] for text in ("A", "Z"))
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  if n == 0:
    raise ConfigError("the tokenizer's chat template has no common prefix before the user text")
  return a[:n]


def _template_ids(tokenizer, text: str) -> list[int]:
  ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=False, tokenize=True)
  if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
    ids = ids["input_ids"]
  return list(ids)


@dataclasses.dataclass(frozen=True)
class SelfPromptStats:
  prompts: int  # in the file now
  new: int  # written by this call
  batches: int  # drawn by this call
  seconds: float
  stopped_at_budget: bool = False  # max_seconds left a batch undrawn


def _read_existing(path: pathlib.Path) -> tuple[list[dict], int]:
  """Complete rows already in ``path`` and the next batch index (a torn last line is dropped)."""
  rows, next_batch = [], 0
  if not path.exists():
    return rows, next_batch
  for line in path.read_text(encoding="utf-8").split("\n"):
    if not line:
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      break
    rows.append(row)
  for row in rows:
    if not str(row.get("id", "")).startswith("self-b"):
      raise DataError(f"{path} exists and is not a file written by self-prompts "
                      f"(row id {row.get('id')!r}); choose another --out")
    next_batch = max(next_batch, int(str(row["id"])[6:].split("-")[0]) + 1)
  if rows:  # rewrite without a torn line, so appends start on a fresh line
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
  return rows, next_batch


def write_self_prompts(llm: Llama, tokenizer, out_path: str | pathlib.Path, *, num: int,
                       source: str, batch_size: int = 64, max_new_tokens: int = 96,
                       temperature: float = 1.0, seed: int = 0, max_batches: int | None = None,
                       max_seconds: float | None = None, seeds: Sequence = (),
                       progress: bool = True) -> SelfPromptStats:
  """Sample user requests until ``out_path`` holds ``num`` of them (see the module docstring).

  ``max_batches`` bounds the draws of this call (a sampler that rarely closes its turn would
  otherwise never stop), ``max_seconds`` its time: no batch is drawn that would not finish
  within that many seconds of the call's start, as estimated from the batches this call drew
  (the slowest, the first left out once others are done: it pays for the compile; the first
  batch always runs); rerun to continue. ``seeds``: rows with ``prompt`` (the opening of the
  user turn) and ``category``; none: unsteered.
  """
  start = clock()
  from redrafter_jax.inference.ar import generate
  from redrafter_jax.weights.tokenizer import stop_token_ids

  if num < 1 or batch_size < 1 or max_new_tokens < 1:
    raise ConfigError("num, batch_size and max_new_tokens must be >= 1")
  if not temperature > 0:
    raise ConfigError(f"temperature must be > 0 to draw different requests, got {temperature}")
  out = pathlib.Path(out_path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.touch()  # exists from the start: a run stopped before its first batch leaves it empty
  rows, batch = _read_existing(out)
  seen = {r["prompt"] for r in rows}
  prefix = user_turn_prefix(tokenizer)
  stops = stop_token_ids(tokenizer)
  new, drawn, took, stopped = 0, 0, [], False  # took: seconds of each batch drawn
  bar = tqdm(total=num, initial=min(len(rows), num), desc="self-prompts", unit="prompt",
             disable=not progress)
  seed_ids = [list(tokenizer(s.prompt, add_special_tokens=False)["input_ids"]) for s in seeds]
  while len(rows) < num and (max_batches is None or drawn < max_batches):
    if max_seconds is not None and took and (
        clock() - start + max(took[1:] or took) > max_seconds):
      stopped = True
      break
    batch_start = clock()
    picks = [(batch * batch_size + i) % len(seeds) for i in range(batch_size)] if seeds else []
    openings = [seeds[k] for k in picks]
    prompts = [prefix + seed_ids[k] for k in picks] if seeds else [prefix] * batch_size
    result = generate(llm, prompts, max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed * 1_000_003 + batch, stop_ids=stops)
    fresh = []
    for i, (ids, stopped) in enumerate(zip(result.tokens, result.stopped)):
      text = tokenizer.decode([t for t in ids if t not in stops])
      text = (openings[i].prompt + text if seeds else text).strip()
      if not stopped or len(text) < MIN_CHARS or text in seen:
        continue
      seen.add(text)
      row = dict(id=f"self-b{batch}-{i}", source=source, category=CATEGORY, prompt=text)
      if seeds:
        row.update(category=openings[i].category, seed=openings[i].prompt)
      fresh.append(row)
    fresh = fresh[:num - len(rows)]
    with open(out, "a", encoding="utf-8") as f:
      f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in fresh))
    rows += fresh
    new += len(fresh)
    batch += 1
    drawn += 1
    took.append(clock() - batch_start)
    bar.update(len(fresh))
  bar.close()
  return SelfPromptStats(prompts=len(rows), new=new, batches=drawn, seconds=clock() - start,
                         stopped_at_budget=stopped)
