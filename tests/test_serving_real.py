"""The server on the real SmolLM2-135M-Instruct (slow): chat through the official client
equals ``decode()``, streamed and not, with the real tokenizer and chat template."""

import numpy as np
import openai
import pytest
from flax import nnx

from redrafter_jax.config import DecodeConfig, DrafterConfig
from redrafter_jax.inference.decode import decode
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.serving.app import create_app
from redrafter_jax.serving.engine import Engine, EngineConfig
from redrafter_jax.serving.server import ServerThread
from redrafter_jax.weights import tokenizer as tokenizer_lib

pytestmark = pytest.mark.slow

DCFG = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=24)
QUESTIONS = ["What is the capital of France?", "Name three colors of the rainbow."]


def test_smollm2_chat_matches_decode(smollm2):
  llm, cfg, tok = smollm2
  drafter = Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                  exit_dim=64, num_draft_layers=1), rngs=nnx.Rngs(0))
  stop_ids = tokenizer_lib.stop_token_ids(tok)
  engine = Engine(llm, tok, drafter, config=EngineConfig(slots=2, max_context=256, max_tokens=24,
                                                         decode=DCFG),
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
  ref = decode(llm, drafter, ids, DCFG, stop_ids=stop_ids).tokens
  want = [tok.decode([t for t in row if t not in stop_ids], skip_special_tokens=True)
          for row in ref]
  assert [g.choices[0].message.content for g in got] == want
  assert streamed == want[0]
  assert "Paris" in want[0]  # the real model, really answering
  assert all(np.isfinite(g.usage.model_extra["speculative"]["tokens_per_step"]) for g in got)
