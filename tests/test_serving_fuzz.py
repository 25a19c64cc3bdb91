"""Schema-driven fuzzing of every HTTP route (hypothesis) against a tiny random model.

Each case is one request: a body built from the API's schema where any field may be valid,
missing, or adversarial JSON (wrong types, huge or negative ints, NaN/inf, nested junk, unicode),
plus unknown fields; or raw bytes; or another route and method. Invariants, for every case:
the answer is 2xx or 4xx (never 5xx, never a dropped connection), a 4xx carries an OpenAI error
object with a code, a stream ends with ``[DONE]``, and once the answer is in, the engine is
alive and idle again (no slot, queue place or load count leaked). After all cases: the
``bad_request`` counter counted every 400, the gauges read idle, and a fixed request still gets
the same answer as before.
"""

import json
import time
import urllib.parse

import httpx
import pytest
from flax import nnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from redrafter_jax.config import DecodeConfig, DrafterConfig, LlamaConfig
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama
import serving_doubles as testing
from redrafter_jax.serving.app import create_app
from redrafter_jax.serving.engine import Engine, EngineConfig
from redrafter_jax.serving.server import ServerThread

V = 64
MODEL = "tiny-fuzz"
LLM_CFG = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True,
                      max_position_embeddings=128)
DCFG = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=8)
ECFG = EngineConfig(slots=2, max_context=48, max_tokens=8, max_queue=4, decode=DCFG)
EXAMPLES = 200


@pytest.fixture(scope="module")
def fuzz_server():
  llm = Llama(LLM_CFG, rngs=nnx.Rngs(0))
  drafter = Drafter(DrafterConfig(vocab_size=V, hidden_size=16, exit_dim=16), rngs=nnx.Rngs(1))
  tok = testing.word_tokenizer(V)
  engine = Engine(llm, tok, drafter, config=ECFG, stop_ids=[2]).start()
  try:
    with ServerThread(create_app(engine, tok, model_name=MODEL)) as srv:
      yield srv, engine
  finally:
    engine.stop()


# ---------------------------------------------------------------------------- strategies

EDGE_INTS = [0, -1, 1, 7, 2**31 - 1, 2**31, -2**31 - 1, 2**63, 2**64, -2**63 - 1, 10**30]
EDGE_FLOATS = [0.0, -0.0, 1e-50, 1e-9, 0.5, 2.0, 2.0000001, 1e308, float("nan"), float("inf"),
               float("-inf")]
scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from(EDGE_INTS)
           | st.floats() | st.sampled_from(EDGE_FLOATS) | st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)

ints = st.integers() | st.sampled_from(EDGE_INTS)
floats = st.floats() | st.sampled_from(EDGE_FLOATS) | ints
words = st.lists(st.integers(0, V), min_size=1, max_size=12).map(
    lambda ids: " ".join(f"w{i}" for i in ids))
token_ids = st.lists(st.integers(0, V - 1), min_size=1, max_size=12)
texts = words | st.text(min_size=1, max_size=16)
# field -> (valid values, adversarial values of about the right JSON type)
SHARED = {
    "model": (st.just(MODEL), st.text(max_size=8) | st.just("gpt-4o")),
    "max_tokens": (st.integers(1, 8), ints),
    "temperature": (st.sampled_from([0, 0.0, 0.7, 1.0, 2]), floats),
    "top_p": (st.sampled_from([0.1, 0.9, 1.0]), floats),
    "top_k": (st.integers(-1, 12), ints),
    "seed": (st.integers(-2**63, 2**64 - 1), ints | floats),
    "stop": (st.none() | texts | st.lists(texts, max_size=4),
             st.lists(st.text(max_size=300), max_size=6) | st.just([""])),
    "stream": (st.booleans(), scalars),
    "stream_options": (st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.dictionaries(st.text(max_size=14), scalars, max_size=2)),
    "n": (st.just(1), ints),
    "presence_penalty": (st.just(0.0), floats),
    "logit_bias": (st.none() | st.just({}), st.dictionaries(st.text(max_size=4), floats,
                                                            max_size=2)),
    "user": (st.text(max_size=8), scalars),
}
REQUIRED = {"model", "prompt", "messages"}
prompt_edge = (st.lists(st.integers(-2, V + 2) | ints, max_size=8)
               | st.lists(st.lists(ints, max_size=4), max_size=8)
               | st.lists(words, min_size=7, max_size=9) | st.just("") | st.just([])
               | st.text(max_size=40) | st.just("w1 " * 60))
COMPLETION = {**SHARED, "prompt": (words | token_ids | st.lists(words, min_size=1, max_size=3)
                                   | st.lists(token_ids, min_size=1, max_size=3), prompt_edge),
              "echo": (st.just(False), scalars), "best_of": (st.sampled_from([None, 1]), ints)}
ROLES = ["system", "developer", "user", "assistant", "tool"]
content = texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                           min_size=1, max_size=3)
message = st.fixed_dictionaries({"role": st.just("user"), "content": content})
message_edge = st.fixed_dictionaries(
    {}, optional={"role": st.sampled_from(ROLES + ["robot", ""]) | scalars,
                  "content": content | junk | st.just([{"type": "image_url", "image_url": {}}]),
                  "name": scalars})
CHAT = {**SHARED, "messages": (st.lists(message, min_size=1, max_size=3),
                               st.lists(message_edge, max_size=4) | junk),
        "max_completion_tokens": (st.none() | st.integers(1, 8), ints),
        "response_format": (st.sampled_from([None, {"type": "text"}]), junk)}


@st.composite
def schema_body(draw, schema: dict) -> bytes:
  """A body of valid fields ("valid"), the same with one field set to an adversarial value
  ("one"), or every field valid, adversarial, junk or missing at random ("all"); plus unknown
  fields."""
  mode = draw(st.sampled_from(["valid", "one", "one", "one", "all"]))
  target = draw(st.sampled_from(sorted(schema)))
  body = {}
  for name, (valid, edge) in schema.items():
    if mode != "all":
      choice = "edge" if mode == "one" and name == target else "valid" if name in REQUIRED else \
          draw(st.sampled_from(["valid", "missing"]))
    else:
      choice = draw(st.sampled_from(["valid", "valid", "edge", "junk", "missing"]))
    if choice != "missing":
      body[name] = draw({"valid": valid, "edge": edge, "junk": junk}[choice])
  for key, value in draw(st.dictionaries(st.text(max_size=8), junk, max_size=2)).items():
    body.setdefault(key, value)  # unknown fields
  return json.dumps(body, allow_nan=True).encode()


RAW = st.binary(max_size=40) | st.sampled_from([
    b"", b"   ", b"null", b"[]", b"{", b'{"model": "\\ud800"}', b"\xff\xfe{}",
    b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b'{"model": "tiny-fuzz", "prompt": "w1", "max_tokens": 1e999}',
    json.dumps({"model": MODEL, "prompt": "w1 " * 100, "max_tokens": 4}).encode(),
])
POST_ROUTES = ["/v1/completions", "/v1/chat/completions"]
schema_cases = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/completions"), schema_body(COMPLETION)),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), schema_body(CHAT)))
cases = st.one_of(
    schema_cases, schema_cases, schema_cases,
    st.tuples(st.just("POST"), st.sampled_from(POST_ROUTES), RAW),
    st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
              st.sampled_from(["/health", "/metrics", "/v1/models", "/v1/nothing", "/"]
                              + POST_ROUTES), st.just(b"")),
    st.tuples(st.just("GET"), st.text(max_size=12).map(
        lambda name: "/v1/models/" + urllib.parse.quote(name, safe="")), st.just(b"")),
)


# ---------------------------------------------------------------------------- invariants


def _metric(url, name) -> float:
  for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
    key, _, value = line.rpartition(" ")
    if key == name:
      return float(value)
  raise AssertionError(f"{name} not in /metrics")


def _wait_idle(engine, timeout=60.0) -> None:
  """Slots, queue and the load count all back to zero (cancelled requests leave at the next
  engine step, so this may take a moment)."""
  deadline = time.monotonic() + timeout
  while not (engine.active_slots() == 0 and engine.queue_length() == 0 and engine._load == 0):
    assert engine.alive, engine.error
    assert time.monotonic() < deadline, (engine.active_slots(), engine.queue_length(),
                                         engine._load)
    time.sleep(0.01)


def _check_response(r: httpx.Response, method: str, path: str, raw: bytes) -> int:
  where = (method, path, raw[:300])
  assert r.status_code < 500, (where, r.status_code, r.text[:500])
  assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (where, r.status_code)
  if r.status_code >= 400:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, (where, err)
    assert err["message"] and isinstance(err["code"], str) and err["code"], (where, err)
  elif r.headers.get("content-type", "").startswith("text/event-stream"):
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", (where, r.text[-300:])
    for e in events[:-1]:
      assert "error" not in json.loads(e), (where, e)
  elif path in POST_ROUTES:
    assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]), where
  return r.status_code


def test_fuzzed_requests_never_break_the_server(fuzz_server):
  srv, engine = fuzz_server
  url = srv.url
  fixed = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 6}
  before = httpx.post(f"{url}/v1/completions", json=fixed, timeout=120).json()["choices"]
  counted = _metric(url, 'redrafter_rejected_requests_total{reason="bad_request"}')
  statuses = []

  @settings(max_examples=EXAMPLES, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
  @given(cases)
  @example(("POST", "/v1/chat/completions", json.dumps({  # issue 23's repro
      "model": MODEL, "messages": [{"role": "user", "content": "w1"}], "max_tokens": 8,
      "temperature": 0.7, "top_k": 2**31}).encode()))
  @example(("POST", "/v1/completions", json.dumps({
      "model": MODEL, "prompt": "w1", "temperature": 1e-40, "top_p": 1e-46}).encode()))
  def one_case(case):
    method, path, raw = case
    headers = {"content-type": "application/json"} if raw else {}
    r = httpx.request(method, f"{url}{path}", content=raw, headers=headers, timeout=30)
    statuses.append(_check_response(r, method, path, raw))
    _wait_idle(engine)

  one_case()
  assert len(statuses) >= EXAMPLES
  assert any(s == 200 for s in statuses) and any(s == 400 for s in statuses)
  _wait_idle(engine)
  assert _metric(url, 'redrafter_rejected_requests_total{reason="bad_request"}') == \
      counted + statuses.count(400) + statuses.count(405)
  assert _metric(url, "redrafter_active_slots") == 0
  assert _metric(url, "redrafter_queue_length") == 0
  health = httpx.get(f"{url}/health", timeout=10).json()
  assert (health["status"], health["active_slots"], health["queue_length"]) == ("ok", 0, 0)
  after = httpx.post(f"{url}/v1/completions", json=fixed, timeout=120).json()["choices"]
  assert after == before
