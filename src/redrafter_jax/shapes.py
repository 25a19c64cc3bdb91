"""Axis letters used in array names and einsum strings across the library: one meaning each.

Every array in jitted code carries its shape in its name, e.g. ``logits_BTV`` or ``beams_BWL``.
Upper-case letters are the models' and the decoder's axes:

  A  tokens emitted by one step: the accepted drafts, then the LLM's next token (at most ``L``)
  B  batch rows (sequences; the server's slots)
  C  drafter exit dim (``exit_dim``)
  D  model width (``hidden_size``)
  E  head dim
  F  feed-forward (MLP) width
  G  query heads per kv head (``G = H // K``)
  H  query heads
  I  a projection's input width
  J  drafted tokens per beam, ``L - 1`` (TensorRT-LLM's ``draft_len_per_beam``)
  K  key/value heads
  L  beam length INCLUDING the LLM's own token g0 in column 0 (the reference's ``beam_length``)
  M  generated tokens per row: the output buffer (``max_new_tokens``)
  N  packed tree tokens (the static token budget, ``N <= W * J + 1``)
  O  a projection's output width
  P  positions in one chunk of the distillation loss
  Q  query rows per kv-cache row in attention, ``G * T``
  R  the draft vocabulary: the ``draft_vocab_size`` most frequent tokens
  S  KV-cache slots (the static cache size)
  T  tokens in one forward pass (a prompt, 1 for an AR step, N for a packed tree)
  U  beam extensions of one step in the MLX beam search, ``W * V``
  V  vocabulary
  W  beams per step (beam width; with the context-lookup beam the tree's beams are W + 1)
  X  KV-cache rows, ``K * B``, kv head major (``x = k * B + b``)
  Y  tree nodes before packing, ``L * W``, depth major (``y = depth * W + beam``)
  Z  beam-search candidates of one step, ``W * W`` (each beam's own top W)

Lower-case letters are local to one function:

  e  half the head dim (RoPE frequencies)
  l  the beams' length so far, growing during the MLX beam search
  n  drafter steps trained per position (``train.num_draft_steps``)
  r  rows of one matmul: every leading axis of its input, flattened
  x  any number of axes, leading or trailing (``hidden_xD``, ``values_BNx``)

Digits are literal sizes: ``logits_B1V`` holds one token per row, ``keys_B2`` two keys per row.

Example: ``k_XES`` is one layer's key cache; ``mask_BTS`` says which cache slots each new token
may attend to.
"""
