"""Acceptance: which drafted tokens the LLM keeps, and the token it adds after them.

``exact`` (default; also greedy, where the target distribution is one-hot at the argmax):
  the sibling-by-sibling rule for deterministic drafts on a tree (DESIGN §6). At a node with
  target distribution P and distinct children x1..xk in beam order: accept x1 with probability
  P(x1); if rejected, remove x1 from P, renormalise, try x2 with its new probability; and so on.
  Descend into the accepted child; when all are rejected (or at a leaf), sample the next token
  from what is left of P. Each emitted token then has exactly its AR probability:
  x_i is emitted with (1 - P(x1) - ... - P(x_{i-1})) * P(x_i) / (1 - P(x1) - ... - P(x_{i-1})).
``typical``: Medusa's typical acceptance, p(x) > min(eps, delta * exp(-H(p))). LOSSY by design.
``reference``: the reference implementation's rule (min(1, P/Q) per beam, then sampling from
  relu(P - Q)); NOT exact for beam-search drafts, kept to compare against.

``greedy``: the argmax walk, which every rule above reduces to when all rows are greedy
  (temperature 0); one argmax per tree slot instead of a distribution per depth and random draws.
  Decoding takes it for every all-greedy batch, and always under ``acceptance="greedy"``, which
  therefore refuses a temperature above 0 (``DecodeConfig``, ``ReDrafter``, the server).

All rules return a ``Verdict`` with static shapes; ``A`` = beam length L.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from redrafter_jax.inference import sampling
from redrafter_jax.inference.beam_search import BeamOutput
from redrafter_jax.inference.tree import Tree, unpack

_TINY = 1e-30


@struct.dataclass
class Verdict:
  path_BA: jax.Array  # packed slots of the accepted path, root first (padded with its end)
  num_accepted_B: jax.Array  # drafted tokens accepted, 0 .. L-1
  tokens_BA: jax.Array  # the accepted drafts, then the next token: num_accepted + 1 valid
  end_slot_B: jax.Array  # slot whose LLM output gave the next token (the drafter's next context)


def _gather_rows(x_BN, idx_B):
  return jnp.take_along_axis(x_BN, idx_B[:, None], axis=1)[:, 0]


def _children_mask(tree: Tree, slot_B):
  return tree.valid_BN & (tree.parent_BN == slot_B[:, None])


def _remove_tokens(logp_BV, tokens_BN, remove_BN):
  """Set the log-prob of every ``tokens_BN`` marked in ``remove_BN`` to -inf."""
  B, V = logp_BV.shape
  hit_BV = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], tokens_BN].max(remove_BN)
  return jnp.where(hit_BV, -jnp.inf, logp_BV)


def _assemble(path_BA, num_B, drafted_BA, next_B) -> Verdict:
  """Tokens = accepted drafts (``drafted_BA[:, :num]``) then ``next_B``; pad the path."""
  A = path_BA.shape[1]
  idx_A = jnp.arange(A)
  end_slot_B = _gather_rows(path_BA, num_B)
  path_BA = jnp.where(idx_A[None] <= num_B[:, None], path_BA, end_slot_B[:, None])
  tokens_BA = jnp.where(idx_A[None] < num_B[:, None], drafted_BA,
                        jnp.where(idx_A[None] == num_B[:, None], next_B[:, None], 0))
  return Verdict(path_BA=path_BA.astype(jnp.int32), num_accepted_B=num_B.astype(jnp.int32),
                 tokens_BA=tokens_BA.astype(jnp.int32), end_slot_B=end_slot_B.astype(jnp.int32))


def _walk(tree: Tree, beam_length: int, accept_child):
  """Descend the tree from the root, one level per drafted position.

  ``accept_child(d, slot_B, child_BN)`` marks which children ``child_BN`` of the current node
  (at most one per row) are accepted at depth d. Returns the path (root first), the number of
  accepted drafts, the accepted drafted tokens (padded by one) and the end slot.
  """
  B = tree.tokens_BN.shape[0]
  slot_B = jnp.zeros((B,), jnp.int32)
  alive_B = jnp.ones((B,), bool)
  num_B = jnp.zeros((B,), jnp.int32)
  path, drafted = [slot_B], []
  for d in range(1, beam_length):
    accept_BN = accept_child(d, slot_B, _children_mask(tree, slot_B) & alive_B[:, None])
    moved_B = accept_BN.any(axis=1)
    slot_B = jnp.where(moved_B, jnp.argmax(accept_BN, axis=1).astype(jnp.int32), slot_B)
    alive_B = alive_B & moved_B
    num_B = num_B + moved_B
    path.append(slot_B)
    drafted.append(_gather_rows(tree.tokens_BN, slot_B))
  drafted_BA = jnp.stack(drafted + [jnp.zeros((B,), jnp.int32)], axis=1)
  return jnp.stack(path, axis=1), num_B, drafted_BA, slot_B


def verify_exact(rng, tree: Tree, logp_BNV, *, beam_length: int) -> Verdict:
  """Exact tree rejection sampling (greedy rows: accept exactly the argmax continuation).

  The vocabulary-wide work is one batched pass: the target distribution of every tree slot at
  once (``[B, N, V]``, one top-k/top-p filter for all of them), from which each node keeps only
  the probability of its own token under its parent's distribution. The walk down the tree then
  reads ``[B, N]`` numbers per depth; only the final draw reads one vocabulary row per row.
  """
  B, N, V = logp_BNV.shape
  keys = jax.random.split(rng, beam_length)
  parent_BN = jnp.maximum(tree.parent_BN, 0)  # the root's parent is never read (not a child)
  # p_own_BN[b, n]: P(token of node n | its parent's context), the node's acceptance numerator.
  p_own_BN = jnp.exp(logp_BNV[jnp.arange(B)[:, None], parent_BN, tree.tokens_BN])

  def accept_child(d, slot_B, child_BN):
    p_tok_BN = jnp.where(child_BN, p_own_BN, 0.0)
    before_BN = jnp.cumsum(p_tok_BN, axis=1) - p_tok_BN  # siblings tried earlier (slot order)
    cond_BN = p_tok_BN / jnp.maximum(1.0 - before_BN, _TINY)
    u_BN = jax.random.uniform(keys[d], (B, N))
    return child_BN & (u_BN < cond_BN)

  path_BA, num_B, drafted_BA, slot_B = _walk(tree, beam_length, accept_child)
  # The next token comes from what is left of P at the end node: its tree children were all
  # rejected (or it has none), so they are removed before sampling.
  logp_BV = _remove_tokens(_gather_rows_v(logp_BNV, slot_B), tree.tokens_BN,
                          _children_mask(tree, slot_B))
  next_B = sampling.sample(keys[0], logp_BV)
  return _assemble(path_BA, num_B, drafted_BA, next_B)


def verify_greedy(tree: Tree, logits_BNV, *, beam_length: int) -> Verdict:
  """Greedy acceptance for a batch whose rows are all greedy: descend into the child whose token
  is the LLM's argmax (siblings are distinct, so at most one is), then emit the argmax at the end
  node. Equals ``verify_exact`` at temperature 0 (ties go to the lowest token id in both)."""
  argmax_BN = sampling.greedy_tokens(logits_BNV)

  def accept_child(d, slot_B, child_BN):
    return child_BN & (tree.tokens_BN == _gather_rows(argmax_BN, slot_B)[:, None])

  path_BA, num_B, drafted_BA, slot_B = _walk(tree, beam_length, accept_child)
  return _assemble(path_BA, num_B, drafted_BA, _gather_rows(argmax_BN, slot_B))


def _gather_rows_v(x_BNV, slot_B):
  return jnp.take_along_axis(x_BNV, slot_B[:, None, None], axis=1)[:, 0]


def _longest_beam(accept_BWJ, beam_len_BW):
  """Per beam, the leading accepted drafted tokens (within the budget); pick the longest."""
  J = accept_BWJ.shape[2]
  in_budget_BWJ = jnp.arange(1, J + 1)[None, None, :] < beam_len_BW[:, :, None]
  run_BW = jnp.cumprod(accept_BWJ & in_budget_BWJ, axis=2).sum(axis=2)
  best_B = jnp.argmax(run_BW, axis=1)
  return best_B, _gather_rows(run_BW, best_B)


def _beam_verdict(tree: Tree, beams_BWL, best_B, num_B, next_B) -> Verdict:
  rows = jnp.arange(beams_BWL.shape[0])
  path_BA = jnp.minimum(tree.node_BWL[rows, best_B], tree.size - 1)
  drafted_BA = jnp.concatenate([beams_BWL[rows, best_B, 1:],
                                jnp.zeros_like(beams_BWL[:, 0, :1])], axis=1)
  return _assemble(path_BA, num_B, drafted_BA, next_B)


def verify_typical(rng, tree: Tree, beams: BeamOutput, logp_BNV, *, eps: float,
                   delta: float) -> Verdict:
  """Medusa typical acceptance (lossy): accept x when p(x) > min(eps, delta * exp(-H(p)))."""
  p_BNV = jnp.exp(logp_BNV)
  entropy_BN = -jnp.sum(jnp.where(p_BNV > 0, p_BNV * logp_BNV, 0.0), axis=-1)
  threshold_BN = jnp.minimum(eps, delta * jnp.exp(-entropy_BN))
  parent_logp_BWLV = unpack(tree, logp_BNV)  # P at each beam position, predicting the next
  beams_BWL = beams.beams_BWL
  tok_logp_BWJ = jnp.take_along_axis(parent_logp_BWLV[:, :, :-1], beams_BWL[:, :, 1:, None],
                                      axis=-1)[..., 0]
  accept_BWJ = jnp.exp(tok_logp_BWJ) > unpack(tree, threshold_BN)[:, :, :-1]
  best_B, num_B = _longest_beam(accept_BWJ, tree.beam_len_BW)
  rows = jnp.arange(beams_BWL.shape[0])
  end_B = jnp.minimum(tree.node_BWL[rows, best_B, num_B], tree.size - 1)
  next_B = sampling.sample(rng, _gather_rows_v(logp_BNV, end_B))
  return _beam_verdict(tree, beams_BWL, best_B, num_B, next_B)


def verify_reference(rng, tree: Tree, beams: BeamOutput, logp_BNV) -> Verdict:
  """The reference's rule: per beam accept with min(1, P/Q), resample from relu(P - Q)."""
  if beams.full_logp_BWJV is None:
    raise ValueError("the reference rule needs beam_search(..., return_full=True)")
  key_u, key_s = jax.random.split(rng)
  parent_logp_BWLV = unpack(tree, logp_BNV)
  beams_BWL = beams.beams_BWL
  p_tok_BWJ = jnp.take_along_axis(parent_logp_BWLV[:, :, :-1], beams_BWL[:, :, 1:, None],
                                   axis=-1)[..., 0]
  u_BWJ = jax.random.uniform(key_u, p_tok_BWJ.shape)
  accept_BWJ = u_BWJ < jnp.exp(p_tok_BWJ - beams.logp_BWJ)
  best_B, num_B = _longest_beam(accept_BWJ, tree.beam_len_BW)
  rows = jnp.arange(beams_BWL.shape[0])
  J = beams_BWL.shape[2] - 1
  p_end_BV = jnp.exp(parent_logp_BWLV[rows, best_B, num_B])
  q_BV = jnp.exp(beams.full_logp_BWJV[rows, best_B, jnp.minimum(num_B, J - 1)])
  whole_B = num_B >= tree.beam_len_BW[rows, best_B] - 1
  resid_BV = jnp.where(whole_B[:, None], p_end_BV, jax.nn.relu(p_end_BV - q_BV))
  # All-zero residual (P <= Q everywhere) cannot be sampled from; fall back to P.
  resid_BV = jnp.where(resid_BV.sum(-1, keepdims=True) > 0, resid_BV, p_end_BV)
  next_B = sampling.sample(key_s, jnp.log(resid_BV))
  return _beam_verdict(tree, beams_BWL, best_B, num_B, next_B)
