# What the server's AR step spends choosing greedy rows' tokens, before and after its greedy
# branch: the target distribution + jax.random.categorical per row (what every AR step did),
# the same with this change's draw, sampling.greedy_tokens (the greedy branch), jnp.argmax; logits [B, 49152] float32, timed in rounds in a 100-step
# loop. Run from the repository root: .venv/bin/python <this file>.
import jax, jax.numpy as jnp
from redrafter_jax.inference import sampling
from redrafter_jax.inference.timing import seconds_in_rounds

V, STEPS = 49152, 100


def loop(pick, B):
  x = jax.random.normal(jax.random.key(0), (B, V), jnp.float32)
  params = sampling.SamplingParams.make(B, 0.0)
  keys = jax.random.split(jax.random.key(1), B)

  @jax.jit
  def run(x):
    def body(i, c):
      a, acc = c
      return a + 1e-7, acc + pick(a, params, keys).sum()
    return jax.lax.fori_loop(0, STEPS, body, (x, jnp.int32(0)))[1]
  return lambda: run(x)


draw = lambda a, p, k: jax.vmap(lambda key, lp: sampling.sample(key, lp[None])[0])(
    k, sampling.target_logprobs(a, p, filtered=False))


def before(a, p, k):
  """The AR step's pick as it was: greedy rows one-hot at jnp.argmax, jax.random.categorical."""
  logp = jax.nn.log_softmax(a, axis=-1)
  ids = jnp.arange(V)[None]
  one_hot = jnp.where(ids == jnp.argmax(a, axis=-1, keepdims=True), 0.0, -jnp.inf)
  logp = jnp.where(p.greedy_B[:, None], one_hot, logp)
  return jax.vmap(lambda key, lp: jax.random.categorical(key, lp[None])[0])(k, logp)


fast = lambda a, p, k: sampling.greedy_tokens(a)
slow = lambda a, p, k: jnp.argmax(a, axis=-1)
for B in (1, 8):
  r = seconds_in_rounds({"before: distribution + categorical": (None, loop(before, B)),
                         "distribution + draw": (None, loop(draw, B)),
                         "jnp.argmax": (None, loop(slow, B)),
                         "greedy_tokens": (None, loop(fast, B))}, 10)
  print(f"B={B}: " + ", ".join(f"{k} {v / STEPS * 1e3:.3f} ms" for k, v in r.items()))
