# Times a ReDrafter step inside decode()'s loop (from two generation lengths) and called one at a time
# (TreeStepper), against AR's one-token step, on a synthetic 100-token prompt (real model, bf16
# weights, shipped drafter). Run from the repository root: .venv/bin/python <this file>.
import time, jax, jax.numpy as jnp, numpy as np, dataclasses
from redrafter_jax.weights.llama_weights import load_llama
from redrafter_jax.inference.decode import ReDrafter
from redrafter_jax.inference.tree_choice import Beams
from redrafter_jax.bench._common import load_drafter_arg
from redrafter_jax.inference.timing import TreeStepper, seconds_in_rounds
from redrafter_jax.inference.ar import one_token_stepper
llm, cfg = load_llama("smollm2-135m", param_dtype=jnp.bfloat16)
drafter = load_drafter_arg("shipped", cfg, 0)
prompt = list(range(1000, 1100))
for spec in ["1x5+3/6", "1x3+3/4", "1x2/2"]:
  for n in (32, 160):
    dc = Beams.parse_list(spec)[0].config(max_new_tokens=n, draft_vocab_size=8192)
    rd = ReDrafter(llm, drafter, dc)
    r = rd([prompt]); ts=[]
    for _ in range(3):
      s=time.perf_counter(); r = rd([prompt]); ts.append(time.perf_counter()-s)
    print(spec, n, "steps", r.metrics["steps"], "ms", min(ts)*1e3, flush=True)
  dc = Beams.parse_list(spec)[0].config(max_new_tokens=64, draft_vocab_size=8192)
  st = TreeStepper(llm, drafter, dc, prompt, 40)
  ar = one_token_stepper(llm, 1, st.prepared.cache_size, 120)
  print(spec, "rounds", seconds_in_rounds({"tree": (None, st), "ar": (None, ar)}, 30), "cache", st.prepared.cache_size, flush=True)
