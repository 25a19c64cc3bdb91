# One draft head projection [1,768]x[768,8192] (the shipped drafter's restricted head) in a
# 50-step loop: float32 weights vs bfloat16 weights (hi/lo rows, both layouts; hi only), timed in
# rounds. Run from the repository root: .venv/bin/python <this file>.
import time, jax, jax.numpy as jnp, numpy as np, functools
from redrafter_jax.models import linear
from redrafter_jax.inference.timing import seconds_in_rounds
k = jax.random.normal(jax.random.key(0), (768, 8192), jnp.float32) * 0.02
x = jax.random.normal(jax.random.key(1), (1, 768), jnp.float32)
k_oi = k.T.astype(jnp.bfloat16)
k_io = k.astype(jnp.bfloat16)
def loop(f, w):
  @jax.jit
  def run(x, w):
    def body(i, c):
      y = f(c, w)
      return c + 1e-6 * y[:, :768]
    return jax.lax.fori_loop(0, 50, body, x)
  return lambda: run(x, w)
f32 = loop(lambda c, w: c @ w, k)
b_oi = loop(lambda c, w: linear.project(c, w, jnp.float32, layout="oi"), k_oi)
b_io = loop(lambda c, w: linear.project(c, w, jnp.float32, layout="io"), k_io)
b_lo = loop(lambda c, w: jax.lax.dot_general(jnp.concatenate([c,c]).astype(jnp.bfloat16), w, (((1,),(1,)),((),())), preferred_element_type=jnp.float32)[:1], k_oi)
r = seconds_in_rounds({"f32": (None, f32), "bf16 oi hi/lo": (None, b_oi), "bf16 io hi/lo": (None, b_io), "bf16 oi hi only": (None, b_lo)}, 20)
for n, s in r.items(): print(n, f"{s/50*1e3:.3f} ms per [1,768]x[768,8192]")
