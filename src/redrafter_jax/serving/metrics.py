"""Prometheus metrics of one server (its own registry, so several servers can share a process).

Speculative statistics follow DESIGN §6: tokens per step = accepted drafted tokens + 1 per row
and verification step; the acceptance rate at depth d is P(accepted >= d | accepted >= d - 1).
"""

from __future__ import annotations

import threading

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)


class ServingMetrics:
  """All metrics of one server; the engine thread and the HTTP layer both record into it."""

  content_type = CONTENT_TYPE_LATEST

  def __init__(self, beam_length: int, registry: CollectorRegistry | None = None):
    self.registry = registry or CollectorRegistry()
    r = self.registry
    self.requests = Counter("redrafter_requests", "Finished requests by finish reason",
                            ["finish_reason"], registry=r)
    self.rejected = Counter("redrafter_rejected_requests", "Requests refused before decoding",
                            ["reason"], registry=r)
    self.prompt_tokens = Counter("redrafter_prompt_tokens", "Prompt tokens prefilled", registry=r)
    self.generated_tokens = Counter("redrafter_generation_tokens", "Tokens generated",
                                    registry=r)
    self.tokens_per_step = Histogram(
        "redrafter_tokens_per_step", "Tokens a row gains per verification step (accepted + 1)",
        buckets=tuple(float(i) for i in range(1, beam_length + 1)), registry=r)
    self.depth_reached = Counter(
        "redrafter_draft_accepted_at_depth",
        "Row-steps that accepted at least `depth` drafted tokens (depth 0: all row-steps)",
        ["depth"], registry=r)
    self.depth_rate = Gauge(
        "redrafter_acceptance_rate", "Acceptance rate at draft depth d: "
        "P(accepted >= d | accepted >= d-1), since start", ["depth"], registry=r)
    self.queue_length = Gauge("redrafter_queue_length", "Requests waiting for a slot",
                              registry=r)
    self.active_slots = Gauge("redrafter_active_slots", "Slots decoding a request", registry=r)
    self.step_seconds = Histogram("redrafter_step_seconds", "Latency of one batched decode step",
                                  buckets=_LATENCY_BUCKETS, registry=r)
    self.prefill_seconds = Histogram("redrafter_prefill_seconds", "Latency of one prefill",
                                     buckets=_LATENCY_BUCKETS, registry=r)
    self.request_seconds = Histogram("redrafter_request_seconds",
                                     "Time from arrival to the last token",
                                     buckets=_LATENCY_BUCKETS, registry=r)
    self.ttft_seconds = Histogram("redrafter_time_to_first_token_seconds",
                                  "Time from arrival to the first token", buckets=_LATENCY_BUCKETS,
                                  registry=r)
    self._lock = threading.Lock()
    self._reached = [0] * beam_length  # row-steps with >= d accepted, d = 0 .. L-1
    for d in range(beam_length):  # every series exists from the start, for scrapers
      self.depth_reached.labels(depth=str(d))
      if d:
        self.depth_rate.labels(depth=str(d))
    for reason in ("stop", "length", "cancelled", "error"):
      self.requests.labels(finish_reason=reason)
    for reason in ("queue_full", "bad_request", "unauthorized", "not_found", "too_large",
                   "unavailable"):
      self.rejected.labels(reason=reason)

  def observe_step(self, seconds: float, accepted: list[int]) -> None:
    """One batched step: its latency and each active row's accepted drafted tokens."""
    self.step_seconds.observe(seconds)
    with self._lock:
      for a in accepted:
        self.tokens_per_step.observe(a + 1)
        for d in range(min(a, len(self._reached) - 1) + 1):
          self._reached[d] += 1
          self.depth_reached.labels(depth=str(d)).inc()
      for d in range(1, len(self._reached)):
        if self._reached[d - 1]:
          self.depth_rate.labels(depth=str(d)).set(self._reached[d] / self._reached[d - 1])

  def render(self) -> bytes:
    return generate_latest(self.registry)
