"""What a lease runs: each profile is a list of steps, each with its share of the run's time.

A step is one command line (a bench, the GPU tests) run in its own process, so a step that runs
past its share is stopped without losing what the steps before it wrote, and JAX in the lease's
own process never takes the GPU from the steps. Every step's JAX programs go to one persistent
compilation cache and every compile is logged with its seconds (``runner``).

Sizes: ``gpu`` is the real model on the lease's GPU; ``tiny`` is the same steps at CPU sizes on
the dry-run's tiny model (a random drafter, a few short prompts), which checks the machinery.

Placeholders in a step's argv: ``{py}`` the Python running the lease, ``{model}`` the unpacked
model folder, ``{results}`` this lease's results folder, ``{prompts}`` the repository's
Spec-Bench prompts.
"""

from __future__ import annotations

import dataclasses

PROMPTS = "data/spec_bench.jsonl.gz"
# Chosen up front, so that the lease compiles only their programs: the shipped drafter's own tree
# (decode.json), a drafter-only tree of width 4 and a wide one; the first lease measured all three
# kinds on the H100.
GPU_TREES = "1x4+3/5,4x4,8x5"
GPU_MAIN_TREE = "1x4+3/5"
CACHE_SIZE = 1024  # one cache size for every prompt and method
PROMPT_MULTIPLE = 512  # prompts padded to 512 or 1024: at most two prefill programs per method


@dataclasses.dataclass(frozen=True)
class Step:
  name: str
  argv: tuple[str, ...]
  share: float  # its part of the run's seconds, relative to the other steps'
  what: str
  env: tuple[tuple[str, str], ...] = ()
  reports: bool = False  # rebuild results.md from the JSON it wrote, even when cut short


def _suite(size: str) -> tuple[str, ...]:
  common = ("{py}", "-m", "redrafter_jax.bench", "suite", "--model", "{model}", "--prompts",
            "{prompts}", "--no-transformers", "--no-progress", "--out", "{results}/suite",
            "--typical-temperature", "0", "--temperatures", "1.0")
  if size == "gpu":
    return common + ("--gpu", "--drafter", "shipped", "--per-category", "1",
                     "--max-new-tokens", "128", "--beams", GPU_TREES, "--main-beams",
                     GPU_MAIN_TREE, "--batch-sizes", "1,4,16", "--cache-size", str(CACHE_SIZE),
                     "--prompt-multiple", str(PROMPT_MULTIPLE))
  # --quick: the two shortest prompts; one tree, one batch size: the fewest programs that still
  # run every part of the suite (each compile costs seconds on a CPU)
  return common + ("--quick", "--drafter", "random", "--exit-dim", "32", "--max-new-tokens", "8",
                   "--beams", "1x3+2/4", "--main-beams", "1x3+2/4", "--batch-sizes", "2",
                   "--split-repeat", "1", "--cache-size", str(CACHE_SIZE), "--prompt-multiple",
                   str(PROMPT_MULTIPLE), "--dtype", "bfloat16")


def measure(size: str) -> list[Step]:
  """The ``measure`` profile: the numbers the GPU table and the issues' goals need."""
  gpu = size == "gpu"
  tiny_model = () if gpu else ("--drafter", "random")
  env_cmd = ("nvidia-smi; " if gpu else "") + (
      '{py} -c "import jax, flax, sys; print(sys.version); print(\'jax\', jax.__version__, '
      '\'flax\', flax.__version__); print(jax.devices())"')
  return [
      Step("environment", ("sh", "-c", env_cmd), 1, "the GPU, driver and JAX the lease ran on"),
      Step("suite", _suite(size), 45,
           "AR vs ReDrafter greedy at three trees and exact sampling at T=1 (batch 1), the "
           "batch sweep, the step split and the divergence report", reports=True),
      Step("step_costs",
           ("{py}", "-m", "redrafter_jax.bench", "step_costs", "--shape",
            "llama3-8b" if gpu else "tiny", "--scan-layers", "--out",
            "{results}/step_costs.md")
           + (() if gpu else ("--reps", "1", "--verify-tokens", "8")), 15,
           "AR step, verification of 8-64 tokens and the draft at the Llama-3-8B shape (layers "
           "scanned: 32 unrolled layers would spend the step's share compiling), against the "
           "time to read their bytes once"),
      Step("loops",
           ("{py}", "-m", "redrafter_jax.bench", "loops", "--model", "{model}", "--prompts",
            "{prompts}", "--out", "{results}/loops.md")
           + (("--drafter", "shipped", "--dtype", "bfloat16", "--param-dtype", "bfloat16",
               "--num-prompts", "3", "--steps-per-check", "8") if gpu
              else tiny_model + ("--max-new-tokens", "8", "--reps", "1", "--num-prompts", "1",
                                 "--steps-per-check", "4")), 20,
           "the decode loops as they are, k steps per check, and with command buffers"),
      Step("gpu_tests", ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                         "tests/test_gpu.py", "tests/test_llama.py"), 10,
           "the gpu-marked tests (cuDNN and Pallas vs xla, ReDrafter == AR, batch > 1)",
           env=(("JAX_PLATFORMS", "cuda,cpu" if gpu else "cpu"),)),
      Step("layers",
           ("{py}", "-m", "redrafter_jax.bench", "layers", "--model", "{model}", "--param-dtype",
            "bfloat16", "--out", "{results}/layers.md")
           + (("--drafter", "shipped") if gpu else
              tiny_model + ("--max-new-tokens", "8", "--repeat", "1", "--context", "16",
                            "--batch", "1")), 9,
           "layers unrolled vs scanned: compile seconds and run time"),
  ]


PROFILES = {"measure": measure}


def profile(name: str, size: str) -> list[Step]:
  from redrafter_jax.lease.limits import LeaseError

  if name not in PROFILES:
    raise LeaseError(f"unknown lease profile {name!r}; built: {', '.join(PROFILES)} (the train "
                     "profile comes with the drafter issue)")
  if size not in ("gpu", "tiny"):
    raise LeaseError(f"unknown size {size!r}: gpu or tiny")
  return PROFILES[name](size)
