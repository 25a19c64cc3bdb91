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


def expected_text(folder, prompt, chat=False, **kwargs):
  model, _ = load_llama(folder)
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
