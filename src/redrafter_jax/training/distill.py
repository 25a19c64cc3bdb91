"""Teacher data for self-distillation: the frozen LLM answers the training prompts (DESIGN §7).

Every prompt is answered once greedily and ``sampled_fraction`` times on average by sampling at
T=1, so the drafter sees the LLM's own continuations under both decoders: at most 1, a seeded
fraction of the prompts gets one sampled answer; above 1, every prompt gets ``floor(f)`` and a
seeded ``frac(f)`` of them one more, which makes more data than there are prompts. Each sampled
answer is a draw of its own: duplicates of a prompt sit in other rows of a batch (each row its
own noise) or in other batches (each batch its own seed), and their records keep the prompt's id
(tools match record ids to prompts).

Jobs are shuffled and cut into shards of ``shard_size`` (any first k shards are a uniform sample
of the prompts: a job stopped early is still representative), ordered within each shard
(``plan_jobs``), and each shard is generated in fixed-size batches (``generate()``; the last
batch is padded by repeating a job; every prompt is padded to a multiple of ``prompt_multiple``
and every batch shares one cache size, so a run compiles one program per prompt bucket and
decoder, greedy or sampled: on a GPU, where each program compiles for tens of seconds, one
bucket, ``prompt_multiple >= max_prompt_tokens``, compiles at most two) and written as one
compressed shard (``data.write_shard``) under a temporary name, then renamed, then recorded in
``manifest.json`` with its wall and CPU seconds and the machine that made it. A rerun with the
same settings skips the shards the manifest lists, so a killed job resumes where it stopped
(losing at most the shard in progress); other settings are refused rather than mixed in.
``max_seconds`` time-boxes a call: it starts no shard that its finished shards say would not
end in time, so a job on a lent machine stops with complete shards and a correct manifest, and
a rerun continues it.

The prompts may come from several files, read in order (jobs index prompts by position, so ids
may repeat across files); the manifest records one file as it always has (its name and digest)
and several as their names joined by "+" and one digest over the files' digests in that order.

The teacher itself is loaded by ``weights.base_model`` (any model spec, ``random:`` ones too).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import pathlib
import time
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from redrafter_jax.config import ConfigError
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.runtime import cache_size_for, round_up
from redrafter_jax.jsonl import read_jsonl
from redrafter_jax.models.llama import Llama
from redrafter_jax.training import data as data_lib
from redrafter_jax.training.data import DataError
from redrafter_jax.weights.tokenizer import encode, stop_token_ids

log = logging.getLogger(__name__)

clock = time.perf_counter  # the time budget's clock (tests replace it)

# ----------------------------------------------------------------------------- prompts


@dataclasses.dataclass(frozen=True)
class Prompt:
  id: str
  category: str
  text: str


def read_prompts(path: str | pathlib.Path, limit: int | None = None) -> list[Prompt]:
  """Prompts from a JSON-lines file (``.gz`` too); a malformed line raises ``DataError`` naming
  the line."""
  out = _prompts_in(path, limit)
  if not out:
    raise DataError(f"{path}: no prompts")
  return out


def _prompts_in(path: str | pathlib.Path, limit: int | None = None) -> list[Prompt]:
  return [Prompt(id=str(obj.get("id", f"line-{lineno}")), category=str(obj.get("category", "")),
                 text=obj["prompt"])
          for lineno, obj in read_jsonl(path, "prompt", what="prompts file", limit=limit)]


def _as_paths(prompts_path) -> list[pathlib.Path]:
  if isinstance(prompts_path, (str, os.PathLike)):
    return [pathlib.Path(prompts_path)]
  paths = [pathlib.Path(p) for p in prompts_path]
  if not paths:
    raise ConfigError("no prompts file given")
  return paths


def _read_prompt_files(paths: Sequence[pathlib.Path]) -> list[Prompt]:
  """The prompts of every file, in order. With several files one may be empty (a self-prompts
  run that kept nothing): it is skipped with a warning; all of them empty is an error."""
  if len(paths) == 1:
    return read_prompts(paths[0])
  out = []
  for path in paths:
    prompts = _prompts_in(path)
    if not prompts:
      log.warning("%s holds no prompts; answering the other files", path)
    out += prompts
  if not out:
    raise DataError(f"{' '.join(map(str, paths))}: no prompts")
  return out


# ----------------------------------------------------------------------------- jobs and shards


# Recorded in the manifest: folders written with another job order cannot be resumed.
JOB_ORDER = "shuffled; within shards greedy jobs first, each kind length-sorted"


MAX_SAMPLED = 16  # sampled answers per prompt at most (more says little new about a prompt)
SEED_STRIDE = 1009  # batch b of shard k samples with seed * 1_000_003 + k * SEED_STRIDE + b


@dataclasses.dataclass(frozen=True)
class Job:
  prompt: int  # index into the prompt list
  sampled: bool  # T=1 sampling (else greedy)
  sample: int = 0  # which sampled answer of the prompt (0 for greedy ones)


def _check_sampled_fraction(sampled_fraction: float) -> None:
  if not 0.0 <= sampled_fraction <= MAX_SAMPLED:  # NaN fails too
    raise ConfigError(f"sampled_fraction (sampled answers per prompt) must be in "
                      f"[0, {MAX_SAMPLED}], got {sampled_fraction}")


def plan_jobs(lengths: Sequence[int], sampled_fraction: float, seed: int,
              shard_size: int) -> list[Job]:
  """Every prompt greedy, and ``sampled_fraction`` sampled answers per prompt on average.

  Prompt i gets ``floor(f)`` sampled answers, plus one more where its seeded draw is below
  ``frac(f)`` (at most 1 that is a seeded fraction of the prompts, as the plan has always
  been: for ``f <= 1`` the draws, the jobs and their order are those of folders written
  before several answers per prompt existed, so those folders resume).

  The jobs are shuffled before they are cut into shards, so that the first k shards are a
  uniform sample of the prompts (a run stopped early still covers every source and length);
  within a shard the greedy jobs come first, then the sampled ones, each sorted by prompt
  length: batches pad little, and most batches are all-greedy, which skips the per-step
  random draw over the vocabulary.
  """
  _check_sampled_fraction(sampled_fraction)
  rng = np.random.default_rng(seed)
  draw = rng.random(len(lengths))
  whole = math.floor(sampled_fraction)
  counts = whole + (draw < sampled_fraction - whole)
  jobs = [Job(i, False) for i in range(len(lengths))]
  for s in range(int(counts.max(initial=0))):  # round s: the prompts with more than s answers
    jobs += [Job(i, True, s) for i in range(len(lengths)) if counts[i] > s]
  jobs = [jobs[i] for i in rng.permutation(len(jobs))]
  by_length = lambda j: (j.sampled, lengths[j.prompt], j.prompt, j.sample)
  return [job for k in range(0, len(jobs), shard_size)
          for job in sorted(jobs[k:k + shard_size], key=by_length)]


def shard_name(index: int) -> str:
  return f"shard-{index:05d}{data_lib.SHARD_SUFFIX}"


def _write_json(path: pathlib.Path, obj) -> None:
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
  os.replace(tmp, path)


def _file_digest(path: pathlib.Path) -> str:
  return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _prompt_settings(paths: Sequence[pathlib.Path]) -> dict[str, str]:
  """The manifest's ``prompts`` and ``prompts_sha256``: one file's name and digest (as folders
  have always recorded them), or the names joined by "+" and a digest over each file's full
  digest in order (another file, order or content is another job)."""
  if len(paths) == 1:
    return dict(prompts=paths[0].name, prompts_sha256=_file_digest(paths[0]))
  digests = "".join(hashlib.sha256(p.read_bytes()).hexdigest() + "\n" for p in paths)
  return dict(prompts="+".join(p.name for p in paths),
              prompts_sha256=hashlib.sha256(digests.encode()).hexdigest()[:16])


def _open_manifest(out: pathlib.Path, settings: dict[str, Any]) -> dict[str, Any]:
  path = out / data_lib.MANIFEST
  if not path.is_file():
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"settings": settings, "shards": {}}
    _write_json(path, manifest)
    return manifest
  manifest = data_lib.read_manifest(out)
  old = manifest.get("settings", {})
  diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
  if diff:
    detail = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff)
    raise DataError(f"{out} was started with other settings ({detail}); resume with the same "
                    "settings or choose a new --out folder")
  return manifest


def machine() -> str:
  """What generated a shard: the JAX backend's device kind and the host's CPU model."""
  import platform

  import jax

  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                 cpu)
  except OSError:
    pass
  return f"{jax.devices()[0].device_kind}; {cpu}, {os.cpu_count()} cpus"


@dataclasses.dataclass(frozen=True)
class DistillStats:
  shards_written: int
  shards_skipped: int
  records: int
  new_tokens: int  # response tokens generated in this call
  seconds: float  # generating and writing (after the prompts are read and planned)
  shards_left: int = 0  # of the folder, still to write
  stopped_at_budget: bool = False  # max_seconds left a shard unstarted

  @property
  def tokens_per_s(self) -> float:
    return self.new_tokens / max(self.seconds, 1e-9)


def _shard_estimate(finished: list[tuple[float, int]], jobs: int) -> float:
  """Seconds a shard of ``jobs`` jobs should take, from ``(seconds, jobs)`` of the shards this
  call finished: the slowest per job, the first left out once others have finished (it pays for
  most of the compiles), so a later shard that compiles more keeps the estimate on the safe
  side."""
  seen = finished[1:] or finished
  return max(seconds / max(n, 1) for seconds, n in seen) * jobs


def distill(llm: Llama, tokenizer,
            prompts_path: str | pathlib.Path | Sequence[str | pathlib.Path],
            out_dir: str | pathlib.Path, *, model_name: str, limit: int | None = None,
            max_new_tokens: int = 256, batch_size: int = 16, sampled_fraction: float = 0.25,
            shard_size: int = 256, max_prompt_tokens: int = 384, seed: int = 0,
            max_shards: int | None = None, max_seconds: float | None = None,
            prompt_multiple: int = 64, progress: bool = True) -> DistillStats:
  """Write (or resume) the teacher data folder ``out_dir``; see the module docstring.

  ``prompts_path``: one prompts file or several (read in order). ``max_shards`` stops after
  writing that many new shards, ``max_seconds`` before the first shard that would not finish
  within that many seconds of this call's start (the first shard always runs): time-boxed
  slices of a long job, which a rerun continues.
  """
  call_start = clock()
  if batch_size < 1 or shard_size < 1 or max_new_tokens < 1 or prompt_multiple < 1:
    raise ConfigError("batch_size, shard_size, max_new_tokens and prompt_multiple must be >= 1")
  _check_sampled_fraction(sampled_fraction)  # before the prompts are read and encoded
  if sampled_fraction > 0 and shard_size > math.lcm(SEED_STRIDE, batch_size):
    # Batch b of shard k and batch b - lcm of shard k + lcm / SEED_STRIDE would share a seed.
    raise ConfigError(f"shard_size {shard_size} above {math.lcm(SEED_STRIDE, batch_size)} (the "
                      f"least common multiple of batch_size and {SEED_STRIDE}) would give two "
                      "batches the same sampling seed")
  paths = _as_paths(prompts_path)
  prompts = _read_prompt_files(paths)
  if limit is not None and limit < len(prompts):
    # A seeded random subset: prompt files are grouped by source, so the first N would not be.
    pick = np.sort(np.random.default_rng(seed).choice(len(prompts), size=limit, replace=False))
    prompts = [prompts[i] for i in pick]
  tokens = [encode(tokenizer, p.text, chat=True) for p in prompts]
  top = max(max(t) for t in tokens)
  if top >= llm.config.vocab_size:
    raise ConfigError(f"the tokenizer produces token id {top}, but the model's vocab_size is "
                      f"{llm.config.vocab_size}: tokenizer and model do not belong together")
  too_long = [i for i, t in enumerate(tokens) if len(t) > max_prompt_tokens]
  if too_long:
    log.info("skipping %d of %d prompts longer than %d tokens", len(too_long), len(prompts),
             max_prompt_tokens)
  keep = [i for i, t in enumerate(tokens) if len(t) <= max_prompt_tokens]
  if not keep:
    raise DataError(f"every prompt is longer than max_prompt_tokens={max_prompt_tokens}")
  lengths = [len(tokens[i]) for i in keep]
  # one cache size for every batch: the longest padded prompt's (module docstring)
  cache_size = cache_size_for(round_up(max(lengths), prompt_multiple), max_new_tokens, 1,
                              llm.config.max_position_embeddings)
  jobs = [dataclasses.replace(j, prompt=keep[j.prompt])
          for j in plan_jobs(lengths, sampled_fraction, seed, shard_size)]
  shards = [jobs[i:i + shard_size] for i in range(0, len(jobs), shard_size)]

  out = pathlib.Path(out_dir)
  settings = dict(model=model_name, vocab_size=llm.config.vocab_size, **_prompt_settings(paths),
                  limit=limit, max_new_tokens=max_new_tokens, sampled_fraction=sampled_fraction,
                  shard_size=shard_size, max_prompt_tokens=max_prompt_tokens, seed=seed,
                  num_shards=len(shards), order=JOB_ORDER)
  manifest = _open_manifest(out, settings)
  todo = [k for k in range(len(shards)) if shard_name(k) not in manifest["shards"]]
  skipped = len(shards) - len(todo)
  if skipped:
    log.info("%s: %d of %d shards already complete, skipping them", out, skipped, len(shards))
  if max_shards is not None:
    todo = todo[:max_shards]
  stops = stop_token_ids(tokenizer)
  start, new_tokens, records, host = clock(), 0, 0, machine()
  finished, stopped = [], False  # (seconds, jobs) of each shard written by this call
  bar = tqdm(total=sum(len(shards[k]) for k in todo), desc="distill", unit="seq",
             disable=not progress)
  for k in todo:
    if max_seconds is not None and finished and (
        clock() - call_start + _shard_estimate(finished, len(shards[k])) > max_seconds):
      stopped = True
      log.info("%s: stopping at the time budget (%.0f s) before shard %d", out, max_seconds, k)
      break
    shard_jobs, encoded, shard_tokens = shards[k], [], 0
    shard_start, shard_cpu = clock(), time.process_time()
    for b in range(0, len(shard_jobs), batch_size):
      batch = shard_jobs[b:b + batch_size]
      padded = batch + [batch[-1]] * (batch_size - len(batch))  # static batch shape
      # The sampled rows draw different numbers: each row its own noise, each batch its seed.
      result = generate(llm, [tokens[j.prompt] for j in padded], max_new_tokens=max_new_tokens,
                        temperature=[1.0 if j.sampled else 0.0 for j in padded],
                        seed=seed * 1_000_003 + k * SEED_STRIDE + b, stop_ids=stops,
                        cache_size=cache_size, prompt_multiple=prompt_multiple)
      for job, response in zip(batch, result.tokens):
        prompt = tokens[job.prompt]
        # The id stays the prompt's own, sampled answers too: tools match ids to prompts.
        encoded.append(data_lib.make_record(
            prompt + response, [0] * len(prompt) + [1] * len(response),
            id=prompts[job.prompt].id, sampled=job.sampled))
        shard_tokens += len(response)
      new_tokens += sum(len(r) for r in result.tokens[:len(batch)])
      bar.update(len(batch))
      bar.set_postfix(tok_s=f"{new_tokens / max(clock() - start, 1e-9):.0f}")
    name = shard_name(k)
    tmp = out / f".{name}.tmp"
    data_lib.write_shard(tmp, encoded)
    os.replace(tmp, out / name)
    seconds = clock() - shard_start
    manifest["shards"][name] = {
        "records": len(encoded), "response_tokens": shard_tokens, "seconds": round(seconds, 1),
        "cpu_seconds": round(time.process_time() - shard_cpu, 1), "machine": host}
    _write_json(out / data_lib.MANIFEST, manifest)
    records += len(encoded)
    finished.append((seconds, len(shard_jobs)))
  bar.close()
  return DistillStats(shards_written=len(finished), shards_skipped=skipped, records=records,
                      new_tokens=new_tokens, seconds=clock() - start,
                      shards_left=len(shards) - skipped - len(finished),
                      stopped_at_budget=stopped)
