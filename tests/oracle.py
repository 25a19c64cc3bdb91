"""A test-only stand-in for the drafter: proposes the TRUE continuation with planted errors.

``OracleDrafter(reference_BM)`` knows each row's reference output (e.g. AR greedy tokens, first
token included). At every step, beam 0 carries the true next L-1 tokens with an error planted at
depth ``e0 = ((step + row) % L) + 1`` (``e0 == L`` means no error), and beam w > 0 errs at depth
``max(1, e0 - w)`` with a different wrong token, so beams share prefixes (exercising the dedup)
and every accepted length 0 .. L-1 occurs as steps go by. If decoding is right, the accepted
length of a step is exactly ``e0 - 1``.
"""

import jax.numpy as jnp
from flax import nnx

from redrafter_jax.inference.beam_search import BeamOutput


class OracleDrafter(nnx.Module):

  def __init__(self, reference_BM, vocab_size: int):
    self.reference = nnx.Variable(jnp.asarray(reference_BM, jnp.int32))
    self.vocab_size = vocab_size

  def planted_error_depth(self, step, batch: int, L: int):
    return ((step + jnp.arange(batch)) % L) + 1

  def propose(self, llm, state, cfg):
    del llm
    ref_BM = self.reference[...]
    B, M = ref_BM.shape
    W, L = cfg.beam_width, cfg.beam_length
    rows = jnp.arange(B)[:, None]
    idx_BJ = jnp.clip(state.out.num_B[:, None] + jnp.arange(L - 1)[None, :], 0, M - 1)
    true_BJ = ref_BM[rows, idx_BJ]
    e0_B = self.planted_error_depth(state.out.steps, B, L)
    err_BW = jnp.maximum(1, e0_B[:, None] - jnp.arange(W)[None, :])
    depth_J = jnp.arange(1, L)
    wrong_BWJ = (true_BJ[:, None, :] + 1 + jnp.arange(W)[None, :, None]) % self.vocab_size
    drafted_BWJ = jnp.where(depth_J[None, None, :] >= err_BW[:, :, None], wrong_BWJ,
                             true_BJ[:, None, :])
    beams_BWL = jnp.concatenate(
        [jnp.broadcast_to(state.g0_B[:, None, None], (B, W, 1)), drafted_BWJ], axis=2)
    # Beam w is scored as less likely than beam w-1 (as a beam search would rank them).
    logp_BWJ = jnp.broadcast_to(-0.01 * (1 + jnp.arange(W))[None, :, None], (B, W, L - 1))
    return BeamOutput(beams_BWL=beams_BWL.astype(jnp.int32), logp_BWJ=logp_BWJ,
                      score_BW=logp_BWJ.sum(-1), full_logp_BWJV=None)
