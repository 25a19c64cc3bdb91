"""The GGUF tensor index: a second read skips the header's parsing and gives the same weights; an
index that does not belong to the file, or is damaged, is not trusted; an unwritable folder
still loads."""

import dataclasses
import json
import logging

import gguf
import numpy as np
import pytest

from redrafter_jax.lease.tiny import TINY, write_tiny_model
from redrafter_jax.weights import gguf_file
from redrafter_jax.weights.gguf_file import index_path, read_gguf, read_index
from redrafter_jax.weights.naming import WeightsError


@pytest.fixture
def tiny_gguf(tmp_path):
  return write_tiny_model(tmp_path / "m")


def _no_reader(monkeypatch):
  def refuse(*a, **k):
    raise AssertionError("the GGUF header was parsed again")

  monkeypatch.setattr(gguf, "GGUFReader", refuse)


def _assert_same(a, b):
  cfg_a, tensors_a = a
  cfg_b, tensors_b = b
  assert cfg_a == cfg_b
  assert tensors_a.keys() == tensors_b.keys()
  for name in tensors_a:
    np.testing.assert_array_equal(tensors_a[name], tensors_b[name], err_msg=name)


def test_second_read_uses_the_index_and_gives_the_same_weights(tiny_gguf, monkeypatch):
  first = read_gguf(tiny_gguf)
  assert index_path(tiny_gguf).is_file()
  assert first[0] == gguf_file.gguf_config(gguf.GGUFReader(str(tiny_gguf)))
  _no_reader(monkeypatch)
  _assert_same(read_gguf(tiny_gguf), first)


def test_the_index_equals_the_readers_view_of_the_file(tiny_gguf):
  reader = gguf.GGUFReader(str(tiny_gguf))
  index = read_index(tiny_gguf)
  data = np.memmap(tiny_gguf, dtype=np.uint8, mode="r")
  assert index.config == gguf_file.gguf_config(reader) and index.arch == "llama"
  assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
  for entry, t in zip(index.tensors, reader.tensors):
    raw = index.raw(data, entry)
    assert raw.dtype == t.data.dtype and raw.shape == t.data.shape
    np.testing.assert_array_equal(raw, t.data, err_msg=t.name)


def test_an_index_of_another_file_is_not_used(tiny_gguf, tmp_path):
  read_gguf(tiny_gguf)
  other = write_tiny_model(tmp_path / "other", dataclasses.replace(TINY, num_layers=3), seed=1)
  (tiny_gguf.parent / "replacement.gguf").write_bytes(other.read_bytes())
  (tiny_gguf.parent / "replacement.gguf").replace(tiny_gguf)
  cfg, tensors = read_gguf(tiny_gguf)
  assert cfg.num_layers == 3 and "model.layers.2.mlp.up_proj.weight" in tensors
  _assert_same((cfg, tensors), read_gguf(other))


def test_a_damaged_index_is_made_again(tiny_gguf, caplog):
  first = read_gguf(tiny_gguf)
  index_path(tiny_gguf).write_text('{"version": 1, "file": ')
  with caplog.at_level(logging.WARNING):
    again = read_gguf(tiny_gguf)
  assert "ignoring the GGUF index" in caplog.text
  _assert_same(again, first)
  assert json.loads(index_path(tiny_gguf).read_text())["version"] == 1


def test_an_unwritable_folder_still_loads(tiny_gguf, monkeypatch, caplog):
  def refuse(*a, **k):
    raise PermissionError("read-only file system")

  monkeypatch.setattr(gguf_file.os, "replace", refuse)
  with caplog.at_level(logging.WARNING):
    cfg, _ = read_gguf(tiny_gguf)
  assert cfg.num_layers == TINY.num_layers and not index_path(tiny_gguf).exists()
  assert "could not save the GGUF index" in caplog.text
  assert not [p for p in tiny_gguf.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_truncated_gguf_is_a_clear_error(tiny_gguf):
  read_gguf(tiny_gguf)
  tiny_gguf.write_bytes(tiny_gguf.read_bytes()[:-100])
  with pytest.raises(WeightsError, match="m/tiny.gguf"):
    read_gguf(tiny_gguf)


def test_the_real_models_saved_index_is_its_header():
  """SmolLM2's GGUF (Q4_1, Q8_0 and F32 tensors): the index read back from beside the file is
  what parsing the header gives."""
  from redrafter_jax.weights import fetch

  path = fetch.ensure_model("smollm2-135m")
  read_index(path)  # saved beside the file, if it was not
  assert index_path(path).is_file()
  assert read_index(path) == gguf_file._parse(path)
