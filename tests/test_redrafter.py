"""The ``ReDrafter`` object: built once, it splits and restricts once and compiles once per shape.

A second call of the same static shapes must compile nothing (counted with JAX's compile
monitoring events) and split nothing (``nnx.split`` and ``restrict_vocab`` counted where the
decode module calls them); its output equals ``decode()``'s and the AR baseline's.
"""

import jax
import pytest
from flax import nnx

import redrafter_jax as rj
from redrafter_jax.config import ConfigError, DecodeConfig, DrafterConfig
from redrafter_jax.inference import decode as decode_lib
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.runtime import GenerateError
from redrafter_jax.models.drafter import Drafter
from tiny_models import TINY_LLM, TINY_VOCAB

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

V = TINY_VOCAB
CFG = TINY_LLM
DECODE = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=10, draft_vocab_size=16)

_COMPILES = [0]


def _on_event(name, secs, **kwargs):
  if name == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


@pytest.fixture
def counted(monkeypatch):
  """Counts of ``nnx.split`` and ``restrict_vocab`` calls made by the decode module."""
  counts = {"split": 0, "restrict": 0}
  split, restrict = nnx.split, decode_lib.restrict_vocab

  def counting_split(*args, **kwargs):
    counts["split"] += 1
    return split(*args, **kwargs)

  def counting_restrict(*args, **kwargs):
    counts["restrict"] += 1
    return restrict(*args, **kwargs)

  monkeypatch.setattr(decode_lib.nnx, "split", counting_split)
  monkeypatch.setattr(decode_lib, "restrict_vocab", counting_restrict)
  return counts


def test_second_call_compiles_and_splits_nothing(llm, drafter, counted):
  rd = rj.ReDrafter(llm, drafter, DECODE)
  assert counted == {"split": 2, "restrict": 1}  # both models split, the vocabulary cut once
  first = rd([[1, 2, 3], [4, 5]], stop_ids=[7])
  before = _COMPILES[0]
  # Other prompts of the same padded shape, another seed: the same programs.
  second = rd([[9, 8], [3, 3, 3, 3]], stop_ids=[7], seed=5)
  third = rd([[1, 2, 3], [4, 5]], stop_ids=[7])
  assert _COMPILES[0] == before, "a call of seen shapes compiled a program"
  assert counted == {"split": 2, "restrict": 1}, "a call split or restricted the models again"
  assert third.tokens == first.tokens and second.steps >= 1
  # Sampled rows are their own (static) kind of batch: compiled once, then not again.
  rd([[1, 2, 3], [4, 5]], temperature=[0.8, 0.0], seed=1)
  sampled_compiles = _COMPILES[0]
  rd([[6], [7, 8]], temperature=[0.5, 1.0], seed=2)
  assert _COMPILES[0] == sampled_compiles
  assert counted == {"split": 2, "restrict": 1}


def test_object_equals_decode_and_ar(llm, drafter):
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [20]]
  rd = rj.ReDrafter(llm, drafter, DECODE)
  got = rd(prompts)
  assert got.tokens == rj.decode(llm, drafter, prompts, DECODE).tokens
  assert got.tokens == generate(llm, prompts, max_new_tokens=DECODE.max_new_tokens).tokens
  twin = rd.stepwise(prompts)
  assert twin.tokens == got.tokens and twin.metrics == got.metrics


def test_models_are_checked_once_at_construction(llm):
  other = Drafter(DrafterConfig(vocab_size=V, hidden_size=16, exit_dim=32), rngs=nnx.Rngs(0))
  with pytest.raises(GenerateError, match="does not match the LLM"):
    rj.ReDrafter(llm, other, DECODE)


def test_greedy_acceptance_rejects_sampling(llm, drafter):
  """``acceptance="greedy"`` means greedy decoding: a temperature above 0 is refused."""
  with pytest.raises(ConfigError, match="greedy"):
    DecodeConfig(acceptance="greedy", temperature=0.7)
  cfg = DecodeConfig(beam_width=2, beam_length=3, max_new_tokens=8, acceptance="greedy")
  rd = rj.ReDrafter(llm, drafter, cfg)
  with pytest.raises(GenerateError, match="greedy"):
    rd([[1, 2, 3]], temperature=0.5)
  prompts = [[1, 2, 3], [4, 5, 6, 7]]
  assert rd(prompts).tokens == generate(llm, prompts, max_new_tokens=8).tokens
