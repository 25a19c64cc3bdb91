"""GPU checks: the cuDNN and Pallas (Triton) attention backends against ``xla`` on the decode
path, and ReDrafter greedy == AR greedy on a GPU, at batch 1 and 3.

Every test but the CPU twin is marked ``gpu`` and skipped unless JAX's default backend is a GPU;
run them there with ``JAX_PLATFORMS=cuda,cpu pytest -m gpu tests/test_gpu.py`` (``conftest``). The
CPU twin runs the same comparison (Pallas in interpret mode against ``xla``) in the default suite,
so the comparison itself is exercised on every machine.

Float32 runs compute float32 matmuls in float32 (``jax.default_matmul_precision("highest")``):
a GPU's default float32 matmul is TF32 (ten mantissa bits), which would swamp the float32 bounds.

Tolerances, as ``tiny_models.rel_err`` (largest difference over the reference's largest logit):

  float32, pallas vs xla    1e-4   the same float32 arithmetic in another order (online softmax)
  float32, cudnn vs xla     3e-2   cuDNN computes in bfloat16 (its cache is bfloat16), so this is
                                   bfloat16 rounding of queries, keys, values and probabilities
  bfloat16, either vs xla   5e-2   both sides round to bfloat16 (2**-8) through every layer
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_models
from oracle import OracleDrafter
from redrafter_jax.config import DecodeConfig, DrafterConfig, LlamaConfig
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.decode import decode
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models.drafter import Drafter
from redrafter_jax.models.llama import Llama

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(
    not ON_GPU, reason=f"needs a CUDA GPU as JAX's default backend (it is "
    f"{jax.default_backend()!r}; on a GPU machine run with JAX_PLATFORMS=cuda,cpu)")

# Head dims of 16 and 64: Triton's dots need every dimension >= 16, cuDNN a multiple of 8.
MODELS = {
    "tiny": LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True),
    "wide": LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=64),
}
TOLERANCE = {("float32", "pallas"): 1e-4, ("float32", "cudnn"): 3e-2,
             ("bfloat16", "pallas"): 5e-2, ("bfloat16", "cudnn"): 5e-2}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Three rows of different lengths (batch > 1 with padding), a cache of 64 slots.
PROMPT_LENGTHS = (12, 7, 3)
CACHE = 64
# The verified tree: parent of each of its 6 tokens (-1: a child of the last committed token).
TREE_PARENTS = (-1, 0, 0, 1, 1, 2)


def llm(name: str, backend: str, dtype: str = "float32") -> Llama:
  """The model ``name`` with random weights: the same weights (seed 0) for every backend."""
  return Llama(MODELS[name], dtype=DTYPES[dtype], backend=backend, rngs=nnx.Rngs(0))


def prompts(name: str) -> list[list[int]]:
  vocab = MODELS[name].vocab_size
  return [np.random.default_rng(i).integers(0, vocab, n).tolist()
          for i, n in enumerate(PROMPT_LENGTHS)]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, cache, tokens_BT, positions_BT, mask_BTT):
  model = nnx.merge(graphdef, state)
  logits_BTV, _, cache = model(tokens_BT, positions_BT,
                               kvc.visible_mask(cache.lengths_B, mask_BTT, cache.size), cache)
  return logits_BTV.astype(jnp.float32), cache


def decode_path_logits(model: Llama, name: str) -> dict[str, np.ndarray]:
  """Float32 logits of the three forwards of a decode: a prefill of the padded prompts (valid
  positions only, ``[n, V]``), one AR step (``[B, V]``) and one tree verification
  (``[B, N, V]``), each over the cache the previous one filled."""
  graphdef, state = nnx.split(model)
  run = lambda cache, *args: _forward(graphdef, state, cache, *(jnp.asarray(a) for a in args))
  rows = prompts(name)
  B, T = len(rows), max(PROMPT_LENGTHS)
  lengths = np.array(PROMPT_LENGTHS, np.int32)
  tokens = np.zeros((B, T), np.int32)
  for b, row in enumerate(rows):
    tokens[b, :len(row)] = row
  valid = np.arange(T)[None] < lengths[:, None]
  cache = model.init_cache(B, CACHE)
  prefill, cache = run(cache, tokens, np.broadcast_to(np.arange(T), (B, T)),
                       kvc.causal_mask(jnp.asarray(valid)))
  cache = kvc.advance(cache, jnp.asarray(lengths))
  step, cache = run(cache, tokens[:, :1], lengths[:, None], np.ones((B, 1, 1), bool))
  cache = kvc.advance(cache, jnp.ones((B,), jnp.int32))
  tree_TT = tiny_models.ancestor_mask(TREE_PARENTS)
  depth = tree_TT.sum(-1) - 1
  N = len(TREE_PARENTS)
  tree_tokens = (np.arange(B * N).reshape(B, N) * 7) % MODELS[name].vocab_size
  tree, _ = run(cache, tree_tokens, (lengths + 1)[:, None] + depth[None],
                np.broadcast_to(tree_TT, (B, N, N)))
  return {"prefill": np.asarray(prefill)[valid], "ar_step": np.asarray(step)[:, 0],
          "tree": np.asarray(tree)}


def assert_same_logits(got: dict, want: dict, tolerance: float, what: str) -> None:
  for part in want:
    assert np.isfinite(got[part]).all(), f"{what}, {part}: not finite"
    err = tiny_models.rel_err(got[part], want[part])
    assert err < tolerance, f"{what}, {part}: relative error {err:.2e} >= {tolerance:.0e}"


def check_backend_against_xla(name: str, backend: str, dtype: str) -> None:
  with jax.default_matmul_precision("highest"):
    want = decode_path_logits(llm(name, "xla", dtype), name)
    got = decode_path_logits(llm(name, backend, dtype), name)
  assert_same_logits(got, want, TOLERANCE[dtype, backend], f"{name} {backend} {dtype}")


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["cudnn", "pallas"])
@pytest.mark.parametrize("name", list(MODELS))
def test_backend_matches_xla_on_the_decode_path(name, backend, dtype):
  check_backend_against_xla(name, backend, dtype)


def test_pallas_matches_xla_on_the_decode_path_cpu_twin():
  """The GPU comparison as it runs everywhere (Pallas in interpret mode on a CPU; Triton on a
  GPU), on the tiny model in float32, where its bound is tightest. The check can fail: the same
  comparison against a model with other weights is far outside the bound."""
  check_backend_against_xla("tiny", "pallas", "float32")
  with jax.default_matmul_precision("highest"):
    want = decode_path_logits(llm("tiny", "xla"), "tiny")
    other = Llama(MODELS["tiny"], backend="pallas", rngs=nnx.Rngs(1))
    with pytest.raises(AssertionError, match="relative error"):
      assert_same_logits(decode_path_logits(other, "tiny"), want, TOLERANCE["float32", "pallas"],
                         "other weights")


def drafter_for(name: str) -> Drafter:
  cfg = MODELS[name]
  return Drafter(DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                               exit_dim=48), rngs=nnx.Rngs(1))


@gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("name", list(MODELS))
def test_redrafter_greedy_equals_ar_greedy(name, backend):
  """Float32 activations (cuDNN is left out: it computes in bfloat16, where a tree verification
  and an AR step may round a near tie differently). A random drafter (its drafts are mostly
  rejected) and an oracle drafter (drafts accepted to every depth) must both reproduce AR's
  tokens, for the batch of three rows of different lengths and for each row alone."""
  rows = prompts(name)
  cfg = DecodeConfig(beam_width=4, beam_length=4, max_new_tokens=24)
  with jax.default_matmul_precision("highest"):
    model = llm(name, backend)
    ar = generate(model, rows, max_new_tokens=cfg.max_new_tokens).tokens
    assert [len(t) for t in ar] == [cfg.max_new_tokens] * len(rows)
    oracle = OracleDrafter(np.asarray(ar), MODELS[name].vocab_size)
    for what, drafter in (("random drafter", drafter_for(name)), ("oracle drafter", oracle)):
      result = decode(model, drafter, rows, cfg)
      assert result.tokens == ar, what
    assert result.metrics["tokens_per_step"] > 2.0  # the oracle's drafts were accepted
    for b, row in enumerate(rows):
      assert decode(model, drafter_for(name), [row], cfg).tokens[0] == ar[b], f"row {b} alone"
