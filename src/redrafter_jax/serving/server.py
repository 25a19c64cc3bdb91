"""Assemble a server from a preset and its ``ServeConfig`` (model, tokenizer, drafter, mesh,
engine, app) and run it.

``build`` loads everything; ``ServerThread`` runs uvicorn in a background thread on a socket
bound before it starts (tests and the load test's own servers: no port races, bounded waits);
``serve_forever`` listens at once and builds in a background thread (``startup``: ``/health``
answers 503 with the progress until ready), then serves in the foreground until SIGINT/SIGTERM
and shuts down gracefully (``lifecycle.GracefulServer``: in-flight requests get
``serve.shutdown_grace`` seconds).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import socket
import threading
import time
from typing import Sequence

import jax
from flax import nnx

from redrafter_jax.config import ConfigError, Preset, ServeConfig
from redrafter_jax.serving.app import SamplingDefaults, create_app, protect
from redrafter_jax.serving.engine import Engine, EngineConfig, tree_mode
from redrafter_jax.serving.placement import serving_mesh
from redrafter_jax.serving.lifecycle import Startup, make_server

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Server:
  """A ready app and the engine behind it (the engine thread is already running)."""

  app: object
  engine: Engine
  model_name: str

  def close(self) -> None:
    self.engine.stop()


def drafter_folder(preset: Preset) -> pathlib.Path | None:
  """The folder of the preset's drafter (``drafter_path``, 'shipped' resolved), None when it
  names none. Raises ``ConfigError`` when it is missing."""
  if preset.drafter_path is None:
    return None
  from redrafter_jax.weights.shipped import resolve_drafter

  try:
    return resolve_drafter(preset.drafter_path)
  except FileNotFoundError as e:
    raise ConfigError(f"{e} (train one, or pass --drafter PATH)") from None


def served_drafter_folder(preset: Preset) -> pathlib.Path:
  """``drafter_folder``, which a speculative server must have: ``ConfigError`` when none."""
  folder = drafter_folder(preset)
  if folder is None:
    raise ConfigError("no drafter to serve: set drafter_path in the preset, pass --drafter PATH, "
                      "or use --random-drafter (tests) or --ar (no speculation)")
  return folder


def preflight(preset: Preset, serve: ServeConfig) -> None:
  """The checks that need no model loaded (a named drafter exists), so that ``serve`` reports
  them before it listens rather than from its background start-up."""
  if serve.speculative and not serve.random_drafter:
    served_drafter_folder(preset)
  served_weights_dtype(preset, random_drafter=serve.random_drafter)


def load_drafter_for(preset: Preset, llm_cfg, *, random: bool, seed: int = 0):
  """The drafter to serve: a random one (tests), or the preset's ``drafter_path``."""
  from redrafter_jax.models.drafter import Drafter

  if random:
    return Drafter(preset.drafter_config(llm_cfg), rngs=nnx.Rngs(seed))
  folder = served_drafter_folder(preset)
  from redrafter_jax.weights.drafter_io import load_drafter

  try:
    return load_drafter(folder)
  except FileNotFoundError as e:
    raise ConfigError(f"{e} (train one, or pass --drafter PATH)") from None


def served_weights_dtype(preset: Preset, *, random_drafter: bool = False) -> str:
  """The LLM weight dtype a server loads (``weights.param_dtype.weights_dtype``): the preset's
  ``param_dtype``, else the one its drafter was measured with, else the preset's ``dtype``. A
  ``--ar`` server reads the same drafter, so a ReDrafter-vs-AR comparison serves the same
  weights."""
  from redrafter_jax.weights.param_dtype import weights_dtype

  drafter = None if random_drafter else drafter_folder(preset)
  return weights_dtype(preset.param_dtype, dtype=preset.dtype, drafter=drafter)


def served_decode(preset: Preset, llm, drafter, *, tree: str = "preset"):
  """The decode settings a server runs and the policy's starting tokens/step:
  ``(decode, prior)``. ``tree`` "auto": the preset's settings with the draft tree predicted
  fastest on this device (``tree_choice.for_device``), the preset's own when the drafter has no
  acceptance table; "preset": the preset's. ``prior``: the drafter's measured tokens/step for
  the served tree (its acceptance.json), None when not measured (the engine then starts from
  the tree's length)."""
  from redrafter_jax.inference import tree_choice

  table = tree_choice.read_acceptance(drafter_folder(preset))
  decode = preset.decode
  if tree == "auto" and table is None:
    log.info("the drafter has no %s: serving the preset's tree", tree_choice.ACCEPTANCE_FILE)
  elif tree == "auto":
    choice = tree_choice.for_device(table, llm, drafter,
                                    draft_vocab_size=decode.draft_vocab_size, log=log.info)
    log.info("draft tree for this device: %s, predicted %.2fx AR at batch 1\n%s",
             choice.beams.label, choice.predicted_speedup, choice.table())
    if not choice.pays:
      log.info("%s: the serving policy steps with AR unless the acceptance it observes pays "
               "for the tree", choice.verdict())
    decode = choice.config(decode)
  return decode, measured_prior(table, decode)


def measured_prior(table, cfg) -> float | None:
  """The tokens/step the policy starts from for ``cfg``'s tree: the drafter's measured one
  (``table``, its acceptance.json), at most the tree's length; None when not measured."""
  from redrafter_jax.inference import tree_choice

  tps = tree_choice.tokens_per_step_for(table, cfg)
  return None if tps is None else min(tps, float(cfg.beam_length))


def with_smaller_trees(config: EngineConfig, trees: Sequence[str], folder=None
                       ) -> EngineConfig:
  """``config`` with the extra trees a server runs (``EngineConfig.trees``): those of ``trees``
  (``WxL[+n][+aK][/N]``) that fit within the served tree and differ from it (the served tree may be
  chosen on the device, so the others are skipped with a log line), each with its measured
  tokens/step from the drafter's acceptance.json in ``folder`` as its prior when it has one.
  A malformed tree is a ``ConfigError``."""
  from redrafter_jax.inference import tree_choice

  try:
    candidates = tree_choice.Beams.parse_list(",".join(trees)) if trees else []
  except ValueError as e:
    raise ConfigError(f"--trees: {e}") from None
  table = tree_choice.read_acceptance(folder) if folder is not None else None
  kept, priors = [], []
  for beams in candidates:
    try:
      trial = dataclasses.replace(config, trees=(*kept, beams.text), tree_priors=())
    except ConfigError as e:
      log.info("not serving tree %s beside the served one: %s", beams.text, e)
      continue
    kept.append(beams.text)
    priors.append(measured_prior(table, trial.tree_modes()[tree_mode(beams.text)]))
  return dataclasses.replace(config, trees=tuple(kept), tree_priors=tuple(priors))


def use_compile_cache(path: str | None, devices: int | None = None) -> str | None:
  """Keep XLA's compiled programs in ``path`` (None: ``xla/`` in the model cache folder; "off":
  not at all), so a restarted server loads its warm-up programs instead of compiling them again.
  ``devices``: how many devices the server spans (None: all local ones). Returns the folder
  used, or None when not caching.

  Not on XLA:CPU across several devices: there a sharded program loaded from the cache hangs in
  its first cross-device collective until XLA aborts the process (its devices wait in different
  collectives), so such a server compiles at every start instead."""
  if path == "off":
    return None
  n = len(jax.local_devices()) if devices is None else devices
  if jax.default_backend() == "cpu" and n > 1:
    log.warning("not caching compiled programs: on XLA:CPU, programs over %d devices hang "
                "when loaded from the cache; they compile at every start", n)
    return None
  if path is None:
    from redrafter_jax.weights.fetch import cache_dir
    path = os.path.join(cache_dir(), "xla")
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  log.info("compiled programs are cached in %s", path)
  return path


def engine_config(preset: Preset, serve: ServeConfig, llm_cfg) -> EngineConfig:
  """The engine's settings from the server's: the preset's decode settings (the draft tree is
  chosen later, once the drafter is loaded), ``max_context`` min(2048, the model's context)
  unless set, ``default_max_tokens`` the preset's ``decode.max_new_tokens`` unless set."""
  return EngineConfig(
      slots=serve.slots, max_context=serve.max_context or min(2048,
                                                               llm_cfg.max_position_embeddings),
      max_tokens=serve.max_tokens,
      default_max_tokens=serve.default_max_tokens or preset.decode.max_new_tokens,
      max_queue=serve.max_queue, speculative=serve.speculative, decode=preset.decode,
      min_context_bucket=serve.min_context_bucket, prefill_tokens=serve.prefill_tokens,
      memory_limit_gb=serve.memory_limit_gb)


def build(preset: Preset, serve: ServeConfig | None = None, *,
          startup: Startup | None = None) -> Server:
  """Load the preset's model and tokenizer (and drafter unless AR), start the engine, and make
  the app, all as ``serve`` (None: the preset's ``serve`` section) says.

  ``serve.tree``: "preset" serves the preset's draft tree; "auto" the one predicted fastest on
  this device for the drafter (``served_decode``, batch 1; the preset's when the drafter has no
  acceptance table). ``serve.trees``: smaller trees the policy may run instead at a step's rows
  (``with_smaller_trees``; ``EngineConfig.trees``). ``startup``: hears each stage and warm-up
  program (``serve_forever``'s ``/health`` reports them while this runs).
  """
  from redrafter_jax.weights import tokenizer as tokenizer_lib
  from redrafter_jax.weights.base_model import load_base_model, load_base_tokenizer

  serve = preset.serve if serve is None else serve
  stage = startup.stage if startup is not None else (lambda name: log.info("%s", name))
  stage("loading the model")
  mesh = serving_mesh(serve.devices)
  param_dtype = served_weights_dtype(preset, random_drafter=serve.random_drafter)
  llm, llm_cfg = load_base_model(preset.model, dtype=preset.dtype, param_dtype=param_dtype,
                                 invariant=preset.invariant)
  tok = load_base_tokenizer(preset.model)
  config = engine_config(preset, serve, llm_cfg)
  drafter = None
  if config.speculative:
    stage("loading the drafter")
    drafter = load_drafter_for(preset, llm_cfg, random=serve.random_drafter)
    folder = None
    if not serve.random_drafter:
      folder = drafter_folder(preset)
      stage("choosing the draft tree" if serve.tree == "auto" else
            "reading the drafter's settings")
      decode, prior = served_decode(preset, llm, drafter, tree=serve.tree)
      config = dataclasses.replace(config, decode=decode, prior_tokens_per_step=prior)
    config = with_smaller_trees(config, serve.trees, folder)
  engine = Engine(llm, tok, drafter, config=config,
                  stop_ids=tokenizer_lib.stop_token_ids(tok), mesh=mesh)
  weights = jax.numpy.dtype(llm.param_dtype).name
  del llm, drafter  # the engine holds the placed copies
  if serve.warmup:
    stage("warm-up: compiling every prompt bucket and step, then timing the steps"
          if serve.warmup_all else "warm-up: compiling the programs that cover any request "
          "(timed between requests; the rest compile in the background)")
    engine.warmup(progress=startup.warmup if startup is not None else None,
                  background=not serve.warmup_all)
  engine.start()
  d = preset.decode
  name = serve.model_name or preset.model
  app = create_app(engine, tok, model_name=name,
                   defaults=SamplingDefaults(d.temperature, d.top_p, d.top_k),
                   max_body_bytes=serve.max_body_bytes)
  unauthorized = engine.metrics.rejected.labels(reason="unauthorized")
  protect(app, api_key=serve.api_key, cors_origins=serve.cors_origins,
          allowed_hosts=serve.allowed_hosts, on_reject=unauthorized.inc)
  log.info("API key: %s; CORS origins: %s; allowed Host names: %s",
           "required on /v1" if serve.api_key else "none (open)",
           ", ".join(serve.cors_origins) or "none", ", ".join(serve.allowed_hosts) or "any")
  log.info("serving %s (%s, %d slots, %d device(s) on the model axis, %s weights)", name,
           engine.mode, config.slots, mesh.shape["model"], weights)
  return Server(app, engine, name)


def _bind(host: str, port: int) -> socket.socket:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  return sock


class ServerThread:
  """uvicorn serving ``app`` in a daemon thread; ``with ServerThread(app) as s: s.url``."""

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
               shutdown_grace: float = 5.0):
    self._sock = _bind(host, port)
    self.host, self.port = host, self._sock.getsockname()[1]
    self._server = make_server(app, log_level=log_level, grace=shutdown_grace)
    self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                    name="uvicorn", daemon=True)

  @property
  def url(self) -> str:
    return url_of(self.host, self.port)

  def start(self, timeout: float = 30.0) -> "ServerThread":
    self._thread.start()
    deadline = time.monotonic() + timeout
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the HTTP server did not start within {timeout} s")
      time.sleep(0.02)
    return self

  def stop(self, timeout: float = 30.0) -> None:
    self._server.should_exit = True
    self._thread.join(timeout)
    self._sock.close()

  def __enter__(self) -> "ServerThread":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def url_of(host: str, port: int) -> str:
  return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_forever(preset: Preset, serve: ServeConfig | None = None) -> None:
  """Listen on ``serve.host:serve.port`` at once and print ``listening on http://HOST:PORT``
  (the real port when it is 0); meanwhile ``build(preset, serve)`` runs in a background thread,
  ``/health`` answering 503 with its progress. Then serve until SIGINT/SIGTERM, shut down
  gracefully (``serve.shutdown_grace``), and stop the engine. A build that fails stops the
  listener and its error is raised here (the CLI prints it as one line)."""
  serve = preset.serve if serve is None else serve
  host, port = serve.host, serve.port
  sock = _bind(host, port)
  startup = Startup()
  announce = (f"listening on {url_of(host, sock.getsockname()[1])} (OpenAI API under /v1; "
              "/health answers 503 until the model is ready)")
  uv = make_server(startup, log_level="info", grace=serve.shutdown_grace, announce=announce)
  outcome: dict = {}

  def build_in_background():
    try:
      outcome["server"] = build(preset, serve, startup=startup)
      startup.ready(outcome["server"].app)
    except BaseException as e:  # reported by the main thread, after the listener closes
      outcome["error"] = e
      startup.fail(e)
      uv.should_exit = True

  builder = threading.Thread(target=build_in_background, name="redrafter-startup", daemon=True)
  builder.start()
  try:
    uv.run(sockets=[sock])
  finally:
    sock.close()
    if "server" in outcome:
      outcome["server"].close()
  if "error" in outcome:
    raise outcome["error"]
  if builder.is_alive():
    log.info("stopped while starting up")
