"""A drafter's recorded decoding settings (decode.json) and how explicit settings override them."""

import json

import pytest

from redrafter_jax.config import ConfigError
from redrafter_jax.weights.base_model import load_base_model
from redrafter_jax.config import ConfigError
from redrafter_jax.weights.param_dtype import weights_dtype
from redrafter_jax.weights.shipped import recommended_config, resolve_drafter

RECORDED = {"beam_width": 2, "beam_length": 4, "lookup_ngram": 3, "token_budget": 5,
            "draft_vocab_size": 8192}


@pytest.fixture
def drafter_dir(tmp_path):
  (tmp_path / "decode.json").write_text(json.dumps(RECORDED))
  return tmp_path


def test_recorded_settings_are_the_defaults(drafter_dir):
  cfg = recommended_config(drafter_dir, max_new_tokens=64)
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.token_budget,
          cfg.draft_vocab_size, cfg.max_new_tokens) == (2, 4, 3, 5, 8192, 64)
  assert cfg.num_tree_tokens == 5


@pytest.mark.parametrize("override", [{"beam_width": 4}, {"beam_length": 5}, {"lookup_ngram": 0}])
def test_another_tree_verifies_all_of_it(drafter_dir, override):
  """The recorded budget was measured for the recorded tree; another W, L or lookup gets its
  whole tree unless a budget is given too."""
  cfg = recommended_config(drafter_dir, **override)
  assert cfg.token_budget is None
  W, L = cfg.beam_width, cfg.beam_length
  assert cfg.num_tree_tokens == (W + (cfg.lookup_ngram > 0)) * (L - 1) + 1


def test_explicit_budget_wins(drafter_dir):
  assert recommended_config(drafter_dir, token_budget=7).num_tree_tokens == 7
  assert recommended_config(drafter_dir, beam_width=4, token_budget=9).num_tree_tokens == 9


def test_bad_override_is_a_config_error(drafter_dir):
  with pytest.raises(ConfigError, match="token_budget"):
    recommended_config(drafter_dir, token_budget=99)
  with pytest.raises(ConfigError, match="beam_width"):
    recommended_config(drafter_dir, beam_width=0)


def test_folder_without_decode_json(tmp_path):
  cfg = recommended_config(tmp_path)
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.token_budget,
          cfg.draft_vocab_size) == (4, 5, 0, None, 0)


def test_shipped_settings_are_valid():
  """The shipped drafter's decode.json makes a valid config (its recorded tree and budget)."""
  cfg = recommended_config(resolve_drafter("shipped"))
  assert cfg.beam_width >= 1 and cfg.draft_vocab_size > 0


@pytest.mark.parametrize("name", ["smollm2_135m.yaml", "stages/smollm2_135m_finetune.yaml"])
def test_presets_decode_like_the_shipped_drafter(name):
  """The presets that trained the shipped drafter carry its recorded decoding settings."""
  import pathlib

  from redrafter_jax.config import load_preset

  root = pathlib.Path(__file__).resolve().parents[1]
  got = load_preset(root / "configs" / name).decode
  want = recommended_config(resolve_drafter("shipped"))
  for key in ("beam_width", "beam_length", "lookup_ngram", "token_budget", "draft_vocab_size"):
    assert getattr(got, key) == getattr(want, key), key


def test_param_dtype_is_recorded_and_overridable(tmp_path, drafter_dir, monkeypatch):
  """The LLM weight precision the settings record: the recorded one, an explicit one, float32
  without a record, and "auto" (the shipped drafter's) as the platform's faster weights."""
  from redrafter_jax.models import linear

  (drafter_dir / "decode.json").write_text(json.dumps({**RECORDED, "param_dtype": "bfloat16"}))
  assert weights_dtype(drafter=drafter_dir) == "bfloat16"
  assert weights_dtype("float32", drafter=drafter_dir) == "float32"
  assert weights_dtype(drafter=tmp_path / "nowhere") == "float32"
  assert weights_dtype() == "float32"  # nothing asked, no drafter: the activations' dtype
  assert weights_dtype(dtype="bfloat16") == "bfloat16"
  shipped = json.loads((resolve_drafter("shipped") / "decode.json").read_text())
  assert shipped["param_dtype"] == "auto"
  for bf16, want in ((True, "bfloat16"), (False, "float32")):
    monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: bf16)
    assert weights_dtype(drafter=resolve_drafter("shipped")) == want == (
        linear.preferred_param_dtype(cpu=True))
    assert weights_dtype("auto", drafter=drafter_dir) == want
    # one rule for every entry point: "auto" under float32 activations, else the activations'
    assert weights_dtype("auto") == want
    assert weights_dtype("auto", dtype="bfloat16") == "bfloat16"
    assert weights_dtype(drafter=resolve_drafter("shipped"), dtype="bfloat16") == "bfloat16"
    llm, _ = load_base_model("random:tiny", param_dtype="auto")
    assert llm.embed_tokens.embedding[...].dtype == want
  assert linear.preferred_param_dtype(cpu=False) == "bfloat16"


def test_unknown_recorded_param_dtype_is_a_clear_error(drafter_dir):
  (drafter_dir / "decode.json").write_text(json.dumps({**RECORDED, "param_dtype": "fp8"}))
  with pytest.raises(ConfigError, match=r"decode.json: param_dtype must be one of .*'fp8'"):
    weights_dtype(drafter=drafter_dir)
  with pytest.raises(ConfigError, match=r"^param_dtype must be one of .*'fp16'"):
    weights_dtype("fp16", drafter=drafter_dir)


def test_bf16_instructions_are_read_from_the_cpu_flags(tmp_path):
  from redrafter_jax.models.linear import cpu_has_bf16_matmul

  info = tmp_path / "cpuinfo"
  for flags, want in (("fpu avx2 avx512f amx_tile", False),  # AMX tiles alone: no bf16 unit
                      ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True)):
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\nbugs\t\t: avx512_bf16x\n")
    assert cpu_has_bf16_matmul(str(info)) == want, flags
  info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")  # aarch64
  assert cpu_has_bf16_matmul(str(info))
  info.write_text("model name\t: bf16 avx512_bf16 in a name\nflags\t\t: fpu sse\n")
  assert not cpu_has_bf16_matmul(str(info))
  assert not cpu_has_bf16_matmul(str(tmp_path / "missing"))
