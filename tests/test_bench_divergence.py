"""The divergence report: the first differing index, the float32 model's logit gap there (checked
against a plain forward over the whole sequence), the controls' settings, the summary's counts,
and the bench end to end on tiny random models, in bfloat16 and with a planted difference."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_models
from redrafter_jax.bench import _runner, divergence as div
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.llama import Llama

SUMMARY = re.compile(r"^ReDrafter differs on (\d+)/(\d+); AR-vs-AR controls on (\d+)/(\d+), "
                     r"(\d+)/(\d+)$", re.M)
TREES = ["redrafter_W1_L4_lookup3_N5", "redrafter_W2_L3"]


def test_compare_finds_the_first_difference():
  D = div.Divergence
  assert div.compare([1, 2, 3], [1, 2, 3]) is None and div.compare([], []) is None
  assert div.compare([1, 2, 3], [1, 5, 3]) == D(1, 2, 5)
  assert div.compare([1, 2, 3], [9, 2, 4]) == D(0, 1, 9)
  assert div.compare([1, 2, 3, 4], [1, 2, 3, 5, 6]) == D(3, 4, 5)
  # One a prefix of the other: they differ at the shorter length, where one has no token.
  assert div.compare([1, 2], [1, 2, 7]) == D(2, None, 7)
  assert div.compare([1, 2, 7], [1, 2]) == D(2, 7, None)
  assert div.compare([], [4]) == D(0, None, 4)


def test_logit_gap_equals_a_forward_over_the_whole_sequence():
  """The gap is the float32 model's logit difference at the last position of prompt + prefix,
  here recomputed without cache, padding or jit; bfloat16 weights, float32 activations."""
  model = Llama(tiny_models.TINY_LLM, dtype=jnp.float32, param_dtype=jnp.bfloat16,
                rngs=nnx.Rngs(0))
  prompt = [3, 9, 17, 4, 22]

  def full(ids):
    T = len(ids)
    logits_BTV = model(jnp.asarray([ids]), jnp.arange(T)[None],
                       kvc.causal_mask(jnp.ones((1, T), bool)), None)[0]
    return np.asarray(logits_BTV[0, -1], np.float64)

  for prefix in ([40, 7, 11], []):
    logits = full(prompt + prefix)
    a, b = int(np.argsort(logits)[-1]), int(np.argsort(logits)[-5])
    g = div.logit_gap(model, prompt, prefix, a, b)
    assert abs(logits[a] - logits[b]) > 1e-2  # a gap the check can tell apart
    assert g.value == pytest.approx(logits[a] - logits[b], abs=1e-4)
    assert g.preferred == a
    assert div.logit_gap(model, prompt, prefix, b, a).value == pytest.approx(-g.value, abs=1e-6)
  # The prefix matters: the gap at another position is another number.
  assert div.logit_gap(model, prompt, [40], a, b).value != pytest.approx(g.value, abs=1e-4)
  with pytest.raises(ValueError, match="needs float32 activations"):
    div.logit_gap(Llama(tiny_models.TINY_LLM, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), prompt,
                  [], a, b)


def test_controls_settings():
  assert div.companions(list("abcde"), "d") == ["e", "a", "b"]
  assert div.companions(["a", "b"], "a") == ["b", "b", "b"]
  assert div.companions(["a"], "a") == ["a", "a", "a"]
  # cache size + 512, else - 512, else the need rounded up to 128, else the need itself.
  assert div.other_cache_size(512, 300, 8192) == 1024
  assert div.other_cache_size(1024, 300, 1024) == 512
  assert div.other_cache_size(512, 300, 600) == 384
  assert div.other_cache_size(256, 42, 256) == 128
  assert div.other_cache_size(256, 200, 256) == 200
  assert div.other_cache_size(128, 128, 128) is None


def synthetic():
  """Three prompts, two trees and both controls; output_ids only."""
  ref = {"a": [1, 2, 3, 4], "b": [5, 6, 7], "c": [8, 9]}
  outs = {"a": dict(t1=[1, 2, 3, 4], t2=[1, 2, 9, 4], ar_batch4=[1, 2, 3, 4],
                    ar_other_cache=[1, 2, 3, 4]),
          "b": dict(t1=[5, 6], t2=[5, 6, 7], ar_batch4=[5, 0, 7], ar_other_cache=[5, 6, 7]),
          "c": dict(t1=[8, 9], t2=[8, 9], ar_batch4=[8, 9])}
  runs = {p: {"ar_greedy": dict(output_ids=ref[p]),
              **{k: dict(output_ids=v, cache_size=512) for k, v in outs[p].items()}}
          for p in ref}
  runs["b"]["ar_batch4"]["companions"] = ["c", "a", "c"]
  prompts = {p: dict(category=cat, cache_size=256) for p, cat in zip("abc", "xyz")}
  return runs, prompts


def cells(md: str, first: str, after: str) -> list[str]:
  """The row starting with ``first`` in the table under the heading starting with ``after``."""
  lines = md.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith(after))
  line = next(l for l in lines[start:] if l.startswith(f"| {first} |"))
  return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip("|"))]  # "\|" is a cell's own


def test_report_counts_prompts_and_shows_the_gaps_it_holds():
  runs, prompts = synthetic()
  gaps = {"a": {"t2": dict(index=2, reference_token=3, other_token=9, gap=1.25,
                           float32_prefers=3, reference_text=" x|y", other_text="z",
                           float32_prefers_text=" x|y")},
          # held for other tokens (a run measured again): not shown
          "b": {"ar_batch4": dict(index=1, reference_token=6, other_token=1, gap=7.0,
                                  float32_prefers=6)}}
  md = "\n".join(div.report(runs, [("t1", "tree one"), ("t2", "tree two")], gaps, prompts))
  # x: prompts where any tree differs (a: t2, b: t1 ended early); c ran no cache control.
  assert "ReDrafter differs on 2/3; AR-vs-AR controls on 1/3, 0/2" in md.splitlines()
  assert "Per tree: tree one 1/3; tree two 1/3." in md.splitlines()
  assert cells(md, "a", "### tree two") == ["a", "x", "2", "3 ' x\\|y'", "9 'z'", "+1.250",
                                             "reference"]
  assert cells(md, "a", "### tree one")[2] == "same"
  assert cells(md, "b", "### tree one")[2:] == ["2", "7", "(ended)", "n/a", "n/a"]
  assert cells(md, "b", "### our AR greedy, batch 4")[2:] == [
      "1", "6", "0", "n/a", "n/a", "rows 1-3: c, a, c; cache 512"]
  assert cells(md, "a", "### our AR greedy, another cache")[-1] == "cache 512 (reference 256)"
  one = "\n".join(div.report(runs, [("t2", "tree two")], gaps, prompts))
  assert "ReDrafter differs on 1/3;" in one and "Per tree" not in one


def test_fill_gaps_computes_each_missing_gap_once(monkeypatch):
  runs, _ = synthetic()
  calls = []

  def fake(model, prompt, prefix, a, b):
    calls.append((tuple(prompt), tuple(prefix), a, b))
    return div.Gap(float(a - b), a)

  monkeypatch.setattr(div, "logit_gap", fake)
  ids = {p: [100 + i] for i, p in enumerate("abc")}
  keys = ["t1", "t2", *div.CONTROLS]
  gaps = {}
  assert div.fill_gaps(None, ids, runs, gaps, keys) == 2  # b's t1 only ended early: no gap
  assert sorted(calls) == [((100,), (1, 2), 3, 9), ((101,), (5,), 6, 0)]
  assert gaps["a"]["t2"] == dict(index=2, reference_token=3, other_token=9, gap=-6.0,
                                 float32_prefers=3)
  assert div.fill_gaps(None, ids, runs, gaps, keys) == 0
  runs["a"]["t2"]["output_ids"] = [1, 7, 3, 4]  # measured again: another divergence
  runs["b"]["ar_batch4"]["output_ids"] = [5, 6, 7]  # now the same: its record goes
  assert div.fill_gaps(None, ids, runs, gaps, keys) == 1
  assert gaps["a"]["t2"]["index"] == 1 and "ar_batch4" not in gaps["b"]


# ---- the bench, end to end on a tiny random model --------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny HF Llama folder with a word-level tokenizer, and Spec-Bench-style prompts for it."""
  root = tmp_path_factory.mktemp("divergence")
  return tiny_models.bench_inputs(root)


def bench_args(tiny, out, *extra):
  model, prompts = tiny
  return ["--model", str(model), "--prompts", str(prompts), "--drafter", "random",
          "--exit-dim", "32", "--max-new-tokens", "10", "--beams", "1x4+3/5,2x3",
          "--no-progress", "--out", str(out), *extra]


def recount(data) -> tuple[int, int, int]:
  runs = data["runs"]
  differs = lambda p, k: k in runs[p] and div.compare(runs[p]["ar_greedy"]["output_ids"],
                                                      runs[p][k]["output_ids"]) is not None
  return (sum(any(differs(p, k) for k in TREES) for p in runs),
          sum(differs(p, div.CONTROL_BATCH) for p in runs),
          sum(differs(p, div.CONTROL_CACHE) for p in runs))


def test_bench_runs_end_to_end_in_bfloat16(tiny, tmp_path, capsys):
  from redrafter_jax.weights.llama_weights import load_llama

  assert div.main(bench_args(tiny, tmp_path)) == 0
  out = capsys.readouterr().out
  data = json.loads((tmp_path / "divergence.json").read_text())
  assert (tmp_path / "divergence.md").read_text().strip() == out.strip()
  assert (data["settings"]["dtype"], data["settings"]["param_dtype"]) == ("bfloat16", "bfloat16")
  # The first prompt of each category; every run on each.
  assert list(data["runs"]) == ["p0", "p2", "p4"]
  for pid, runs in data["runs"].items():
    assert set(runs) == {"ar_greedy", *TREES, div.CONTROL_BATCH, div.CONTROL_CACHE}
    assert all(1 <= len(r["output_ids"]) <= 10 for r in runs.values())
    assert runs[div.CONTROL_CACHE]["cache_size"] != data["prompts"][pid]["cache_size"]
  assert data["runs"]["p0"][div.CONTROL_BATCH]["companions"] == ["p2", "p4", "p2"]
  (m,) = SUMMARY.findall(out)
  x, y, z = recount(data)
  assert m == (str(x), "3", str(y), "3", str(z), "3")
  assert data["summary"] == f"ReDrafter differs on {x}/3; AR-vs-AR controls on {y}/3, {z}/3"
  assert "Per tree: ReDrafter W=1 L=4 + lookup 3, N=5 " in out
  # Every divergence where both runs have a token has its gap, from the float32 judge.
  judge = None
  for pid, runs in data["runs"].items():
    for key in TREES + list(div.CONTROLS):
      d = div.compare(runs["ar_greedy"]["output_ids"], runs[key]["output_ids"])
      rec = data["gaps"].get(pid, {}).get(key)
      if d is None or None in (d.reference_token, d.other_token):
        assert rec is None
        continue
      assert (rec["index"], rec["reference_token"], rec["other_token"]) == (
          d.index, d.reference_token, d.other_token)
      judge = judge or load_llama(tiny[0], param_dtype=jnp.bfloat16)[0]
      ids = _prompt_ids(tiny, pid)
      g = div.logit_gap(judge, ids, runs["ar_greedy"]["output_ids"][:d.index],
                        d.reference_token, d.other_token)
      assert rec["gap"] == pytest.approx(g.value, abs=1e-5)


def _prompt_ids(tiny, pid):
  from redrafter_jax.weights.tokenizer import encode, load_tokenizer

  row = next(json.loads(l) for l in tiny[1].read_text().splitlines() if f'"{pid}"' in l)
  return encode(load_tokenizer(tiny[0]), row["prompt"], chat=True)


def test_a_planted_difference_is_reported_where_it_is(tiny, tmp_path, capsys, monkeypatch):
  """In float32 ReDrafter gives AR's tokens; one run of one tree, changed at index 3, is counted
  in x, tabled at index 3, and its gap is the float32 model's (which sides with AR: AR took its
  argmax)."""
  real, planted = _runner.Runner.call, {}

  def call(self, m, prompts, *a):
    tokens, stats = real(self, m, prompts, *a)
    if m.key == "redrafter_W2_L3" and not planted:
      t = min(3, len(tokens[0]) - 1)
      planted.update(index=t, ref=tokens[0][t], new=(tokens[0][t] + 1) % tiny_models.VOCAB)
      tokens[0][t] = planted["new"]
    return tokens, stats

  monkeypatch.setattr(_runner.Runner, "call", call)
  assert div.main(bench_args(tiny, tmp_path, "--dtype", "float32", "--param-dtype",
                             "float32")) == 0
  out = capsys.readouterr().out
  data = json.loads((tmp_path / "divergence.json").read_text())
  for pid, runs in data["runs"].items():
    assert runs["redrafter_W1_L4_lookup3_N5"]["output_ids"] == runs["ar_greedy"]["output_ids"]
  assert SUMMARY.search(out).group(1, 2) == ("1", "3")
  assert "Per tree: ReDrafter W=1 L=4 + lookup 3, N=5 0/3; ReDrafter W=2 L=3 1/3." in out
  rec = data["gaps"]["p0"]["redrafter_W2_L3"]
  t = planted["index"]
  assert (rec["index"], rec["reference_token"], rec["other_token"]) == (
      t, planted["ref"], planted["new"])
  assert rec["gap"] > 0 and rec["float32_prefers"] == planted["ref"]
  row = cells(out, "p0", "### ReDrafter W=2 L=3")
  assert row[:3] == ["p0", "writing", str(t)] and row[6] == "reference"
  assert row[3].startswith(f"{planted['ref']} ") and row[4].startswith(f"{planted['new']} ")


def test_bad_arguments_are_one_line_errors(tiny, tmp_path, capsys):
  for bad in (["--beams", "4"], ["--cache-size", "0"], ["--max-new-tokens", "0"]):
    with pytest.raises(SystemExit) as e:
      div.parse_args(bench_args(tiny, tmp_path, *bad))
    assert e.value.code == 2
  assert div.main(bench_args(tiny, tmp_path, "--cache-size", "100000")) == 2
  assert "--cache-size 100000 is outside 1..256" in capsys.readouterr().err
  assert div.main(bench_args(tiny, tmp_path, "--cache-size", "8")) == 2
  err = capsys.readouterr().err
  assert "skipping prompt p0" in err and "no prompt fits the cache" in err
