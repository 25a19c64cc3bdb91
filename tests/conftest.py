"""Shared fixtures. Fakes 8 CPU devices (before JAX is imported) to test sharding, and makes
implicit rank promotion an error: every broadcast in the library is written out (``[:, None]``),
so a shape mistake fails loudly instead of broadcasting into a wrong answer.

Tests run on the CPU unless ``JAX_PLATFORMS`` says otherwise (CI has no GPU). On a GPU machine
run them with ``JAX_PLATFORMS=cuda,cpu``: the GPU is then the default backend (the ``gpu``-marked
tests run), and the CPU stays available for what names it (the HF folder reader stages tensors on
the CPU backend, so with ``cuda`` alone every tiny-model reference fails with "Unknown backend
cpu"). The fake device count is an XLA:CPU flag: it multiplies the host platform only, never the
GPUs, so it is added to ``XLA_FLAGS`` (keeping any flags already there) on every platform. Tests
that shard over the default backend's 8 devices assume the CPU default.

Float32 parity tests state their matmul precision (``jax.default_matmul_precision("highest")``):
a GPU's default float32 matmul is TF32, ten mantissa bits, which is not the arithmetic they check.
"""

import os

_FAKE_DEVICES = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAKE_DEVICES}".strip()
# The tiny-model tests spend their time compiling, not running: the CPU backend's code generation
# without LLVM's costly optimisations compiles them about a third faster and computes the same
# values (no fast-math either way; both programs of every bitwise comparison are compiled alike).
# The real-model (slow) tests run their programs long enough that the optimised code pays:
# ``REDRAFTER_TEST_CODEGEN=full`` (``make test`` sets it for them) keeps XLA's defaults.
_QUICK_CODEGEN = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if (os.environ.get("REDRAFTER_TEST_CODEGEN", "quick") == "quick"
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {_QUICK_CODEGEN}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"  # also for the subprocesses tests start
# One persistent compilation cache for the whole run: the pytest workers, the subprocesses tests
# start, and modules that compile what an earlier module compiled (each module's programs are
# dropped when it ends) load a program instead of compiling it again. It lives in .pytest_cache
# (ignored by git), so a clean clone starts empty; the key is the program, the flags and the JAX
# version, so a cached program is the one XLA would compile.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache",
                 "jax-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(scope="module")
def float32_matmuls():
  """Float32 matmuls computed in float32 on every backend, for the module that asks (``pytestmark
  = pytest.mark.usefixtures("float32_matmuls")``) and its module fixtures: JAX's default float32
  matmul on a GPU is TF32, ten mantissa bits, and a parity test checks float32 arithmetic. The
  setting is the calling thread's: work in other threads (the serving engine's loop) keeps the
  default, so a module that runs the engine must not ask for it (its programs would differ)."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="session")
def smollm2():
  """The real SmolLM2-135M-Instruct (fetched once into the cache), fp32, with its tokenizer."""
  from redrafter_jax.weights import fetch
  from redrafter_jax.weights.llama_weights import load_llama
  from redrafter_jax.weights.tokenizer import load_tokenizer

  model, cfg = load_llama("smollm2-135m")
  tok = load_tokenizer(fetch.model_path("smollm2-135m"))
  return model, cfg, tok


@pytest.fixture(scope="session")
def spec_bench_path(tmp_path_factory):
  """The Spec-Bench prompts the checkout carries (data/spec_bench.jsonl.gz), as a plain JSON-lines
  file: tests read its rows with ``read_text``, the code under test reads either form."""
  import gzip
  from pathlib import Path

  from redrafter_jax.bench.ar import DEFAULT_PROMPTS

  path = tmp_path_factory.mktemp("spec_bench") / "spec_bench.jsonl"
  path.write_bytes(gzip.decompress(Path(DEFAULT_PROMPTS).read_bytes()))
  return path


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
  """Drop JAX's compiled programs after each test module, so that one long pytest process does
  not accumulate hundreds of executables (and the real model's) until memory runs out."""
  yield
  import gc

  import jax

  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _no_leaked_compile_cache():
  """A test that points XLA's persistent compilation cache elsewhere (``serve`` run in-process)
  must not leave it there for the tests after it."""
  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)


@pytest.fixture(autouse=True)
def _tree_times_cached_on_a_busy_machine(monkeypatch):
  """Tests share the machine with each other's threads and with whatever else runs: tree step
  times are cached whatever the load, so that a test's second call reads what its first timed
  (``test_tree_choice`` tests the refusal itself)."""
  from redrafter_jax.inference import tree_choice

  monkeypatch.setattr(tree_choice, "BUSY_SHARE", 1.0)


@pytest.fixture(scope="module")
def llm():
  """The tiny random LLM (``tiny_models``), one per test module; a module may define its own."""
  from tiny_models import tiny_llm

  return tiny_llm()


@pytest.fixture(scope="module")
def drafter():
  """The tiny random drafter matching ``llm``, one per test module."""
  from tiny_models import tiny_drafter

  return tiny_drafter()
