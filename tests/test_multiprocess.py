"""Two processes joined by ``jax.distributed`` on localhost train exactly like one process."""

import csv
import os
import pathlib
import socket
import subprocess
import sys

import pytest

from redrafter_jax.training import trainer
from test_trainer import TINY, losses_of, preset, write_synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(data_dir, out_dir, overrides, num_processes=2, devices_per_process=4):
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
  procs = []
  for i in range(num_processes):
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", str(TINY), "--no-progress",
           "--no-export", f"train.data={data_dir}", f"train.output_dir={out_dir}",
           *overrides, "--coordinator", f"localhost:{port}",
           "--num-processes", str(num_processes), "--process-id", str(i)]
    procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  outputs = []
  for p in procs:
    try:
      outputs.append(p.communicate(timeout=300)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  return outputs


def _run_and_compare(tmp_path, mesh, stop_after=None):
  data_dir = write_synthetic(tmp_path / "data")
  common = ["train.seq_len=64", "train.log_every=2", "train.num_steps=4",
            "train.checkpoint_every=2", f"train.mesh_data={mesh[0]}", f"train.mesh_model={mesh[1]}"]
  if stop_after is not None:  # both processes stop (with a checkpoint there), then resume
    _launch(data_dir, tmp_path / "mp", common + ["--stop-after-steps", str(stop_after)])
  _launch(data_dir, tmp_path / "mp", common)
  rows = list(csv.DictReader(open(tmp_path / "mp" / "metrics.csv")))
  multi = {int(r["step"]): float(r["loss"]) for r in rows}
  # Both processes wrote their data-iterator state into the (last two) checkpoints.
  steps = sorted(int(p.name) for p in (tmp_path / "mp" / "checkpoints").iterdir()
                 if p.name.isdigit())
  assert steps == ([3, 4] if stop_after == 3 else [2, 4]), steps
  for step in steps:
    folder = tmp_path / "mp" / "checkpoints" / str(step) / "data"
    names = sorted(p.name for p in folder.glob("process_*.json"))
    assert names == ["process_0-of-2.json", "process_1-of-2.json"], names

  single = losses_of(trainer.train(
      preset(data_dir, tmp_path / "single", num_steps=4, checkpoint_every=2, mesh_data=1),
      progress=False, export=False))
  assert [int(r["step"]) for r in rows] == sorted(single) == [1, 2, 3, 4]
  for step, loss in single.items():
    assert multi[step] == pytest.approx(loss, rel=1e-5), (step, multi[step], loss)


def test_two_processes_data_x_model_with_stop_and_resume(tmp_path):
  """Mesh data=4 x model=2 over 2 processes x 4 devices: the data axis spans the processes and
  the LLM is tensor-parallel inside each; the run stops after step 3 and resumes there (train
  state and each process's data-iterator state restored)."""
  _run_and_compare(tmp_path, (4, 2), stop_after=3)


@pytest.mark.slow
def test_two_processes_data_parallel(tmp_path):
  _run_and_compare(tmp_path, (8, 1))
