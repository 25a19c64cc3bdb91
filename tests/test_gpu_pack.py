"""``bench gpu_pack``: our NumPy dequantizer equals the gguf package's on random blocks, and a
pack of the real GGUF unpacks into a folder whose weights equal the GGUF reader's."""

import numpy as np
import pytest

from redrafter_jax.bench import gpu_pack


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "F16", "F32"])
def test_dequantize_matches_gguf(kind):
  import gguf

  qtype = getattr(gguf.GGMLQuantizationType, kind)
  rng = np.random.default_rng(0)
  w = rng.standard_normal((6, 64)).astype(np.float32)
  raw = gguf.quants.quantize(w, qtype)
  want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(6, 64)
  got = gpu_pack.dequantize(np.asarray(raw).tobytes(), kind, (6, 64))
  np.testing.assert_array_equal(got, want)
  if kind == "Q4_1":  # a real check: 4-bit weights are far from the floats, but close
    assert 0 < np.abs(got - w).max() < 0.5


def test_unsupported_type_is_a_clear_error():
  with pytest.raises(ValueError, match="unsupported GGUF tensor type Q6_K"):
    gpu_pack.dequantize(b"\0" * 210, "Q6_K", (256,))


@pytest.mark.slow
def test_pack_unpack_round_trip_equals_the_gguf_reader(tmp_path, smollm2):
  from redrafter_jax.weights.llama_weights import read_llama, load_llama

  parts = gpu_pack.pack("smollm2-135m", tmp_path / "pack", part_mib=20)
  assert len(parts) >= 5 and all(p.stat().st_size <= 20 * 2 ** 20 for p in parts)
  with pytest.raises(FileNotFoundError, match="have not arrived"):
    parts[-1].rename(tmp_path / "away")
    gpu_pack.unpack(tmp_path / "pack", tmp_path / "model")
  (tmp_path / "away").rename(parts[-1])
  tensors = gpu_pack.unpack(tmp_path / "pack", tmp_path / "model")
  _, want, _ = read_llama("smollm2-135m")
  assert tensors.keys() == want.keys()
  for name, w in want.items():
    np.testing.assert_array_equal(tensors[name], w, err_msg=name)
  model, _ = load_llama(tmp_path / "model")
  assert (tmp_path / "model" / "tokenizer.json").is_file()
  assert len(gpu_pack.plan(tmp_path / "pack")) == len(parts)
