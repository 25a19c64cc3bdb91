"""The server on the real SmolLM2-135M-Instruct with the shipped drafter (slow): chat through the
official client equals ``decode()``, streamed and not, with the real tokenizer and chat template,
and the drafts are accepted."""

import dataclasses

import openai
import pytest

from redrafter_jax.inference.decode import decode
from redrafter_jax.serving.app import create_app
from redrafter_jax.serving.engine import Engine, EngineConfig
from redrafter_jax.serving.server import ServerThread
from redrafter_jax.weights import tokenizer as tokenizer_lib
from redrafter_jax.weights.drafter_io import load_drafter
from redrafter_jax.weights.shipped import recommended_config, resolve_drafter

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]


def test_smollm2_chat_matches_decode(smollm2):
  llm, cfg, tok = smollm2
  path = resolve_drafter("shipped")  # it reads layers 2, 15 and 27: the slots carry their states
  drafter = load_drafter(path)
  dcfg = dataclasses.replace(recommended_config(path, max_new_tokens=24), cache_size=256)
  stop_ids = tokenizer_lib.stop_token_ids(tok)
  engine = Engine(llm, tok, drafter, config=EngineConfig(slots=2, max_context=256, max_tokens=24,
                                                         decode=dcfg),
                  stop_ids=stop_ids).start()
  try:
    with ServerThread(create_app(engine, tok, model_name="smollm2")) as srv:
      client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                             timeout=600)
      messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
      got = [client.chat.completions.create(model="smollm2", messages=m, max_tokens=24,
                                            temperature=0) for m in messages]
      streamed = "".join(ch.choices[0].delta.content or "" for ch in
                         client.chat.completions.create(model="smollm2", messages=messages[0],
                                                        max_tokens=24, temperature=0,
                                                        stream=True))
  finally:
    engine.stop()
  ids = [tokenizer_lib.encode_messages(tok, m) for m in messages]
  ref = decode(llm, drafter, ids, dcfg, stop_ids=stop_ids).tokens
  want = [tok.decode([t for t in row if t not in stop_ids], skip_special_tokens=True)
          for row in ref]
  assert [g.choices[0].message.content for g in got] == want
  assert streamed == want[0]
  assert "Paris" in want[0]  # the real model, really answering
  # the shipped drafter's drafts are accepted through the server (a random one stays at ~1.0)
  spec = [g.usage.model_extra["speculative"] for g in got]
  assert sum(x["accepted_tokens"] for x in spec) > 0.15 * sum(x["steps"] for x in spec), spec
