"""Drafter import/export: round trips per format and dtype, foreign layouts, PyTorch-written
checkpoints, the CLI, and every error path (type and a message naming the problem)."""

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from redrafter_jax import cli
from redrafter_jax.config import ConfigError, DecodeConfig, DrafterConfig, LlamaConfig
from redrafter_jax.models.drafter import TokenRanking, abstract_drafter, restrict_vocab
from redrafter_jax.weights import drafter_io
from redrafter_jax.weights.drafter_io import load_drafter, save_drafter
from redrafter_jax.weights.naming import WeightsError
from redrafter_jax.weights.params import flat_params, load_into

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

D, C, V = 16, 24, 37
CONFIGS = {
    "proj-rnn": DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=C, num_draft_layers=2),
    "noproj-nornn": DrafterConfig(vocab_size=V, hidden_size=D, num_draft_layers=1, rnn=False),
    "topk-3layers": DrafterConfig(vocab_size=V, hidden_size=D, exit_dim=C, num_draft_layers=3,
                                  logit_top_k=5),
}
REFERENCE_KEYS = {
    "input_proj.weight": (C, 2 * D), "input_proj.bias": (C,),
    "lm_head.0.linear.weight": (C, C), "lm_head.0.linear.bias": (C,),
    "lm_head.1.linear.weight": (C, C), "lm_head.1.linear.bias": (C,),
    "lm_head.2.weight": (V, C),
    "rnn_u.weight": (D, D), "rnn_u.bias": (D,), "rnn_w.weight": (D, D),
}


def random_drafter(cfg: DrafterConfig, seed: int = 0):
  """Every parameter drawn at random (ResBlocks are zero-initialised by the module itself)."""
  rng = np.random.default_rng(seed)
  arrays = {}
  for name, var in flat_params(abstract_drafter(cfg)).items():
    scale = 0.1 if name.endswith("bias") else 1.0 / np.sqrt(var.shape[0])
    arrays[name] = (scale * rng.normal(size=var.shape)).astype(np.float32)
  return load_into(abstract_drafter(cfg), arrays, dtype=jnp.float32, source="test")


def assert_same_params(got, want_arrays):
  got = {k: np.asarray(v) for k, v in flat_params(got).items()}
  assert set(got) == set(want_arrays)
  for name, value in want_arrays.items():
    np.testing.assert_array_equal(got[name], np.asarray(value), err_msg=name)


def _inputs(seed=1, rows=3):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=(rows, D)), jnp.float32) for _ in range(3)]


# ---------------------------------------------------------------------------------------------
# Round trips and file layout.


@pytest.mark.parametrize("fmt", drafter_io.FORMATS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_fp32_is_exact(tmp_path, fmt, name):
  cfg = CONFIGS[name]
  drafter = random_drafter(cfg, seed=3)
  out = save_drafter(drafter, tmp_path / "out", format=fmt)
  loaded = load_drafter(out)
  assert loaded.config == cfg
  assert_same_params(loaded, flat_params(drafter))
  # The weights file itself also names the folder.
  assert_same_params(load_drafter(next(out.glob("*.safetensors"))), flat_params(drafter))
  h, s, e = _inputs()
  np.testing.assert_array_equal(np.asarray(loaded.step(h, s, e)[0]),
                                np.asarray(drafter.step(h, s, e)[0]))


@pytest.mark.parametrize("fmt", drafter_io.FORMATS)
@pytest.mark.parametrize("dtype, jdtype", [("float16", jnp.float16), ("bfloat16", jnp.bfloat16),
                                           ("fp16", jnp.float16), ("bf16", jnp.bfloat16)])
def test_round_trip_low_precision_equals_the_cast(tmp_path, fmt, dtype, jdtype):
  drafter = random_drafter(CONFIGS["proj-rnn"], seed=4)
  out = save_drafter(drafter, tmp_path / "out", format=fmt, dtype=dtype)
  stored = load_file(str(next(out.glob("*.safetensors"))))
  assert {v.dtype for v in stored.values()} == {np.dtype(jdtype)}
  cast = {k: np.asarray(v.astype(jdtype).astype(jnp.float32))
          for k, v in flat_params(drafter).items()}
  assert_same_params(load_drafter(out), cast)  # widened back to float32, exactly
  native = load_drafter(out, dtype=jdtype)
  assert all(v.dtype == jdtype for v in flat_params(native).values())
  assert_same_params(native, {k: v.astype(jdtype) for k, v in cast.items()})


@pytest.mark.parametrize("fmt", ["reference", "mlx"])
def test_reference_layout_keys_shapes_and_config(tmp_path, fmt):
  cfg = CONFIGS["proj-rnn"]
  drafter = random_drafter(cfg)
  out = save_drafter(drafter, tmp_path / "out", format=fmt)
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  tensors = load_file(str(out / "model.safetensors"))
  assert {k: v.shape for k, v in tensors.items()} == REFERENCE_KEYS
  # PyTorch layout (out, in): the file holds our kernels transposed.
  params = flat_params(drafter)
  for theirs, ours in [("input_proj.weight", "input_proj.kernel"),
                       ("lm_head.2.weight", "lm_head.2.kernel")]:
    np.testing.assert_array_equal(tensors[theirs], np.asarray(params[ours]).T)
  assert json.loads((out / "config.json").read_text()) == {
      "model_type": "recurrent_drafting_drafter", "vocab_size": V, "hidden_size": D,
      "exit_dim": C, "num_draft_layers": 2, "rnn": True}
  # Our optional logit_top_k appears only when set; no input_proj when exit_dim == 2 * hidden.
  out2 = save_drafter(random_drafter(CONFIGS["noproj-nornn"]), tmp_path / "b", format=fmt)
  assert not any(k.startswith("input_proj") for k in load_file(str(out2 / "model.safetensors")))
  out3 = save_drafter(random_drafter(CONFIGS["topk-3layers"]), tmp_path / "c", format=fmt)
  assert json.loads((out3 / "config.json").read_text())["logit_top_k"] == 5


def test_trtllm_layout_keys_and_config(tmp_path):
  drafter = random_drafter(CONFIGS["proj-rnn"])
  out = save_drafter(drafter, tmp_path / "out", format="trtllm", dtype="float16")
  tensors = load_file(str(out / "rank0.safetensors"))
  want = {"drafter.input_proj.weight", "drafter.input_proj.bias", "drafter.layers.0.linear.weight",
          "drafter.layers.0.linear.bias", "drafter.layers.1.linear.weight",
          "drafter.layers.1.linear.bias", "drafter.lm_head.weight", "drafter.rnn_u.weight",
          "drafter.rnn_u.bias", "drafter.rnn_w.weight"}
  assert set(tensors) == want
  assert tensors["drafter.lm_head.weight"].shape == (V, C)
  config = json.loads((out / "config.json").read_text())
  assert {k: config[k] for k in ("redrafter_num_layers", "redrafter_hidden_size",
                                 "redrafter_exit_dim", "redrafter_is_rnn", "vocab_size")} == {
      "redrafter_num_layers": 2, "redrafter_hidden_size": D, "redrafter_exit_dim": C,
      "redrafter_is_rnn": True, "vocab_size": V}
  assert config["dtype"] == "float16"


# What TensorRT-LLM's examples/redrafter/convert_checkpoint.py reads from a drafter folder
# (--drafter_model_dir): config fields, then tensors by their reference names (n = layers).
TRTLLM_CONVERTER_CONFIG = ("hidden_size", "exit_dim", "num_draft_layers", "rnn")
TRTLLM_CONVERTER_TENSORS = ("input_proj.weight", "input_proj.bias", "lm_head.{i}.linear.weight",
                            "lm_head.{i}.linear.bias", "lm_head.{n}.weight", "rnn_u.weight",
                            "rnn_u.bias", "rnn_w.weight")


def test_reference_export_holds_what_trtllm_converter_reads(tmp_path):
  """The route to a TensorRT-LLM engine is the reference export + TensorRT-LLM's converter."""
  cfg = CONFIGS["proj-rnn"]
  out = save_drafter(random_drafter(cfg), tmp_path / "out", format="reference")
  config = json.loads((out / "config.json").read_text())
  assert all(k in config for k in TRTLLM_CONVERTER_CONFIG)
  n = cfg.num_draft_layers
  want = {name.format(i=i, n=n) for name in TRTLLM_CONVERTER_TENSORS for i in range(n)}
  assert set(load_file(str(out / "model.safetensors"))) == want


def test_trtllm_export_is_the_drafter_part_only(tmp_path):
  """No base model and no engine build fields: TensorRT-LLM's converter writes those."""
  out = save_drafter(random_drafter(CONFIGS["proj-rnn"]), tmp_path / "out", format="trtllm")
  config = json.loads((out / "config.json").read_text())
  for field in ("redrafter_num_beams", "redrafter_draft_len_per_beam", "redrafter_greedy_search",
                "num_hidden_layers", "base_model_architecture"):
    assert field not in config
  assert all(k.startswith("drafter.") for k in load_file(str(out / "rank0.safetensors")))


def test_trtllm_full_checkpoint_skips_base_model_tensors(tmp_path):
  drafter = random_drafter(CONFIGS["proj-rnn"])
  out = save_drafter(drafter, tmp_path / "out", format="trtllm")
  tensors = load_file(str(out / "rank0.safetensors"))
  tensors["transformer.vocab_embedding.weight"] = np.zeros((V, D), np.float32)
  tensors["lm_head.weight"] = np.zeros((V, D), np.float32)
  save_file(tensors, str(out / "rank0.safetensors"))
  config = json.loads((out / "config.json").read_text())
  config.update(hidden_size=D, num_hidden_layers=2, architecture="ReDrafterForCausalLM")
  (out / "config.json").write_text(json.dumps(config))
  assert_same_params(load_drafter(out), flat_params(drafter))


def _write_folder(folder, tensors, config):
  folder.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(folder / "model.safetensors"))
  (folder / "config.json").write_text(json.dumps(config))
  return folder


def _reference(tmp_path, name="proj-rnn", seed=0):
  drafter = random_drafter(CONFIGS[name], seed=seed)
  out = save_drafter(drafter, tmp_path / f"ref-{name}-{seed}")
  return drafter, load_file(str(out / "model.safetensors")), json.loads(
      (out / "config.json").read_text())


@pytest.mark.parametrize("rename", [
    {"lm_head.": "lm_heads.", "input_proj.": "input_projs."},  # lm_heads.* layout
    {"lm_head.": "lm_heads."},  # lm_heads.* with the singular input_proj
    {"lm_head.": "0."},  # a bare Sequential saved as module 0
])
def test_alternative_reference_layouts_import(tmp_path, rename):
  drafter, tensors, config = _reference(tmp_path)
  renamed = {}
  for key, value in tensors.items():
    for old, new in rename.items():
      if key.startswith(old):
        key = new + key[len(old):]
    renamed[key] = value
  assert set(renamed) != set(tensors)
  folder = _write_folder(tmp_path / "alt", renamed, config)
  assert_same_params(load_drafter(folder), flat_params(drafter))


def test_reference_config_fields_from_transformers_are_accepted(tmp_path):
  """The reference's config.json (a transformers PretrainedConfig) carries extra fields."""
  drafter, tensors, config = _reference(tmp_path)
  config.update(architectures=["Drafter"], torch_dtype="float32", transformers_version="4.41.0",
                num_lookback_tokens=-1)
  folder = _write_folder(tmp_path / "hf", tensors, config)
  assert_same_params(load_drafter(folder), flat_params(drafter))
  # A config without ``rnn`` takes it from the tensors present.
  del config["rnn"]
  folder = _write_folder(tmp_path / "no-rnn-field", tensors, config)
  assert load_drafter(folder).config.rnn is True


# ---------------------------------------------------------------------------------------------
# A checkpoint written by PyTorch with the reference's module names.


def _torch_drafter(drafter):
  """A torch module tree named like the reference's PyTorch drafter, holding ``drafter``'s
  weights (copied through torch's own (out, in) Linear layout), and its forward in torch."""
  import torch

  cfg = drafter.config
  p = {k: torch.from_numpy(np.asarray(v).copy()) for k, v in flat_params(drafter).items()}

  def linear(i, o, kernel, bias=None):
    layer = torch.nn.Linear(i, o, bias=bias is not None)
    with torch.no_grad():
      layer.weight.copy_(kernel.T)
      if bias is not None:
        layer.bias.copy_(bias)
    return layer

  class Block(torch.nn.Module):

    def __init__(self, i):
      super().__init__()
      self.linear = linear(C, C, p[f"lm_head.{i}.linear.kernel"], p[f"lm_head.{i}.linear.bias"])

    def forward(self, x):
      return x + torch.nn.functional.silu(self.linear(x))

  class TorchDrafter(torch.nn.Module):

    def __init__(self):
      super().__init__()
      self.input_proj = linear(2 * D, C, p["input_proj.kernel"], p["input_proj.bias"])
      n = cfg.num_draft_layers
      self.lm_head = torch.nn.Sequential(*[Block(i) for i in range(n)],
                                         linear(C, V, p[f"lm_head.{n}.kernel"]))
      self.rnn_u = linear(D, D, p["rnn_u.kernel"], p["rnn_u.bias"])
      self.rnn_w = linear(D, D, p["rnn_w.kernel"])

    def step(self, h, s, e):
      s = torch.nn.functional.silu(self.rnn_w(e) + self.rnn_u(s))
      logits = self.lm_head(self.input_proj(torch.cat([h, s], dim=-1)))
      return torch.log_softmax(logits, dim=-1), s

  return TorchDrafter()


def test_pytorch_saved_reference_checkpoint_imports_with_identical_outputs(tmp_path):
  import torch
  from safetensors.torch import save_file as torch_save_file

  cfg = CONFIGS["proj-rnn"]
  original = random_drafter(cfg, seed=5)
  module = _torch_drafter(original)
  folder = tmp_path / "torch"
  folder.mkdir()
  torch_save_file(module.state_dict(), str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(
      dict(model_type="recurrent_drafting_drafter", vocab_size=V, hidden_size=D, exit_dim=C,
           num_draft_layers=2, num_lookback_tokens=-1, rnn=True)))
  assert set(load_file(str(folder / "model.safetensors"))) == set(REFERENCE_KEYS)
  imported = load_drafter(folder)
  assert_same_params(imported, flat_params(original))
  h, s, e = _inputs(seed=7)
  with torch.no_grad():
    want_logp, want_s = module.step(*(torch.from_numpy(np.array(x)) for x in (h, s, e)))
  got_logp, got_s = imported.step(h, s, e)
  np.testing.assert_allclose(np.asarray(got_logp), want_logp.numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(got_s), want_s.numpy(), atol=1e-5, rtol=1e-5)


def test_pytorch_saved_drafter_decodes_identically(tmp_path):
  """Decoding with the imported drafter equals decoding with the original, token for token and
  step for step (greedy and sampled: sampled outputs depend on every drafted beam)."""
  from flax import nnx
  from safetensors.torch import save_file as torch_save_file

  from redrafter_jax.inference.decode import decode
  from redrafter_jax.models.llama import Llama

  llm_cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=4, tie_word_embeddings=True,
                        max_position_embeddings=256)
  llm = Llama(llm_cfg, rngs=nnx.Rngs(0))
  original = random_drafter(CONFIGS["proj-rnn"], seed=6)
  folder = tmp_path / "torch"
  folder.mkdir()
  torch_save_file(_torch_drafter(original).state_dict(), str(folder / "model.safetensors"))
  (folder / "config.json").write_text(json.dumps(CONFIGS["proj-rnn"].to_dict()))
  imported = load_drafter(folder)
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
  results = {}
  for temperature in (0.0, 1.0):
    cfg = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=24, temperature=temperature)
    want = decode(llm, original, prompts, cfg, seed=11)
    got = decode(llm, imported, prompts, cfg, seed=11)
    assert got.tokens == want.tokens
    assert got.metrics == want.metrics
    assert sum(len(t) for t in got.tokens) == 48
    results[temperature] = (cfg, got)
  # The comparison can fail: a drafter differing in one tensor samples a different output.
  arrays = {k: np.asarray(v) for k, v in flat_params(original).items()}
  arrays["rnn_u.bias"] = arrays["rnn_u.bias"] + 0.5
  other = load_into(abstract_drafter(original.config), arrays, dtype=jnp.float32, source="test")
  cfg, got = results[1.0]
  assert decode(llm, other, prompts, cfg, seed=11).tokens != got.tokens


# ---------------------------------------------------------------------------------------------
# Compact head: only the draft vocabulary's rows are written.


def ranked_drafter(cfg: DrafterConfig, rows: int, seed: int = 0):
  """A random drafter with a shuffled token ranking whose head rows outside the ``rows``
  top-ranked tokens are zero, as the trainer leaves them with ``train.vocab_limit``."""
  drafter = random_drafter(cfg, seed=seed)
  ranking_V = np.random.default_rng(seed + 100).permutation(cfg.vocab_size).astype(np.int32)
  drafter.token_ranking = TokenRanking(jnp.asarray(ranking_V))
  head = drafter.lm_head[-1]
  keep_V = np.zeros((cfg.vocab_size,), bool)
  keep_V[ranking_V[:rows]] = True
  head.kernel.set_value(jnp.where(jnp.asarray(keep_V)[None, :], head.kernel[...], 0))
  return drafter


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["proj-rnn", "noproj-nornn"])
def test_compact_head_round_trip_is_the_same_drafter(tmp_path, name, dtype):
  cfg, R = CONFIGS[name], 11
  drafter = ranked_drafter(cfg, R, seed=4)
  out = save_drafter(drafter, tmp_path / "out", dtype=dtype, head_rows=R)
  tensors = load_file(str(out / "model.safetensors"))
  n = cfg.num_draft_layers
  assert tensors[f"lm_head.{n}.weight"].shape == (R, cfg.exit_dim)
  assert json.loads((out / "config.json").read_text())["head_rows"] == R
  loaded = load_drafter(out)
  assert loaded.config == cfg
  cast = {k: np.asarray(jnp.asarray(v, dtype).astype(jnp.float32))
          for k, v in flat_params(drafter).items()}
  assert_same_params(loaded, cast)
  np.testing.assert_array_equal(loaded.token_ranking[...], drafter.token_ranking[...])
  # What decoding uses, the head restricted to the draft vocabulary, is the same too.
  h, s, e = _inputs()
  want = restrict_vocab(load_drafter(save_drafter(drafter, tmp_path / "full", dtype=dtype)), R)
  got = restrict_vocab(loaded, R)
  np.testing.assert_array_equal(got.vocab_ids[...], want.vocab_ids[...])
  np.testing.assert_array_equal(got.logits(h, got.recur(got.init_state(h), e)),
                                want.logits(h, want.recur(want.init_state(h), e)))
  # Full again: a compact folder re-exports to the full reference layout.
  full = save_drafter(loaded, tmp_path / "again", dtype=dtype)
  assert load_file(str(full / "model.safetensors"))[f"lm_head.{n}.weight"].shape == (
      cfg.vocab_size, cfg.exit_dim)


def test_compact_head_refuses_what_it_would_lose(tmp_path):
  cfg = CONFIGS["proj-rnn"]
  drafter = ranked_drafter(cfg, 11)
  with pytest.raises(ConfigError, match=r"2 of the other 26 rows are not zero"):
    save_drafter(ranked_drafter(cfg, 13), tmp_path / "a", head_rows=11)
  for bad in (-1, V, V + 5):
    with pytest.raises(ConfigError, match="head_rows must be in 1..36"):
      save_drafter(drafter, tmp_path / "b", head_rows=bad)
  for fmt in ("mlx", "trtllm"):
    with pytest.raises(ConfigError, match=f"the {fmt} format needs the full head"):
      save_drafter(drafter, tmp_path / "c", format=fmt, head_rows=11)
  assert not any(tmp_path.iterdir())


def test_compact_head_folder_errors(tmp_path):
  cfg = CONFIGS["proj-rnn"]
  out = save_drafter(ranked_drafter(cfg, 11), tmp_path / "out", head_rows=11)
  config = json.loads((out / "config.json").read_text())
  for bad in (-2, "11", 11.0, True, V):
    (out / "config.json").write_text(json.dumps(dict(config, head_rows=bad)))
    _expect(ConfigError, out, "head_rows must be an integer", repr(bad))
  (out / "config.json").write_text(json.dumps(dict(config, head_rows=12)))
  _expect(WeightsError, out, "'lm_head.2.weight'", "(11, 24)", "(12, 24)")
  (out / "config.json").write_text(json.dumps(config))
  (out / "token_ranking.json").unlink()
  _expect(WeightsError, out, "token_ranking.json", "11 top-ranked")


# ---------------------------------------------------------------------------------------------
# Error paths.


def _expect(exc, folder, *needles):
  with pytest.raises(exc) as info:
    load_drafter(folder)
  for needle in needles:
    assert needle in str(info.value), (needle, str(info.value))


def test_unknown_tensor_name(tmp_path):
  _, tensors, config = _reference(tmp_path)
  tensors["lm_head.0.linear.weights"] = tensors["lm_head.0.linear.weight"]
  _expect(WeightsError, _write_folder(tmp_path / "x", tensors, config),
          "lm_head.0.linear.weights", "unknown")


def test_missing_tensor(tmp_path):
  _, tensors, config = _reference(tmp_path)
  del tensors["rnn_w.weight"]
  _expect(WeightsError, _write_folder(tmp_path / "x", tensors, config), "missing",
          "rnn_w.weight")


def test_wrong_shape(tmp_path):
  _, tensors, config = _reference(tmp_path)
  tensors["lm_head.2.weight"] = np.zeros((V + 1, C), np.float32)
  _expect(WeightsError, _write_folder(tmp_path / "x", tensors, config), "'lm_head.2.weight'",
          f"({V + 1}, {C})", f"({V}, {C})")
  # A kernel stored (in, out) instead of PyTorch's (out, in).
  _, tensors, config = _reference(tmp_path, seed=1)
  tensors["input_proj.weight"] = tensors["input_proj.weight"].T.copy()
  _expect(WeightsError, _write_folder(tmp_path / "y", tensors, config), "'input_proj.weight'",
          f"({2 * D}, {C})")


@pytest.mark.parametrize("change, needles", [
    ({"num_draft_layers": 3}, ["num_draft_layers=3", "lm_head.2.linear.weight"]),
    ({"vocab_size": V + 5}, ["vocab_size=" + str(V + 5), "lm_head.2.weight"]),
    ({"rnn": False}, ["rnn=False", "rnn_u.weight"]),
    ({"exit_dim": 2 * D}, ["exit_dim=" + str(2 * D), "input_proj.weight"]),
])
def test_config_does_not_match_tensors(tmp_path, change, needles):
  _, tensors, config = _reference(tmp_path)
  _expect(WeightsError, _write_folder(tmp_path / "x", tensors, config | change), *needles)


@pytest.mark.parametrize("config, exc, needles", [
    ({"vocab_size": V, "hidden_size": D, "exit_dim": C, "num_draft_layers": 2, "rnn": True,
      "num_heads": 4}, ConfigError, ["num_heads"]),
    ({"hidden_size": D, "exit_dim": C, "num_draft_layers": 2, "rnn": True}, ConfigError,
     ["vocab_size"]),
    ({"model_type": "llama", "vocab_size": V, "hidden_size": D}, WeightsError,
     ["model_type", "llama"]),
    ({"redrafter_num_layers": 2, "redrafter_hidden_size": D, "vocab_size": V}, ConfigError,
     ["redrafter_exit_dim", "redrafter_is_rnn"]),
])
def test_bad_config(tmp_path, config, exc, needles):
  _, tensors, _ = _reference(tmp_path)
  _expect(exc, _write_folder(tmp_path / "x", tensors, config), *needles)


def test_missing_or_unreadable_files(tmp_path):
  _, tensors, config = _reference(tmp_path)
  folder = _write_folder(tmp_path / "x", tensors, config)
  (folder / "config.json").unlink()
  _expect(WeightsError, folder, "config.json")
  folder = _write_folder(tmp_path / "y", tensors, config)
  (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
  _expect(WeightsError, folder, "model.safetensors", "sharded")
  folder = _write_folder(tmp_path / "z", tensors, config)
  (folder / "model.safetensors").write_bytes(b"not a safetensors file")
  _expect(WeightsError, folder, "model.safetensors", "not a readable safetensors")
  (folder / "config.json").write_text("{oops")
  _expect(ConfigError, folder, "config.json", "invalid JSON")
  _expect(FileNotFoundError, tmp_path / "nowhere", "nowhere")


def test_two_names_for_one_parameter(tmp_path):
  _, tensors, config = _reference(tmp_path)
  renamed = {("lm_heads." + k[len("lm_head."):] if k.startswith("lm_head.") else k): v
             for k, v in tensors.items()}
  renamed["input_projs.weight"] = renamed["input_proj.weight"]
  _expect(WeightsError, _write_folder(tmp_path / "x", renamed, config), "input_proj.weight",
          "input_projs.weight", "same parameter")


def test_save_refuses_non_empty_folder_and_bad_arguments(tmp_path):
  drafter = random_drafter(CONFIGS["proj-rnn"])
  out = tmp_path / "out"
  out.mkdir()
  save_drafter(drafter, out)  # an empty folder is fine
  with pytest.raises(FileExistsError, match=r"out is not empty.*overwrite"):
    save_drafter(drafter, out)
  (tmp_path / "file").write_text("x")
  with pytest.raises(FileExistsError, match="not a folder"):
    save_drafter(drafter, tmp_path / "file")
  with pytest.raises(ConfigError, match="'onnx'"):
    save_drafter(drafter, tmp_path / "o2", format="onnx")
  with pytest.raises(ConfigError, match="'int8'"):
    save_drafter(drafter, tmp_path / "o3", dtype="int8")
  assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_overwrite_replaces_the_whole_folder(tmp_path):
  out = save_drafter(random_drafter(CONFIGS["proj-rnn"], seed=1), tmp_path / "out",
                     format="trtllm")
  new = random_drafter(CONFIGS["noproj-nornn"], seed=2)
  save_drafter(new, out, format="reference", overwrite=True)
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  assert_same_params(load_drafter(out), flat_params(new))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary siblings left


@pytest.mark.parametrize("fmt", drafter_io.FORMATS)
def test_export_files_get_the_umask_mode(tmp_path, fmt):
  """Exported files are as readable as any file the user creates (safetensors' own writer makes
  the weights 0600, which hid a shared export from the other users of a machine)."""
  import os
  import stat

  umask = os.umask(0o022)
  try:
    out = save_drafter(random_drafter(CONFIGS["proj-rnn"], seed=1), tmp_path / "out",
                       format=fmt)
  finally:
    os.umask(umask)
  modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
  assert modes and all(m == 0o644 for m in modes.values()), modes
  assert stat.S_IMODE(out.stat().st_mode) == 0o755


def test_failed_write_leaves_nothing_half_written(tmp_path, monkeypatch):
  old = random_drafter(CONFIGS["proj-rnn"], seed=1)
  out = save_drafter(old, tmp_path / "out")
  write_bytes = pathlib.Path.write_bytes

  def broken_write(self, data):
    if self.suffix != ".safetensors":
      return write_bytes(self, data)
    write_bytes(self, b"partial")
    raise OSError("disk full")

  monkeypatch.setattr(pathlib.Path, "write_bytes", broken_write)
  with pytest.raises(OSError, match="disk full"):
    save_drafter(random_drafter(CONFIGS["proj-rnn"], seed=2), out, overwrite=True)
  with pytest.raises(OSError, match="disk full"):
    save_drafter(old, tmp_path / "fresh")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
  monkeypatch.undo()
  assert_same_params(load_drafter(out), flat_params(old))  # the old export is intact


# ---------------------------------------------------------------------------------------------
# Command line.


def test_cli_export_and_import(tmp_path, capsys):
  drafter = random_drafter(CONFIGS["proj-rnn"], seed=8)
  src = save_drafter(drafter, tmp_path / "src", format="trtllm")
  assert cli.main(["export", "--drafter", str(src), "--format", "mlx", "--dtype", "bf16",
                   "--out", str(tmp_path / "mlx")]) == 0
  cast = {k: v.astype(jnp.bfloat16).astype(jnp.float32) for k, v in flat_params(drafter).items()}
  assert_same_params(load_drafter(tmp_path / "mlx"), cast)
  assert set(load_file(str(tmp_path / "mlx" / "model.safetensors"))) == set(REFERENCE_KEYS)

  # --head-rows: the compact head, read back as the same drafter.
  ranked = save_drafter(ranked_drafter(CONFIGS["proj-rnn"], 11, seed=8), tmp_path / "ranked")
  assert cli.main(["export", "--drafter", str(ranked), "--format", "reference", "--head-rows",
                   "11", "--out", str(tmp_path / "compact")]) == 0
  assert_same_params(load_drafter(tmp_path / "compact"), flat_params(load_drafter(ranked)))
  capsys.readouterr()
  assert cli.main(["export", "--drafter", str(ranked), "--head-rows", "11", "--out",
                   str(tmp_path / "compact-mlx")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "mlx format needs the full head" in err

  # import: a lm_heads.* checkpoint becomes our canonical reference folder.
  _, tensors, config = _reference(tmp_path, seed=9)
  alt = {k.replace("lm_head.", "lm_heads."): v for k, v in tensors.items()}
  _write_folder(tmp_path / "alt", alt, config)
  assert cli.main(["import", "--src", str(tmp_path / "alt"), "--out", str(tmp_path / "ref")]) == 0
  assert load_file(str(tmp_path / "ref" / "model.safetensors")).keys() == tensors.keys()
  capsys.readouterr()

  # Errors: one line, exit status 2.
  assert cli.main(["export", "--drafter", str(src), "--format", "mlx", "--out",
                   str(tmp_path / "mlx")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "--overwrite" in err and "\n" not in err
  del tensors["rnn_u.bias"]
  _write_folder(tmp_path / "broken", tensors, config)
  assert cli.main(["import", "--src", str(tmp_path / "broken"), "--out",
                   str(tmp_path / "r2")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and "rnn_u.bias" in err and "\n" not in err
  assert not (tmp_path / "r2").exists()
