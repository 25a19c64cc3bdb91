"""Plain AR ``generate``: greedy equals a no-cache reference loop, batches equal rows run alone,
stop tokens end rows independently, and bad arguments raise ``GenerateError``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_models
from redrafter_jax.inference.ar import generate
from redrafter_jax.inference.runtime import GenerateError, pack_prompts
from redrafter_jax.models import kv_cache as kvc

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  model, _, _ = tiny_models.load_tiny(tmp_path_factory.mktemp("tiny"), "llama", seed=2)
  return model


prompt = tiny_models.random_tokens


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, tokens_1T, index):
  model = nnx.merge(graphdef, state)
  T = tokens_1T.shape[1]
  logits, _, _ = model(tokens_1T, jnp.arange(T)[None], kvc.causal_mask(jnp.ones((1, T), bool)))
  return logits[0, index]


def reference_greedy(model, ids, n):
  """Greedy decoding by re-running the whole sequence without a cache at every step."""
  graphdef, state = nnx.split(model)
  ids = list(ids)
  out = []
  for _ in range(n):
    padded = np.zeros((1, 64), np.int32)  # one shape: causal, so the zeros after are unseen
    padded[0, :len(ids)] = ids
    nxt = int(jnp.argmax(_logits_at(graphdef, state, jnp.asarray(padded), len(ids) - 1)))
    out.append(nxt)
    ids.append(nxt)
  return out


def test_greedy_equals_no_cache_reference(model):
  ids = prompt(0, 13)
  result = generate(model, [ids], max_new_tokens=20)
  assert result.tokens[0] == reference_greedy(model, ids, 20)
  assert result.stopped == [False]
  assert result.steps == 19  # one forward per token after the prefill's


def test_batched_greedy_equals_each_row_alone(model):
  prompts = [prompt(1, 3), prompt(2, 17), prompt(3, 9), prompt(4, 30)]  # 3 padding buckets
  batched = generate(model, prompts, max_new_tokens=16)
  for b, p in enumerate(prompts):
    assert batched.tokens[b] == generate(model, [p], max_new_tokens=16).tokens[0], f"row {b}"
  assert len({tuple(t) for t in batched.tokens}) == 4  # rows really differ


def test_stop_token_ends_only_its_row(model):
  prompts = [prompt(5, 8), prompt(6, 11)]
  free = generate(model, prompts, max_new_tokens=16).tokens
  stop = free[0][4]  # a token row 0 emits at step 5 (and maybe earlier)
  cut = free[0].index(stop) + 1
  stopped = generate(model, prompts, max_new_tokens=16, stop_ids=[stop])
  assert stopped.tokens[0] == free[0][:cut]
  assert stopped.stopped[0]
  row1_cut = free[1].index(stop) + 1 if stop in free[1] else 16
  assert stopped.tokens[1] == free[1][:row1_cut]
  assert stopped.stopped[1] == (stop in free[1])


def test_per_row_temperature_keeps_greedy_rows_greedy(model):
  prompts = [prompt(7, 10), prompt(8, 10)]
  greedy = generate(model, prompts, max_new_tokens=12).tokens
  mixed = generate(model, prompts, max_new_tokens=12, temperature=[0.0, 1.5], seed=3).tokens
  assert mixed[0] == greedy[0]
  assert mixed[1] != greedy[1]  # sampling at T=1.5 from a random model departs from greedy


def test_pack_prompts_right_pads_to_a_bucket():
  tokens, lengths = pack_prompts([[1, 2, 3], [4]], pad_id=9, multiple=4)
  np.testing.assert_array_equal(tokens, [[1, 2, 3, 9], [4, 9, 9, 9]])
  np.testing.assert_array_equal(lengths, [3, 1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(prompts=[[1] * 250]), "exceeds the model's context of 256"),
    (dict(cache_size=8), "cache_size 8 is too small"),
])
def test_bad_arguments_raise_generate_error(model, kwargs, match):
  kwargs = dict(dict(prompts=[[1, 2, 3]], max_new_tokens=8), **kwargs)
  with pytest.raises(GenerateError, match=match):
    generate(model, kwargs.pop("prompts"), **kwargs)


@pytest.mark.slow
def test_smollm2_batched_greedy_equals_each_row_alone(smollm2):
  model, _, tok = smollm2
  text = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
          "those used for wine. Within fifty years presses were running in more than two hundred "
          "European cities, and the price of books fell sharply.")
  ids = tok(text)["input_ids"]
  prompts = [ids[:n] for n in (33, 38, 41, 47)]  # one padding bucket: two compiles in all
  batched = generate(model, prompts, max_new_tokens=24)
  for b, p in enumerate(prompts):
    assert batched.tokens[b] == generate(model, [p], max_new_tokens=24).tokens[0], f"row {b}"
  assert len({tuple(t) for t in batched.tokens}) == 4
