"""``redrafter-jax generate``: prints what the library generates, and bad arguments give one
``error: ...`` line with exit status 2."""

import re

import pytest

import tiny_models
from redrafter_jax.cli import main
from redrafter_jax.inference.ar import generate
from redrafter_jax.weights.llama_weights import load_llama
from redrafter_jax.weights.tokenizer import encode, load_tokenizer, stop_token_ids


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  """A tiny random Llama (context 256) with a word-level tokenizer and chat template."""
  folder = tiny_models.save(tiny_models.hf_model("llama", seed=5),
                            tmp_path_factory.mktemp("cli") / "tiny")
  return tiny_models.save_tokenizer(folder)


def cli(capsys, *argv):
  rc = main(["generate", *map(str, argv)])
  out, err = capsys.readouterr()
  return rc, out, err


def expected_text(folder, prompt, chat=False, param_dtype=None, **kwargs):
  """What the library generates with the weights ``generate`` loads by default (no drafter:
  "auto", ``weights.param_dtype.weights_dtype``)."""
  import jax.numpy as jnp

  from redrafter_jax.weights.param_dtype import weights_dtype

  model, _ = load_llama(folder, param_dtype=jnp.dtype(param_dtype or weights_dtype("auto")))
  tok = load_tokenizer(folder)
  ids = encode(tok, prompt, chat=chat)
  stop = stop_token_ids(tok)
  tokens = generate(model, [ids], stop_ids=stop, **kwargs).tokens[0]
  return tok.decode([t for t in tokens if t not in stop], skip_special_tokens=True)


def test_greedy_output_matches_the_library(folder, capsys):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", 12)
  assert rc == 0, err
  assert out.strip() == expected_text(folder, "w1 w2 w3", max_new_tokens=12)
  assert out.strip()  # the tiny model writes words, not nothing
  speed = err.strip().splitlines()[-1]
  assert re.search(r"first call [\d.]+ s \(incl\. compile\) = [\d.]+ tok/s", speed), speed
  assert re.search(r"steady state [\d.]+ s = [\d.]+ tok/s", speed), speed


def test_chat_sampling_is_seeded(folder, capsys):
  args = ["--model", folder, "--prompt", "w7 w8", "--chat", "--temperature", 1.0, "--top-p", 0.9,
          "--top-k", 50, "--max-new-tokens", 10, "--runs", 1]
  rc1, out1, _ = cli(capsys, *args, "--seed", 1)
  rc2, out2, _ = cli(capsys, *args, "--seed", 1)
  rc3, out3, _ = cli(capsys, *args, "--seed", 2)
  assert rc1 == rc2 == rc3 == 0
  assert out1 == out2 != out3
  assert out1.strip() == expected_text(folder, "w7 w8", chat=True, max_new_tokens=10,
                                       temperature=1.0, top_p=0.9, top_k=50, seed=1)


def test_bfloat16_runs(folder, capsys):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1", "--dtype", "bfloat16",
                     "--max-new-tokens", 4, "--runs", 1)
  assert rc == 0, err
  assert len(out.split()) >= 1


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "   "], "--prompt is empty"),
    (["--prompt", "w1", "--temperature", "-0.5"], "temperature must be >= 0"),
    (["--prompt", "w1", "--top-p", "0"], "top_p must be in"),
    (["--prompt", "w1", "--top-k", "-3"], "top_k must be >= 0"),
    (["--prompt", "w1", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "w1", "--runs", "0"], "--runs must be >= 1"),
    (["--prompt", "w1", "--system", "be brief"], "--system needs --chat"),
    (["--prompt", "w1", "--model", "no-such-model"], "'no-such-model' is neither a known name"),
    (["--prompt", " ".join(["w3"] * 200), "--max-new-tokens", "100", "--model", "{folder}"],
     r"prompt \(200 tokens\) \+ max_new_tokens \(100\).*exceeds the model's context of 256"),
    (["--prompt", "w1", "--model", "{folder}", "--backend", "cudnn"],
     "'cudnn' needs an NVIDIA GPU"),
])
def test_bad_arguments_are_one_error_line(folder, capsys, argv, message):
  import jax

  if "cudnn" in argv and jax.default_backend() == "gpu":
    pytest.skip("cudnn is available on this machine")
  argv = [a.replace("{folder}", str(folder)) for a in argv]
  rc, out, err = cli(capsys, *argv)
  assert rc == 2
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), err
  assert re.search(message, lines[0]), lines[0]
  assert out == ""


def test_unknown_dtype_is_rejected_by_the_parser(capsys):
  with pytest.raises(SystemExit) as e:
    main(["generate", "--prompt", "w1", "--dtype", "float8"])
  assert e.value.code == 2
  assert "invalid choice: 'float8'" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_chat(smollm2, capsys):
  model, _, tok = smollm2
  prompt = "What is the capital of France? Answer in one word."
  rc, out, err = cli(capsys, "--prompt", prompt, "--chat", "--max-new-tokens", 16, "--runs", 1)
  assert rc == 0, err
  ids = encode(tok, prompt, chat=True)
  stop = stop_token_ids(tok)
  tokens = generate(model, [ids], max_new_tokens=16, stop_ids=stop).tokens[0]
  assert out.strip() == tok.decode([t for t in tokens if t not in stop],
                                   skip_special_tokens=True).strip()
  assert "Paris" in out


@pytest.fixture(scope="module")
def drafter_folder(folder, tmp_path_factory):
  """A random drafter for the tiny model, saved in the reference format."""
  from flax import nnx

  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.drafter import Drafter
  from redrafter_jax.weights.drafter_io import save_drafter

  model, cfg = load_llama(folder)
  d = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, exit_dim=24),
              rngs=nnx.Rngs(0))
  return save_drafter(d, tmp_path_factory.mktemp("drafter") / "d")


def test_redrafter_greedy_prints_the_ar_text(folder, drafter_folder, capsys):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", 12,
                     "--drafter", drafter_folder, "--beam-width", 3, "--beam-length", 4)
  assert rc == 0, err
  assert out.strip() == expected_text(folder, "w1 w2 w3", max_new_tokens=12)
  speed = err.strip().splitlines()[-1]
  assert speed.startswith("redrafter W=3 L=4:"), speed
  assert re.search(r"tokens/step [\d.]+", speed), speed


@pytest.mark.parametrize("argv,message", [
    (["--beam-width", 0], "beam_width must be an integer >= 1"),
    (["--beam-length", 1], "beam_length must be an integer >= 2"),
    (["--beam-width", 4, "--beam-length", 5, "--token-budget", 3], "token_budget must be in"),
    (["--draft-vocab", 2, "--beam-width", 4], "draft_vocab_size (2) must be >= beam_width"),
])
def test_bad_beam_settings_are_one_error_line(folder, drafter_folder, capsys, argv, message):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1", "--drafter", drafter_folder,
                     *argv)
  assert rc == 2 and out == ""
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_missing_drafter_is_one_error_line(folder, capsys, tmp_path):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1", "--drafter", tmp_path / "nope")
  assert rc == 2 and err.strip().startswith("error: drafter not found")


@pytest.mark.slow
def test_demo_runs_the_shipped_drafter_and_matches_ar(capsys):
  """``make demo``'s command on the real model: prints the answer, both speeds, tokens/step,
  and that ReDrafter's greedy text is AR's."""
  rc = main(["demo", "--max-new-tokens", "24", "--prompt", "Write a Python function that adds "
             "two numbers."])
  out = capsys.readouterr().out
  assert rc == 0
  assert "def " in out  # the model's answer is printed
  assert re.search(r"AR [0-9.]+ tok/s \| ReDrafter [0-9.]+ tok/s, [0-9.]+ tokens/step", out)
  assert "ReDrafter output identical to AR greedy: yes" in out


# ----------------------------------------------------------------------------- defaults that pay


@pytest.fixture
def used(monkeypatch):
  """What ``generate`` really ran: every ``DecodeConfig`` a ReDrafter was built with and every
  weight dtype an LLM was loaded in."""
  from redrafter_jax.inference import decode
  from redrafter_jax.weights import llama_weights

  seen = {"configs": [], "param_dtypes": []}

  class Recording(decode.ReDrafter):
    def __init__(self, llm, drafter, cfg, *a, **kw):
      seen["configs"].append(cfg)
      super().__init__(llm, drafter, cfg, *a, **kw)

  load = llama_weights.load_llama

  def recording_load(*a, **kw):
    seen["param_dtypes"].append(str(kw.get("param_dtype")))
    return load(*a, **kw)

  monkeypatch.setattr(decode, "ReDrafter", Recording)
  monkeypatch.setattr(llama_weights, "load_llama", recording_load)
  return seen


@pytest.fixture(scope="module")
def recorded_drafter(drafter_folder, tmp_path_factory):
  """The random drafter with a decode.json that records a tree, a vocabulary and weights."""
  import json
  import shutil

  folder = tmp_path_factory.mktemp("recorded") / "d"
  shutil.copytree(drafter_folder, folder)
  (folder / "decode.json").write_text(json.dumps(dict(
      beam_width=2, beam_length=3, lookup_ngram=2, token_budget=4, draft_vocab_size=64,
      param_dtype="bfloat16")))
  return folder


def settings_line(err):
  return next(line for line in err.splitlines() if line.startswith("settings: "))


def test_drafter_recorded_settings_are_the_defaults(folder, recorded_drafter, used, capsys):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", 10,
                     "--runs", 1, "--drafter", recorded_drafter)
  assert rc == 0, err
  (cfg,) = used["configs"]
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.num_tree_tokens,
          cfg.draft_vocab_size) == (2, 3, 2, 4, 64)
  assert used["param_dtypes"] == ["bfloat16"]
  assert settings_line(err) == ("settings: float32 activations, bfloat16 weights; ReDrafter "
                                "W=2 L=3 lookup=2 N=4 draft vocab=64 (tree: the drafter's "
                                "decode.json)")
  assert err.strip().splitlines()[-1].startswith("redrafter W=2 L=3 + lookup 2:")
  assert out.strip() == expected_text(folder, "w1 w2 w3", max_new_tokens=10,
                                      param_dtype="bfloat16")  # greedy ReDrafter = AR


@pytest.fixture
def timed_drafter(recorded_drafter, tmp_path, monkeypatch):
  """``recorded_drafter`` with an acceptance table (tree 2x3 at 1.5 tokens/step), the per-device
  timing cache in ``tmp_path`` and step times set by the test: ``set_times(tree_s, ar_s)``."""
  import shutil

  from redrafter_jax.inference import tree_choice

  folder = tmp_path / "d"
  shutil.copytree(recorded_drafter, folder)
  tree_choice.write_acceptance(folder, {"2x3": dict(tokens_per_step=1.5, steps=4, tokens=6)}, {})
  monkeypatch.setattr(tree_choice, "timing_cache", lambda root=None: tmp_path / "trees")
  times = {}

  def time_steps(llm, drafter, candidates, **kwargs):
    return {**{b.text: times["tree"] for b in candidates}, "ar": times["ar"]}

  monkeypatch.setattr(tree_choice, "time_steps", time_steps)
  return folder, lambda tree_s, ar_s: times.update(tree=tree_s, ar=ar_s)


def test_auto_tree_is_the_default_and_runs_when_it_pays(folder, timed_drafter, used, capsys):
  drafter, set_times = timed_drafter
  set_times(0.010, 0.010)  # 1.5 tokens per step at AR's step time: predicted 1.5x
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", 10,
                     "--runs", 1, "--drafter", drafter)
  assert rc == 0, err
  (cfg,) = used["configs"]
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram) == (2, 3, 0)
  assert "(tree: fastest on this device)" in settings_line(err)
  assert "predicted faster than AR" not in err
  assert out.strip() == expected_text(folder, "w1 w2 w3", max_new_tokens=10,
                                      param_dtype="bfloat16")


def test_auto_decodes_with_ar_where_no_tree_pays(folder, timed_drafter, used, capsys):
  """A tree predicted slower than AR (here 1.5 tokens per step at 5x AR's step time) is not
  run: greedy ReDrafter gives AR's tokens, so AR is the faster way to the same text."""
  drafter, set_times = timed_drafter
  set_times(0.050, 0.010)
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", 10,
                     "--runs", 1, "--drafter", drafter)
  assert rc == 0, err
  assert used["configs"] == []  # no ReDrafter was built
  assert ("no draft tree is predicted faster than AR here (best tree 2x3, predicted 0.30x AR "
          "at batch 1): decoding with AR") in err
  assert settings_line(err) == "settings: float32 activations, bfloat16 weights; AR"
  assert err.strip().splitlines()[-1].startswith("ar: ")
  assert out.strip() == expected_text(folder, "w1 w2 w3", max_new_tokens=10,
                                      param_dtype="bfloat16")
  # asked for a comparison, it runs the best tree beside AR all the same
  rc, _, err = cli(capsys, "--model", folder, "--prompt", "w1 w2 w3", "--max-new-tokens", 10,
                   "--runs", 1, "--drafter", drafter, "--compare-ar")
  assert rc == 0, err
  (cfg,) = used["configs"]
  assert (cfg.beam_width, cfg.beam_length) == (2, 3)
  assert "comparing AR with that tree, as asked" in err
  assert err.strip().splitlines()[-1].endswith("tokens identical")


def test_flags_override_the_recorded_settings(folder, recorded_drafter, used, capsys):
  from redrafter_jax.config import DecodeConfig

  rc, _, err = cli(capsys, "--model", folder, "--prompt", "w1 w2", "--max-new-tokens", 6,
                   "--runs", 1, "--drafter", recorded_drafter, "--beam-width", 3,
                   "--draft-vocab", 0, "--param-dtype", "float32")
  assert rc == 0, err
  (cfg,) = used["configs"]
  # W given: the recorded L and lookup stay, the recorded budget (of the recorded tree) goes.
  whole = DecodeConfig(beam_width=3, beam_length=3, lookup_ngram=2).num_tree_tokens
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.num_tree_tokens,
          cfg.draft_vocab_size) == (3, 3, 2, whole, 0)
  assert used["param_dtypes"] == ["float32"]
  assert "(tree: given)" in settings_line(err)


def test_without_decode_json_the_library_defaults_apply(folder, drafter_folder, used, capsys):
  from redrafter_jax.weights.param_dtype import weights_dtype

  rc, _, err = cli(capsys, "--model", folder, "--prompt", "w1", "--max-new-tokens", 4,
                   "--runs", 1, "--drafter", drafter_folder)
  assert rc == 0, err
  (cfg,) = used["configs"]
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.draft_vocab_size) == (4, 5, 0, 0)
  assert "(tree: the library's default)" in settings_line(err)
  # a drafter that records no weights: float32, as the server loads it
  assert used["param_dtypes"] == [weights_dtype(drafter=drafter_folder)] == ["float32"]


def test_param_dtype_auto_is_the_platforms_choice(folder, used, capsys):
  from redrafter_jax.models.linear import preferred_param_dtype

  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1 w2", "--max-new-tokens", 6,
                     "--runs", 1, "--param-dtype", "auto")
  assert rc == 0, err
  want = preferred_param_dtype()
  assert used["param_dtypes"] == [want]
  assert settings_line(err) == f"settings: float32 activations, {want} weights; AR"
  assert out.strip() == expected_text(folder, "w1 w2", max_new_tokens=6, param_dtype=want)


def test_compare_ar_prints_both_speeds_and_identical(folder, recorded_drafter, capsys):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w4 w5 w6", "--max-new-tokens", 12,
                     "--drafter", recorded_drafter, "--compare-ar")
  assert rc == 0, err
  assert out.strip() == expected_text(folder, "w4 w5 w6", max_new_tokens=12,
                                      param_dtype="bfloat16")
  lines = err.strip().splitlines()
  assert lines[-3].startswith("ar: ") and lines[-2].startswith("redrafter W=2 L=3 + lookup 2: ")
  m = re.fullmatch(r"compare \(steady state\): AR ([\d.]+) tok/s, ReDrafter ([\d.]+) tok/s = "
                   r"([\d.]+)x AR \| tokens identical", lines[-1])
  assert m, lines[-1]
  ar, rd, ratio = map(float, m.groups())
  assert ratio == pytest.approx(rd / ar, abs=0.02)


def test_compare_ar_says_when_sampled_tokens_differ():
  from redrafter_jax.commands.generate import Generation, comparison_line

  ar = (Generation(tokens=[1, 2, 3], stopped=False, forwards=3), [1.0])
  rd = (Generation(tokens=[1, 2, 4], stopped=False, forwards=2), [0.5])
  assert comparison_line(ar, rd, greedy=True) == (
      "compare (first call, incl. compile): AR 3.0 tok/s, ReDrafter 6.0 tok/s = 2.00x AR | "
      "tokens DIFFERENT")
  assert "tokens different (sampling" in comparison_line(ar, rd, greedy=False)


def test_compare_ar_needs_a_drafter(folder, capsys):
  rc, out, err = cli(capsys, "--model", folder, "--prompt", "w1", "--compare-ar")
  assert rc == 2 and out == ""
  assert err.strip() == "error: --compare-ar needs --drafter (e.g. --drafter shipped)"


def _options_without_their_default(parser) -> list[str]:
  """The options of ``parser`` that have a default (not None, False or empty) whose ``--help``
  text does not say it (argparse's %(default)s or a text naming it)."""
  import argparse

  formatter = parser._get_formatter()
  return [a.option_strings[0] for a in parser._actions
          if a.option_strings and not isinstance(a, argparse._HelpAction)
          and a.default is not None and a.default is not False
          and not (isinstance(a.default, (list, tuple, str)) and not a.default)
          and "default" not in (formatter._expand_help(a) if a.help else "")]


def test_every_command_help_shows_its_defaults(capsys):
  """Each option with a default says it in ``--help`` (argparse's %(default)s or a text)."""
  import argparse

  from redrafter_jax import cli as cli_module

  missing = []
  for name, module in cli_module._available().items():
    if isinstance(module, cli_module.Unavailable) or getattr(module, "PASSTHROUGH", False):
      continue  # a pass-through command (bench, loadtest) has no parser: the benchmark's reads
    p = argparse.ArgumentParser(prog=name)
    module.add_arguments(p)
    missing += [f"{name} {option}" for option in _options_without_their_default(p)]
  assert missing == []
  with pytest.raises(SystemExit):
    main(["generate", "--help"])
  help_text = " ".join(capsys.readouterr().out.split())
  assert "tokens to generate at most (default: 128)" in help_text
  assert "(default: auto)" in help_text and "auto}" in help_text  # --tree, --param-dtype auto


def test_every_benchmark_help_shows_its_defaults(monkeypatch):
  """``redrafter-jax bench NAME --help`` (and ``loadtest``) show each option's default too: the
  parser each benchmark builds is caught where it parses, and every defaulted option checked."""
  import argparse
  import importlib
  import inspect

  from redrafter_jax.bench.__main__ import available

  class Parsed(Exception):
    pass

  def catch(self, *args, **kwargs):
    raise Parsed(self)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
  missing, checked = {}, 0
  for name in available():
    module = importlib.import_module(f"redrafter_jax.bench.{name}")
    try:
      module.main([])
    except Parsed as caught:
      parser = caught.args[0]
    else:  # a benchmark without options (``plots FOLDER``) builds no parser
      assert "ArgumentParser" not in inspect.getsource(module), name
      continue
    checked += 1
    if gaps := _options_without_their_default(parser):
      missing[name] = gaps
  assert checked >= 15 and missing == {}
