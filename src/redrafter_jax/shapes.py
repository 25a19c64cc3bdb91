"""Axis letters used in array names and einsum strings across the library.

Every array in jitted code carries its shape in its name, e.g. ``logits_BTV`` or ``beams_BWL``:

  B  batch rows
  T  tokens in one forward pass (prompt chunk, 1 for an AR step, N for a packed tree)
  S  KV-cache slots (static cache size)
  D  model width (``hidden_size``)
  V  vocabulary size
  H  query heads
  K  key/value heads (GQA groups: ``G = H // K`` query heads share one kv head)
  G  query heads per kv head
  E  head dim
  F  feed-forward (MLP) width
  W  beams drafted per step (beam width)
  L  beam length INCLUDING the LLM's own token g0 in column 0 (the reference's ``beam_length``;
     the number of drafted tokens per beam is ``L - 1``, TensorRT-LLM's ``draft_len_per_beam``)
  N  packed tree tokens (static token budget, ``N <= W * (L - 1) + 1``)
  C  drafter exit dim (``exit_dim``)
  A  accepted tokens in one step (at most ``L``)

Example: ``k_BSKE`` is a key cache of one layer; ``mask_BTS`` says which cache slots each new token
may attend to.
"""
