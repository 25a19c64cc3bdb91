"""GPU leases: ship the model and a profile to a lent GPU machine, run it there, bring results back.

Our GPU time comes in short leases from a remote runner with hard rules (``limits``). A lease is
planned here (``plan``: the model packed as its quantized bytes by ``model_pack``, split into one
chunk per call so that each call fits), run there (``runner``: a ``profiles`` entry, each step in
its own process under its share of the time, results bundled after every step), and proven on
this CPU first (``dry_run``: the same plan through ``fake_device`` with a ``tiny`` model).
"""
