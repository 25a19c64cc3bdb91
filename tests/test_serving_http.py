"""The OpenAI-compatible HTTP server, in-process on 127.0.0.1 (uvicorn in a thread), driven by
the official ``openai`` client and raw HTTP: parity with ``decode()``, streaming, stop strings,
seeds, bad input, queue limit, disconnects, metrics, and a small load test."""

import concurrent.futures as cf
import json
import sys
import threading
import time
import traceback

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx
from jax.experimental import io_callback

import serving_doubles as testing
from redrafter_jax.config import DecodeConfig, LlamaConfig
from redrafter_jax.inference.decode import decode
from redrafter_jax.models.llama import Llama
from redrafter_jax.bench import loadtest
from redrafter_jax.serving import protocol
from redrafter_jax.serving.app import create_app, protect
from redrafter_jax.serving.engine import Engine, EngineConfig
from redrafter_jax.serving.server import ServerThread
from redrafter_jax.weights import tokenizer as tokenizer_lib

V = 256
EOS = 2
MODEL = "tiny-test"
LLM_CFG = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                      max_position_embeddings=512)
DCFG = DecodeConfig(beam_width=3, beam_length=4, max_new_tokens=32)
ECFG = EngineConfig(slots=4, max_context=128, max_tokens=32, max_queue=32, decode=DCFG)
RNG = np.random.default_rng(1)
PROMPTS = [" ".join(f"w{i}" for i in RNG.integers(0, V - 6, size=n)) for n in
           [1, 4, 30, 9, 15, 2, 26, 6, 20, 11, 3, 17, 8, 24, 5, 13]]
MAX_TOKENS = [16, 4, 9, 1, 32, 7, 12, 25, 3, 16, 10, 2, 16, 6, 14, 8]


@pytest.fixture(scope="module")
def llm():
  return Llama(LLM_CFG, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def tok():
  return testing.word_tokenizer(V)


@pytest.fixture(scope="module")
def server(llm, tok):
  engine = Engine(llm, tok, testing.SelfDrafter(V), config=ECFG, stop_ids=[EOS]).start()
  with ServerThread(create_app(engine, tok, model_name=MODEL)) as srv:
    yield srv
  engine.stop()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_text(llm, prompt_ids: list[list[int]], max_tokens: list[int]) -> list[str]:
  """What the server must answer at temperature 0: ``decode()``'s tokens, as text."""
  tokens = decode(llm, testing.SelfDrafter(V), prompt_ids, DCFG, stop_ids=[EOS]).tokens
  return [testing.word_text(t for t in row[:m] if t != EOS) for row, m in zip(tokens, max_tokens)]


def encode(tok, text):
  return tokenizer_lib.encode(tok, text, chat=False)


def test_completion_and_chat_match_decode(client, llm, tok):
  r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0)
  chat_ids = tokenizer_lib.encode_messages(tok, [{"role": "user", "content": PROMPTS[4]}])
  c = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                     messages=[{"role": "user", "content": PROMPTS[4]}])
  want = greedy_text(llm, [encode(tok, PROMPTS[2]), chat_ids], [12, 12])
  assert r.choices[0].text == want[0] and r.object == "text_completion"
  assert c.choices[0].message.content == want[1] and c.choices[0].message.role == "assistant"
  for resp, prompt_len in ((r, len(encode(tok, PROMPTS[2]))), (c, len(chat_ids))):
    assert resp.model == MODEL and resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens == prompt_len
    spec = resp.usage.model_extra["speculative"]
    assert spec["mode"] == "redrafter" and spec["steps"] >= 1
    assert spec["tokens_per_step"] == pytest.approx((spec["accepted_tokens"] + spec["steps"])
                                                    / spec["steps"])
    assert spec["accepted_tokens"] > 0  # the self-drafter's drafts are mostly right


def test_streaming_equals_non_streaming(client):
  plain = client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=20, temperature=0)
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=20,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
  assert text == plain.choices[0].text
  assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) > 1  # really streamed
  assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == \
      plain.choices[0].finish_reason
  assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

  messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": PROMPTS[3]}]
  plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                         temperature=0)
  chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                               temperature=0, stream=True))
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
      plain.choices[0].message.content
  assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stop_strings(client):
  full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                   temperature=0).choices[0].text
  words = full.split(" ")
  stop = " ".join(words[3:5])
  r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                stop=[stop])
  assert r.choices[0].finish_reason == "stop"
  assert r.choices[0].text == full[:full.index(stop)]
  streamed = "".join(ch.choices[0].text for ch in client.completions.create(
      model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True))
  assert streamed == r.choices[0].text


def test_seed_reproducible_with_concurrent_requests(client):
  ask = lambda seed, prompt=PROMPTS[5]: client.completions.create(
      model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=seed).choices[0].text
  alone = ask(7)
  with cf.ThreadPoolExecutor(6) as pool:
    noise = [pool.submit(ask, 100 + i, PROMPTS[i]) for i in range(5)]
    again = pool.submit(ask, 7)
    texts = [f.result(timeout=300) for f in noise]
  assert again.result(timeout=300) == alone
  assert ask(8) != alone
  assert len(set(texts)) > 1


def test_sixteen_concurrent_requests_match_decode(client, llm, tok):
  def ask(i):
    return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i],
                                     temperature=0).choices[0].text
  with cf.ThreadPoolExecutor(16) as pool:
    got = list(pool.map(ask, range(16), timeout=600))
  assert got == greedy_text(llm, [encode(tok, p) for p in PROMPTS], MAX_TOKENS)


def _post(url, path, body: bytes | str | dict, timeout: float = 60):
  content = json.dumps(body) if isinstance(body, dict) else body
  return httpx.post(f"{url}{path}", content=content, timeout=timeout,
                    headers={"content-type": "application/json"})


GOOD = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 2}
BAD = [  # (path, body, status, param, code)
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt", "empty_prompt"),
    ("/v1/completions", {**GOOD, "prompt": []}, 400, "prompt", "empty_prompt"),
    ("/v1/completions", {**GOOD, "prompt": " ".join(["w3"] * 200)}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": " ".join(["w3"] * 100), "max_tokens": 30}, 400,
     "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, V + 1]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {**GOOD, "prompt": [[1]] * 37}, 400, "prompt", "too_many_prompts"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens", "integer_below_min_value"),
    ("/v1/completions", {**GOOD, "max_tokens": -3}, 400, "max_tokens",
     "integer_below_min_value"),
    ("/v1/completions", {**GOOD, "max_tokens": 10_000}, 400, "max_tokens",
     "integer_above_max_value"),
    ("/v1/completions", {**GOOD, "max_tokens": 2**31}, 400, "max_tokens",
     "integer_above_max_value"),
    ("/v1/completions", {**GOOD, "temperature": -1}, 400, "temperature",
     "integer_below_min_value"),
    ("/v1/completions", {**GOOD, "temperature": 2.5}, 400, "temperature",
     "decimal_above_max_value"),
    ("/v1/completions", {**GOOD, "temperature": 1e-9}, 400, "temperature",
     "decimal_below_min_value"),
    ("/v1/completions", '{"model": "tiny-test", "prompt": "w1", "temperature": NaN}', 400,
     "temperature", "invalid_value"),
    ("/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p", "decimal_above_max_value"),
    ("/v1/completions", {**GOOD, "top_p": 1e-50}, 400, "top_p", "decimal_below_min_value"),
    ("/v1/completions", {**GOOD, "temperature": 0.7, "top_k": 2**31}, 400, "top_k",
     "integer_above_max_value"),
    ("/v1/completions", {**GOOD, "top_k": -2}, 400, "top_k", "integer_below_min_value"),
    ("/v1/completions", {**GOOD, "seed": 2**64}, 400, "seed", "integer_above_max_value"),
    ("/v1/completions", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "array_above_max_length"),
    ("/v1/completions", {**GOOD, "stop": "x" * 300}, 400, "stop", "invalid_value"),
    ("/v1/completions", {**GOOD, "n": 2}, 400, "n", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "w1"}, 400, "model", "missing_required_parameter"),
    ("/v1/completions", '{"model": "tiny-test", "prompt": "w1"', 400, None, "invalid_json"),
    ("/v1/completions", "[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", "", 400, None, "invalid_json"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "empty_prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages", "invalid_value"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "integer_below_min_value"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 33}, 400,
     "max_completion_tokens", "integer_above_max_value"),
]


def test_bad_input_gets_4xx_and_the_server_keeps_serving(server):
  refused = _metric(server.url, 'redrafter_rejected_requests_total{reason="bad_request"}')
  for path, body, status, param, code in BAD:
    r = _post(server.url, path, body)
    assert r.status_code == status, (body, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert (err["param"], err["code"]) == (param, code), (body, err)
    good = _post(server.url, "/v1/completions", GOOD)
    assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
  assert httpx.get(f"{server.url}/v1/nothing", timeout=10).json()["error"]["code"] == "not_found"
  # Every 400 is counted (the 404s under their own reason).
  assert _metric(server.url, 'redrafter_rejected_requests_total{reason="bad_request"}') == \
      refused + sum(status == 400 for _, _, status, _, _ in BAD)
  assert _metric(server.url, 'redrafter_rejected_requests_total{reason="not_found"}') >= 2


def test_error_messages_name_the_field():
  """Messages say which field (nested ones by their path) and which name the client used."""
  with pytest.raises(protocol.APIError) as e:
    protocol.parse(protocol.ChatCompletionRequest,
                   json.dumps({**CHAT, "messages": [{"content": "w1"}]}).encode())
  assert "'messages[0].role' is required" in e.value.message
  assert e.value.code == "missing_required_parameter"


def _wait(predicate, timeout=120.0, state=lambda: ""):
  """Poll until ``predicate()``; on timeout fail with ``state()`` (what the test saw) and where
  every thread of the process stood (a request that never reached the queue once hung here on
  CI's loaded machine, 2026-12-07, and passed alone: the stacks name where it waits)."""
  deadline = time.monotonic() + timeout
  while not predicate():
    assert time.monotonic() < deadline, f"timed out {state()}\n{_thread_stacks()}"
    time.sleep(0.05)


def _thread_stacks() -> str:
  names = {t.ident: t.name for t in threading.enumerate()}
  return "\n".join(f"--- thread {names.get(ident, ident)}:\n" + "".join(
      traceback.format_stack(frame)[-8:]) for ident, frame in sys._current_frames().items())


def _health(url):
  return httpx.get(f"{url}/health", timeout=10).json()


def _metric(url, name):
  """A sample's value from /metrics; ``name`` may include labels (0 when absent)."""
  for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
    key, _, value = line.rpartition(" ")
    if key == name:
      return float(value)
  return 0.0


# While GATE is clear, every decode step of the one-slot server blocks (inside the jitted step,
# through a host callback), so a request stays in its slot for as long as a test needs:
# no test depends on how fast the tiny model is. On XLA:CPU a program with a host callback runs
# in the engine thread's dispatch, and the engine hands out a request's first token only after
# dispatching the next step: ``_close_gate(free_steps=1)`` lets that step through, so the first
# token arrives at once rather than when the gate's wait times out.
GATE = threading.Event()
GATE.set()
_FREE_STEPS = [0]


def _close_gate(free_steps: int = 0) -> None:
  _FREE_STEPS[0] = free_steps
  GATE.clear()


def _pass_gate():
  if _FREE_STEPS[0] > 0:
    _FREE_STEPS[0] -= 1
  else:  # every test sets the gate when done; the timeout only keeps a broken test from hanging
    GATE.wait(600)
  return np.int32(0)


class GatedDrafter(testing.SelfDrafter):

  def propose(self, llm, state, cfg):
    beams = super().propose(llm, state, cfg)
    zero = io_callback(_pass_gate, jax.ShapeDtypeStruct((), jnp.int32))
    return beams.replace(beams_BWL=beams.beams_BWL + zero)


@pytest.fixture(scope="module")
def one_slot(llm, tok):
  """One slot and one waiting place, with gated steps."""
  cfg = EngineConfig(slots=1, max_context=512, max_tokens=400, max_queue=1, decode=DCFG)
  engine = Engine(llm, tok, GatedDrafter(V), config=cfg, stop_ids=()).start()
  try:
    with ServerThread(create_app(engine, tok, model_name=MODEL)) as srv:
      yield srv, engine
  finally:
    GATE.set()
    engine.stop()


CANCELLED = 'redrafter_requests_total{finish_reason="cancelled"}'
LONG = {"model": MODEL, "prompt": "w1", "max_tokens": 400}


def _slot_cancelled(engine) -> bool:
  active = engine._slots[0]  # the engine sees a cancellation at its next step boundary
  return active is not None and active.handle.cancelled


def test_queue_limit_429_and_disconnect_frees_the_slot(one_slot):
  srv, engine = one_slot
  url = srv.url
  cancelled = _metric(url, CANCELLED)
  _close_gate(free_steps=1)
  try:
    with httpx.stream("POST", f"{url}/v1/completions", json={**LONG, "stream": True},
                      timeout=120) as first:
      # Hold the line iterator: a generator expression over ``first.iter_lines()`` alone would
      # be freed after ``next`` and finalize it, which closes the stream, and the server would
      # cancel the request as a disconnect long before the test leaves the block (under load
      # the freed slot then went to the waiting request, which never reached the queue).
      lines = first.iter_lines()
      event = next(line for line in lines if line.startswith("data: "))  # in the slot
      result = {}

      def wait_in_queue():  # queued behind the gated stream: it must outlast the checks below
        try:
          result["r"] = _post(url, "/v1/completions", {**GOOD, "max_tokens": 3}, timeout=600)
        except Exception as e:  # shown by the assertion below, not lost in the thread
          result["r"] = e

      waiter = threading.Thread(target=wait_in_queue)
      waiter.start()
      _wait(lambda: _health(url)["queue_length"] == 1 or not waiter.is_alive(),
            state=lambda: f"(first stream's first event {event!r}; /health {_health(url)})")
      r = result.get("r")
      assert waiter.is_alive(), (
          f"the waiting request ended: {getattr(r, 'status_code', r)} {getattr(r, 'text', '')}")
      refused = _post(url, "/v1/completions", GOOD)  # slot busy, queue full
      assert refused.status_code == 429, refused.text
      assert refused.json()["error"]["code"] == "queue_full"
      assert refused.headers["retry-after"] == "1"
    _wait(lambda: _slot_cancelled(engine))  # leaving mid-stream cancelled the request
  finally:
    GATE.set()
  waiter.join(120)  # the waiting request got the freed slot
  assert result["r"].status_code == 200
  assert result["r"].json()["usage"]["completion_tokens"] == 3
  assert _metric(url, CANCELLED) == cancelled + 1
  assert _health(url)["active_slots"] == 0
  assert _post(url, "/v1/completions", GOOD).status_code == 200


def test_client_that_gives_up_on_a_plain_request_is_cancelled(one_slot):
  srv, engine = one_slot
  url = srv.url
  cancelled = _metric(url, CANCELLED)
  GATE.clear()
  try:
    with pytest.raises(httpx.TimeoutException):
      httpx.post(f"{url}/v1/completions", json=LONG, timeout=0.5)
    _wait(lambda: _slot_cancelled(engine))
  finally:
    GATE.set()
  _wait(lambda: _metric(url, CANCELLED) == cancelled + 1)
  _wait(lambda: _health(url)["active_slots"] == 0)
  assert _post(url, "/v1/completions", GOOD).status_code == 200


def test_models_health_and_metrics(server, client):
  assert [m.id for m in client.models.list().data] == [MODEL]
  health = _health(server.url)
  assert health["status"] == "ok" and health["mode"] == "redrafter" and health["slots"] == 4
  client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0)
  text = httpx.get(f"{server.url}/metrics", timeout=10).text
  for name in ("redrafter_requests_total", "redrafter_generation_tokens_total",
               "redrafter_tokens_per_step_bucket", 'redrafter_acceptance_rate{depth="1"}',
               'redrafter_acceptance_rate{depth="3"}', "redrafter_queue_length",
               "redrafter_active_slots", "redrafter_step_seconds_bucket",
               "redrafter_time_to_first_token_seconds_bucket"):
    assert name in text, name
  steps = _metric(server.url, "redrafter_tokens_per_step_count")
  total = _metric(server.url, "redrafter_tokens_per_step_sum")
  assert steps > 0 and total / steps > 1.2  # the self-drafter's multi-token steps
  # Row-steps reaching each depth add up to the tokens, and give the per-depth rates.
  reached = [_metric(server.url, f'redrafter_draft_accepted_at_depth_total{{depth="{d}"}}')
             for d in range(DCFG.beam_length)]
  assert reached[0] == steps and sum(reached) == total
  for d in range(1, DCFG.beam_length):
    rate = _metric(server.url, f'redrafter_acceptance_rate{{depth="{d}"}}')
    assert rate == pytest.approx(reached[d] / reached[d - 1])


@pytest.mark.parametrize("chat", [False, True])
def test_small_load_test_all_complete(server, capsys, chat):
  """The load-test script against this server: 16 requests from 4 clients, none lost (raw
  completions, or chat messages through the chat template)."""
  code = loadtest.main(["--url", server.url, "--requests", "16", "--concurrency", "4",
                        "--max-tokens", "8", "--warmup", "0", "--json"] + ["--chat"] * chat)
  out = capsys.readouterr().out
  report = json.loads(out[out.index("{\n"):])["server"]
  assert code == 0, out
  assert (report["completed"], report["failed"], report["lost"]) == (16, 0, 0), report
  assert 16 <= report["completion_tokens"] <= 16 * 8
  assert report["latency_p99_s"] >= report["latency_p50_s"] > 0
  assert report["tokens_per_step"] > 1  # the self-drafter's drafts were accepted
  assert "16/16" in out and "latency p99" in out


def test_an_engine_fault_is_a_500_for_that_request_only(one_slot, monkeypatch):
  srv, engine = one_slot
  real_admission = engine._place.admission

  def admission(slot, prompt, *args):
    if prompt == encode(testing.word_tokenizer(V), "w9 w9 w9"):
      raise OverflowError("injected fault")
    return real_admission(slot, prompt, *args)

  monkeypatch.setattr(engine._place, "admission", admission)
  poison = {**GOOD, "prompt": "w9 w9 w9"}
  r = _post(srv.url, "/v1/completions", poison)
  assert r.status_code == 500, r.text
  err = r.json()["error"]
  assert err["code"] == "internal_error" and "injected fault" in err["message"]
  with httpx.stream("POST", f"{srv.url}/v1/completions", json={**poison, "stream": True},
                    timeout=60) as s:
    events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
  assert json.loads(events[0])["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
  assert _post(srv.url, "/v1/completions", GOOD).status_code == 200
  assert _health(srv.url) == {**_health(srv.url), "status": "ok", "active_slots": 0,
                              "queue_length": 0}


def test_parsing_runs_off_the_event_loop(server, monkeypatch):
  """While one request's tokenization is stuck, /health and other requests still answer: the
  body is parsed and tokenized in a worker thread, not on the event loop."""
  entered, release, threads = threading.Event(), threading.Event(), []
  real_encode = tokenizer_lib.encode

  def slow_encode(tok, text, **kwargs):
    if text == "w42 w42 w42":
      threads.append(threading.current_thread().name)
      entered.set()
      assert release.wait(60)
    return real_encode(tok, text, **kwargs)

  monkeypatch.setattr(tokenizer_lib, "encode", slow_encode)
  result = {}
  stuck = threading.Thread(target=lambda: result.update(
      r=_post(server.url, "/v1/completions", {**GOOD, "prompt": "w42 w42 w42"})))
  stuck.start()
  try:
    assert entered.wait(60)
    t0 = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 5
  finally:
    release.set()
    stuck.join(60)
  assert result["r"].status_code == 200
  assert threads and threads[0].startswith("redrafter-parse")


def test_body_over_the_limit_is_413(one_slot):
  srv, engine = one_slot
  app = create_app(engine, testing.word_tokenizer(V), model_name=MODEL, max_body_bytes=200)
  with ServerThread(app) as small:
    ok = {**GOOD, "prompt": "w1 " * 20}
    assert _post(small.url, "/v1/completions", ok).status_code == 200
    big = json.dumps({**GOOD, "prompt": "w1 " * 100}).encode()
    r = _post(small.url, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    chunked = httpx.post(f"{small.url}/v1/chat/completions", content=iter([big[:150], big[150:]]),
                         headers={"content-type": "application/json"}, timeout=30)
    assert "content-length" not in chunked.request.headers
    assert chunked.status_code == 413, chunked.text
    assert _metric(small.url, 'redrafter_rejected_requests_total{reason="too_large"}') >= 2
    assert _post(small.url, "/v1/completions", ok).status_code == 200


@pytest.mark.parametrize("finishes", [True, False])
def test_shutdown_drains_requests_in_flight(one_slot, finishes):
  """Stopping the HTTP server: new requests get 503 and /health says draining while a request
  is in flight; that request finishes within the grace (finish_reason, then [DONE]) or, past
  the grace, ends with a shutting_down error event, then [DONE]. The engine is left idle."""
  srv, engine = one_slot
  app = create_app(engine, testing.word_tokenizer(V), model_name=MODEL)
  http = ServerThread(app, shutdown_grace=60 if finishes else 0.5).start()
  # More tokens than the prefill and the one free step can give (the self-drafter's beams are
  # all accepted): the request must still be held at the gate when the server starts draining,
  # or the drain finds nothing in flight and the server is gone before /health is asked.
  held = 2 * (DCFG.beam_length + 1)
  body = {**LONG, "max_tokens": held if finishes else 400, "stream": True}
  _close_gate(free_steps=1)
  stopper = threading.Thread(target=http.stop)
  try:
    with httpx.stream("POST", f"{http.url}/v1/completions", json=body, timeout=120) as s:
      lines = s.iter_lines()
      first = next(line for line in lines if line.startswith("data: "))
      assert engine.active_slots() == 1, "the streamed request is not held at the gate"
      stopper.start()
      _wait(lambda: _health_status(http.url) == 503)
      assert httpx.get(f"{http.url}/health", timeout=10).json()["status"] == "draining"
      refused = _post(http.url, "/v1/completions", GOOD)
      assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
      if finishes:
        GATE.set()
      events = [first[6:]] + [line[6:] for line in lines if line.startswith("data: ")]
  finally:
    GATE.set()
    stopper.join(60)
  assert not stopper.is_alive()
  assert events[-1] == "[DONE]"
  last = json.loads(events[-2])
  if finishes:
    assert last["choices"][0]["finish_reason"] == "length"
  else:
    assert last["error"]["code"] == "shutting_down"
  _wait(lambda: engine.active_slots() == 0 and engine._load == 0)


def _health_status(url) -> int:
  return httpx.get(f"{url}/health", timeout=10).status_code


def test_api_key_cors_and_allowed_hosts(one_slot):
  """With a key, /v1 routes need 'Authorization: Bearer KEY' (the openai client sends it) and
  /health stays open; CORS answers the configured origin only; an unlisted Host gets 400."""
  srv, engine = one_slot
  app = create_app(engine, testing.word_tokenizer(V), model_name=MODEL)
  unauthorized = engine.metrics.rejected.labels(reason="unauthorized")
  protect(app, api_key="s3cret", cors_origins=["https://app.example"],
                 allowed_hosts=["127.0.0.1", "localhost"], on_reject=unauthorized.inc)
  before = unauthorized._value.get()
  with ServerThread(app) as http:
    url = http.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
      r = httpx.post(f"{url}/v1/completions", json=GOOD, headers=headers, timeout=30)
      assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    assert unauthorized._value.get() == before + 4
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
    assert good.completions.create(model=MODEL, prompt="w1", max_tokens=2).choices[0].text
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{url}/v1/completions", headers=preflight, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(f"{url}/v1/completions", timeout=30,
                      headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{url}/health", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 400
