"""Choosing the draft tree per device: the drafter's acceptance table, the device's step times
(cached per device), and the choice that combines them."""

import json
import os

import jax.numpy as jnp
import pytest
from flax import nnx

from redrafter_jax.inference import tree_choice
from redrafter_jax.inference.decode import decode
from redrafter_jax.inference.tree_choice import Beams, TreeChoiceError
from redrafter_jax.models.llama import Llama
from tiny_models import TINY_LLM

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [3, 1, 4]]


def test_tree_text_round_trips():
  for b in Beams.parse_list(tree_choice.DEFAULT_CANDIDATES + ",3x3,2x5+2,8x5+a8,1x4+3+a3/7"):
    assert Beams.parse_list(b.text) == [b]
  assert Beams(1, 4, 3, 5).text == "1x4+3/5" and Beams(2, 3).text == "2x3"
  (alts,) = Beams.parse_list("1x4+3+a3/7")
  assert alts == Beams(1, 4, 3, 7, alternatives=3) and alts.config().first_alternatives == 3
  assert Beams.parse_list("8x5+a8")[0].config().num_tree_tokens == 8 * 4 + 1 + 8


@pytest.mark.parametrize("text", ["8x5+a", "8x5+3+3", "8x5+a2+a3", "8x5+a8+3", "8x5+", "1x4+a2/9",
                                  "8x5+a-1"])
def test_malformed_tree_text_is_refused(text):
  with pytest.raises(ValueError, match=r"WxL\[\+n\]\[\+aK\]\[/N\]"):
    Beams.parse_list(text)


def test_measured_acceptance_is_decode_tokens_per_step(llm, drafter):
  """The table's tokens/step is what decode() reports for the same batches (a multiple of the
  batch size is used: the first 4 of the 5 prompts, batched shortest first)."""
  trees = [Beams(2, 3), Beams(1, 3, 2, 4)]
  seen = []
  table = tree_choice.measure_acceptance(llm, drafter, PROMPTS, trees, max_new_tokens=12,
                                         batch_size=2, on_result=lambda k, r: seen.append(k))
  assert seen == ["2x3", "1x3+2/4"]
  batches = [[PROMPTS[3], PROMPTS[1]], [PROMPTS[0], PROMPTS[2]]]
  for b in trees:
    ms = [decode(llm, drafter, batch, b.config(max_new_tokens=12)).metrics for batch in batches]
    steps = sum(m["steps"] for m in ms)
    tokens = steps + sum(m["accepted_tokens"] for m in ms)
    assert table[b.text] == dict(tokens_per_step=tokens / steps, steps=steps, tokens=tokens)
  with pytest.raises(TreeChoiceError, match="at least batch_size=8"):
    tree_choice.measure_acceptance(llm, drafter, PROMPTS, trees, max_new_tokens=4, batch_size=8)


def test_acceptance_file_round_trip_and_errors(tmp_path):
  assert tree_choice.read_acceptance(tmp_path) is None  # no table: no automatic choice
  table = {"1x4+3/5": dict(tokens_per_step=1.75, steps=4, tokens=7),
           "2x3": dict(tokens_per_step=1.5, steps=2, tokens=3)}
  tree_choice.write_acceptance(tmp_path, table, {"prompts": "p.jsonl"})
  assert tree_choice.read_acceptance(tmp_path) == {Beams(1, 4, 3, 5): 1.75, Beams(2, 3): 1.5}
  path = tmp_path / tree_choice.ACCEPTANCE_FILE
  for bad in ("not json", json.dumps({"tokens_per_step": {"9q9": 2.0}}),
              json.dumps({"tokens_per_step": {"2x3": 0.5}}), json.dumps({"other": 1})):
    path.write_text(bad)
    with pytest.raises(TreeChoiceError, match="acceptance"):
      tree_choice.read_acceptance(tmp_path)


def test_choose_maximises_tokens_per_second():
  tps = {Beams(1, 4, 3, 5): 1.8, Beams(4, 5, 3, 16): 2.4, Beams(2, 3): 1.4}
  seconds = {"1x4+3/5": 0.030, "4x5+3/16": 0.060, "2x3": 0.020, "ar": 0.025}
  c = tree_choice.choose(tps, seconds)
  # tokens/s: 2x3 1.4 / 20 ms = 70; 1x4+3/5 1.8 / 30 ms = 60; 4x5+3/16 2.4 / 60 ms = 40
  assert c.beams == Beams(2, 3)
  assert [r[0] for r in c.rows] == [Beams(2, 3), Beams(1, 4, 3, 5), Beams(4, 5, 3, 16)]
  assert c.predicted_speedup == pytest.approx(1.4 * 0.025 / 0.020)
  assert "<- chosen" in c.table().splitlines()[1]
  assert c.pays and c.verdict() == "best tree 2x3, predicted 1.75x AR at batch 1"
  slow = tree_choice.choose(tps, {**seconds, "ar": 0.010})  # 2x3: 1.4 x 10 ms / 20 ms
  assert not slow.pays and slow.verdict() == (
      "no draft tree is predicted faster than AR here (best tree 2x3, predicted 0.70x AR at "
      "batch 1)")
  cfg = c.config(tree_choice.Beams(4, 5, 3, 16, 2).config(draft_vocab_size=64,
                                                          max_new_tokens=9))
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.token_budget,
          cfg.draft_vocab_size, cfg.max_new_tokens) == (2, 3, 0, None, 64, 9)
  assert cfg.first_alternatives == 0  # the base's alternatives do not leak into the choice
  alts = tree_choice.choose({Beams(1, 4, 3, 7, 4): 2.1}, {"1x4+3+a4/7": 0.05, "ar": 0.025})
  cfg = alts.config(tree_choice.Beams(4, 5).config())
  assert (cfg.beam_width, cfg.beam_length, cfg.lookup_ngram, cfg.token_budget,
          cfg.first_alternatives) == (1, 4, 3, 7, 4)
  with pytest.raises(TreeChoiceError, match="step time"):
    tree_choice.choose(tps, {"ar": 0.02})


def test_tuned_times_once_per_device_and_caches(tmp_path, llm, drafter, monkeypatch):
  """The first call times every tree on this device (real step programs); the second reads the
  cache; weights of another dtype are another device entry and are timed again."""
  folder = tmp_path / "drafter"
  folder.mkdir()
  tree_choice.write_acceptance(folder, {
      "1x3": dict(tokens_per_step=1.2, steps=5, tokens=6),
      "2x3+2/5": dict(tokens_per_step=1.5, steps=4, tokens=6)}, {})
  real, calls = tree_choice.time_steps, []

  def counting(*args, **kwargs):
    calls.append(jnp.dtype(args[0].param_dtype).name)
    return real(*args, **kwargs)

  monkeypatch.setattr(tree_choice, "time_steps", counting)
  cache = tmp_path / "cache"
  first = tree_choice.tuned(folder, llm, drafter, cache=cache, log=lambda m: None)
  assert calls == ["float32"]
  (entry,) = (cache / "trees").glob("*.json")
  seconds = json.loads(entry.read_text())["seconds"]
  assert set(seconds) == {"1x3", "2x3+2/5", "ar"} and all(v > 0 for v in seconds.values())
  again = tree_choice.tuned(folder, llm, drafter, cache=cache, log=lambda m: None)
  assert calls == ["float32"] and again == first
  assert first.beams in (Beams(1, 3), Beams(2, 3, 2, 5))
  bf16 = Llama(TINY_LLM, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  tree_choice.tuned(folder, bf16, drafter, cache=cache, log=lambda m: None)
  assert calls == ["float32", "bfloat16"] and len(list((cache / "trees").glob("*.json"))) == 2
  assert tree_choice.tuned(tmp_path, llm, drafter, cache=cache) is None  # no table


def test_step_times_are_taken_in_rounds_over_every_program(llm, drafter, monkeypatch):
  """Every tree and AR are compiled first, then timed one call each per round: a slow spell of
  the machine slows all of them, not the one (AR, say) whose turn it was."""
  from redrafter_jax.inference import ar
  from redrafter_jax.inference.decode import ReDrafter

  order = []
  real_step, real_stepper = ReDrafter.step, ar.one_token_stepper

  def step(self, *args, **kwargs):
    order.append(f"{self.static_config.beam_width}x{self.static_config.beam_length}")
    return real_step(self, *args, **kwargs)

  def stepper(*args, **kwargs):
    call = real_stepper(*args, **kwargs)
    return lambda: (order.append("ar"), call())[1]

  monkeypatch.setattr(ReDrafter, "step", step)
  monkeypatch.setattr(ar, "one_token_stepper", stepper)
  seconds = tree_choice.time_steps(llm, drafter, [Beams(1, 3), Beams(2, 3)], context=8,
                                   repeat=3)
  assert set(seconds) == {"1x3", "2x3", "ar"} and all(v > 0 for v in seconds.values())
  # A first step each (a tree's cache width), an untimed call each, then 3 rounds.
  assert order == ["1x3", "2x3"] + ["1x3", "2x3", "ar"] * 4


def test_other_processes_cpu_time_is_measured_and_ours_is_not():
  """Processes that spin on every core while a block runs make ``OtherLoad`` read a busy
  machine; CPU time this process spends itself is not counted as theirs."""
  import subprocess
  import sys
  import time

  from redrafter_jax.inference import timing

  spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
              for _ in range(os.cpu_count() or 1)]
  try:
    time.sleep(0.3)  # started and spinning
    with timing.OtherLoad() as load:
      time.sleep(1.0)
  finally:
    for p in spinners:
      p.kill()
      p.wait()
  assert load.share > 0.5
  # The arithmetic, on samples of (wall s, machine busy CPU s, own CPU s) over 2 s of 2 CPUs:
  # 3 busy seconds of which 2 are ours leave 1 s of 4 to the others.
  samples = iter([(10.0, 100.0, 50.0), (12.0, 103.0, 52.0)])

  class Sampled(timing.OtherLoad):
    _sample = staticmethod(lambda: next(samples))

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(timing.psutil, "cpu_count", lambda: 2)
    with Sampled() as load:
      pass
  assert load.share == pytest.approx(0.25)


@pytest.mark.parametrize("share, cached", [(0.05, True), (0.6, False)])
def test_step_times_taken_beside_other_load_are_not_cached(tmp_path, llm, drafter, monkeypatch,
                                                          share, cached):
  """Step times timed while other processes kept the CPUs busy choose this run's tree but are
  not cached: the next run times again (a busy spell skews trees against AR)."""
  monkeypatch.setattr(tree_choice, "BUSY_SHARE", 0.2)  # conftest lifts it for other tests

  class Load:
    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.share = share

  timed, logged = [], []
  monkeypatch.setattr(tree_choice, "OtherLoad", Load)
  monkeypatch.setattr(tree_choice, "time_steps", lambda *a, **k: timed.append(1) or {
      "1x3": 0.02, "2x3+2/5": 0.03, "ar": 0.015})
  table = {Beams(1, 3): 1.2, Beams(2, 3, 2, 5): 1.5}
  for _ in range(2):
    choice = tree_choice.for_device(table, llm, drafter, cache=tmp_path, log=logged.append)
    assert choice.beams == Beams(1, 3)  # 1.2 / 0.02 beats 1.5 / 0.03
  assert len(timed) == (1 if cached else 2)
  entries = list((tmp_path / "trees").glob("*.json"))
  assert len(entries) == (1 if cached else 0)
  if cached:
    assert json.loads(entries[0].read_text())["other_cpu_share"] == share
  else:
    assert sum("not caching" in m and "60%" in m for m in logged) == 2


def test_calibration_prompts_are_held_out_and_spread_over_categories(tmp_path):
  """``tune-tree`` calibrates on prompts with no teacher answer (never trained on), taken
  round-robin over categories."""
  from redrafter_jax.commands.tune_tree import calibration_prompts
  from redrafter_jax.jsonl import write_jsonl
  from redrafter_jax.training import data as data_lib

  rows = [{"id": f"{c}-{i}", "category": c, "prompt": f"{c} {i}"}
          for c in ("code", "math", "qa") for i in range(4)]
  write_jsonl(rows, tmp_path / "p.jsonl")
  teacher = tmp_path / "teacher"
  teacher.mkdir()
  data_lib.write_shard(teacher / "shard-00000.npz", [
      data_lib.make_record([1, 2], [0, 1], id=i) for i in ("code-0", "math-0", "math-1")])
  got = calibration_prompts(tmp_path / "p.jsonl", [teacher], 7)
  assert [p.id for p in got] == ["code-1", "math-2", "qa-0", "code-2", "math-3", "qa-1",
                                 "code-3"]
  assert len(calibration_prompts(tmp_path / "p.jsonl", [], 100)) == 12


@pytest.fixture
def tune_tree_folder(tmp_path, monkeypatch):
  """A random drafter for the tiny model in ``tmp_path/drafter``, five prompts in
  ``tmp_path/p.jsonl``, an empty teacher folder and a private tree-timing cache."""
  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.jsonl import write_jsonl
  from redrafter_jax.models.drafter import Drafter
  from redrafter_jax.weights.base_model import load_base_model
  from redrafter_jax.weights.drafter_io import save_drafter

  monkeypatch.setenv("REDRAFTER_JAX_CACHE", str(tmp_path / "cache"))
  _, cfg = load_base_model("random:tiny")
  save_drafter(Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size),
                       rngs=nnx.Rngs(0)), tmp_path / "drafter")
  write_jsonl([{"id": str(i), "category": "c", "prompt": f"prompt {i}"} for i in range(5)],
              tmp_path / "p.jsonl")
  (tmp_path / "teacher").mkdir()
  return tmp_path


def test_tune_tree_command_measures_writes_and_chooses(tune_tree_folder, capsys):
  """``redrafter-jax tune-tree`` end to end on a tiny model: calibration prompts -> the
  drafter's acceptance.json -> this device's timing -> the printed choice; ``--time-only``
  keeps the table and reads the cached times."""
  tmp_path = tune_tree_folder
  from redrafter_jax import cli

  args = ["tune-tree", "--model", "random:tiny", "--drafter", str(tmp_path / "drafter")]
  assert cli.main(args + ["--prompts", str(tmp_path / "p.jsonl"), "--held-out-from",
                          str(tmp_path / "teacher"), "--num-prompts", "4", "--batch-size", "2",
                          "--max-new-tokens", "6", "--candidates", "1x3,2x3+2/5"]) == 0
  out = capsys.readouterr().out
  table = json.loads((tmp_path / "drafter" / tree_choice.ACCEPTANCE_FILE).read_text())
  assert set(table["tokens_per_step"]) == {"1x3", "2x3+2/5"}
  assert table["measured_with"]["ids"] == ["0", "1", "2", "3"]
  assert "chosen for this device" in out and "timing 2 draft trees" in out
  assert cli.main(args + ["--time-only"]) == 0
  out = capsys.readouterr().out
  assert "chosen for this device" in out and "timing" not in out  # the cached times
  assert cli.main(args + ["--candidates", "9q9"]) == 2
  assert "--candidates" in capsys.readouterr().err
  # --time-only reads no prompts: a --prompts beside it is a mistake, not silently ignored
  assert cli.main(args + ["--time-only", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
  assert "--time-only" in capsys.readouterr().err


def test_tune_tree_add_keeps_the_table_and_refuses_other_settings(tune_tree_folder, capsys):
  """``--add`` measures only the named trees into the existing table (the others kept, the
  addition recorded); trees measured on other settings are refused, the table left as it was."""
  tmp_path = tune_tree_folder
  from redrafter_jax import cli

  args = ["tune-tree", "--model", "random:tiny", "--drafter", str(tmp_path / "drafter"),
          "--prompts", str(tmp_path / "p.jsonl"), "--held-out-from", str(tmp_path / "teacher"),
          "--num-prompts", "4", "--batch-size", "2"]
  file = tmp_path / "drafter" / tree_choice.ACCEPTANCE_FILE
  assert cli.main(args + ["--add", "--candidates", "1x2", "--max-new-tokens", "6"]) == 2
  assert "measure the whole table first" in capsys.readouterr().err and not file.exists()
  assert cli.main(args + ["--candidates", "1x3,2x3+2/5", "--max-new-tokens", "6"]) == 0
  first = json.loads(file.read_text())
  assert cli.main(args + ["--add", "--candidates", "1x2", "--max-new-tokens", "6"]) == 0
  table = json.loads(file.read_text())
  assert set(table["tokens_per_step"]) == {"1x2", "1x3", "2x3+2/5"}
  for tree in ("1x3", "2x3+2/5"):
    assert table["tokens_per_step"][tree] == first["tokens_per_step"][tree]
    assert table["counts"][tree] == first["counts"][tree]
  assert [a["trees"] for a in table["measured_with"]["added"]] == [["1x2"]]
  capsys.readouterr()
  assert cli.main(args + ["--add", "--candidates", "1x4", "--max-new-tokens", "5"]) == 2
  assert "max_new_tokens" in capsys.readouterr().err
  assert json.loads(file.read_text()) == table
  assert cli.main(args + ["--add", "--time-only", "--candidates", "1x4"]) == 2
