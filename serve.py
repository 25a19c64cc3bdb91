#!/usr/bin/env python
"""Serve a model over an OpenAI-compatible HTTP API with ReDrafter speculative decoding.

The same as ``redrafter-jax serve``; all logic lives in ``redrafter_jax.serving``. Examples:

  python serve.py --config configs/smollm2_135m.yaml --host 127.0.0.1 --port 8000
  python serve.py --config configs/tiny.yaml --random-drafter --port 8001     # offline smoke run
  python serve.py --config configs/smollm2_135m.yaml --ar                      # no speculation

Then, with the official client:

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
  client.chat.completions.create(model="smollm2-135m",
                                 messages=[{"role": "user", "content": "Hi!"}])

Endpoints: /v1/completions, /v1/chat/completions (``stream: true`` for server-sent events),
/v1/models, /health, /metrics (Prometheus). Load test: ``redrafter-jax loadtest``.
"""

import sys

from redrafter_jax.cli import main

if __name__ == "__main__":
  sys.exit(main(["serve", *sys.argv[1:]]))
