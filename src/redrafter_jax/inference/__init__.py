"""Decoding: the AR baseline and ReDrafter, as pure functions and jitted programs.

Read in this order: ``runtime`` (prompt packing, prefill, the output record), ``sampling`` (the
target distribution), ``ar`` (the AR baseline), ``beam_search`` and ``lookup`` (drafting),
``tree`` (dynamic tree attention), ``verify`` (acceptance rules), ``step`` (one ReDrafter
step), ``decode`` (the ``ReDrafter`` object and ``decode``).
"""
