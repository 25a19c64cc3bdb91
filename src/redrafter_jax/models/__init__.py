"""The networks and their state: ``llama`` (the base LLM), ``attention`` (its backends),
``linear`` (its ``[out, in]`` projections), ``kv_cache`` (the static-shape cache it writes) and
``drafter`` (the ReDrafter head). Nothing here loads files or decodes."""
