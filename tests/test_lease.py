"""The GPU lease, proven on the CPU: the fake runner keeps the real runner's rules, plans fit
them, the payload survives the trip, a step past its deadline does not take the others with it,
what comes back obeys the return rules, and the whole measure profile runs end to end."""

import dataclasses
import gzip
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from redrafter_jax.lease import model_pack, plan as plan_lib, runner
from redrafter_jax.lease.fake_device import FakeDevice
from redrafter_jax.lease.limits import MiB, LeaseError, Limits, returned_files, tree_bytes
from redrafter_jax.lease.profiles import Step
from redrafter_jax.lease.tiny import write_tiny_model

REPO = pathlib.Path(__file__).resolve().parents[1]


def git_repo(root: pathlib.Path, files: dict[str, bytes], ignore: str = "/.lease/\n"):
  root.mkdir(parents=True, exist_ok=True)
  subprocess.run(["git", "init", "-q", str(root)], check=True)
  (root / ".gitignore").write_text(ignore)
  for name, data in files.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(data)
  subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
  return root


# ---- the fake runner keeps the real one's rules


def test_carried_paths_are_replaced_per_call_and_tmp_stays(tmp_path):
  repo = git_repo(tmp_path / "repo", {"tracked.txt": b"t"})
  for name in ("a", "b"):
    (repo / ".lease" / name).mkdir(parents=True)
    (repo / ".lease" / name / f"{name}.bin").write_bytes(name.encode())
  dev = FakeDevice(repo, tmp_path / "machine", Limits())
  r1 = dev.run('ls .lease; cp .lease/a/a.bin "$TMPDIR/"; cat tracked.txt', [".lease/a"])
  assert r1.rc == 0 and "a" in r1.output.split() and r1.output.endswith("t")
  r2 = dev.run('ls .lease; ls "$TMPDIR"', [".lease/b"])
  listed = r2.output.split()
  assert "b" in listed and "a" not in listed  # a's carry is gone...
  assert "a.bin" in listed  # ...what the command copied to /tmp stays


def test_untracked_files_travel_ignored_ones_do_not(tmp_path):
  repo = git_repo(tmp_path / "repo", {"tracked.txt": b"t"}, ignore="/ignored.txt\n/.lease/\n")
  (repo / "untracked.txt").write_text("u")
  (repo / "ignored.txt").write_text("i")
  r = FakeDevice(repo, tmp_path / "m", Limits()).run("ls")
  assert sorted(r.output.split()) == ["tracked.txt", "untracked.txt"]


def test_a_call_over_the_size_limit_is_refused(tmp_path):
  repo = git_repo(tmp_path / "repo", {"big.bin": b"x" * 3000})
  (repo / ".lease").mkdir()
  (repo / ".lease" / "more.bin").write_bytes(b"y" * 3000)
  limits = dataclasses.replace(Limits(), call_bytes=5000)
  dev = FakeDevice(repo, tmp_path / "m", limits)
  assert dev.run("true").rc == 0
  r = dev.run("true", [".lease/more.bin"])
  assert r.rc is None and "larger than" in r.refused


def test_a_call_past_its_time_is_killed(tmp_path):
  repo = git_repo(tmp_path / "repo", {"t": b""})
  r = FakeDevice(repo, tmp_path / "m", Limits()).run("echo started; sleep 30", timeout_s=1)
  assert r.rc == 124 and "started" in r.output


def test_return_rules(tmp_path):
  out = tmp_path / "out"
  limits = dataclasses.replace(Limits(), return_file_bytes=100, return_files=3)
  for name, size in [("a", 10), ("b c", 10), ("big", 101), ("d/e/f/deep", 10), ("d/ok", 10),
                     ("x", 10), ("y", 10)]:
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_bytes(b"z" * size)
  back, left = returned_files(out, limits)
  assert [p.relative_to(out).as_posix() for p in back] == ["a", "d/ok", "x"]
  reasons = " ".join(left)
  assert "b c (a name" in reasons and "big (over" in reasons
  assert "d/e/f/deep (more than 2 folders" in reasons and "y (more than 3 files)" in reasons


# ---- plans


def test_plan_chunks_fit_and_reassemble(tmp_path):
  repo = git_repo(tmp_path / "repo", {"code.py": b"x" * 20_000})
  payload = tmp_path / "payload"
  payload.mkdir()
  rng = np.random.default_rng(0)
  (payload / "weights.bin").write_bytes(rng.integers(0, 255, 300_000, dtype=np.uint8).tobytes())
  (payload / "sub").mkdir()
  (payload / "sub" / "tok.json").write_text('{"a": 1}')
  limits = dataclasses.replace(Limits(), call_bytes=tree_bytes(repo) + Limits().margin_bytes
                               + 64 * 1024 + 120_000)
  p = plan_lib.make_plan(repo, payload, "measure", limits=limits, size="tiny")
  # three upload calls, the last running part 1, then part 2's call carrying nothing
  assert len(p.calls) == 4
  assert all(c.travel_bytes <= limits.call_bytes for c in p.calls)
  assert all("lease run" not in c.command for c in p.calls[:2])
  assert f"lease run --profile measure --size tiny" in p.calls[2].command
  assert "--part" not in p.calls[2].command and p.calls[2].carry
  assert p.calls[3].command.endswith(f"--budget {p.part2_budget_s} --part 2")
  assert p.calls[3].carry == () and p.part2_budget_s >= 60
  assert p.device_s <= limits.lease_seconds
  stash = tmp_path / "stash"
  stash.mkdir()
  for c in p.calls[:3]:
    for f in (repo / c.carry[0]).iterdir():
      (stash / f.name).write_bytes(f.read_bytes())
  out = plan_lib.restore_payload(stash, tmp_path / "restored")
  assert (out / "weights.bin").read_bytes() == (payload / "weights.bin").read_bytes()
  assert (out / "sub" / "tok.json").read_text() == '{"a": 1}'
  # a chunk that never arrived (the machine went back between calls) is named
  next(stash.glob("payload.tar.gz.01")).unlink()
  with pytest.raises(LeaseError, match=r"chunks \['payload.tar.gz.01'\] have not arrived"):
    plan_lib.restore_payload(stash, tmp_path / "again")
  # a stale chunk from another plan is caught by the checksum
  (stash / "payload.tar.gz.01").write_bytes(b"\0" * 10)
  with pytest.raises(LeaseError, match="do not reassemble"):
    plan_lib.restore_payload(stash, tmp_path / "again")


def test_plan_refuses_what_cannot_fit(tmp_path):
  repo = git_repo(tmp_path / "repo", {"big.bin": b"x" * 50_000})
  payload = tmp_path / "p"
  payload.mkdir()
  (payload / "w").write_bytes(b"w")
  with pytest.raises(LeaseError, match="leaving no room"):
    plan_lib.make_plan(repo, payload, "measure",
                       limits=dataclasses.replace(Limits(), call_bytes=40_000))
  with pytest.raises(LeaseError, match="to run the profile"):
    plan_lib.make_plan(repo, payload, "measure", limits=Limits(), budget_s=150)
  # a lease too short for part 2 plans part 1 only, and says which steps it leaves out
  p = plan_lib.make_plan(repo, payload, "measure", limits=Limits(), budget_s=600)
  assert len(p.calls) == 1 and p.part2_budget_s == 0
  assert p.not_planned == ("layers", "step_costs_scanned", "step_costs_unrolled")
  assert "Not planned (no time left for part 2): layers, step_costs_scanned" in p.describe(
      Limits())


def test_plan_measures_the_checkout_from_git():
  files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
  names = [n for n in files.decode().split("\0") if n and (REPO / n).is_file()]
  assert tree_bytes(REPO) == sum((REPO / n).stat().st_size for n in names)


# ---- the model as it travels


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "F16", "F32"])
def test_dequantize_matches_gguf(kind):
  import gguf

  qtype = getattr(gguf.GGMLQuantizationType, kind)
  w = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
  raw = gguf.quants.quantize(w, qtype)
  want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(6, 64)
  got = model_pack.dequantize(np.asarray(raw).tobytes(), kind, (6, 64))
  np.testing.assert_array_equal(got, want)
  if kind == "Q4_1":  # a real check: 4-bit weights are far from the floats, but close
    assert 0 < np.abs(got - w).max() < 0.5


def test_unsupported_type_is_a_clear_error():
  with pytest.raises(ValueError, match="unsupported GGUF tensor type Q6_K"):
    model_pack.dequantize(b"\0" * 210, "Q6_K", (256,))


def test_tiny_pack_unpacks_to_the_gguf_readers_weights(tmp_path):
  from redrafter_jax.weights.llama_weights import load_llama, read_llama
  from redrafter_jax.weights.tokenizer import encode, load_tokenizer

  gguf_path = write_tiny_model(tmp_path / "tiny")
  pack = model_pack.pack(gguf_path, tmp_path / "pack", tokenizer=tmp_path / "tiny" / "tokenizer")
  got = model_pack.unpack(pack, tmp_path / "hf")
  cfg, want, _ = read_llama(gguf_path)
  assert got.keys() == want.keys()
  for name, w in want.items():
    np.testing.assert_array_equal(got[name], w, err_msg=name)
  model, cfg2 = load_llama(tmp_path / "hf")
  assert cfg2 == cfg
  tok = load_tokenizer(tmp_path / "hf")
  ids = encode(tok, "héllo", chat=True)
  assert "héllo" in tok.decode(ids)
  (pack / model_pack.TENSORS).write_bytes(b"short")
  with pytest.raises(ValueError, match="the manifest lists"):
    model_pack.unpack(pack, tmp_path / "hf2")


@pytest.mark.slow
def test_real_pack_unpacks_to_the_gguf_readers_weights(tmp_path, smollm2):
  from redrafter_jax.weights.llama_weights import read_llama

  pack = model_pack.pack("smollm2-135m", tmp_path / "pack")
  tensors = model_pack.unpack(pack, tmp_path / "model")
  _, want, _ = read_llama("smollm2-135m")
  assert tensors.keys() == want.keys()
  for name, w in want.items():
    np.testing.assert_array_equal(tensors[name], w, err_msg=name)
  assert (tmp_path / "model" / "tokenizer.json").is_file()


# ---- the run


def fake_profile(monkeypatch, steps):
  monkeypatch.setattr("redrafter_jax.lease.profiles.PROFILES", {"fake": lambda size: steps})


def staged(tmp_path, repo):
  """A stash holding a tiny model's payload, as the plan's calls leave it."""
  gguf_path = write_tiny_model(tmp_path / "tiny")
  pack = model_pack.pack(gguf_path, tmp_path / "pack", tokenizer=tmp_path / "tiny" / "tokenizer")
  p = plan_lib.make_plan(repo, pack, "measure", limits=Limits(), size="tiny")
  stash = tmp_path / "stash"
  stash.mkdir()
  for c in p.calls:
    for carried in c.carry:
      for f in (repo / carried).iterdir():
        (stash / f.name).write_bytes(f.read_bytes())
  return stash


def test_a_step_past_its_deadline_is_stopped_and_the_rest_still_run(tmp_path, monkeypatch):
  repo = git_repo(tmp_path / "repo", {"x": b""})
  stash = staged(tmp_path, repo)
  py = sys.executable
  fake_profile(monkeypatch, [
      Step("writes", ("sh", "-c", "echo one > {results}/one.md"), 1, "writes a result"),
      Step("hangs", ("sh", "-c", "echo hanging; sleep 60"), 1, "never ends"),
      Step("compiles", (py, "-c", "import jax, jax.numpy as jnp; "
                        "jax.jit(lambda x: x * 3)(jnp.ones(4)).block_until_ready()"), 2,
           "compiles one program"),
  ])
  monkeypatch.setattr(runner, "LISTED_COMPILE_S", 0.0)  # list every program, however quick
  out = tmp_path / "out"
  rc = runner.run("fake", "tiny", stash, out, budget_s=runner.RESERVE_S + 40, repo=repo)
  assert rc == 1  # one step did not finish
  md = (out / "lease.md").read_text()
  rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
  assert "| ok |" in rows["payload"] and "| ok |" in rows["writes"]
  assert "stopped at its deadline" in rows["hangs"]
  assert "| ok |" in rows["compiles"]
  assert "jit(<lambda>)" in md  # the compiled program and its seconds
  assert "hanging" in (out / "lease.log").read_text()
  folder = runner.collect(out, tmp_path / "into")
  assert (folder / "one.md").read_text() == "one\n"
  assert (folder / "lease.md").is_file()
  assert b"hanging" in gzip.decompress((folder / "lease.log.gz").read_bytes())


def test_part_2_continues_from_part_1s_stash(tmp_path, monkeypatch):
  """Part 2 (the plan's last call) runs its steps from part 1's stash and brings back both
  parts' results and steps; without part 1 in the stash it is one clear error."""
  repo = git_repo(tmp_path / "repo", {"x": b""})
  stash = staged(tmp_path, repo)
  fake_profile(monkeypatch, [
      Step("first", ("sh", "-c", "echo one > {results}/one.md"), 1, "part 1's step"),
      Step("second", ("sh", "-c", "test -f {results}/one.md && test -d {model} && "
                      "echo two > {results}/two.md"), 1, "part 2's step", part=2),
  ])
  with pytest.raises(LeaseError, match="no part 1 of a lease here"):
    runner.run("fake", "tiny", stash, tmp_path / "out0", budget_s=60, repo=repo, part=2)
  assert runner.run("fake", "tiny", stash, tmp_path / "out1", budget_s=60, repo=repo) == 0
  assert runner.run("fake", "tiny", stash, tmp_path / "out2", budget_s=60, repo=repo,
                    part=2) == 0
  md = (tmp_path / "out2" / "lease.md").read_text()
  rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| ")}
  assert "| 1 | ok |" in rows["first"] and "| 2 | ok |" in rows["second"]
  assert "part 1: budget 60 s" in md and "part 2: budget 60 s" in md
  folder = runner.collect(tmp_path / "out2", tmp_path / "into")
  assert (folder / "one.md").read_text() == "one\n" and (folder / "two.md").read_text() == "two\n"
  # a part-1 run starts over: part 2 after it does not see older results
  assert runner.run("fake", "tiny", stash, tmp_path / "out3", budget_s=60, repo=repo) == 0
  assert "| second |" not in (tmp_path / "out3" / "lease.md").read_text()


def test_results_over_the_file_limit_come_back_in_parts(tmp_path):
  root = tmp_path / "work" / "results"
  folder = root / "dev" / "day"
  folder.mkdir(parents=True)
  rng = np.random.default_rng(0)
  for i in range(3):
    (folder / f"r{i}.bin").write_bytes(rng.integers(0, 255, 20_000, dtype=np.uint8).tobytes())
  log = tmp_path / "log"
  log.write_bytes(b"L" * 50_000)
  limits = dataclasses.replace(Limits(), return_file_bytes=30_000, return_files=5)
  out = tmp_path / "out"
  notes = runner.bundle(root, log, "# md\n", out, limits)
  back, left = returned_files(out, limits)
  assert not left and len(back) == 5  # lease.md, lease.log, three parts
  assert (out / "lease.log").stat().st_size <= 30_000
  assert b"left out" in (out / "lease.log").read_bytes()[:100]
  assert notes == []
  folder_back = runner.collect(out, tmp_path / "into")
  for i in range(3):
    assert (folder_back / f"r{i}.bin").read_bytes() == (folder / f"r{i}.bin").read_bytes()
  # too many parts: the biggest result files are left out, and it says so
  (folder / "huge.bin").write_bytes(rng.integers(0, 255, 200_000, dtype=np.uint8).tobytes())
  notes = runner.bundle(root, log, "# md\n", out, limits)
  assert notes and "huge.bin" in notes[0]
  assert len(list(out.iterdir())) <= 5


def test_payload_wheels_are_importable_by_the_steps(tmp_path):
  """A profile's wheels, unpacked from the payload without pip, import in a step's process (the
  image lacks grain); steps see them through PYTHONPATH."""
  import subprocess
  import sys
  import zipfile

  wheels = tmp_path / "payload" / plan_lib.WHEELS
  wheels.mkdir(parents=True)
  with zipfile.ZipFile(wheels / "carried-1.0-py3-none-any.whl", "w") as z:
    z.writestr("carried_pkg/__init__.py", "VALUE = 42\n")
    z.writestr("carried-1.0.dist-info/METADATA", "Name: carried\nVersion: 1.0\n")
  stash = tmp_path / "stash"
  assert runner.install_wheels(wheels, stash / runner.PYLIB) == ["carried-1.0-py3-none-any.whl"]
  probe = [sys.executable, "-c", "import carried_pkg; print(carried_pkg.VALUE)"]
  done = subprocess.run(probe, env=runner.step_env(stash, ()), capture_output=True, text=True)
  assert done.stdout.strip() == "42", done.stderr
  # without the unpacked wheels the same step cannot import it
  done = subprocess.run(probe, env=runner.step_env(tmp_path / "other", ()), capture_output=True,
                        text=True)
  assert done.returncode != 0


def test_train_profile_steps_and_needs():
  """The train profile carries grain for the GPU image, times its long steps itself ({budget}),
  and measures in part 2; its recipe's format is the one the exporter can hold."""
  from redrafter_jax.lease import profiles

  gpu = profiles.profile_of("train", "gpu")
  assert any(n.startswith("grain") for n in gpu.needs)
  assert not profiles.profile_of("train", "tiny").needs  # the CPU has grain
  names = [s.name for s in gpu.steps]
  assert names == ["environment", "teacher", "train", "bring_back", "measure"]
  by = {s.name: s for s in gpu.steps}
  for name in ("teacher", "train"):
    assert any("{budget}" in a for a in by[name].argv) and by[name].part == 1
  assert by["measure"].part == 2 and "{results}/drafter" in by["measure"].argv
  assert "--batch-size" in by["teacher"].argv
  assert int(by["teacher"].argv[by["teacher"].argv.index("--batch-size") + 1]) >= 256
  # one prompt shape: every teacher batch runs one of at most two programs (greedy, sampled)
  arg = lambda flag: int(by["teacher"].argv[by["teacher"].argv.index(flag) + 1])
  assert arg("--prompt-multiple") >= arg("--max-prompt-tokens")
  assert "redrafter-jax" in " ".join(by["bring_back"].argv)  # the recipe reads three layers


def test_unknown_profile_is_one_clear_error(capsys):
  from redrafter_jax.cli import main

  assert main(["lease", "run", "--profile", "nope", "--stash", "/nonexistent", "--size",
               "tiny"]) == 2
  assert "unknown lease profile 'nope'" in capsys.readouterr().err


# ---- the whole plan, on the CPU

# The dry runs check the machinery (calls, stash, parts, deadlines, collect), not whether the
# tiny model's steps fit the GPU's shares: on CI's 2 cores, shared with a second test process,
# the tiny steps take about as long as the real ones on a GPU, and with the lease's 900 s part 2
# had 140 s, where the layers step once stopped 0.3 s short of its deadline (CI, 2026-12-07).
# A longer lease gives part 2 its full call; the plan at the default budget is tested above.
DRY_RUN_BUDGET_S = 1200


def test_dry_run_of_the_measure_profile_passes(tmp_path, capsys):
  from redrafter_jax.cli import main

  rc = main(["lease", "dry-run", "--profile", "measure", "--keep", str(tmp_path / "m"),
             "--budget", str(DRY_RUN_BUDGET_S)])
  out = capsys.readouterr().out
  assert rc == 0, out[-8000:]
  assert "4 device calls" in out and "dry-run call 4/4: rc 0" in out
  for step, part in (("loops", 1), ("suite", 1), ("gpu_tests", 1), ("layers", 2),
                     ("step_costs_scanned", 2), ("step_costs_unrolled", 2)):
    assert f"| {step} | {part} | ok |" in out
  collected = tmp_path / "m" / "collected" / "results"
  names = {p.name for p in collected.rglob("*") if p.is_file()}
  assert {"lease.md", "lease.log.gz", "step_costs_scanned.md", "step_costs_unrolled.md", "loops.md", "layers.md",
          "measurements.json", "results.md"} <= names
  assert not (REPO / ".lease" / "dry-run").exists()


def test_dry_run_of_the_train_profile_passes(tmp_path, capsys):
  """The train profile end to end on the tiny model: prompts, teacher data, a time-boxed
  training, the drafter back in float16, and the measurement with it in part 2."""
  from redrafter_jax.cli import main

  rc = main(["lease", "dry-run", "--profile", "train", "--keep", str(tmp_path / "m"),
             "--budget", str(DRY_RUN_BUDGET_S)])
  out = capsys.readouterr().out
  assert rc == 0, out[-8000:]
  assert "dry-run call 4/4: rc 0" in out
  for step, part in (("teacher", 1), ("train", 1), ("bring_back", 1),
                     ("measure", 2)):
    assert f"| {step} | {part} | ok |" in out
  collected = tmp_path / "m" / "collected" / "results"
  names = {str(p.relative_to(collected)).split("/", 2)[-1]
           for p in collected.rglob("*") if p.is_file()}
  assert {"teacher_manifest.json", "train/metrics.csv", "train/schedule.json",
          "drafter/config.json", "lease.md"} <= names, names
  assert any(n.startswith("suite/") and n.endswith("measurements.json") for n in names)
  drafter = next(collected.rglob("drafter"))
  from redrafter_jax.weights.drafter_io import load_drafter

  assert load_drafter(drafter).config.feature_layers == (0, 1)
