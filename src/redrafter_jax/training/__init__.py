"""Drafter training by self-distillation from the frozen LLM (DESIGN §7).

Read in this order: ``self_prompts`` (requests the LLM writes itself), ``distill`` (the LLM
answers prompts: teacher data shards), ``data`` (the grain pipeline over them), ``losses`` (the
distillation loss), ``checkpoint`` (orbax), ``trainer`` (the sharded training loop).
"""
