"""Decode loops that check their predicate once per k steps (``steps_per_check``): AR and
ReDrafter give the same tokens, step counts, metrics and final state for every k, with rows that
finish at different steps (stop tokens), a ``max_new_tokens`` that is not a multiple of k, and
across context-bucket segments; and ``bench loops`` runs every variant and checks them."""

import json

import numpy as np
import pytest

from oracle import OracleDrafter
from redrafter_jax.bench import loops
from redrafter_jax.config import ConfigError, DecodeConfig
from redrafter_jax.inference import decode as decode_lib
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.runtime import GenerateError
from tiny_models import TINY_VOCAB

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 14  # a multiple of neither k
KS = (3, 4)


@pytest.fixture(scope="module")
def ar_greedy(llm):
  return generate(llm, PROMPTS, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def stop(ar_greedy):
  """A token row 0 first emits at index >= 2: row 0 stops early and the others run on (the
  tests check the row lengths)."""
  row0 = ar_greedy.tokens[0]
  return next(row0[i] for i in range(2, len(row0)) if row0[i] not in row0[:i])


def oracle(ar_greedy, batch: int):
  """Drafts the first ``batch`` rows' greedy continuation with planted errors: steps accept
  0 .. L-1 tokens."""
  return OracleDrafter(np.asarray(ar_greedy.tokens[:batch]), TINY_VOCAB)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("batch", [1, 3])
def test_ar_same_for_every_k(llm, stop, temperature, batch):
  prompts = PROMPTS[:batch]
  kwargs = dict(max_new_tokens=MAX_NEW, stop_ids=[stop], temperature=temperature, seed=5)
  plain = generate(llm, prompts, **kwargs)
  if batch == 3 and temperature == 0.0:  # rows end at different steps, one on the stop token
    assert plain.stopped[0] and len(plain.tokens[0]) < MAX_NEW
    assert max(len(t) for t in plain.tokens) == MAX_NEW
  for k in KS:
    r = generate(llm, prompts, steps_per_check=k, **kwargs)
    assert (r.tokens, r.stopped, r.steps) == (plain.tokens, plain.stopped, plain.steps), k


def _final_state(rd, prompts, **kwargs):
  p = rd.prepare(prompts, **kwargs)
  return rd.loop(p, rd.start(p))


def _committed(state):
  """Per row: the committed K/V of every layer (the slots below the row's length)."""
  cache = state.cache
  lengths = np.asarray(cache.lengths_B)
  out = []
  for i in range(cache.num_layers):
    k_BKSE, v_BKSE = (np.asarray(x) for x in cache.layer_BKSE(i))
    out.append([(k_BKSE[b, :, :n], v_BKSE[b, :, :n]) for b, n in enumerate(lengths)])
  return out


@pytest.mark.parametrize("temperature", [0.0, 0.5])  # sampled: low enough to accept drafts
@pytest.mark.parametrize("batch", [1, 3])
def test_redrafter_same_for_every_k(llm, ar_greedy, stop, temperature, batch):
  """Tokens, stop flags, steps and every metric equal k=1's; so do the final state's lengths,
  committed K/V, context, output record, metrics and PRNG key (what masked steps must keep)."""
  prompts = PROMPTS[:batch]
  cfg = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=MAX_NEW)
  kwargs = dict(stop_ids=[stop], temperature=temperature, seed=2)
  drafter = oracle(ar_greedy, batch)
  rd = decode_lib.ReDrafter(llm, drafter, cfg)
  plain = rd(prompts, **kwargs)
  plain_state = _final_state(rd, prompts, **kwargs)
  assert plain.metrics["accepted_tokens"] > 0  # multi-token commits happen
  if batch == 3:
    steps = plain.metrics["steps_per_row"]
    assert min(steps) < max(steps)  # the rows finish at different steps
    if temperature == 0.0:
      assert plain.stopped[0] and len(plain.tokens[0]) < MAX_NEW
  for k in KS:
    rk = decode_lib.ReDrafter(llm, drafter, DecodeConfig(beam_width=3, beam_length=4,
                                                        max_new_tokens=MAX_NEW,
                                                        steps_per_check=k))
    r = rk(prompts, **kwargs)
    assert (r.tokens, r.stopped, r.steps) == (plain.tokens, plain.stopped, plain.steps), k
    assert r.metrics == plain.metrics, k
    state = _final_state(rk, prompts, **kwargs)
    np.testing.assert_array_equal(state.cache.lengths_B, plain_state.cache.lengths_B)
    for layer_k, layer_1 in zip(_committed(state), _committed(plain_state)):
      for (kk, vk), (k1, v1) in zip(layer_k, layer_1):
        np.testing.assert_array_equal(kk, k1)
        np.testing.assert_array_equal(vk, v1)
    for name in ("context_BS", "g0_B", "h_BD", "done_B"):
      np.testing.assert_array_equal(getattr(state, name), getattr(plain_state, name))
    for a, b in zip(*(jax_leaves((s.out, s.metrics)) for s in (state, plain_state))):
      np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(key_data(state.rng), key_data(plain_state.rng))


def jax_leaves(tree):
  import jax

  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def key_data(key):
  import jax

  return np.asarray(jax.random.key_data(key))


def test_redrafter_k_keeps_context_bucket_segments(llm, drafter):
  """With small context buckets a masked step must also stop at a bucket's edge: the same
  segments (one program each), the tokens of AR and the step count of k=1."""
  prompts = [[1, 2, 3, 4, 5], list(range(1, 30))]
  ar = generate(llm, prompts, max_new_tokens=40)
  results = {}
  for k in (1, 3):
    cfg = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=40, steps_per_check=k)
    rd = decode_lib.ReDrafter(llm, drafter, cfg, min_bucket=16)
    before = decode_lib.TRACE_COUNT["decode"]
    results[k] = rd(prompts, cache_size=128)
    assert decode_lib.TRACE_COUNT["decode"] == before + 2  # the 64 bucket, then the whole cache
    assert results[k].tokens == ar.tokens
  assert results[3].steps == results[1].steps and results[3].metrics == results[1].metrics


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_steps_per_check(llm, bad):
  with pytest.raises(ConfigError, match="steps_per_check"):
    DecodeConfig(steps_per_check=bad)
  with pytest.raises(GenerateError, match="steps_per_check"):
    generate(llm, [[1, 2]], max_new_tokens=4, steps_per_check=bad)


@pytest.mark.slow  # ~35 s of subprocesses; the lease dry-run (default suite) runs this bench too
def test_loops_bench_runs_every_variant(tmp_path, capsys):
  out = tmp_path / "loops.md"
  rc = loops.main(["--tiny", "--reps", "1", "--num-prompts", "1", "--max-new-tokens", "7",
                   "--steps-per-check", "3", "--out", str(out)])
  assert rc == 0
  text = out.read_text()
  assert text in capsys.readouterr().out
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
          if line.startswith("| ") and not line.startswith("| variant")]
  assert [r[0] for r in rows] == ["plain", "k=3", "cmdbuf"]
  for r in rows[:2]:
    assert float(r[2]) > 0 and float(r[3]) > 0 and r[-1] == "yes"
    assert all(float(x) > 0 for x in r[7].split("+"))  # each variant compiled its programs
  assert rows[0][4] == rows[0][5] == "1.00x"
  assert loops.NOT_ON_CPU in rows[2]
  data = json.loads(out.with_suffix(".json").read_text())
  assert data["results"]["k=3"]["steps_per_check"] == 3
  assert data["results"]["plain"]["rows"][0]["ar_tokens"] == \
      data["results"]["k=3"]["rows"][0]["ar_tokens"]
  assert data["not_run"] == {"cmdbuf": loops.NOT_ON_CPU}


def test_loops_bench_fails_when_a_variant_differs(monkeypatch, tmp_path, capsys):
  """The bench compares every variant's outputs with plain's and fails when one differs."""
  row = dict(batch=1, calls=1, ar_ms_per_token=1.0, ar_compile_s=1.0,
             redrafter_ms_per_token=1.0, redrafter_compile_s=1.0, ar_tokens=[[[1, 2, 3]]],
             ar_steps=[2], redrafter_tokens=[[[1, 2, 3]]], redrafter_metrics=[{"steps": 2}],
             tokens_per_step=1.5)
  report = dict(backend="cpu", device="cpu", jax="x", draft_vocab=0, param_dtype="float32")

  def fake_spawn(args, variant):
    r = dict(row, redrafter_tokens=[[[1, 2, 4]]]) if variant == "k=4" else row
    return dict(report, variant=variant, steps_per_check=loops.steps_of(variant), rows=[r])

  monkeypatch.setattr(loops, "spawn", fake_spawn)
  assert loops.main(["--tiny", "--steps-per-check", "3,4"]) == 1
  captured = capsys.readouterr()
  assert "k=4, batch 1: redrafter_tokens differ" in captured.err
  assert "| k=3 | 1 |" in captured.out and captured.out.count("| NO |") == 1


def test_loops_bench_writes_each_variant_before_the_next(monkeypatch, tmp_path):
  """A caller that stops the bench mid-way (a lease step's deadline) keeps the variants that
  finished: the table and its JSON are on disk before each next variant starts."""
  out = tmp_path / "loops.md"
  row = dict(batch=1, calls=1, ar_ms_per_token=2.0, ar_compile_s=1.0,
             redrafter_ms_per_token=1.0, redrafter_compile_s=1.0, ar_tokens=[[[1, 2]]],
             ar_steps=[2], redrafter_tokens=[[[1, 2]]], redrafter_metrics=[{"steps": 1}],
             tokens_per_step=2.0)
  seen = {}

  def fake_spawn(args, variant):
    if variant != "plain":
      seen[variant] = (out.read_text(), json.loads(out.with_suffix(".json").read_text()))
    if variant == "k=4":
      raise KeyboardInterrupt  # stands in for the process being stopped
    return dict(backend="cpu", device="cpu", jax="x", draft_vocab=0, param_dtype="float32",
                variant=variant, steps_per_check=loops.steps_of(variant), rows=[row])

  monkeypatch.setattr(loops, "spawn", fake_spawn)
  with pytest.raises(KeyboardInterrupt):
    loops.main(["--tiny", "--steps-per-check", "3,4", "--out", str(out)])
  text, data = seen["k=4"]
  assert "| plain | 1 | 2.000 | 1.000 |" in text and "| k=3 | 1 | 2.000 |" in text
  assert "| k=4 | | not run (yet) |" in text
  assert sorted(data["results"]) == ["k=3", "plain"]
  assert "| k=3 | | not run (yet) |" in seen["k=3"][0]


@pytest.mark.parametrize("argv", [["--steps-per-check", "1"], ["--steps-per-check", "4,4"],
                                  ["--prompt-multiple", "0"], ["--cache-size", "0"],
                                  ["--batch-sizes", "0"], ["--reps", "0"],
                                  ["--prompts", "/nonexistent.jsonl"], ["--beams", "4x4,2x3"]])
def test_loops_bench_bad_arguments(argv):
  with pytest.raises(SystemExit) as e:
    loops.parse_args(argv)
  assert e.value.code == 2
