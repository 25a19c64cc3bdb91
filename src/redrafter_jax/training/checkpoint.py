"""Training checkpoints with Orbax: train state, data-iterator state and config, per step.

A checkpoint ``<dir>/<step>/`` holds three items:

  ``state``   the train state pytree (drafter params, optimizer state, step), sharded arrays
  ``data``    grain's iterator state (one JSON file per process, grain's own Orbax handler)
  ``config``  the preset as JSON, to refuse resuming with settings that change the run

Orbax writes each checkpoint to a temporary folder and renames it when complete, so a crash
mid-save leaves the previous checkpoints intact; only the newest ``keep`` are kept. Saving is
synchronous: the train state is donated to the next step, so its buffers must not be read after.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Mapping

import grain
import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
  """A thin wrapper over ``ocp.CheckpointManager`` for the three items above."""

  def __init__(self, directory: str | pathlib.Path, *, keep: int = 2):
    self.directory = pathlib.Path(directory).resolve()
    options = ocp.CheckpointManagerOptions(max_to_keep=max(1, keep), create=True,
                                           enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_iterator, config: Mapping[str, Any]) -> None:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              data=grain.checkpoint.CheckpointSave(data_iterator),
                              config=ocp.args.JsonSave(dict(config)))
    self._manager.save(step, args=args, force=True)
    self._manager.wait_until_finished()
    log.info("saved checkpoint %d in %s", step, self.directory)

  def read_config(self, step: int) -> dict[str, Any]:
    out = self._manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    return dict(out["config"])

  def restore(self, step: int, abstract_state: Any, data_iterator) -> Any:
    """The state at ``step`` (placed like ``abstract_state``'s shardings); ``data_iterator`` is
    set to where it was when the checkpoint was written."""
    out = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(data_iterator)))
    log.info("restored checkpoint %d from %s", step, self.directory)
    return out["state"]

  def restore_params(self, step: int) -> Any:
    """The drafter's parameters saved at ``step`` (host arrays; no optimizer, no data state)."""
    out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return out["state"]["params"]

  def close(self) -> None:
    self._manager.close()


def abstract_like(tree: Any, shardings: Any) -> Any:
  """``ShapeDtypeStruct``s with shardings: the restore target for ``tree``."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
                      shardings)
