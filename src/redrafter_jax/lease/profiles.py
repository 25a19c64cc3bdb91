"""What a lease runs: each profile is a list of steps, each with its share of the run's time.

A step is one command line (a bench, the GPU tests) run in its own process, so a step that runs
past its share is stopped without losing what the steps before it wrote, and JAX in the lease's
own process never takes the GPU from the steps. Every step's JAX programs go to one persistent
compilation cache and every compile is logged with its seconds (``runner``).

Parts: a step runs in part 1 (the plan's last upload call, up to the runner's 10 minutes) or in
part 2 (one more call right after it, with what is left of the lease; the stash, the model and the
compilation cache are still there while the machine is warm). Part 1 holds what the lease is for.

Shares: from the first measure lease (H200, 2026-11-26: ``results/nvidia-h200/``), where
compiling the 30-layer model's programs took 5-11 s each (the suite: 67 programs, 181 of its 252
s) and the loops, the gpu tests and the layers were stopped at their deadlines.

Sizes: ``gpu`` is the real model on the lease's GPU; ``tiny`` is the same steps at CPU sizes on
the dry-run's tiny model (a random drafter, a few short prompts), which checks the machinery.

Placeholders in a step's argv: ``{py}`` the Python running the lease, ``{model}`` the unpacked
model folder, ``{results}`` this lease's results folder (it comes back), ``{scratch}`` a folder in
the stash for what stays on the machine (teacher data, checkpoints), ``{prompts}`` the
repository's Spec-Bench prompts, ``{budget}`` the seconds the step has, less ``STEP_RESERVE_S``
(for a step that times itself and ends on time, which a step stopped at its deadline does not).

Packages: a profile's ``needs`` are Python distributions the GPU image lacks (it has JAX, Flax,
Optax, Orbax, transformers; not grain). ``lease plan`` downloads their wheels for the image's
Python into the payload and ``lease run`` unpacks them onto the steps' ``PYTHONPATH``.
"""

from __future__ import annotations

import dataclasses

from redrafter_jax.config import DrafterConfig

PROMPTS = "data/spec_bench.jsonl.gz"
# Chosen up front, so that the lease compiles only their programs: the shipped drafter's own tree
# (decode.json) and a width-4 tree with the lookup beam and the drafter's 4 best first tokens
# (step-1 alternatives: more tokens/step at every tree the CPU measured them with, and a GPU
# verifies the few extra tokens almost free). Wide trees (8x5, 16x5) were the slowest on both
# GPUs so far (H100 1.09x/1.03x, H200 0.97x AR) and are left out to save their compiles.
GPU_TREES = "1x4+3/5,4x4+3+a4"
GPU_MAIN_TREE = "1x4+3/5"
CACHE_SIZE = 1024  # one cache size for every prompt and method
STEP_RESERVE_S = 20  # {budget}: a step's seconds less this (process start, the last write)
# The GPU image's Python, and the wheels the train profile needs on it (grain and the packages it
# imports that the image lacks): ``lease plan`` downloads them for this Python.
IMAGE_PYTHON = "3.12"
TRAIN_NEEDS = ("grain==0.2.18", "array-record==0.8.6", "portpicker", "cloudpickle")
TRAIN_CONFIG = "configs/lease_train.yaml"
PROMPT_MULTIPLE = 512  # prompts padded to 512 or 1024: at most two prefill programs per method


@dataclasses.dataclass(frozen=True)
class Step:
  name: str
  argv: tuple[str, ...]
  share: float  # its part of the run's seconds, relative to the other steps'
  what: str
  env: tuple[tuple[str, str], ...] = ()
  reports: bool = False  # rebuild results.md from the JSON it wrote, even when cut short
  part: int = 1  # the run call it belongs to (module docstring)


@dataclasses.dataclass(frozen=True)
class Profile:
  steps: tuple[Step, ...]
  needs: tuple[str, ...] = ()  # wheels the image lacks (module docstring)


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
  suite = Step("suite", _suite(size), 64,
               "AR vs ReDrafter greedy at two trees and exact sampling at T=1 (batch 1), the "
               "batch sweep, the step split and the divergence report", reports=True)
  loops = Step("loops",
               ("{py}", "-m", "redrafter_jax.bench", "loops", "--model", "{model}", "--prompts",
                "{prompts}", "--out", "{results}/loops.md", "--cache-size", str(CACHE_SIZE),
                "--prompt-multiple", str(PROMPT_MULTIPLE))
               + (("--drafter", "shipped", "--dtype", "bfloat16", "--param-dtype", "bfloat16",
                   "--num-prompts", "3", "--steps-per-check", "8") if gpu
                  else tiny_model + ("--max-new-tokens", "8", "--reps", "1", "--num-prompts",
                                     "1", "--steps-per-check", "4")), 25,
               "the decode loops as they are, k steps per check, and with command buffers "
               "(one prompt bucket: three programs per variant)")
  gpu_tests = Step("gpu_tests", ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                                 "gpu", "tests/test_gpu.py"), 10,
                   "the gpu-marked decode-path tests (cuDNN and Pallas vs xla, ReDrafter == AR, "
                   "batch > 1)", env=(("JAX_PLATFORMS", "cuda,cpu" if gpu else "cpu"),))
  layers = Step("layers",
                ("{py}", "-m", "redrafter_jax.bench", "layers", "--model", "{model}",
                 "--param-dtype", "bfloat16", "--out", "{results}/layers.md")
                + (("--drafter", "shipped") if gpu else
                   tiny_model + ("--max-new-tokens", "8", "--repeat", "1", "--context", "16",
                                 "--batch", "1")), 50,
                "SmolLM2's layers unrolled vs scanned: compile seconds and run time", part=2)
  # The first lease measured the Llama-3-8B shape's AR step, scanned, at 2.27x the time to read
  # its weights once. The same shape at 8 layers, scanned and unrolled, says how much of that
  # is the scan (a scan may copy each layer's weights out of the stacked array every step).
  def step_costs(scan: bool) -> Step:
    kind = "scanned" if scan else "unrolled"
    return Step(f"step_costs_{kind}",
                ("{py}", "-m", "redrafter_jax.bench", "step_costs", "--shape",
                 "llama3-8b" if gpu else "tiny", "--layers", "8" if gpu else "2",
                 "--verify-tokens", "16" if gpu else "8", "--out",
                 f"{{results}}/step_costs_{kind}.md")
                + (("--scan-layers",) if scan else ()) + (() if gpu else ("--reps", "1")), 25,
                f"AR step, verification of 16 tokens and the draft at the Llama-3-8B shape cut "
                f"to 8 layers, {kind}, against the time to read their bytes once", part=2)

  environment = Step("environment", ("sh", "-c", env_cmd), 1,
                     "the GPU, driver and JAX the lease ran on")
  # the loops first: their numbers pick the GPU's default loop, and no lease has measured them
  return [environment, loops, suite, gpu_tests, layers, step_costs(True), step_costs(False)]


def _recipe():
  """The GPU training recipe (``TRAIN_CONFIG``), as a preset."""
  from redrafter_jax.config import load_preset

  return load_preset(TRAIN_CONFIG)


def train(size: str) -> Profile:
  """The ``train`` profile (issue 36 item 2): teacher data, a drafter trained on it, brought back
  and measured against AR, in one lease.

  Part 1: the model answers the repository's training prompts at a large batch (several
  sampled answers per prompt) until its time is up, and the drafter trains on what was written
  (``configs/lease_train.yaml``, the ablations' best recipe) for a time budget that fits the
  schedule to the steps there is time for; then the drafter comes back in float16 with the
  teacher manifest and the training curves. Part 2: greedy AR against ReDrafter with the new
  drafter, batch 1, one Spec-Bench prompt per category.

  The model's own prompts (``self-prompts``, Magpie-style) are not a step: a lease's teacher
  time answers a small part of the repository's 12.9k prompts (x4 with the sampled answers), and
  the first train lease (2026-11-28) spent the step's share compiling its program."""
  gpu = size == "gpu"
  recipe = _recipe()
  # the drafter's own format: reference (MLX, TensorRT-LLM) unless it has an option only ours
  # holds (several layers, the copy hint)
  own = set(DrafterConfig.OWN_OPTIONS) & {k for k, v in (recipe.drafter or {}).items() if v}
  export_format = "redrafter-jax" if own else "reference"
  tiny_vocab = 64
  # the head trains train.vocab_limit rows; the rest stay zero and are not brought back
  head_rows = recipe.train.vocab_limit if gpu else tiny_vocab
  cli = ("{py}", "-m", "redrafter_jax.cli")
  fast = ("--dtype", "bfloat16", "--param-dtype", "bfloat16") if gpu else ()
  teacher = Step(
      "teacher", cli + ("distill-data", "--model", "{model}", "--prompts",
                        "data/prompts/mix-v1.jsonl.gz", "--out", "{scratch}/teacher",
                        "--max-seconds", "{budget}")
      # one prompt shape (--prompt-multiple 384 = --max-prompt-tokens): at most two programs,
      # greedy and sampled; shards of 1024 so that several end within the step and one is held out
      # batch 1024: the first train lease wrote 37.7k tokens/s at 512 (~7.5 ms a decode step);
      # 5 sampled answers per prompt (77k jobs, ~19M tokens): at 1024 rows the 51.6k jobs of 3
      # per prompt could run out before the step's time does
      + fast + (("--batch-size", "1024", "--shard-size", "1024", "--max-new-tokens", "384",
                 "--max-prompt-tokens", "384", "--prompt-multiple", "384",
                 "--sampled-fraction", "5") if gpu else
                ("--limit", "48", "--batch-size", "8", "--shard-size", "16",
                 "--max-new-tokens", "16", "--sampled-fraction", "1.5")), 270,
      "teacher data: the model answers the training prompts, greedy and sampled at T=1, at a "
      "large batch until the step's time is up")
  tiny_train = ("model={model}", "drafter.exit_dim=32", "drafter.feature_layers=[0, 1]",
                "train.seq_len=64", "train.batch_size=4", "train.num_steps=8",
                "train.eval_batches=1", "train.log_every=2", f"train.vocab_limit={tiny_vocab}",
                "train.loss_chunk=16")
  training = Step(
      "train", cli + ("train", "--config", TRAIN_CONFIG, "--no-progress",
                      "model={model}", "train.data={scratch}/teacher",
                      "train.output_dir={scratch}/train", "train.max_seconds={budget}")
      + (() if gpu else tiny_train), 250,
      "the drafter trained on that data (configs/lease_train.yaml), its schedule fitted to the "
      "step's time")
  gather = ("mkdir -p {results}/train && cp {scratch}/teacher/manifest.json "
            "{results}/teacher_manifest.json; for f in metrics.csv eval.csv schedule.json "
            "curves.png; do [ -f {scratch}/train/$f ] && cp {scratch}/train/$f {results}/train/; "
            "done; ")
  bring_back = Step(
      "bring_back", ("sh", "-c", gather + " ".join(
          cli + ("export", "--drafter", "{scratch}/train/drafter", "--out",
                 "{results}/drafter", "--overwrite", "--dtype", "fp16", "--format",
                 export_format, "--head-rows", str(head_rows)))), 6,
      "the drafter in float16 with a compact head (the rows it trained), the teacher manifest "
      "and the training curves into the results")
  measure_step = Step(
      "measure", ("{py}", "-m", "redrafter_jax.bench", "suite", "--model", "{model}",
                  "--prompts", "{prompts}", "--drafter", "{results}/drafter",
                  "--no-transformers", "--no-progress", "--out", "{results}/suite",
                  "--typical-temperature", "0", "--temperatures", "", "--batch-sizes", "",
                  "--split-repeat", "1", "--cache-size", str(CACHE_SIZE),
                  "--prompt-multiple", str(PROMPT_MULTIPLE))
      # the head trained on train.vocab_limit tokens: draft over those
      + ("--draft-vocab", str(head_rows))
      + (("--gpu", "--per-category", "1", "--max-new-tokens", "128", "--beams", GPU_TREES,
          "--main-beams", GPU_MAIN_TREE) if gpu else
         ("--quick", "--max-new-tokens", "8", "--beams", "1x3+2/4", "--main-beams", "1x3+2/4",
          "--dtype", "bfloat16")), 1,
      "greedy AR against ReDrafter with the new drafter at two trees, batch 1, one Spec-Bench "
      "prompt per category (13), then the divergence report as far as time allows",
      reports=True, part=2)
  environment = Step("environment", ("sh", "-c", ("nvidia-smi; " if gpu else "") + (
      '{py} -c "import jax, grain, sys; print(sys.version); print(\'jax\', jax.__version__, '
      '\'grain\', grain.__version__); print(jax.devices())"')), 8,
      "the GPU, driver and JAX, and grain from the carried wheels")
  return Profile((environment, teacher, training, bring_back, measure_step),
                 needs=TRAIN_NEEDS if gpu else ())


PROFILES = {"measure": lambda size: Profile(tuple(measure(size))), "train": train}


def profile_of(name: str, size: str) -> Profile:
  """The profile ``name`` at ``size`` (gpu | tiny); an unknown one is one clear error."""
  from redrafter_jax.lease.limits import LeaseError

  if name not in PROFILES:
    raise LeaseError(f"unknown lease profile {name!r}; built: {', '.join(PROFILES)}")
  if size not in ("gpu", "tiny"):
    raise LeaseError(f"unknown size {size!r}: gpu or tiny")
  got = PROFILES[name](size)
  return got if isinstance(got, Profile) else Profile(tuple(got))


def profile(name: str, size: str) -> list[Step]:
  return list(profile_of(name, size).steps)
