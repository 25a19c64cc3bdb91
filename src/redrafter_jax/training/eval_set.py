"""Fixed evaluation sets: the LLM's greedy answers to fixed prompts, committed with the code, so
that every clone, run and seed scores a drafter on the same positions.

A set is a JSON-lines file (gzipped with no timestamp, like the other data files), one answer
per line:

  ``id``        the prompt's id in the file it came from
  ``category``  its category there
  ``model``     the base model that answered (every line the same): the tokenizer and chat
                template of ``prompt``, and the LLM a drafter scored on the set must be made for
  ``prompt``    token ids of the chat-templated prompt
  ``answer``    token ids of the model's greedy answer (its stop token included where it stopped)

Two are committed under ``data/eval`` (``NAMES``; data/README.md says how each was made):

  ``specbench``  the greedy answers to the first 10 prompts per category of Spec-Bench
                 (``bench acceptance --per-category 10``'s prompts), 128 new tokens at most
  ``heldout``    the greedy answers of mix-v1's last teacher shard (``shard-00062``), which the
                 presets that read all 63 shards hold out (``answers_from_shard``)

The trainer's held-out evaluation scores the same kind of set: every greedy answer of its
held-out shards in fixed batches (``greedy_indices``, ``data.held_out_batches``); for a run
whose held-out shard is mix-v1's ``shard-00062`` those are the ``heldout`` set's answers (a
record longer than ``train.seq_len`` windowed as in training).
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np

from redrafter_jax.jsonl import DataError, read_jsonl, write_jsonl
from redrafter_jax.training import data as data_lib
from redrafter_jax.training.data import greedy_indices

EVAL_DIR = pathlib.Path(__file__).resolve().parents[3] / "data" / "eval"
NAMES = {"specbench": "specbench-greedy-v1.jsonl.gz", "heldout": "heldout-greedy-v1.jsonl.gz"}


@dataclasses.dataclass(frozen=True)
class EvalAnswer:
  """One line of a set (see the module docstring); token ids as tuples of ints."""

  id: str
  category: str
  model: str
  prompt: tuple[int, ...]
  answer: tuple[int, ...]

  def row(self) -> dict[str, Any]:
    return {"id": self.id, "category": self.category, "model": self.model,
            "prompt": list(self.prompt), "answer": list(self.answer)}


def resolve(name_or_path: str | pathlib.Path) -> pathlib.Path:
  """A committed set's file (``NAMES``: ``specbench``, ``heldout``) or a path as given."""
  if str(name_or_path) in NAMES:
    return EVAL_DIR / NAMES[str(name_or_path)]
  return pathlib.Path(name_or_path)


def _token_ids(value, path, lineno: int, field: str) -> tuple[int, ...]:
  ok = (isinstance(value, list) and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))
  if not ok:
    raise DataError(f"{path}:{lineno}: {field!r} must be a non-empty list of token ids")
  return tuple(value)


def read_eval_set(name_or_path: str | pathlib.Path) -> list[EvalAnswer]:
  """The answers of a set (``resolve``), in file order, checked: every field present, token
  ids non-negative integers, ids unique, one model throughout.

  Raises:
    DataError: naming the file and line of the first problem.
  """
  path = resolve(name_or_path)
  out, seen = [], {}
  for lineno, row in read_jsonl(path, "id", what="eval set"):
    for field in ("category", "model"):
      if not isinstance(row.get(field), str) or not row[field]:
        raise DataError(f"{path}:{lineno}: not an eval set line (want a string {field!r})")
    if row["id"] in seen:
      raise DataError(f"{path}:{lineno}: duplicate id {row['id']!r} (line {seen[row['id']]})")
    seen[row["id"]] = lineno
    if out and row["model"] != out[0].model:
      raise DataError(f"{path}:{lineno}: model {row['model']!r}, but line 1 has "
                      f"{out[0].model!r} (a set is one model's answers)")
    out.append(EvalAnswer(row["id"], row["category"], row["model"],
                          _token_ids(row.get("prompt"), path, lineno, "prompt"),
                          _token_ids(row.get("answer"), path, lineno, "answer")))
  if not out:
    raise DataError(f"{path}: the eval set holds no answers")
  return out


def write_eval_set(answers: Sequence[EvalAnswer], path: str | pathlib.Path) -> pathlib.Path:
  """Write ``answers`` as a set at ``path`` (gzipped, byte for byte reproducible, for ``.gz``)."""
  if not answers:
    raise DataError(f"{path}: an eval set needs at least one answer")
  write_jsonl([a.row() for a in answers], path)
  return pathlib.Path(path)


def check_model(answers: Sequence[EvalAnswer], model: str, vocab_size: int, where) -> None:
  """Refuse to score ``answers`` with another model than the one that wrote them, or token ids
  its vocabulary does not hold.

  Raises:
    DataError: one line naming ``where`` (the set) and both models.
  """
  if answers[0].model != model:
    raise DataError(f"eval set {where} holds {answers[0].model!r}'s answers, not {model!r}'s: "
                    f"score it with --model {answers[0].model}")
  top = max(max(a.prompt + a.answer) for a in answers)
  if top >= vocab_size:
    raise DataError(f"eval set {where} has token id {top}, beyond {model!r}'s vocabulary of "
                    f"{vocab_size}")


def answers_from_records(records: Sequence[Mapping[str, Any]], categories: Mapping[str, str],
                         model: str) -> list[EvalAnswer]:
  """The greedy ``records`` as a set: prompt = the tokens before the response, answer = the
  response (``mask``), category by prompt id from ``categories``.

  Raises:
    DataError: a record whose id ``categories`` lacks, or whose response is not one run of
      tokens after its prompt.
  """
  out = []
  for r in (records[i] for i in greedy_indices(records)):
    mask = np.asarray(r["mask"]) > 0
    n_prompt = int(np.argmax(mask)) if mask.any() else mask.size
    if not mask.any() or not mask[n_prompt:].all() or n_prompt == 0:
      raise DataError(f"record {r['id']!r}: want a prompt, then a non-empty response")
    if r["id"] not in categories:
      raise DataError(f"record {r['id']!r} is not in the prompts file (another prompt mix?)")
    tokens = [int(t) for t in r["tokens"]]
    out.append(EvalAnswer(r["id"], categories[r["id"]], model, tuple(tokens[:n_prompt]),
                          tuple(tokens[n_prompt:])))
  return out


def answers_from_shard(shard: str | pathlib.Path, prompts: str | pathlib.Path) -> list[EvalAnswer]:
  """The greedy answers of one teacher shard (``distill-data``'s), with their categories from
  ``prompts``, the prompts file its folder was made from; the model is the folder's.

  Raises:
    DataError: ``prompts`` is not the file the folder's manifest names (its digest differs).
  """
  shard, prompts = pathlib.Path(shard), pathlib.Path(prompts)
  settings = data_lib.read_manifest(shard.parent).get("settings", {})
  digest = hashlib.sha256(prompts.read_bytes()).hexdigest()[:16]
  if settings.get("prompts_sha256") not in (None, digest):
    raise DataError(f"{prompts} is not the prompts file {shard.parent} was made from "
                    f"({settings.get('prompts')!r}, digest {settings['prompts_sha256']})")
  categories = {str(r["id"]): str(r.get("category", ""))
                for _, r in read_jsonl(prompts, "prompt", what="prompts file")}
  return answers_from_records(data_lib.read_shard(shard), categories,
                              str(settings.get("model", "")))
