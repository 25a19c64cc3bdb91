"""KV-cache consistency: cached prefill + AR steps, packed tree forwards and path commits all
reproduce plain no-cache forwards of the same token sequences."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_models
from redrafter_jax.models import kv_cache as kvc
from redrafter_jax.models import llama

pytestmark = pytest.mark.usefixtures("float32_matmuls")  # float32 parity: no TF32 on GPUs

S = 64  # cache slots


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, cache, tokens_BT, positions_BT, mask_BTT):
  model = nnx.merge(graphdef, state)
  mask_BTS = kvc.visible_mask(cache.lengths_B, mask_BTT, cache.size)
  logits_BTV, _, cache = model(tokens_BT, positions_BT, mask_BTS, cache)
  return logits_BTV, cache


def step(model, cache, tokens_BT, positions_BT, mask_BTT):
  """One cached forward: new tokens see the committed slots plus what ``mask_BTT`` allows."""
  graphdef, state = nnx.split(model)
  logits_BTV, cache = _step(graphdef, state, cache, jnp.asarray(tokens_BT, jnp.int32),
                            jnp.asarray(positions_BT, jnp.int32), jnp.asarray(mask_BTT))
  return np.asarray(logits_BTV), cache


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, state, tokens_BT):
  model = nnx.merge(graphdef, state)
  B, T = tokens_BT.shape
  logits_BTV, _, _ = model(tokens_BT, jnp.broadcast_to(jnp.arange(T), (B, T)),
                           kvc.causal_mask(jnp.ones((B, T), bool)), None)
  return logits_BTV


def full_forward(model, tokens):
  """Logits of one token list through a plain causal forward (no cache).

  Padded to one length (causal attention: the padding after the tokens is never seen), so the
  forward compiles once.
  """
  padded = np.zeros((1, 32), np.int32)
  padded[0, :len(tokens)] = tokens
  return np.asarray(_full(*nnx.split(model), jnp.asarray(padded)))[0, :len(tokens)]


def prefill(model, prompts):
  """Right-padded prompts into a fresh cache; returns (last-token logits per row, cache)."""
  B, T = len(prompts), max(len(p) for p in prompts)
  tokens = np.zeros((B, T), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  lengths = np.array([len(p) for p in prompts], np.int32)
  valid = np.arange(T)[None] < lengths[:, None]
  cache = model.init_cache(B, S)
  logits, cache = step(model, cache, tokens, np.broadcast_to(np.arange(T), (B, T)),
                       kvc.causal_mask(jnp.asarray(valid)))
  cache = kvc.advance(cache, jnp.asarray(lengths))
  return logits[np.arange(B), lengths - 1], cache


@pytest.fixture(scope="module", params=["unrolled", "scanned"])
def model(request, tmp_path_factory):
  """The tiny model, its layers unrolled or scanned (``stack_layers``: a stacked cache)."""
  model, _, _ = tiny_models.load_tiny(tmp_path_factory.mktemp("tiny"), "llama", seed=1)
  return llama.stack_layers(model) if request.param == "scanned" else model


tokens = tiny_models.random_tokens


def test_prefill_then_ar_steps_equal_full_forward(model):
  seqs = [tokens(0, 19), tokens(1, 13)]
  prompt_lens = [12, 6]
  k = 7
  logits, cache = prefill(model, [s[:n] for s, n in zip(seqs, prompt_lens)])
  for b, (s, n) in enumerate(zip(seqs, prompt_lens)):
    np.testing.assert_allclose(logits[b], full_forward(model, s[:n])[-1], atol=1e-5)
  for i in range(k):
    pos = np.array(prompt_lens) + i
    np.testing.assert_array_equal(np.asarray(cache.lengths_B), pos)
    new = np.array([[s[p]] for s, p in zip(seqs, pos)], np.int32)
    logits, cache = step(model, cache, new, pos[:, None], jnp.ones((2, 1, 1), bool))
    cache = kvc.advance(cache, jnp.ones((2,), jnp.int32))
    for b, s in enumerate(seqs):
      ref = full_forward(model, s[:pos[b] + 1])[-1]
      np.testing.assert_allclose(logits[b, 0], ref, atol=1e-5, err_msg=f"row {b} step {i}")


def pack_tree(branches):
  """Unique nodes of several token branches sharing the cached prefix.

  Returns (node tokens, depth of each node, ancestor-or-self mask ``[N, N]``, and per branch the
  node indices along it). Shared leading tokens become one node.
  """
  node_of, toks, depth, parent = {}, [], [], []
  paths = []
  for br in branches:
    path = []
    for d in range(len(br)):
      key = tuple(br[:d + 1])
      if key not in node_of:
        node_of[key] = len(toks)
        toks.append(br[d])
        depth.append(d)
        parent.append(path[-1] if path else -1)
      path.append(node_of[key])
    paths.append(path)
  return (np.array(toks, np.int32), np.array(depth, np.int32), tiny_models.ancestor_mask(parent),
          paths)


def test_tree_forward_equals_each_branch_alone(model):
  prompts = [tokens(2, 9), tokens(3, 15)]
  # Row 0: three branches with a shared first token; row 1: two disjoint branches.
  trees = [[[5, 6, 7, 8], [5, 9, 10], [5, 6, 11]], [[20, 21, 22], [30, 31]]]
  packed = [pack_tree(t) for t in trees]
  N = max(len(p[0]) for p in packed) + 1  # + one padding node to prove padding is harmless
  toks_BN = np.zeros((2, N), np.int32)
  pos_BN = np.zeros((2, N), np.int32)
  mask_BNN = np.broadcast_to(np.eye(N, dtype=bool), (2, N, N)).copy()
  for b, (t, d, m, _) in enumerate(packed):
    n = len(t)
    toks_BN[b, :n], pos_BN[b, :n] = t, len(prompts[b]) + d
    mask_BNN[b, :n, :n] = m
  _, cache = prefill(model, prompts)
  logits_BNV, tree_cache = step(model, cache, toks_BN, pos_BN, mask_BNN)
  np.testing.assert_array_equal(np.asarray(tree_cache.lengths_B), [9, 15])  # not committed
  for b, tree in enumerate(trees):
    for branch, path in zip(tree, packed[b][3]):
      ref_TV = full_forward(model, prompts[b] + branch)[len(prompts[b]):]
      np.testing.assert_allclose(logits_BNV[b, path], ref_TV, atol=1e-5,
                                 err_msg=f"row {b} branch {branch}")


@pytest.mark.parametrize("num", [[3, 2], [1, 0]])
def test_commit_of_a_path_equals_running_it_as_a_chain(model, num):
  prompts = [tokens(4, 10), tokens(5, 7)]
  trees = [[[40, 41, 42], [40, 43, 44], [45]], [[50, 51], [52, 53, 54]]]
  accepted = [1, 1]  # the branch each row accepts (not the first one: its nodes are not in order)
  packed = [pack_tree(t) for t in trees]
  N = max(len(p[0]) for p in packed)
  toks_BN = np.zeros((2, N), np.int32)
  pos_BN = np.zeros((2, N), np.int32)
  mask_BNN = np.broadcast_to(np.eye(N, dtype=bool), (2, N, N)).copy()
  path_BA = np.zeros((2, 3), np.int32)
  for b, (t, d, m, paths) in enumerate(packed):
    toks_BN[b, :len(t)], pos_BN[b, :len(t)] = t, len(prompts[b]) + d
    mask_BNN[b, :len(t), :len(t)] = m
    path = paths[accepted[b]]
    path_BA[b, :len(path)] = path
  assert path_BA[0].tolist() == [0, 3, 4] and path_BA[1].tolist() == [2, 3, 4]
  _, cache = prefill(model, prompts)
  _, cache = step(model, cache, toks_BN, pos_BN, mask_BNN)
  cache = kvc.commit(cache, jnp.asarray(path_BA), jnp.asarray(num, jnp.int32))
  kept = [trees[b][accepted[b]][:num[b]] for b in range(2)]
  np.testing.assert_array_equal(np.asarray(cache.lengths_B),
                                [len(p) + len(k) for p, k in zip(prompts, kept)])
  # A following token after the committed path sees exactly prompt + path.
  follow = np.array([[60], [61]], np.int32)
  logits, _ = step(model, cache, follow, np.asarray(cache.lengths_B)[:, None],
                   jnp.ones((2, 1, 1), bool))
  for b in range(2):
    ref = full_forward(model, prompts[b] + kept[b] + [int(follow[b, 0])])[-1]
    np.testing.assert_allclose(logits[b, 0], ref, atol=1e-5, err_msg=f"row {b}")


def _stacked(cache, which):
  """One of the cache's K/V as one [layers, B, S] array (K = E = 1), via the [B, K, S, E] view."""
  i = {"k": 0, "v": 1}[which]
  return np.stack([np.asarray(cache.layer_BKSE(n)[i])[:, 0, :, 0]
                   for n in range(cache.num_layers)])


def test_commit_moves_only_the_path_slots():
  cache = kvc.init(num_layers=2, batch=2, size=8, num_kv_heads=1, head_dim=1)
  ramp = jnp.arange(2 * 2 * 8, dtype=jnp.float32).reshape(2, 2, 8)  # [layer, X = K * B, S]
  cache = cache.replace(k=tuple(ramp[:, :, None, :]), v=tuple(-ramp[:, :, :, None]),
                        lengths_B=jnp.array([2, 3], jnp.int32))
  out = kvc.commit(cache, jnp.array([[1, 3], [0, 2]]), jnp.array([2, 1]))
  np.testing.assert_array_equal(np.asarray(out.lengths_B), [4, 4])
  k = _stacked(out, "k")
  before = np.asarray(ramp)
  for layer in range(2):
    np.testing.assert_array_equal(k[layer, 0, :4], before[layer, 0, [0, 1, 3, 5]])
    np.testing.assert_array_equal(k[layer, 1, :4], before[layer, 1, [0, 1, 2, 3]])
    np.testing.assert_array_equal(k[layer, 1, 3], before[layer, 1, 3])  # path[0] = 0: in place
    np.testing.assert_array_equal(k[layer, :, 6:], before[layer, :, 6:])  # beyond: untouched
  np.testing.assert_array_equal(_stacked(out, "v"), -k)


def test_visible_mask_sees_committed_slots_and_allowed_new_tokens():
  lengths = jnp.array([3, 0])
  tree_TT = jnp.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)  # two children of node 0
  mask = np.asarray(kvc.visible_mask(lengths, jnp.stack([tree_TT, tree_TT]), 8))
  assert mask.shape == (2, 3, 8)
  np.testing.assert_array_equal(mask[0, 2], [1, 1, 1, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(mask[1, 1], [1, 1, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(mask[0, :, 6:], False)  # beyond the new tokens: never


def test_causal_mask_hides_padding_keys():
  mask = np.asarray(kvc.causal_mask(jnp.array([[True, True, False]])))
  np.testing.assert_array_equal(mask[0], [[1, 0, 0], [1, 1, 0], [1, 1, 0]])


def test_write_past_the_end_is_dropped_not_clamped():
  """A write that does not fit must never shift back onto committed slots."""
  cache = kvc.init(num_layers=1, batch=2, size=4, num_kv_heads=1, head_dim=1)
  cache = cache.replace(lengths_B=jnp.array([3, 1], jnp.int32))
  new_BTKE = jnp.full((2, 2, 1, 1), 7.0)
  out = kvc.write_layer(cache, 0, new_BTKE, -new_BTKE)
  np.testing.assert_array_equal(_stacked(out, "k")[0], [[0, 0, 0, 7], [0, 7, 7, 0]])
  np.testing.assert_array_equal(_stacked(out, "v"), -_stacked(out, "k"))
  np.testing.assert_array_equal(np.asarray(out.lengths_B), [3, 1])  # written, not committed


def test_write_places_each_row_and_head_at_its_own_slots():
  """Head-major X = K * B: row b's head k lands at x = k * B + b, slots lengths[b] + t."""
  B, T, K, E, size = 2, 3, 2, 4, 8
  cache = kvc.init(num_layers=1, batch=B, size=size, num_kv_heads=K, head_dim=E)
  cache = cache.replace(lengths_B=jnp.array([1, 4], jnp.int32))
  new_BTKE = jnp.arange(B * T * K * E, dtype=jnp.float32).reshape(B, T, K, E) + 1
  out = kvc.write_layer(cache, 0, new_BTKE, -new_BTKE)
  assert out.k[0].shape == (K * B, E, size) and out.v[0].shape == (K * B, size, E)
  k_BKSE, v_BKSE = (np.asarray(a) for a in out.layer_BKSE(0))
  expected = np.zeros((B, K, size, E), np.float32)
  for b, start in enumerate([1, 4]):
    expected[b, :, start:start + T] = np.asarray(new_BTKE[b]).transpose(1, 0, 2)
  np.testing.assert_array_equal(k_BKSE, expected)
  np.testing.assert_array_equal(v_BKSE, -expected)
  np.testing.assert_array_equal(np.asarray(out.k[0])[1 * B + 0, :, 1], np.asarray(new_BTKE[0, 0, 1]))


@pytest.mark.parametrize("layout", kvc.LAYOUTS)
def test_take_and_put_rows_move_rows_in_every_layout(layout):
  B, S, K, E, L = 5, 8, 2, 4, 2
  cache = kvc.init(L, B, S, K, E, layout=layout)
  rng = np.random.default_rng(0)
  cache = cache.replace(k=tuple(jnp.asarray(rng.normal(size=k.shape), k.dtype) for k in cache.k),
                        v=tuple(jnp.asarray(rng.normal(size=v.shape), v.dtype) for v in cache.v),
                        lengths_B=jnp.arange(B, dtype=jnp.int32) + 1)
  idx = jnp.array([3, 0], jnp.int32)
  sub = kvc.take_rows(cache, idx)
  assert sub.batch == 2 and sub.layout == layout and sub.lengths_B.tolist() == [4, 1]
  for i in range(L):  # the rows' [B, K, S, E] views, whatever the layout
    for got, full in zip(kvc.to_BKSE(*sub.layer(i), 2, layout),
                         kvc.to_BKSE(*cache.layer(i), B, layout)):
      np.testing.assert_array_equal(got, np.asarray(full)[[3, 0]])
  # Put back changed rows: only those rows change.
  moved = sub.replace(k=tuple(k + 1 for k in sub.k), v=tuple(v - 1 for v in sub.v),
                      lengths_B=sub.lengths_B + 2)
  out = kvc.put_rows(cache, idx, moved)
  assert out.lengths_B.tolist() == [3, 2, 3, 6, 5]
  for i in range(L):
    new_k, new_v = (np.asarray(x) for x in kvc.to_BKSE(*out.layer(i), B, layout))
    old_k, old_v = (np.asarray(x) for x in kvc.to_BKSE(*cache.layer(i), B, layout))
    np.testing.assert_array_equal(new_k[[3, 0]], old_k[[3, 0]] + 1)
    np.testing.assert_array_equal(new_v[[3, 0]], old_v[[3, 0]] - 1)
    np.testing.assert_array_equal(new_k[[1, 2, 4]], old_k[[1, 2, 4]])
    np.testing.assert_array_equal(new_v[[1, 2, 4]], old_v[[1, 2, 4]])
  other = kvc.init(L, 2, S, K, E, layout="BKSE" if layout != "BKSE" else "XES")
  with pytest.raises(kvc.CacheError, match="put_rows"):
    kvc.put_rows(cache, idx, other)
  # The first W slots only: taken, changed and put back; the other slots stay as they were.
  W = 5
  part = kvc.take_rows(cache, idx, W)
  assert part.size == W and part.batch == 2
  for i in range(L):
    for got, full in zip(kvc.to_BKSE(*part.layer(i), 2, layout),
                         kvc.to_BKSE(*cache.layer(i), B, layout)):
      np.testing.assert_array_equal(got, np.asarray(full)[[3, 0], :, :W])
  out = kvc.put_rows(cache, idx, part.replace(k=tuple(k + 1 for k in part.k)))
  for i in range(L):
    new_k = np.asarray(kvc.to_BKSE(*out.layer(i), B, layout)[0])
    old_k = np.asarray(kvc.to_BKSE(*cache.layer(i), B, layout)[0])
    np.testing.assert_array_equal(new_k[[3, 0], :, :W], old_k[[3, 0], :, :W] + 1)
    np.testing.assert_array_equal(new_k[[3, 0], :, W:], old_k[[3, 0], :, W:])
  with pytest.raises(kvc.CacheError, match="take_rows: 9 slots"):
    kvc.take_rows(cache, idx, S + 1)


@pytest.mark.parametrize("layout", kvc.LAYOUTS)
def test_put_window_writes_back_only_the_step_slots(layout):
  """A sub-batch step changes slots [length, length + N) of its rows: ``put_window`` writes
  those back (and the lengths), nothing else; slots past the taken width are not written."""
  B, S, K, E, L, W, N = 5, 12, 2, 4, 2, 8, 3
  rng = np.random.default_rng(1)
  cache = kvc.init(L, B, S, K, E, layout=layout)
  cache = cache.replace(k=tuple(jnp.asarray(rng.normal(size=k.shape), k.dtype) for k in cache.k),
                        v=tuple(jnp.asarray(rng.normal(size=v.shape), v.dtype) for v in cache.v),
                        lengths_B=jnp.array([2, 5, 1, 3, 7], jnp.int32))
  idx = jnp.array([3, 0, 4], jnp.int32)
  sub = kvc.take_rows(cache, idx, W)
  start = sub.lengths_B  # [3, 2, 7]: row 4's window 7..9 crosses the width 8
  changed = sub.replace(k=tuple(k * 0 + 5 for k in sub.k), v=tuple(v * 0 - 5 for v in sub.v),
                        lengths_B=sub.lengths_B + 1)
  out = kvc.put_window(cache, idx, changed, start, N)
  assert out.lengths_B.tolist() == [3, 5, 1, 4, 8]
  for i in range(L):
    new = [np.asarray(x) for x in kvc.to_BKSE(*out.layer(i), B, layout)]
    old = [np.asarray(x) for x in kvc.to_BKSE(*cache.layer(i), B, layout)]
    for n, o, value in zip(new, old, (5, -5)):
      want = o.copy()
      for row, s0 in zip([3, 0, 4], [3, 2, 7]):
        hi = min(s0 + N, W)
        want[row, :, s0:hi] = value
      np.testing.assert_array_equal(n, want)
  with pytest.raises(kvc.CacheError, match="put_window"):
    kvc.put_window(cache, idx, changed, start[:2], N)


def _random_cache(rng, L, B, S, K, E, layout, lengths):
  cache = kvc.init(L, B, S, K, E, layout=layout)
  return cache.replace(k=tuple(jnp.asarray(rng.normal(size=k.shape), k.dtype) for k in cache.k),
                       v=tuple(jnp.asarray(rng.normal(size=v.shape), v.dtype) for v in cache.v),
                       lengths_B=jnp.asarray(lengths, jnp.int32))


def _stack(cache):
  return cache.replace(k=(jnp.stack(cache.k),), v=(jnp.stack(cache.v),), stacked=True)


def _assert_same_layers(stacked, per_layer):
  assert stacked.stacked and not per_layer.stacked
  assert (stacked.num_layers, stacked.size, stacked.batch, stacked.num_kv_heads) == (
      per_layer.num_layers, per_layer.size, per_layer.batch, per_layer.num_kv_heads)
  np.testing.assert_array_equal(stacked.lengths_B, per_layer.lengths_B)
  for i in range(per_layer.num_layers):
    for got, want in zip(stacked.layer(i), per_layer.layer(i)):
      np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", kvc.LAYOUTS)
def test_stacked_cache_ops_equal_per_layer_ops(layout):
  """A stacked cache (one [L, ...] array, what a scan over layers carries) gives the same
  values as the per-layer cache under every operation, with the layer index traced where a
  scan traces it."""
  L, B, S, K, E = 3, 4, 12, 2, 4
  rng = np.random.default_rng(2)
  cache = _random_cache(rng, L, B, S, K, E, layout, [2, 5, 1, 3])
  stacked = _stack(cache)
  _assert_same_layers(stacked, cache)
  assert stacked.head_axis == cache.head_axis + 1 == kvc.HEAD_AXIS[layout] + 1
  empty = kvc.init(L, B, S, K, E, layout=layout, stacked=True)
  assert empty.stacked and empty.k[0].shape == (L, *cache.k[0].shape)
  new_BTKE = jnp.asarray(rng.normal(size=(B, 3, K, E)), jnp.float32)
  written = kvc.write_layer(cache, 1, new_BTKE, -new_BTKE)
  traced = jax.jit(lambda c, i: kvc.write_layer(c, i, new_BTKE, -new_BTKE))(stacked, 1)
  _assert_same_layers(traced, written)
  width = 8
  for i in range(L):
    got = jax.jit(lambda c, i: c.layer(i, width))(traced, i)
    for g, w in zip(got, written.layer(i, width)):
      np.testing.assert_array_equal(g, w)
  path_BA, num_B = jnp.array([[0, 2], [1, 0], [2, 1], [0, 1]]), jnp.array([2, 1, 0, 2])
  _assert_same_layers(kvc.commit(traced, path_BA, num_B), kvc.commit(written, path_BA, num_B))
  idx = jnp.array([3, 0], jnp.int32)
  sub, sub_stacked = kvc.take_rows(cache, idx, width), kvc.take_rows(stacked, idx, width)
  _assert_same_layers(sub_stacked, sub)
  bumped = lambda c: c.replace(k=tuple(k + 1 for k in c.k), lengths_B=c.lengths_B + 1)
  _assert_same_layers(kvc.put_rows(stacked, idx, bumped(sub_stacked)),
                      kvc.put_rows(cache, idx, bumped(sub)))
  _assert_same_layers(kvc.put_window(stacked, idx, bumped(sub_stacked), sub.lengths_B, 3),
                      kvc.put_window(cache, idx, bumped(sub), sub.lengths_B, 3))
  with pytest.raises(kvc.CacheError, match="stacked"):
    kvc.put_rows(stacked, idx, sub)
