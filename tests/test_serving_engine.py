"""Serving engine (no HTTP): continuous batching equals ``decode()``, per-request seeds, stop
strings, cancellation, AR mode and a model sharded over 8 (fake) devices."""

import dataclasses
import logging
import queue
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

import serving_doubles as testing
from redrafter_jax.config import DecodeConfig, DrafterConfig, LlamaConfig
from redrafter_jax.inference.decode import decode
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
from redrafter_jax.serving.engine import (Delta, Engine, EngineConfig, Failed, Finished,
                                          GenerationRequest, QueueFull, RequestError)
from redrafter_jax.serving import policy
from redrafter_jax.serving.placement import serving_mesh
from redrafter_jax.serving.textstream import TextStream

V = 256
EOS = 2
LLM_CFG = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                      max_position_embeddings=512)
DCFG = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=24)
# Context buckets of 32, 64 and 96 slots: steps read only the part of the cache their rows use.
ECFG = EngineConfig(slots=4, max_context=96, max_tokens=24, max_queue=16, decode=DCFG,
                    min_context_bucket=32)
RNG = np.random.default_rng(0)
# 16 prompts of different lengths (1..40 tokens) and different max_tokens.
PROMPTS = [RNG.integers(3, V, size=n).tolist() for n in
           [1, 3, 40, 7, 12, 2, 33, 5, 18, 9, 25, 4, 16, 31, 6, 11]]
MAX_TOKENS = [24, 5, 17, 1, 24, 9, 13, 24, 3, 20, 8, 24, 11, 2, 24, 15]


@pytest.fixture(scope="module")
def llm():
  return Llama(LLM_CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tok():
  return testing.word_tokenizer(V)


@pytest.fixture(scope="module")
def random_drafter():
  return Drafter(DrafterConfig(vocab_size=V, hidden_size=32, exit_dim=48), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def reference(llm, random_drafter):
  """``decode()`` greedy for all prompts at once (max_new_tokens = the largest limit)."""
  return decode(llm, random_drafter, PROMPTS, DCFG, stop_ids=[EOS]).tokens


def expected(ref_tokens, max_tokens):
  return ref_tokens[:max_tokens]


@pytest.fixture(scope="module")
def self_engine(llm, tok):
  engine = Engine(llm, tok, testing.SelfDrafter(V), config=ECFG, stop_ids=[EOS]).start()
  yield engine
  engine.stop()


def run_concurrently(engine, requests, timeout=300.0):
  """Submit every request at once; collect each one's Finished event (bounded wait)."""
  events = queue.Queue()
  for i, r in enumerate(requests):
    engine.submit(r, lambda e, i=i: events.put((i, e)))
  done, deltas = {}, {i: [] for i in range(len(requests))}
  deadline = time.monotonic() + timeout
  while len(done) < len(requests):
    i, e = events.get(timeout=max(deadline - time.monotonic(), 0.01))
    if isinstance(e, Finished):
      done[i] = e
    else:
      assert isinstance(e, Delta), e
      deltas[i].append(e)
  return [done[i] for i in range(len(requests))], deltas


def assert_serves_decode(engine, reference, idx):
  """Prompts ``idx`` served at once by ``engine`` get ``decode()``'s greedy tokens."""
  results, _ = run_concurrently(
      engine, [GenerationRequest(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in idx])
  for i, r in zip(idx, results):
    assert r.token_ids == expected(reference[i], MAX_TOKENS[i]), i


@pytest.mark.parametrize("kind", ["random", "self", "ar", "lookup"])
def test_concurrent_greedy_equals_decode(llm, tok, random_drafter, reference, self_engine, kind):
  """16 requests of different lengths through 4 slots: queueing, slot reuse, no cross-talk
  (``lookup``: the random drafter plus the context-lookup beam, whose context each slot keeps)."""
  if kind == "self":
    engine = self_engine
  else:
    cfg = {"random": ECFG, "ar": dataclasses.replace(ECFG, speculative=False),
           "lookup": dataclasses.replace(ECFG, decode=dataclasses.replace(DCFG, lookup_ngram=2))
           }[kind]
    engine = Engine(llm, tok, None if kind == "ar" else random_drafter, config=cfg,
                    stop_ids=[EOS]).start()
  try:
    reqs = [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    results, deltas = run_concurrently(engine, reqs)
  finally:
    if engine is not self_engine:
      engine.stop()
  for i, (r, m) in enumerate(zip(results, MAX_TOKENS)):
    want = expected(reference[i], m)
    assert r.token_ids == want, i
    assert r.finish_reason == ("stop" if want[-1] == EOS else "length")
    assert r.usage["completion_tokens"] == len(want)
    # The streamed pieces add up to the text of the tokens.
    text = "".join(d.text for d in deltas[i]) + r.text
    assert text == testing.word_text(t for t in want if t != EOS)
  spec = [r.usage["speculative"] for r in results]
  steps = sum(s["steps"] for s in spec)
  accepted = sum(s["accepted_tokens"] for s in spec)
  generated = sum(len(r.token_ids) for r in results)
  # The prefill gives the first token, every step one or more (the last one maybe cut).
  assert steps + len(results) <= generated <= accepted + steps + len(results)
  if kind == "self":  # multi-token commits really happened
    assert accepted / steps > 0.8, (accepted, steps)
  if kind == "ar":
    assert accepted == 0 and all(s["mode"] == "ar" for s in spec)
  if kind == "random":  # steps read the smallest context bucket their rows fit in
    assert engine.context_counts[64] > 0 and engine.context_counts[96] > 0, engine.context_counts


def test_steps_follow_the_load_with_identical_greedy_output(self_engine, reference):
  """With a cost table in which a tree pays at one row only, steps with 2+ rows run as plain
  AR steps on their row bucket and 1-row steps as tree steps; every greedy request still gets
  exactly ``decode()``'s tokens. A request alone runs on the 1-row bucket."""
  engine = self_engine
  buckets = engine._place.row_buckets()
  fake = {(b, m, k, c): 0.01 if m == "ar" else 0.011 if b == 1 else 1.0
          for b in buckets for m in policy.MODES for k in policy.KINDS
          for c in engine._place.context_buckets()}
  before = engine.step_counts.copy()
  engine.costs = policy.StepCosts(fake, min_seen=None)  # this table, whatever steps cost
  try:
    reqs = [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    results, _ = run_concurrently(engine, reqs)
    mixed = engine.step_counts - before
    alone = engine.generate(GenerationRequest(PROMPTS[2], max_tokens=12))
    single = engine.step_counts - before - mixed
  finally:
    engine.costs = None
  for i, (r, m) in enumerate(zip(results, MAX_TOKENS)):
    assert r.token_ids == expected(reference[i], m), i
  assert alone.token_ids == expected(reference[2], 12)
  assert set(mixed) <= {(1, "spec")} | {(b, "ar") for b in buckets[1:]}, mixed
  assert mixed[1, "spec"] > 0 and mixed[4, "ar"] > 0
  assert set(single) == {(1, "spec")}
  assert alone.usage["speculative"]["accepted_tokens"] > 0
  summary = engine.served_summary()  # what the engine logs when it stops
  assert f"1 rows spec: {engine.step_counts[1, 'spec']}," in summary, summary
  assert f"4 rows ar: {engine.step_counts[4, 'ar']}" in summary, summary


def serve_each_bucket_on(engine, best, reference):
  """Give ``engine`` a cost table under which rows bucket b runs mode ``best[b]`` (bucket 4,
  all slots, pays most for any rows: ``plan`` may pick it for fewer live rows too), serve all
  prompts at once and one alone, and check every greedy result against ``decode()``'s."""
  place = engine._place
  fake = {(b, m, k, c): (0.001 * b if m == best[b] else 1.0) if b < 4 or m != "ar" else 0.5
          for b in place.row_buckets() for m in place.modes() for k in policy.KINDS
          for c in place.context_buckets()}
  engine.costs = policy.StepCosts(fake, min_seen=None)
  engine.start()
  try:
    reqs = [GenerationRequest(p, max_tokens=m) for p, m in zip(PROMPTS, MAX_TOKENS)]
    results, _ = run_concurrently(engine, reqs)
    alone = engine.generate(GenerationRequest(PROMPTS[2], max_tokens=12))
  finally:
    engine.stop()
  for i, (r, m) in enumerate(zip(results, MAX_TOKENS)):
    assert r.token_ids == expected(reference[i], m), i
  assert alone.token_ids == expected(reference[2], 12)


def test_smaller_trees_serve_identical_greedy_output(llm, tok, reference):
  """With smaller trees among the modes (``EngineConfig.trees``), a cost table that makes
  each rows bucket pay for a different one: steps run on each tree (and AR), each tree's
  acceptance is observed on its own, and every greedy request still gets ``decode()``'s
  tokens (a smaller tree's step pads its tokens to the batch's width and writes back only its
  own tree's cache slots)."""
  cfg = dataclasses.replace(ECFG, trees=("1x2", "2x3+2/5"), tree_priors=(1.5, None),
                            decode=dataclasses.replace(DCFG, lookup_ngram=2))
  engine = Engine(llm, tok, testing.SelfDrafter(V), config=cfg, stop_ids=[EOS])
  assert engine._place.modes() == ("ar", "spec:1x2", "spec:2x3+2/5", "spec")
  assert {m: a.prior for m, a in engine.acceptance.items()} == {
      "spec": 4.0, "spec:1x2": 1.5, "spec:2x3+2/5": 3.0}
  serve_each_bucket_on(engine, {1: "spec", 2: "spec:2x3+2/5", 4: "spec:1x2"}, reference)
  served = {m for (_, m) in engine.step_counts}
  assert {"spec:1x2", "spec:2x3+2/5", "spec"} <= served, engine.step_counts
  assert all(a.row_steps > 0 for a in engine.acceptance.values()), engine.acceptance
  # A drafter that guesses right: each tree gives what its length allows (1x2: at most 2).
  observed = {m: a.tokens / a.row_steps for m, a in engine.acceptance.items()}
  assert 1.5 < observed["spec:1x2"] <= 2.0 < observed["spec"]
  assert observed["spec:2x3+2/5"] <= 3.0, observed
  assert "spec:1x2 tokens/step observed" in engine.served_summary()


def test_trees_with_step1_alternatives_serve_identical_greedy_output(llm, tok, random_drafter,
                                                                    reference):
  """A served tree and a smaller tree with step-1 alternatives (``+aK``: beams that end after
  their first token, packed beside the drafter's beams), a cost table that sends each rows
  bucket to another mode: every greedy request gets ``decode()``'s tokens, and each tree's
  steps ran."""
  cfg = dataclasses.replace(ECFG, trees=("1x2+a2", "1x3"),
                            decode=dataclasses.replace(DCFG, first_alternatives=3))
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  assert engine._place.modes() == ("ar", "spec:1x2+a2", "spec:1x3", "spec")
  serve_each_bucket_on(engine, {1: "spec", 2: "spec:1x2+a2", 4: "spec:1x3"}, reference)
  served = {m for (_, m) in engine.step_counts}
  assert {"spec:1x2+a2", "spec"} <= served, engine.step_counts


@pytest.mark.parametrize("trees, match", [
    (("1x5",), "must fit within"), (("4x4",), "must fit within"),  # L > 4; 13 > 10 tokens
    (("1x2", "1X2"), "given twice"), (("3x4",), "given twice"), (("2x",), "tree '2x'"),
    ("1x2", "must be a list")])
def test_smaller_trees_are_checked(trees, match):
  from redrafter_jax.config import ConfigError

  with pytest.raises(ConfigError, match=match):
    dataclasses.replace(ECFG, trees=trees)
  with pytest.raises(ConfigError, match="one value per tree"):
    dataclasses.replace(ECFG, trees=("1x2",), tree_priors=(1.5, 2.0))
  with pytest.raises(ConfigError, match=r"prior of tree 1x3 must be in \[1, 3\]"):
    dataclasses.replace(ECFG, trees=("1x3",), tree_priors=(3.5,))


def test_a_smaller_tree_keeps_its_step1_alternatives():
  """``+aK`` in a served tree's text reaches its decode settings (not the served tree's)."""
  modes = dataclasses.replace(ECFG, trees=("1x2+a2", "1x2")).tree_modes()
  assert modes["spec:1x2+a2"].first_alternatives == 2
  assert modes["spec:1x2"].first_alternatives == modes["spec"].first_alternatives == 0


def test_a_step_after_a_prefill_does_not_price_the_step(self_engine, reference):
  """The device runs an admission's prefill just before the next step, so the time between
  two reads is both's: the served-cost table leaves that step out (the policy compares step
  costs; a prefill costs the same whichever mode follows), though it counts as run. A request
  alone: one admission, so every step but the first is priced."""
  engine = self_engine
  warm = {(b, m, k, c): 0.01 for b in engine._place.row_buckets() for m in policy.MODES
          for k in policy.KINDS for c in engine._place.context_buckets()}
  # A request's last step is dispatched ahead, before its end is known, and read by the engine
  # thread a few milliseconds after the request returns: wait for that read (an earlier
  # test's before the table is installed, this one's before the table is read).
  time.sleep(0.5)
  before = engine.step_counts.copy()
  engine.costs = policy.StepCosts(warm, min_seen=1)
  try:
    alone = engine.generate(GenerationRequest(PROMPTS[2], max_tokens=12))
    time.sleep(0.5)
    steps = sum((engine.step_counts - before).values())
    counted, priced = engine.costs.steps, sum(n for _, n in engine.costs.seen.values())
  finally:
    engine.costs = None
  assert alone.token_ids == expected(reference[2], 12)
  assert steps >= 3 and counted == steps and priced == steps - 1, (steps, counted, priced)


def test_step_costs_are_read_at_the_context_a_step_reads(self_engine, reference):
  """The cost table is per context bucket: with a tree that pays at context 32 only, a short
  request alone runs tree steps and a long one (context 64) AR steps, both with decode()'s
  tokens."""
  engine = self_engine
  assert engine._place.context_buckets() == (32, 64, 96)
  fake = {(b, m, k, c): 0.01 if m == "ar" else 0.011 if c == 32 else 1.0
          for b in engine._place.row_buckets() for m in policy.MODES for k in policy.KINDS
          for c in engine._place.context_buckets()}
  engine.costs = policy.StepCosts(fake, min_seen=None)
  try:
    counts = []
    for i, m in ((0, 4), (2, 12)):  # 1 + 4 + scratch fits 32; 40 + 12 + scratch needs 64
      before = engine.step_counts.copy()
      got = engine.generate(GenerationRequest(PROMPTS[i], max_tokens=m))
      assert got.token_ids == expected(reference[i], m), i
      counts.append(set(engine.step_counts - before))
  finally:
    engine.costs = None
  assert counts == [{(1, "spec")}, {(1, "ar")}], counts


def test_seed_reproducible_regardless_of_batch(self_engine):
  """A sampled request gives the same tokens alone and amid others (in another slot)."""
  target = GenerationRequest(PROMPTS[4], max_tokens=20, temperature=1.0, seed=1234)
  alone = self_engine.generate(target)
  others = [GenerationRequest(p, max_tokens=24, temperature=1.0, seed=i, top_k=(i % 3) * 5)
            for i, p in enumerate(PROMPTS[:5])]
  greedy = GenerationRequest(PROMPTS[1], max_tokens=20)
  greedy_alone = self_engine.generate(greedy)  # an all-greedy batch: the argmax program
  results, _ = run_concurrently(self_engine, [greedy] + others[:3] + [target] + others[3:])
  assert results[4].token_ids == alone.token_ids
  # Amid sampled requests (it shares the first batch with three) a greedy request takes the
  # general rule and gives the same tokens.
  assert results[0].token_ids == greedy_alone.token_ids
  other_seed = self_engine.generate(GenerationRequest(PROMPTS[4], max_tokens=20,
                                                      temperature=1.0, seed=99))
  assert other_seed.token_ids != alone.token_ids
  # The top-k/top-p path (a different compiled step) is reproducible too.
  filtered = GenerationRequest(PROMPTS[2], max_tokens=16, temperature=0.8, top_p=0.9, top_k=20,
                               seed=5)
  assert self_engine.generate(filtered).token_ids == self_engine.generate(filtered).token_ids


def test_stop_strings_trim_output(self_engine):
  full = self_engine.generate(GenerationRequest(PROMPTS[0], max_tokens=24))
  words = full.text.split(" ")
  assert len(words) >= 8
  # A stop string spanning two tokens, and one inside a word ("w12" contains "w1").
  stop = " ".join(words[4:6])
  cut = self_engine.generate(GenerationRequest(PROMPTS[0], max_tokens=24, stop=[stop, "zzz"]))
  assert cut.finish_reason == "stop"
  assert cut.text == full.text[:full.text.index(stop)]
  assert len(cut.token_ids) < len(full.token_ids)
  inner = words[3][:2]  # e.g. "w1": the text stops in the middle of a token's word
  cut2 = self_engine.generate(GenerationRequest(PROMPTS[0], max_tokens=24, stop=[inner]))
  assert cut2.text == full.text[:full.text.index(inner)]


def test_cancel_frees_the_slot(llm, tok):
  cfg = EngineConfig(slots=1, max_context=256, max_tokens=200, max_queue=1, decode=DCFG)
  engine = Engine(llm, tok, testing.SelfDrafter(V), config=cfg, stop_ids=()).start()
  try:
    events = queue.Queue()
    long = engine.submit(GenerationRequest(PROMPTS[1], max_tokens=200), events.put)
    assert isinstance(events.get(timeout=120), Delta)  # it is decoding
    waiting = engine.submit(GenerationRequest(PROMPTS[3], max_tokens=3), events.put)
    with pytest.raises(QueueFull):  # one in the slot, one waiting: the limit
      engine.submit(GenerationRequest(PROMPTS[3], max_tokens=3), events.put)
    long.cancel()
    finished = {}
    deadline = time.monotonic() + 120
    while len(finished) < 2:
      e = events.get(timeout=max(deadline - time.monotonic(), 0.01))
      if isinstance(e, Finished):
        finished[e.finish_reason] = e
    assert set(finished) == {"cancelled", "length"}
    assert len(finished["cancelled"].token_ids) < 200
    assert len(finished["length"].token_ids) == 3
    assert engine.active_slots() == 0 and engine.queue_length() == 0
    del waiting
  finally:
    engine.stop()


def test_bad_requests_are_refused(self_engine):
  bad = [(GenerationRequest([]), "prompt"), (GenerationRequest([V + 5]), "prompt"),
         (GenerationRequest([5] * 70, max_tokens=20), "max_tokens"),
         (GenerationRequest([5] * 95), "prompt"),
         (GenerationRequest([5], max_tokens=0), "max_tokens"),
         (GenerationRequest([5], max_tokens=25), "max_tokens"),
         (GenerationRequest([5], temperature=-0.5), "temperature"),
         (GenerationRequest([5], top_p=0.0), "top_p"),
         (GenerationRequest([5], top_k=-1), "top_k"),
         (GenerationRequest([5], stop=[""]), "stop"),
         # What the device arrays cannot hold (int32, float32) is refused here too, so no
         # caller can reach a failing conversion on the engine thread.
         (GenerationRequest([5], temperature=0.7, top_k=2**31), "top_k"),
         (GenerationRequest([5], temperature=1e-40), "temperature"),
         (GenerationRequest([5], temperature=float("nan")), "temperature"),
         (GenerationRequest([5], temperature=float("inf")), "temperature"),
         (GenerationRequest([5], temperature=0.5, top_p=1e-46), "top_p"),
         (GenerationRequest([5], top_p=float("nan")), "top_p"),
         (GenerationRequest([5], seed=2**64), "seed"),
         (GenerationRequest([5], max_tokens=2**31), "max_tokens"),
         (GenerationRequest([5], stop=["x" * 257]), "stop")]
  for request, param in bad:
    with pytest.raises(RequestError) as e:
      self_engine.submit(request, lambda _: None)
    assert e.value.param == param, (request, str(e.value))
    assert e.value.code, (request, str(e.value))
  assert self_engine.generate(GenerationRequest([5], max_tokens=2)).finish_reason == "length"


def test_greedy_acceptance_engine_refuses_sampling(llm, tok, random_drafter):
  """A server configured with acceptance 'greedy' verifies by argmax: temperature must be 0."""
  cfg = dataclasses.replace(ECFG, decode=dataclasses.replace(DCFG, acceptance="greedy"))
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  with pytest.raises(RequestError) as e:
    engine.check(GenerationRequest([5], temperature=0.7))
  assert e.value.param == "temperature"
  assert engine.check(GenerationRequest([5], max_tokens=3)) == 3


def test_sharded_engine_equals_decode(llm, tok, random_drafter, reference):
  """The LLM split over 8 devices (tensor parallel) gives the same greedy tokens."""
  mesh = serving_mesh(8)
  engine = Engine(llm, tok, random_drafter, config=ECFG, stop_ids=[EOS], mesh=mesh).start()
  try:
    up_proj = engine._place.llm_state["layers"][0]["mlp"]["up_proj"]
    (weight,) = [up_proj[name] for name in ("weight", "kernel") if name in up_proj]
    assert len(weight[...].sharding.device_set) == 8
    # Column-parallel: the output features are split, in either weight layout.
    P = jax.sharding.PartitionSpec
    want = P("model", None) if "weight" in up_proj else P(None, "model")
    assert weight[...].sharding.spec == want
    assert_serves_decode(engine, reference, [0, 2, 6, 13])
  finally:
    engine.stop()


@pytest.mark.parametrize("layout", ["BSKE", "BKSE"])
def test_engine_serves_from_every_cache_layout(tok, random_drafter, reference, layout):
  """The slot batch takes the model's cache layout (cuDNN's, Pallas's): same greedy tokens.
  The ``xla`` backend reads every layout, so the layouts are checked on CPU."""
  llm = Llama(LLM_CFG, cache_layout=layout, rngs=nnx.Rngs(0))  # the fixture's weights
  engine = Engine(llm, tok, random_drafter, config=ECFG, stop_ids=[EOS]).start()
  try:
    assert engine._place.batch.state.cache.layout == layout
    # 5 requests through 4 slots: admission, row groups, slot reuse
    assert_serves_decode(engine, reference, [0, 2, 6, 13, 4])
  finally:
    engine.stop()


def test_scanned_layers_serve_split_over_devices(tok, random_drafter, reference):
  """A model that scans over its layers serves from a stacked slot-batch cache, split over kv
  heads past its layer axis on a 2-device mesh: decode()'s greedy tokens."""
  from redrafter_jax.models.llama import stack_layers

  assert LLM_CFG.num_kv_heads % 2 == 0  # so that the cache splits over 2 devices
  llm = stack_layers(Llama(LLM_CFG, rngs=nnx.Rngs(0)))  # the fixture's weights
  engine = Engine(llm, tok, random_drafter, config=ECFG, stop_ids=[EOS],
                  mesh=serving_mesh(2)).start()
  try:
    cache = engine._place.batch.state.cache
    assert cache.stacked and cache.num_layers == LLM_CFG.num_layers
    spec = cache.k[0].sharding.spec
    assert spec[cache.head_axis] == "model" and spec[0] is None, spec
    assert_serves_decode(engine, reference, [0, 2, 6, 13, 4])
  finally:
    engine.stop()


def test_bf16_weights_serve_with_a_float32_draft_table(tok, random_drafter):
  """With bfloat16 weights the server's drafter reads a float32 copy of the embedding table
  (made once, not converted at every step) and serves decode()'s greedy tokens."""
  llm = Llama(LLM_CFG, param_dtype=jax.numpy.bfloat16, rngs=nnx.Rngs(0))
  idx = [0, 2, 6, 13, 4]
  ref = decode(llm, random_drafter, [PROMPTS[i] for i in idx], DCFG, stop_ids=[EOS]).tokens
  engine = Engine(llm, tok, random_drafter, config=ECFG, stop_ids=[EOS]).start()
  try:
    table = engine._place.draft_embed
    assert table.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(table),
                                  np.asarray(llm.embed_tokens.embedding[...], np.float32))
    results, _ = run_concurrently(
        engine, [GenerationRequest(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in idx])
  finally:
    engine.stop()
  for j, (i, r) in enumerate(zip(idx, results)):
    assert r.token_ids == expected(ref[j], MAX_TOKENS[i]), i
  f32 = Engine(Llama(LLM_CFG, rngs=nnx.Rngs(0)), tok, random_drafter, config=ECFG, stop_ids=[EOS])
  assert f32._place.draft_embed is None  # float32 weights: the LLM's own table


def test_text_stream_partial_characters_and_stops():
  """Bytes as tokens: a multi-byte character waits for its last byte; stop strings split
  over pushes are cut, and text that might start a stop string is held back until clear."""
  decode_bytes = lambda ids: bytes(ids).decode("utf-8", errors="replace")
  s = TextStream(decode_bytes, stop=["END"])
  e_acute = list("é".encode())
  assert s.push(list(b"caf") + e_acute[:1]) == ""
  assert s.push(e_acute[1:] + list(b" E")) == "café "  # "E" may begin "END"
  assert s.push(list(b"N")) == ""
  assert s.push(list(b"Dx")) == ""
  assert s.stopped and s.text == "café "
  s2 = TextStream(decode_bytes, stop=["END"])
  assert s2.push(list(b"a EN")) == "a "
  assert s2.push(list(b"d")) == "ENd"
  assert s2.push(list(b"E")) == ""
  assert s2.flush() == "E" and not s2.stopped
  # The request ends inside a multi-byte character: the partial bytes are dropped, not U+FFFD.
  s3 = TextStream(decode_bytes)
  assert s3.push(list(b"na") + list("ï".encode())[:1]) == ""  # the window waits
  assert s3.flush() == "na" and s3.text == "na"
  s4 = TextStream(decode_bytes, stop=["x"])
  assert s4.push(list("€".encode())[:2]) == "" and s4.flush() == ""


def test_a_fault_in_one_request_fails_it_alone(self_engine, monkeypatch):
  """A fault in one request's prefill, and one in another's detokenization mid-generation,
  fail those two (Failed, slot freed); the requests beside them finish with exactly the
  tokens they get alone, and the engine stays idle-clean and serving."""
  from redrafter_jax.serving import engine as engine_lib

  engine = self_engine
  normal = [GenerationRequest(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in (0, 2, 4, 6, 9)]
  normal.append(GenerationRequest(PROMPTS[5], max_tokens=20, temperature=1.0, seed=3))
  alone = [engine.generate(r).token_ids for r in normal]
  poison_prefill = GenerationRequest([7, 7, 7], max_tokens=10)
  poison_text = GenerationRequest(PROMPTS[1], max_tokens=24, stop=["POISON"])

  real_admission = engine._place.admission

  def admission(slot, prompt, *args):
    if prompt == [7, 7, 7]:
      raise OverflowError("injected prefill fault")
    return real_admission(slot, prompt, *args)

  class FaultyText(TextStream):
    def push(self, ids):
      if "POISON" in self._stop and len(self._ids) >= 3:
        raise UnicodeDecodeError("utf-8", b"", 0, 1, "injected detokenizer fault")
      return super().push(ids)

  monkeypatch.setattr(engine._place, "admission", admission)
  monkeypatch.setattr(engine_lib, "TextStream", FaultyText)
  errors_before = engine.metrics.requests.labels(finish_reason="error")._value.get()
  requests = normal[:3] + [poison_prefill, poison_text] + normal[3:]
  events = queue.Queue()
  for i, r in enumerate(requests):
    engine.submit(r, lambda e, i=i: events.put((i, e)))
  ended = {}
  deadline = time.monotonic() + 300
  while len(ended) < len(requests):
    i, e = events.get(timeout=max(deadline - time.monotonic(), 0.01))
    if isinstance(e, (Finished, Failed)):
      ended[i] = e
  assert isinstance(ended[3], Failed) and "injected prefill fault" in ended[3].message
  assert isinstance(ended[4], Failed) and "injected detokenizer fault" in ended[4].message
  assert ended[3].code == ended[4].code == "internal_error"
  got = [ended[i].token_ids for i in (0, 1, 2, 5, 6, 7)]
  assert got == alone
  assert engine.metrics.requests.labels(finish_reason="error")._value.get() == errors_before + 2
  assert engine.active_slots() == 0 and engine.queue_length() == 0 and engine._load == 0
  monkeypatch.undo()
  assert engine.generate(normal[0]).token_ids == alone[0]


def test_one_admission_call_equals_one_per_request(llm):
  """Prompts prefilled together (one call, a padding row included) leave the slot batch as
  prefilling each alone does, first tokens and sampled draws included (the greedy row alone is
  an all-greedy call, which takes the argmax without drawing), and the padding row writes
  nowhere."""
  from redrafter_jax.serving import batch as batch_lib

  B, S, M, T = 4, 96, 24, 64
  stop = jax.numpy.asarray([EOS], np.int32)
  # (slot, prompt, seed, temperature, top_p, top_k, limit): greedy, sampled, top-k/top-p.
  rows = [(3, PROMPTS[2], 7, 0.0, 1.0, 0, 24), (0, PROMPTS[6], 1 << 40 | 5, 1.0, 1.0, 0, 9),
          (2, PROMPTS[10], 11, 0.7, 0.9, 5, 1)]

  def admit(batch, rows, pad=0):
    k = len(rows) + pad
    rows = rows + [rows[0]] * pad
    tokens = np.zeros((k, T), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r[1])] = r[1]
    col = lambda j, dt: np.asarray([r[j] for r in rows], dt)
    slots = np.asarray([r[0] for r in rows[:k - pad]] + [B] * pad, np.int32)
    return batch_lib.admit(llm, batch, slots, tokens, np.asarray([len(r[1]) for r in rows]),
                           col(2, np.uint64).astype(np.uint32),
                           (col(2, np.uint64) >> 32).astype(np.uint32), col(3, np.float32),
                           col(4, np.float32), col(5, np.int32), col(6, np.int32), stop,
                           np.asarray([r[3] > 0 and (r[4] < 1 or r[5] > 0) for r in rows]))

  empty = lambda: batch_lib.empty(LLM_CFG, np.float32, B, S, M, DCFG.beam_length)
  together, first_k = admit(empty(), rows, pad=1)
  alone, firsts = empty(), []
  for r in rows:
    alone, first = admit(alone, [r])
    firsts.append(int(first[0]))
  assert np.asarray(first_k)[:3].tolist() == firsts
  leaves = jax.tree_util.tree_leaves_with_path(together)
  for (path, got), want in zip(leaves, jax.tree.leaves(alone)):
    if jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key):
      got, want = jax.random.key_data(got), jax.random.key_data(want)
    # Float leaves (the prefilled K/V) may differ by float32 rounding: XLA:CPU's matmul rounds
    # by the number of rows it is given (a 4-row admission vs 1-row ones; seen at 1.3e-6 on a
    # 2-core EPYC). Token ids, lengths and keys are integers and must match exactly.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  state = together.state
  assert np.asarray(state.done_B).tolist() == [False, True, True, False]  # slot 1 free; 2: limit 1
  assert np.asarray(state.cache.lengths_B).tolist() == [len(PROMPTS[6]), 0, len(PROMPTS[10]),
                                                        len(PROMPTS[2])]
  assert not np.asarray(state.cache.k[0]).reshape(2, B, -1)[:, 1].any()  # the padding row: nowhere


LAYERS = (0, 1)  # both of the tiny LLM's layers: a multi-layer drafter's context


@pytest.fixture(scope="module")
def layered_drafter():
  """A drafter that reads the states of ``LAYERS`` (the shipped drafter's kind), with a random
  mixing projection so that every layer's state matters, and reads its context: the copy hint
  and the context attention (with a random output projection, so that what it reads matters)."""
  d = Drafter(DrafterConfig(vocab_size=V, hidden_size=32, exit_dim=48, feature_layers=LAYERS,
                            copy_ngram=2, context_attention=16), rngs=nnx.Rngs(2))
  rng = np.random.default_rng(3)
  for w, scale in ((d.feature_proj.kernel, 1 / 8), (d.ctx_out.kernel, 0.05)):
    w.set_value(rng.normal(size=w[...].shape).astype(np.float32) * scale)
  return d


def test_slot_batch_keeps_a_multi_layer_drafters_states(llm, layered_drafter):
  """After an admission, an AR step and a tree step, each slot's ``h`` is the states of the
  drafter's layers at its newest cached token, and its context memory at every cached position
  is the drafter's over those states, as one forward over the whole text gives them."""
  from redrafter_jax.models import kv_cache as kvc
  from redrafter_jax.serving import batch as batch_lib

  B, S, M, T = 2, 96, 24, 64
  stop = jax.numpy.asarray([EOS], np.int32)
  batch = batch_lib.empty(LLM_CFG, np.float32, B, S, M, DCFG.beam_length, layers=LAYERS,
                          memory=(16, np.float32))
  assert batch.state.h_BD.shape == (B, 2 * 32)
  prompts = [PROMPTS[2], PROMPTS[4]]
  tokens = np.zeros((B, T), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  ones = lambda dt: np.ones((B,), dt)
  batch, _ = batch_lib.admit(llm, batch, np.arange(B, dtype=np.int32), tokens,
                             np.asarray([len(p) for p in prompts], np.int32), ones(np.uint32),
                             ones(np.uint32), 0 * ones(np.float32), ones(np.float32),
                             0 * ones(np.int32), 24 * ones(np.int32), stop, ones(bool) & False,
                             layers=LAYERS, drafter=layered_drafter)
  embed = llm.embed_tokens.embedding[...]

  def check(batch, what):
    s = batch.state
    for b, p in enumerate(prompts):
      n = int(s.out.num_B[b])
      seq = p + np.asarray(s.out.tokens_BM[b, :n - 1]).tolist()  # g0, the last, is not cached
      assert len(seq) == int(s.cache.lengths_B[b]), what
      x = jax.numpy.asarray([seq])
      mask = kvc.causal_mask(jax.numpy.ones_like(x, bool))
      _, taps, _ = llm.forward_layers(x, jax.numpy.arange(len(seq))[None], mask, None,
                                      layers=LAYERS)
      np.testing.assert_allclose(np.asarray(s.h_BD[b]), np.asarray(taps[0, -1]), atol=2e-5,
                                 err_msg=f"{what}, row {b}")
      text = jax.numpy.asarray([seq + [int(s.g0_B[b])]])  # the last position's follower: g0
      keys, values = layered_drafter.memory_over(
          jax.numpy.pad(layered_drafter.context(taps), ((0, 0), (0, 1), (0, 0))), text, embed)
      n = len(seq)
      np.testing.assert_allclose(np.asarray(s.memory.keys_BSA[b, :n]), np.asarray(keys[0, :n]),
                                 atol=5e-5, err_msg=f"{what}, row {b}")
      np.testing.assert_allclose(np.asarray(s.memory.values_BSA[b, :n]),
                                 np.asarray(values[0, :n]), atol=5e-5, err_msg=f"{what}, row {b}")

  check(batch, "admission")
  batch, _ = jax.jit(lambda b: batch_lib.ar_step(llm, b, stop, 0, layers=LAYERS,
                                                 drafter=layered_drafter))(batch)
  check(batch, "AR step")
  batch, _ = jax.jit(lambda b: batch_lib.spec_step(llm, layered_drafter, b, stop, DCFG, 0))(batch)
  check(batch, "tree step")
  # The check sees a step that keeps other states (here the layers swapped).
  with pytest.raises(AssertionError, match="planted"):
    check(jax.jit(lambda b: batch_lib.ar_step(llm, b, stop, 0, layers=LAYERS[::-1],
                                              drafter=layered_drafter))(batch)[0], "planted")


def test_engine_serves_a_multi_layer_drafter_like_decode(llm, tok, layered_drafter):
  """The server with a multi-layer drafter that reads its context (copy hint, context
  attention): tree steps, and AR steps while several rows are
  active (a cost table in which a tree pays at one row only), give ``decode()``'s greedy tokens,
  and with tree steps only each request accepts as many drafts as in ``decode()``."""
  want = decode(llm, layered_drafter, PROMPTS, DCFG, stop_ids=[EOS])
  engine = Engine(llm, tok, layered_drafter, config=ECFG, stop_ids=[EOS]).start()
  try:
    assert engine._place.batch.state.h_BD.shape[1] == 2 * 32
    idx = [0, 2, 6, 13, 4]
    results, _ = run_concurrently(engine, [GenerationRequest(PROMPTS[i], max_tokens=24)
                                           for i in idx])
    for i, r in zip(idx, results):
      assert r.token_ids == want.tokens[i], i
      alone = decode(llm, layered_drafter, [PROMPTS[i]], DCFG, stop_ids=[EOS])
      assert r.usage["speculative"]["accepted_tokens"] == alone.metrics["accepted_tokens"], i
    assert sum(r.usage["speculative"]["accepted_tokens"] for r in results) > 0
    fake = {(b, m, k, c): 0.01 if m == "ar" else 0.011 if b == 1 else 1.0
            for b in engine._place.row_buckets() for m in policy.MODES for k in policy.KINDS
            for c in engine._place.context_buckets()}
    engine.costs = policy.StepCosts(fake, min_seen=None)
    assert_serves_decode(engine, want.tokens, [1, 3, 5, 7, 9, 11])
  finally:
    engine.stop()


def test_waiting_prompts_of_one_bucket_are_prefilled_together(llm, tok, reference):
  """While the engine is busy, requests that arrive queue up and are then admitted in calls of
  one prompt bucket each (``Placement.group``), with outputs unchanged; ``prefill_tokens``
  caps a call's padded tokens."""
  cfg = dataclasses.replace(ECFG, prefill_tokens=64)
  engine = Engine(llm, tok, testing.SelfDrafter(V), config=cfg, stop_ids=[EOS])
  place = engine._place
  assert [place.prefill_rows(T) for T in (16, 32, 64)] == [4, 2, 1]
  adm = lambda slot, n: place.admission(slot, [3] * n, 0, 0.0, 1.0, 0, 4)
  groups = place.group([adm(0, 3), adm(1, 40), adm(2, 20), adm(3, 9), adm(4, 30), adm(5, 1)])
  assert [[a.slot for a in g] for g in groups] == [[0, 3, 5], [1], [2, 4]]
  with pytest.raises(ValueError, match="1 to 2 prompts of one bucket"):
    place.admit([adm(0, 20), adm(1, 20), adm(2, 20)])

  release, calls = threading.Event(), []
  real_admit = place.admit

  def admit(group):
    calls.append([a.slot for a in group])
    if len(calls) == 1:  # hold the engine thread until every request is queued
      assert release.wait(60)
    return real_admit(group)

  engine.start()
  try:
    place.admit = admit
    idx = list(range(16))
    reqs = [GenerationRequest(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in idx]
    threading.Timer(0.5, release.set).start()
    results, _ = run_concurrently(engine, reqs)
  finally:
    engine.stop()
  assert [r.token_ids for r in results] == [expected(reference[i], MAX_TOKENS[i]) for i in idx]
  assert sum(map(len, calls)) == 16 and max(map(len, calls)) > 1, calls


def test_warmup_compiles_everything_serving_meets(llm, tok, random_drafter, reference):
  """After ``warmup()`` requests of every prompt bucket and sampling mode (greedy, sampled,
  top-k/top-p) are served without a single new compile, and greedy ones still equal
  ``decode()`` (the warm-up leaves a clean batch)."""
  cfg = dataclasses.replace(ECFG, max_context=64)
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  assert engine.warmup() > 0
  assert engine._place.buckets() == [16, 32, 64]
  compiled = engine._place.compiled_programs()
  # a prefill per prompt bucket and admission rows (1, 2, 4: prefill_tokens 1024 holds 4
  # prompts of 64); per row bucket (1, 2, 4) and context (32, 64): a tree step and an AR step
  assert [engine._place.admission_rows(T) for T in (16, 32, 64)] == [[1, 2, 4]] * 3
  assert engine._place.row_buckets() == [1, 2, 4]
  assert engine._place.context_buckets() == (32, 64)
  assert compiled + len(engine._place.dropped) == 3 * 3 + 3 * 2 * 2  # less those never paying
  greedy = [0, 8, 2]  # prompts of 1, 18 and 40 tokens: buckets 16, 32, 64
  sampled = [GenerationRequest(PROMPTS[i], max_tokens=4, temperature=0.8, top_p=p, top_k=k,
                               seed=i) for i, p, k in ((1, 1.0, 0), (4, 0.9, 0), (6, 1.0, 5))]
  engine.start()
  try:
    got = [engine.generate(GenerationRequest(PROMPTS[i], max_tokens=4)).token_ids
           for i in greedy]
    for r in sampled:
      assert len(engine.generate(r).token_ids) == 4
    assert engine._place.compiled_programs() == compiled
    assert set(engine.context_counts) == {32, 64}  # 1 + 4 + scratch fits 32; 40 + 4 does not
  finally:
    engine.stop()
  assert got == [expected(reference[i], 4) for i in greedy]


def test_background_warmup_serves_on_covering_programs_then_adopts_the_rest(
    llm, tok, random_drafter, reference, caplog):
  """``warmup(background=True)`` compiles only the covering set (the largest prompt bucket for
  one prompt; each mode's step over all slots at the largest context), untimed; requests of
  every bucket are served on it at once, padded, with the same greedy tokens and no compile on
  the engine thread. The background thread then compiles the rest, and between requests the
  engine times each finished step group (and the covering one) and takes it into use."""
  cfg = dataclasses.replace(ECFG, max_context=64)
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  place = engine._place
  caplog.set_level(logging.INFO, logger="redrafter_jax.serving.engine")
  engine.warmup(background=True)
  cover = place.cover_programs()
  assert cover == [("admit", 64, 1), ("admit", 16, 1), ("step", 4, "ar", 64),
                   ("step", 4, "spec", 64)]  # 16: half the smallest context, 32
  assert place.compiled_programs() == 4
  everything = set(place.admission_programs() + place.step_programs())
  assert set(place.rest_programs()) == everything - set(cover)
  rest = place.rest_programs()  # single prompts first, then the steps by context: 1 row and
  assert rest[:5] == [("admit", 32, 1), ("step", 1, "ar", 32), ("step", 1, "spec", 32),
                      ("step", 4, "ar", 32), ("step", 4, "spec", 32)]  # all slots first
  assert rest[5:7] == [("step", 2, "ar", 32), ("step", 2, "spec", 32)]
  assert engine._usable == {(4, 64)} and engine.costs.warm == {}  # timed between requests
  compiles = []
  compile_ = place.compile
  place.compile = lambda key: compiles.append((threading.current_thread().name, key)) or (
      compile_(key))
  greedy = [0, 8, 2]  # prompts of 1, 18 and 40 tokens: buckets 16, 32, 64
  engine._pending, pending = [], engine._pending  # serve on the cover alone first
  engine.start()
  try:
    got = [engine.generate(GenerationRequest(PROMPTS[i], max_tokens=4)).token_ids
           for i in greedy]
    assert compiles == [] and place.compiled_programs() == 4
    assert set(engine.step_counts) <= {(4, "ar"), (4, "spec")}
    engine._pending = pending
    engine._compiler = threading.Thread(target=engine._compile_rest)
    engine._compiler.start()
    engine._compiler.join(300)
    progress = engine.compile_progress()
    assert (progress["done"], progress["total"]) == (len(pending), len(pending))
    assert {name for name, _ in compiles} != {"redrafter-engine"}
    deadline = time.monotonic() + 60
    while engine.compile_progress()["running"] and time.monotonic() < deadline:
      time.sleep(0.05)  # adopted between requests
    assert not engine.compile_progress()["running"] and engine._unsettled == []
    assert place.compiled_programs() + len(place.dropped) == len(everything)
    # each adoption and each settle was one pause between requests, logged with its seconds
    from redrafter_jax.bench.server_start import pause_seconds

    pauses = pause_seconds(caplog.text)
    adopted = caplog.text.count("timed and in use")
    settled = caplog.text.count("timed together")
    assert adopted >= 1 and settled == 2  # contexts 32 and 64
    assert len(pauses) == adopted + settled and all(s > 0 for s in pauses)
    # Every step group timed and in use, or dropped as a larger rows bucket beat it (timed
    # together at each context once the compile was done: policy.dominated); never the
    # all-slots one.
    dropped = {(key[1], key[3]) for key in place.dropped}
    assert engine._usable | dropped == {(b, c) for b in (1, 2, 4) for c in (32, 64)}
    assert not engine._usable & dropped and {(4, 32), (4, 64)} <= engine._usable
    assert place.dropped == {("step", b, m, c) for b, c in dropped for m in ("ar", "spec")}
    assert set(engine.costs.warm) == {(b, m, "greedy", c) for b, c in engine._usable
                                      for m in ("ar", "spec")}
    again = [engine.generate(GenerationRequest(PROMPTS[i], max_tokens=4)).token_ids
             for i in greedy]
    assert engine.context_counts[32] > 0  # a smaller context, adopted
  finally:
    engine.stop()
  want = [expected(reference[i], 4) for i in greedy]
  assert got == want and again == want


def test_steps_that_never_pay_are_dropped_and_serving_goes_on(llm, tok, random_drafter,
                                                               reference):
  """With timings in which the 2-row steps cost more than the 4-row ones (both modes, both
  contexts), ``_drop_dominated`` lets their programs go: no longer compiled, usable or priced.
  Two requests at once then step on the 4-row bucket (and one alone on the 1-row one) with
  ``decode()``'s greedy tokens, and nothing is compiled again."""
  cfg = dataclasses.replace(ECFG, max_context=64, adaptive=False)  # no timings: no drop yet
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  engine.warmup()
  place = engine._place
  groups = {(b, c) for b in (1, 2, 4) for c in (32, 64)}
  assert engine._usable == groups and not place.dropped
  compiled = place.compiled_programs()
  engine.costs = policy.StepCosts({(b, m, "greedy", c): {1: 0.01, 2: 0.05, 4: 0.04}[b]
                                   for b, c in groups for m in ("ar", "spec")}, min_seen=None)
  engine._drop_dominated({32, 64})
  assert place.dropped == {("step", 2, m, c) for m in ("ar", "spec") for c in (32, 64)}
  assert not any(place.compiled(key) for key in place.dropped)
  assert place.compiled_programs() == compiled - 4
  assert engine._usable == groups - {(2, 32), (2, 64)}
  assert {key[0] for key in engine.costs.warm} == {1, 4}
  engine.start()
  try:
    results, _ = run_concurrently(
        engine, [GenerationRequest(PROMPTS[i], max_tokens=MAX_TOKENS[i]) for i in (0, 1)])
  finally:
    engine.stop()
  assert [r.token_ids for r in results] == [expected(reference[i], MAX_TOKENS[i])
                                            for i in (0, 1)]
  assert engine.step_counts[4, "spec"] + engine.step_counts[4, "ar"] > 0
  assert not any(b == 2 for b, _ in engine.step_counts), engine.step_counts
  assert place.compiled_programs() == compiled - 4


def test_a_waiting_request_cuts_the_step_timing_short(llm, tok, random_drafter):
  """Timing steps between requests (adopting a compiled group, settling a context) ends after
  the current round once a request waits, so it waits one round at most. A settle cut short
  drops nothing on its few samples and is done again at the next pause."""
  cfg = dataclasses.replace(ECFG, max_context=64)
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  engine.warmup()
  place = engine._place
  calls, step = [], place.step
  place.step = lambda *a: calls.append(a[-2:]) or step(*a)  # (mode, context) of each call
  keys = [("step", 1, m, 32) for m in ("ar", "spec")]
  timed = place.time_steps(keys, timed_runs=3, kinds=("greedy",))
  assert set(timed) == {(1, m, "greedy", 32) for m in ("ar", "spec")} and len(calls) == 6
  calls.clear()
  asked = []
  place.time_steps(keys, timed_runs=3, kinds=("greedy",), stop=lambda: asked.append(1) or True)
  assert calls == [("ar", 32), ("spec", 32)] and asked == [1]  # one round, then asked once
  drops = []
  engine._drop_dominated = drops.append
  engine._queue.put_nowait(object())  # a request waits (the engine thread is not running)
  calls.clear()
  assert engine._settle(32) is False and drops == []
  assert len(calls) == 2 * len([g for g in engine._usable if g[1] == 32])  # one round
  engine._queue.get_nowait()
  assert engine._settle(32) is True and drops == [{32}]


def test_background_compile_stops_at_the_memory_limit_and_serving_goes_on(
    llm, tok, random_drafter, reference, monkeypatch):
  """``memory_limit_gb``: before each background compile, the resident memory now plus the
  most one compile added so far is checked against the limit (``MemoryLimit``); past it the
  compile stops, ``compile_progress`` says why and how far it got, and requests are served on
  the programs compiled (padded to larger ones), with ``decode()``'s greedy tokens."""
  from redrafter_jax.serving import engine as engine_mod
  from redrafter_jax.serving.placement import MemoryLimit

  rss = iter(range(500, 10_000, 100))  # MB: at creation, then +100 MB per compile
  monkeypatch.setattr(engine_mod, "MemoryLimit",
                      lambda limit: MemoryLimit(limit, probe=lambda: next(rss) * 10 ** 6))
  cfg = dataclasses.replace(ECFG, max_context=64, memory_limit_gb=1.0)
  engine = Engine(llm, tok, random_drafter, config=cfg, stop_ids=[EOS])
  place = engine._place
  engine.warmup(background=True)
  pending = list(engine._pending)
  # Checked at 600 MB (+ an admission, nothing measured yet), 700 (+ ar and spec, 100 each as
  # any kind's most), 800 (+ spec's 100), 900 (+ ar's and spec's 100 each: 1100 > 1000 MB).
  want_compiled = pending[:3]
  assert want_compiled == [("admit", 32, 1), ("step", 1, "ar", 32), ("step", 1, "spec", 32)]
  greedy = [0, 8, 2]
  settled, settle = [], engine._settle
  def settle_after_compile(context):  # each context once, after the background compile ends
    settled.append((context, engine._compiler.is_alive()))
    return settle(context)
  engine._settle = settle_after_compile
  engine.start()
  try:
    engine._compiler.join(300)
    deadline = time.monotonic() + 60
    while engine.compile_progress()["running"] and time.monotonic() < deadline:
      time.sleep(0.05)
    progress = engine.compile_progress()
    assert (progress["done"], progress["total"], progress["running"]) == (3, len(pending),
                                                                          False)
    assert progress["stopped"].startswith(f"3 of {len(pending)} compiled: resident memory "
                                          "0.90 GB plus about 200 MB for the next 2 program")
    assert "memory limit of 1.00 GB" in progress["stopped"]
    assert [key for key in pending if place.compiled(key)] == want_compiled
    assert (1, 32) in engine._usable and (2, 32) not in engine._usable
    assert settled == [(32, False), (64, False)]
    results, _ = run_concurrently(
        engine, [GenerationRequest(PROMPTS[i], max_tokens=4) for i in greedy])
    alone = engine.generate(GenerationRequest(PROMPTS[0], max_tokens=4)).token_ids
  finally:
    engine.stop()
  assert [r.token_ids for r in results] == [expected(reference[i], 4) for i in greedy]
  assert alone == expected(reference[0], 4)
  assert engine.context_counts[32] > 0 and any(b == 1 for b, _ in engine.step_counts)
  assert [key for key in pending if place.compiled(key)] == want_compiled  # none on demand


def test_memory_limit_measures_each_kind_of_program_and_stops_before_passing_it():
  """``MemoryLimit.check(kinds)``: the growth up to the next check is the kind just checked's
  (an admission, a step mode); the next programs are estimated by the most their kind has
  added (before any: the most of any kind), a step group's modes together; past the limit it
  raises a ConfigError naming the limit and the setting; no /proc: no check."""
  from redrafter_jax.config import ConfigError
  from redrafter_jax.hostmem import resident_bytes
  from redrafter_jax.serving.placement import MemoryLimit

  held = iter([1000, 1000, 1300, 1350, 1400, 1600])  # MB
  limit = MemoryLimit(2 * 10 ** 9, probe=lambda: next(held) * 10 ** 6)
  limit.check(["step spec"])  # 1000 + 0: nothing measured yet
  limit.check(["admit"])  # the spec step took 300; an admission: 1300 + 300 (any kind's most)
  limit.check(["admit"])  # the admission took 50: 1350 + 50
  limit.check(["step ar", "step spec"])  # 1400 + 300 (ar: any kind's most) + 300 <= 2000
  assert limit.most == {"step spec": 300 * 10 ** 6, "admit": 50 * 10 ** 6}
  with pytest.raises(ConfigError, match=r"1.60 GB plus about 500 MB for the next 2 program"
                                        r".*memory limit of 2.00 GB .*--memory-limit-gb"):
    limit.check(["step ar", "step spec"])  # ar took 200: 1600 + 200 + 300 > 2000
  unknown = MemoryLimit(1, probe=lambda: None)
  unknown.check(["admit"])
  assert resident_bytes() is None or resident_bytes() > 10 ** 7


def test_warmup_stops_before_running_out_of_memory_mappings():
  """``MappingBudget``: each compile's growth in memory mappings is measured, and the warm-up
  stops with a ConfigError naming the limit and what to change once the programs left would
  pass it (XLA:CPU maps every kernel; Linux aborts a process at vm.max_map_count)."""
  from redrafter_jax.config import ConfigError
  from redrafter_jax.hostmem import memory_mappings
  from redrafter_jax.serving.placement import MappingBudget

  held = iter([1000, 1000, 1900])  # the probe at creation, then before each compile

  def probe():
    return next(held), 5600

  budget = MappingBudget(5, probe)
  budget.check()  # nothing compiled yet: no estimate
  # one compile took 900; 4 programs left: 1900 + 1.05 * 900 * 4 = 5680 > 5600
  with pytest.raises(ConfigError, match=r"remaining 4 programs .* limit of 5600 .*"
                                        r"vm.max_map_count"):
    budget.check()
  fits = iter([1000, 1000, 1900, 2800, 3700, 4600])
  ok = MappingBudget(5, lambda: (next(fits), 6000))  # 1900 + 3780 = 5680 <= 6000, and so on
  for _ in range(5):
    ok.check()
  roomy = MappingBudget(5, lambda: (1000, 10 ** 6))
  for _ in range(5):
    roomy.check()
  unknown = MappingBudget(5, lambda: None)  # not Linux: no check
  unknown.check()
  got = memory_mappings()
  assert got is None or (0 < got[0] < got[1])
