"""Benchmarks, run as ``python -m redrafter_jax.bench <name> [options]``.

Each benchmark is a module ``redrafter_jax.bench.<name>`` with ``main(argv) -> int``: ``ar``
(plain AR decoding against transformers), and the speculative decoder's own benchmarks. They
print tables of measurements taken side by side in one run; they are not tests.
"""
