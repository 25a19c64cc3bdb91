"""The distillation prompt mix: requests that look like what users send, from the source sets.

The drafter is only as good as the answers it learns from, and a drafter trained on answers to
math, code and roleplay prompts is accepted far less often on summaries, extractions, passages
and open questions (checkpoints/README). This module builds the prompts of the broad teacher set
from the source prompt sets the repository carries in ``data/sources`` (``SOURCES``; each file
may be plain ``.jsonl`` or gzipped ``.jsonl.gz``), never from Spec-Bench, the evaluation set:

- ``train_prompts.jsonl``: GSM8K math, GPTeacher code / roleplay / general, as written;
- ``qa_prompts.jsonl``: open-domain questions, as written and once more with a framing that
  asks for a short or a detailed answer;
- ``passages.jsonl``: context tasks built around each passage (summarize, extract, answer from
  the passage, rewrite, continue, translate): ``CONTEXT_TASKS`` names them, each passage gets
  ``tasks_per_passage`` of them;
- seeds for self-written requests (``self_prompt_seeds``): a task opening ("Write a persuasive
  essay about") and a topic, which the LLM completes into a request of its own words
  (``self_prompts.write_self_prompts(seeds=...)``), steering Magpie-style sampling across the
  kinds of requests the benchmarks' categories name (writing, reasoning, STEM, humanities, ...).

Every choice is a function of the seed and the row's position, so the same inputs give the same
file; rows are deduplicated on their text. Each row keeps ``category`` (the kind of request) and
``source`` (where its material came from) so the mix can be counted (``count_mix``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import pathlib
from typing import Iterable, Sequence

from redrafter_jax.jsonl import DataError, read_jsonl, write_jsonl

# --------------------------------------------------------------------------- context tasks

# name -> (category, template); {passage} is the passage text.
CONTEXT_TASKS: dict[str, tuple[str, str]] = {
    "summarize": ("summarization", "Summarize: {passage}"),
    "summarize_short": ("summarization",
                        "Summarize the following text in two or three sentences.\n\n{passage}"),
    "tldr": ("summarization", "{passage}\n\nWrite a one-paragraph summary of the text above."),
    "extract_entities": ("extraction", "Extract every person, place and organization mentioned "
                         "in the text below. Return them as a JSON object with the keys "
                         "\"people\", \"places\" and \"organizations\".\n\n{passage}"),
    "extract_facts": ("extraction", "List the key facts stated in the following text as bullet "
                      "points.\n\n{passage}"),
    "extract_numbers": ("extraction", "Identify any numbers, dates, names or quantities in the "
                        "following text and explain what each refers to.\n\n{passage}"),
    "rag_main": ("rag", "{passage}\n\nBased on the passage above, what is the main point the "
                 "author makes, and what supports it?"),
    "rag_who": ("rag", "Read the passage and answer the question.\n\nPassage: {passage}\n\n"
                "Question: Who or what is this passage mainly about, and what happens to them?"),
    "rag_why": ("rag", "Use only the information in the document below to answer.\n\n"
                "Document: {passage}\n\nQuestion: What reasons or explanations does the "
                "document give?"),
    "rewrite_formal": ("writing", "Rewrite the following text in a formal, professional "
                       "tone.\n\n{passage}"),
    "rewrite_simple": ("writing", "Rewrite this for a ten-year-old reader, keeping every "
                       "important idea:\n\n{passage}"),
    "continue": ("writing", "Continue the following text with two more paragraphs in the same "
                 "style.\n\n{passage}"),
    "translate_fr": ("translation", "Translate English to French: {passage}"),
    "translate_de": ("translation", "Translate English to German: {passage}"),
    "translate_es": ("translation", "Translate English to Spanish: {passage}"),
}

QA_FRAMINGS = (
    "Answer briefly: {q}",
    "{q} Explain your answer.",
    "Give a detailed answer to the following question. {q}",
    "Question: {q}\nAnswer:",
)

# --------------------------------------------------------------------------- self-prompt seeds

# category -> task openings; the LLM continues "<opening> <topic>" into a whole request.
SEED_TASKS: dict[str, tuple[str, ...]] = {
    "writing": ("Write a short story about", "Compose a blog post about",
                "Write a persuasive essay on", "Draft a professional email about",
                "Write a poem about", "Write a product description for",
                "Write a speech about", "Write a letter to a friend about"),
    "roleplay": ("Pretend you are an expert in", "Imagine you are a character who loves",
                 "Act as a tour guide and tell me about", "You are a teacher explaining",
                 "Role-play as a journalist interviewing someone about"),
    "reasoning": ("Explain step by step why", "What would happen if there were no",
                  "Solve this logic puzzle about", "What are the pros and cons of",
                  "Compare and contrast two approaches to"),
    "math": ("Solve the following math problem about", "Calculate", "A word problem about",
             "Prove or explain the formula for"),
    "coding": ("Write a Python function that works with", "Write a JavaScript snippet for",
               "Explain this programming concept:", "Write a SQL query about",
               "Debug a program that handles"),
    "stem": ("Explain how", "In physics, what is", "Describe the biology of",
             "What is the chemistry behind", "How does technology for"),
    "humanities": ("Discuss the history of", "What is the cultural significance of",
                   "Analyze the economic impact of", "Describe the philosophy behind",
                   "How did society change because of"),
    "qa": ("What is", "Who was", "When did", "Where can I learn about", "Why do people care about"),
    "extraction": ("Extract the key information from a report about",
                   "Make a table of facts about", "List the main points of an article on"),
    "summarization": ("Summarize the main ideas of", "Give me a brief overview of",
                      "Condense the debate about"),
}

TOPICS: tuple[str, ...] = (
    "the ocean", "climate change", "a small town", "artificial intelligence", "the moon landing",
    "coffee", "friendship", "a rainy day", "the Roman Empire", "electric cars", "volcanoes",
    "honeybees", "the stock market", "chess", "a job interview", "renewable energy", "vaccines",
    "the French Revolution", "black holes", "photosynthesis", "social media", "the human brain",
    "ancient Egypt", "a birthday party", "remote work", "cybersecurity", "mountain climbing",
    "the printing press", "jazz music", "a lost dog", "recycling", "the immune system",
    "quantum computing", "a haunted house", "healthy breakfast", "the Great Wall of China",
    "inflation", "the water cycle", "dinosaurs", "a space station", "smartphones", "democracy",
    "Shakespeare", "gardening", "a train journey", "earthquakes", "the Internet", "genetics",
    "a coffee shop", "the Renaissance", "time management", "plastic pollution", "soccer",
    "the solar system", "a cooking competition", "machine learning", "the Cold War",
    "rainforests", "public libraries", "a wedding", "nuclear energy", "the Silk Road",
    "sleep", "video games", "a city at night", "antibiotics", "the Industrial Revolution",
    "budgeting", "a robot", "the Olympic Games", "coral reefs", "electricity", "a detective",
    "mental health", "the Amazon river", "cryptocurrency", "a school trip", "gravity",
    "the Middle Ages", "a new neighbor", "fast food", "migration of birds", "3D printing",
    "the Egyptian pyramids", "public transport", "a thunderstorm", "DNA", "a startup company",
    "world music", "an old photograph", "the Moon", "tea", "ancient Greece", "a museum visit",
    "deserts", "self-driving cars", "a family dinner", "the human heart", "the Vikings",
    "urban farming", "a spaceship crew", "the periodic table", "online shopping", "tigers",
    "the Cuban Missile Crisis", "a marathon", "wind turbines", "human rights", "a mystery box",
    "the printing of money", "bicycles", "the Arctic", "a video call", "language learning",
    "the stock of a bakery", "blockchain", "a king and a queen", "sound waves", "a hospital",
    "the Great Depression", "bread baking", "satellites", "a summer camp", "algorithms",
    "the Beatles", "volunteering", "glaciers", "a magic trick", "the Internet of Things",
    "World War I", "a farmer's market", "solar panels", "penguins", "a courtroom",
    "the theory of evolution", "minimalism", "a road trip", "cloud computing", "pirates",
)


@dataclasses.dataclass(frozen=True)
class MixRow:
  id: str
  category: str
  source: str
  prompt: str


def _pick(key: str, n: int, k: int) -> list[int]:
  """``k`` distinct indices of ``range(n)`` chosen by a hash of ``key`` (stable across runs and
  Python versions, unlike ``hash()``)."""
  order = sorted(range(n), key=lambda i: hashlib.sha256(f"{key}/{i}".encode()).digest())
  return order[:k]


def _plain(path: pathlib.Path) -> pathlib.Path:
  """The file's name without ``.gz``: rows a file lends its name to (a missing id or source)
  are the same read from ``x.jsonl`` or ``x.jsonl.gz``."""
  return path.with_suffix("") if path.suffix == ".gz" else path


def prompts_as_written(path: pathlib.Path) -> list[MixRow]:
  """Rows of a prompts file (``{id, prompt, category?, source?}``), unchanged."""
  plain = _plain(path)
  return [MixRow(id=str(r.get("id", f"{plain.stem}-{i}")), category=str(r.get("category", "")),
                 source=str(r.get("source", plain.name)), prompt=r["prompt"].strip())
          for i, (_, r) in enumerate(read_jsonl(path, "prompt"))]


def qa_rows(path: pathlib.Path, *, seed: int) -> list[MixRow]:
  """Each question as written, and once more in a framing picked by the seed."""
  rows = prompts_as_written(path)
  out = list(rows)
  for i, r in enumerate(rows):
    framing = QA_FRAMINGS[_pick(f"qa/{seed}/{r.id}", len(QA_FRAMINGS), 1)[0]]
    out.append(dataclasses.replace(r, id=f"{r.id}/framed", prompt=framing.format(q=r.prompt)))
  return out


def context_rows(path: pathlib.Path, *, tasks_per_passage: int, seed: int,
                 max_chars: int = 1600) -> list[MixRow]:
  """``tasks_per_passage`` context tasks per passage (``CONTEXT_TASKS``), picked by the seed;
  passages longer than ``max_chars`` are cut at a sentence end before it."""
  if not 1 <= tasks_per_passage <= len(CONTEXT_TASKS):
    raise DataError(f"tasks_per_passage must be in [1, {len(CONTEXT_TASKS)}], "
                    f"got {tasks_per_passage}")
  names = sorted(CONTEXT_TASKS)
  out = []
  for i, (_, r) in enumerate(read_jsonl(path, "text")):
    pid = str(r.get("id", f"passage-{i}"))
    text = _cut(r["text"].strip(), max_chars)
    for t in _pick(f"ctx/{seed}/{pid}", len(names), tasks_per_passage):
      category, template = CONTEXT_TASKS[names[t]]
      out.append(MixRow(id=f"{pid}/{names[t]}", category=category,
                        source=str(r.get("source", _plain(path).name)),
                        prompt=template.format(passage=text)))
  return out


def _cut(text: str, max_chars: int) -> str:
  if len(text) <= max_chars:
    return text
  head = text[:max_chars]
  end = head.rfind(". ")
  return head[:end + 1] if end > max_chars // 2 else head


def self_prompt_seeds(num: int, *, seed: int) -> list[MixRow]:
  """``num`` distinct (category, "<task opening> <topic>") seeds, categories in turn so every
  prefix of the list is balanced; the order of the (task, topic) pairs is fixed by the seed."""
  pools = {c: [(t, topic) for t in tasks for topic in TOPICS] for c, tasks in SEED_TASKS.items()}
  for c, pool in pools.items():
    order = _pick(f"seeds/{seed}/{c}", len(pool), len(pool))
    pools[c] = [pool[i] for i in order]
  most = sum(len(p) for p in pools.values())
  if num > most:
    raise DataError(f"asked for {num} seeds, but the task x topic lists hold {most}")
  out, k = [], 0
  while len(out) < num:
    for c in SEED_TASKS:
      if k < len(pools[c]) and len(out) < num:
        task, topic = pools[c][k]
        out.append(MixRow(id=f"seed-{c}-{k}", category=c, source="seed",
                          prompt=f"{task} {topic}"))
    k += 1
  return out


def dedup(rows: Iterable[MixRow]) -> list[MixRow]:
  """First occurrence of each prompt text (whitespace-normalised); ids must be unique."""
  seen, ids, out = set(), set(), []
  for r in rows:
    if r.id in ids:
      raise DataError(f"duplicate prompt id {r.id!r}")
    ids.add(r.id)
    key = " ".join(r.prompt.split())
    if key not in seen:
      seen.add(key)
      out.append(r)
  return out


# The folder of source prompt sets inside the checkout (data/README.md: sources and licences).
SOURCES = pathlib.Path(__file__).resolve().parents[3] / "data" / "sources"


def source_file(data_dir: str | pathlib.Path, name: str) -> pathlib.Path:
  """``data_dir/name.jsonl``, or its gzipped twin ``name.jsonl.gz`` (the rows are the same)."""
  d = pathlib.Path(data_dir)
  for path in (d / f"{name}.jsonl", d / f"{name}.jsonl.gz"):
    if path.is_file():
      return path
  raise DataError(f"{d}: no {name}.jsonl or {name}.jsonl.gz (the mix reads train_prompts, "
                  "qa_prompts and passages; the repository carries them in data/sources)")


def build_mix(data_dir: str | pathlib.Path = SOURCES, *, tasks_per_passage: int = 3, seed: int = 0,
              exclude: Sequence[str | pathlib.Path] = (),
              max_per_category: int | None = None) -> list[MixRow]:
  """The mix from ``data_dir`` (train, qa and passages files, ``.jsonl`` or ``.jsonl.gz``;
  default: ``SOURCES``, the checkout's ``data/sources``; see the module docstring).

  ``exclude``: prompts files whose prompts must not appear (e.g. an evaluation set); a row whose
  text equals one of theirs is dropped. ``max_per_category`` keeps at most that many rows of
  each category (a seeded choice, file order kept), so GSM8K's 7,473 math prompts do not make
  a third of the mix.
  """
  rows = (prompts_as_written(source_file(data_dir, "train_prompts"))
          + qa_rows(source_file(data_dir, "qa_prompts"), seed=seed)
          + context_rows(source_file(data_dir, "passages"), tasks_per_passage=tasks_per_passage,
                         seed=seed))
  banned = {" ".join(r.prompt.split()) for p in exclude
            for r in prompts_as_written(pathlib.Path(p))}
  rows = [r for r in dedup(rows) if " ".join(r.prompt.split()) not in banned]
  if max_per_category is None:
    return rows
  if max_per_category < 1:
    raise DataError(f"max_per_category must be >= 1, got {max_per_category}")
  by_category = collections.defaultdict(list)
  for i, r in enumerate(rows):
    by_category[r.category].append(i)
  keep = {idx[j] for c, idx in by_category.items()
          for j in _pick(f"cap/{seed}/{c}", len(idx), min(len(idx), max_per_category))}
  return [r for i, r in enumerate(rows) if i in keep]


def write_rows(rows: Sequence[MixRow], path: str | pathlib.Path) -> None:
  """A JSON-lines prompts file (``.gz``: compressed, reproducible byte for byte)."""
  write_jsonl([dataclasses.asdict(r) for r in rows], path)


def count_mix(rows: Iterable[MixRow]) -> dict[str, int]:
  """Rows per category, most first."""
  return dict(collections.Counter(r.category for r in rows).most_common())
