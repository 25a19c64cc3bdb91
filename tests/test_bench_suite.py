"""The benchmark suite: a --quick run writes every file, resumes without redoing work, and its
report's numbers are exactly the JSON's measurements (tiny random model; the real SmolLM2 --quick
run is marked slow)."""

import json
import re

import pytest

import tiny_models
from redrafter_jax.bench import (_common, _measurements, _runner, decode as bench_decode, report,
                                 suite)

PNGS = {"speedup_vs_beam_width.png", "accepted_length_histogram.png", "step_split.png"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A tiny HF Llama folder with a word-level tokenizer, and Spec-Bench-style prompts for it."""
  root = tmp_path_factory.mktemp("suite")
  return tiny_models.bench_inputs(root)


def quick_args(tiny, out, *extra):
  model, prompts = tiny
  return ["--quick", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
          "--max-new-tokens", "10", "--exit-dim", "32", "--no-progress", *extra]


def the_folder(out):
  (path,) = list(out.glob("*/*/measurements.json"))
  return path.parent


def test_quick_run_writes_everything_and_resumes(tiny, tmp_path, monkeypatch, capsys):
  out = tmp_path / "results"
  # With the batch sweep: the --gpu code path, run on CPU (xla attention, float32).
  args = quick_args(tiny, out, "--batch-sizes", "1,3")
  assert suite.main(args) == 0
  folder = the_folder(out)
  assert folder.name.endswith("-quick") and folder.parent.name == suite.machine_slug(False)
  assert {p.name for p in folder.iterdir()} == {"measurements.json", "results.md",
                                                "batch_throughput.png"} | PNGS
  for png in folder.glob("*.png"):
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
  data = json.loads((folder / "measurements.json").read_text())
  assert data["settings"]["dtype"] == "float32"
  # The two shortest of the first prompts of each category (p1 and p3 are not first).
  assert sorted(data["runs"]) == ["p0", "p4"]
  sampled = {"ar_T0.7", "redrafter_exact_T0.7_W4_L5", "redrafter_typical_T0.7_W4_L5"}
  keys = {"ar_greedy", "transformers_greedy", "transformers_greedy_bf16",
          "redrafter_W1_L4_lookup3", "redrafter_W4_L5", "prompt_lookup_10"} | sampled
  for pid, runs in data["runs"].items():
    assert set(runs) == keys
    for key, r in runs.items():
      assert 1 <= r["new_tokens"] <= 10 and r["seconds"] > 0 and r["steps"] >= 1
      assert r["new_tokens"] == len(r["output_ids"])
      assert r["category"] == data["prompts"][pid]["category"]
    # Greedy is exact (transformers in bfloat16 computes another model's greedy answer).
    for key in keys - sampled - {"transformers_greedy_bf16"}:
      assert runs[key]["output_ids"] == runs["ar_greedy"]["output_ids"], key
    assert sum(runs["redrafter_W4_L5"]["accepted_histogram"]) == runs["redrafter_W4_L5"]["steps"]
  assert set(data["step_split"]) == {"redrafter_W1_L4_lookup3", "redrafter_W4_L5"}
  assert set(data["batch"]) == {"1", "3"}
  b3 = data["batch"]["3"]["redrafter_W4_L5"]
  assert len(b3["row_tokens"]) == 3 and b3["new_tokens"] == sum(b3["row_tokens"])
  md = (folder / "results.md").read_text()
  for section in ("## Greedy", "## Sampling", "## Per category", "## One decode step",
                  "## Batch sizes", "untrained"):
    assert section in md
  assert "LOSSY" in md and all(f"]({p})" in md for p in PNGS)
  # The divergence section: both AR controls on each prompt, counted in the summary line.
  controls = data["divergence"]["controls"]
  assert set(controls) == {"p0", "p4"} and data["divergence"]["gaps"] == {}
  assert controls["p0"]["ar_batch4"]["companions"] == ["p4"] * 3
  for pid, c in controls.items():
    assert c["ar_other_cache"]["cache_size"] != data["prompts"][pid]["cache_size"]
    assert 1 <= len(c["ar_batch4"]["output_ids"]) <= 10
  assert "## Greedy divergence from our AR" in md
  assert re.search(r"^ReDrafter differs on 0/2; AR-vs-AR controls on \d/2, \d/2$", md, re.M)

  # Resume: drop one run and one step split; only those two are measured again. A difference
  # planted in one ReDrafter output gets its float32 gap then (the JSON has no gap for it).
  planted = data["runs"]["p0"]["redrafter_W1_L4_lookup3"]["output_ids"]
  t = min(2, len(planted) - 1)
  ar_token, planted[t] = planted[t], (planted[t] + 1) % tiny_models.VOCAB
  removed = data["runs"]["p4"].pop("redrafter_W4_L5")
  del data["step_split"]["redrafter_W1_L4_lookup3"]
  (folder / "measurements.json").write_text(json.dumps(data))
  calls = []
  measure, real_split = _runner.Runner.measure, bench_decode.step_split
  monkeypatch.setattr(_runner.Runner, "measure",
                      lambda self, m, *a, **k: calls.append(m.key) or measure(self, m, *a, **k))
  monkeypatch.setattr(bench_decode, "step_split",
                      lambda *a, **k: calls.append("split") or real_split(*a, **k))
  assert suite.main(args) == 0
  assert calls == ["redrafter_W4_L5", "split"]
  again = json.loads((folder / "measurements.json").read_text())
  assert again["runs"]["p0"] == data["runs"]["p0"]  # untouched measurements are kept
  assert again["runs"]["p4"]["redrafter_W4_L5"]["output_ids"] == removed["output_ids"]
  assert len(again["sessions"]) == 2
  assert again["divergence"]["controls"] == controls
  gap = again["divergence"]["gaps"]["p0"]["redrafter_W1_L4_lookup3"]
  assert (gap["index"], gap["reference_token"], gap["other_token"]) == (t, ar_token, planted[t])
  assert gap["gap"] > 0 and gap["float32_prefers"] == ar_token  # AR took the model's argmax
  md = (folder / "results.md").read_text()
  assert re.search(r"^ReDrafter differs on 1/2; AR-vs-AR controls on \d/2, \d/2$", md, re.M)
  assert re.search(rf"^\| p0 \| writing \| {t} \| {ar_token} .* \| {planted[t]} .* \| "
                   rf"\+{gap['gap']:.3f} \| reference \|$", md, re.M)
  assert report.main([str(folder)]) == 0  # rebuilt from the JSON alone: the same report
  assert (folder / "results.md").read_text() == md

  # A resumed run must not mix settings.
  capsys.readouterr()
  assert suite.main(quick_args(tiny, out, "--param-dtype", "bfloat16")) == 2
  assert "other settings {'param_dtype': ('float32', 'bfloat16')}" in capsys.readouterr().err


def test_bf16_weights_run_adds_the_fp32_ar_baseline(tiny, tmp_path):
  """With bf16 weights every one of our methods runs the bf16-weight LLM (greedy ReDrafter
  still equals its AR), and our AR with float32 weights joins as a baseline with its column."""
  out = tmp_path / "results"
  assert suite.main(quick_args(tiny, out, "--param-dtype", "bfloat16", "--no-transformers",
                               "--temperatures", "0.7", "--typical-temperature", "0")) == 0
  folder = the_folder(out)
  data = json.loads((folder / "measurements.json").read_text())
  assert (data["settings"]["dtype"], data["settings"]["param_dtype"]) == ("float32", "bfloat16")
  assert data["methods"]["ar_greedy_fp32"]["param_dtype"] == "float32"
  for runs in data["runs"].values():
    assert {"ar_greedy", "ar_greedy_fp32", "redrafter_W1_L4_lookup3"} <= set(runs)
    for key in ("redrafter_W1_L4_lookup3", "redrafter_W4_L5"):
      assert runs[key]["output_ids"] == runs["ar_greedy"]["output_ids"], key
  md = (folder / "results.md").read_text()
  assert "vs our AR, fp32 weights" in md and "bfloat16 weights" in md
  fp32_row = next(l for l in md.splitlines() if l.startswith("| our AR greedy, float32 weights |"))
  assert fp32_row.split("|")[6].strip() == "1.00x"  # its own speedup over itself


def test_one_cache_size_for_every_method_prompt_and_batch(tiny, tmp_path, capsys):
  """``--cache-size N``: every run, control and batch uses N; a prompt that needs more is
  skipped with a message; N past the model's context is a one-line error."""
  from redrafter_jax.weights.tokenizer import encode, load_tokenizer

  model, prompts = tiny
  tok = load_tokenizer(model)
  rows = {r["id"]: r for r in map(json.loads, prompts.read_text().splitlines())}
  n = {pid: len(encode(tok, rows[pid]["prompt"], chat=True)) for pid in ("p0", "p4")}
  args = quick_args(tiny, tmp_path, "--no-transformers", "--temperatures", "0.7",
                    "--typical-temperature", "0", "--batch-sizes", "2", "--max-new-tokens", "60",
                    "--beams", "2x3", "--main-beams", "2x3")
  o = suite.parse_args(args)
  scratch = max(b.length + b.config().num_tree_tokens for b in o.beams + [o.main_beams])
  N = n["p4"] + o.max_new_tokens + scratch  # p4's need exactly: the longer p0 does not fit
  assert N > 64  # more than the padded prompt, which must fit too
  assert suite.main(args + ["--cache-size", str(N)]) == 0
  err = capsys.readouterr().err
  assert f"skipping prompt p0: {n['p0']} tokens do not fit --cache-size {N}" in err
  data = json.loads((the_folder(tmp_path) / "measurements.json").read_text())
  assert list(data["runs"]) == ["p4"] and data["settings"]["cache_size"] == N
  assert data["prompts"]["p4"]["cache_size"] == N
  assert {r["cache_size"] for r in data["runs"]["p4"].values()} == {N}
  assert {r["cache_size"] for recs in data["batch"].values() for r in recs.values()} == {N}
  assert data["divergence"]["controls"]["p4"]["ar_batch4"]["cache_size"] == N
  assert suite.main(quick_args(tiny, tmp_path / "other", "--cache-size", "1000")) == 2
  assert "--cache-size 1000 is outside 1..256" in capsys.readouterr().err


def synthetic():
  """Two prompts in two categories; AR 10 tok/s overall, ReDrafter 20, transformers 5."""
  def rec(cat, n, secs, steps=1, tps=1.0, ids=None):
    return dict(category=cat, new_tokens=n, seconds=secs, steps=steps, tokens_per_step=tps,
                output_ids=ids or [1] * n)
  methods = {k: dict(label=k, kind=kind, temperature=0.0, beam_width=w, beam_length=l,
                     acceptance="greedy", reference="ar_greedy")
             for k, kind, w, l in [("ar_greedy", "ar", 0, 0),
                                   ("transformers_greedy", "transformers", 0, 0),
                                   ("redrafter_W4_L4", "redrafter", 4, 4),
                                   ("prompt_lookup_10", "prompt_lookup", 0, 0)]}
  runs = {"a": {"ar_greedy": rec("x", 10, 2.0), "transformers_greedy": rec("x", 10, 4.0),
                "redrafter_W4_L4": rec("x", 10, 1.0, 4, 2.5),
                "prompt_lookup_10": rec("x", 10, 2.0, 5, 2.0)},
          "b": {"ar_greedy": rec("y", 30, 2.0), "transformers_greedy": rec("y", 30, 4.0),
                "redrafter_W4_L4": rec("y", 30, 1.0, 12, 2.0, [2] * 30)}}
  return dict(schema=1, settings=dict(model="m", dtype="float32", attention="xla",
                                      drafter="d", max_new_tokens=30),
              sessions=[], methods=methods, runs=runs, step_split={}, batch={},
              prompts={"a": dict(category="x"), "b": dict(category="y")})


def row(md, first_cell):
  line = next(l for l in md.splitlines() if l.startswith(f"| {first_cell} |"))
  return [c.strip() for c in line.strip("|").split("|")]


def test_report_numbers_are_ratios_of_json_measurements():
  data = synthetic()
  md = report.render(data, [])
  # Overall rate = all tokens / all seconds (40/4 = 10, not the mean of 5 and 15).
  assert row(md, "ar_greedy")[3] == "10.0"
  rd = row(md, "redrafter_W4_L4")
  assert rd[3:7] == ["20.0", "2.00x", "4.00x", "2.12"]  # tokens/step weighted by steps: 34/16
  assert rd[7] == "1/2"  # prompt b's output differs from AR's
  # prompt lookup ran on prompt a only: its speedups use prompt a alone.
  assert row(md, "prompt_lookup_10")[1:6] == ["1", "10", "5.0", "1.00x", "2.00x"]
  x = row(md, "x")
  assert x[1:6] == ["1", "5.0", "10.0", "2.00x", "2.50"]
  assert x[6:] == ["5.0", "2.00x", "2.00", "2.00x"]
  assert row(md, "y")[6:] == ["n/a", "n/a", "n/a", "n/a"]
  data["runs"]["a"]["redrafter_W4_L4"]["accepted_histogram"] = [1, 2]
  data["runs"]["b"]["redrafter_W4_L4"]["accepted_histogram"] = [3, 0, 1]
  assert _measurements.histogram(data["runs"], "redrafter_W4_L4") == [4, 2, 1]
  # Change one measurement: the table follows.
  data["runs"]["b"]["redrafter_W4_L4"]["seconds"] = 3.0
  assert row(report.render(data, []), "redrafter_W4_L4")[3:5] == ["10.0", "1.00x"]


def test_select_prompts_takes_the_first_n_of_each_category(spec_bench_path, tmp_path):
  rows = [json.loads(l) for l in spec_bench_path.read_text().splitlines()]
  got = suite.select_prompts(spec_bench_path, 2)
  cats = list(dict.fromkeys(r["category"] for r in rows))
  assert len(cats) == 13 and len(got) == 26
  assert [r["id"] for r in got] == [r["id"] for c in cats
                                    for r in [x for x in rows if x["category"] == c][:2]]
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"id": "1", "prompt": "hi"}\n')
  with pytest.raises(suite.SuiteError, match="line 1 lacks \\['category'\\]"):
    suite.select_prompts(bad, 1)


def test_select_prompts_skip_gives_the_next_disjoint_subset(spec_bench_path):
  rows = [json.loads(l) for l in spec_bench_path.read_text().splitlines()]
  cats = list(dict.fromkeys(r["category"] for r in rows))
  tune, report = suite.select_prompts(spec_bench_path, 5), suite.select_prompts(spec_bench_path, 5, 5)
  assert len(tune) == len(report) == 65
  assert not {r["id"] for r in tune} & {r["id"] for r in report}
  assert [r["id"] for r in report] == [r["id"] for c in cats
                                       for r in [x for x in rows if x["category"] == c][5:10]]


def test_gpu_mode_fails_clearly_without_a_gpu(tiny, tmp_path, capsys):
  assert suite.main(quick_args(tiny, tmp_path, "--gpu")) == 2
  err = capsys.readouterr().err
  assert re.search(r"--gpu needs an NVIDIA GPU visible to JAX, but JAX runs on 'cpu'", err)
  assert not list(tmp_path.iterdir())  # failed before writing anything


def test_bad_arguments_are_rejected(capsys):
  for args in (["--beams", "4"], ["--beams", "4x1"], ["--beams", "1x4+x"], ["--beams", "1x4+9"],
               ["--beams", "1x4+3/3"], ["--beams", "1x4+3/8"], ["--beams", "1x4/x"],
               ["--main-beams", "2x"], ["--temperatures", "0"], ["--per-category", "0"],
               ["--batch-sizes", "a"], ["--cache-size", "0"]):
    with pytest.raises(SystemExit) as e:
      suite.parse_args(args)
    assert e.value.code == 2
  assert "WxL" in capsys.readouterr().err


def test_transformers_bf16_peer_runs_its_own_bf16_model(tiny, monkeypatch):
  """On a CPU the suite adds transformers in bfloat16 beside its float32 run, and each method
  generates with its own model; --no-transformers loads neither."""
  import torch

  o = suite.parse_args(quick_args(tiny, "unused"))
  llm, _, drafter, tok, hf, hf_bf16, _ = _runner.load_models(o)
  assert hf.dtype == torch.float32 and hf_bf16.dtype == torch.bfloat16
  assert hf_bf16.model.embed_tokens.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()
  methods = {m.key: m for m in suite.build_methods(o)}
  assert methods["transformers_greedy_bf16"].param_dtype == "bfloat16"
  runner = _runner.Runner(o, llm, drafter, tok, hf, None, hf_bf16)
  used = []
  real = _runner.Runner._transformers
  monkeypatch.setattr(_runner.Runner, "_transformers",
                      lambda self, model, *a: used.append(model) or real(self, model, *a))
  for key in ("transformers_greedy", "transformers_greedy_bf16", "prompt_lookup_10"):
    tokens, stats = runner.call(methods[key], [[5, 6, 7]], 64, 0)
    assert 1 <= len(tokens[0]) <= o.max_new_tokens and stats["steps"] >= 1
  assert used == [hf, hf_bf16, hf]
  o = suite.parse_args(quick_args(tiny, "unused", "--no-transformers"))
  assert "transformers_greedy_bf16" not in {m.key for m in suite.build_methods(o)}
  assert _runner.load_models(o)[4:6] == (None, None)


def test_settings_tell_a_retrained_drafter_from_the_old_one_at_the_same_path(tmp_path):
  """A resumed run compares settings; the drafter enters them by content, not only by path."""
  from redrafter_jax.config import DrafterConfig
  from redrafter_jax.models.drafter import init_drafter
  from redrafter_jax.weights.drafter_io import save_drafter

  path = tmp_path / "drafter"
  cfg = DrafterConfig(vocab_size=64, hidden_size=16, exit_dim=8)
  save_drafter(init_drafter(cfg, seed=0), path, format="reference")
  args = suite.parse_args(["--drafter", str(path), "--no-transformers"])
  before = suite.settings_of(args)
  assert before == suite.settings_of(args) and len(before["drafter_sha256"]) == 16
  save_drafter(init_drafter(cfg, seed=1), path, format="reference", overwrite=True)
  after = suite.settings_of(args)
  assert after["drafter"] == before["drafter"]
  assert after["drafter_sha256"] != before["drafter_sha256"]
  assert suite.settings_of(suite.parse_args(["--drafter", "random"]))["drafter_sha256"] is None


def test_presets_fill_only_what_was_not_given():
  o = suite.parse_args([])
  assert (o.dtype, o.attention, o.batch_sizes, o.per_category) == ("float32", "xla", [], 1)
  o = suite.parse_args(["--gpu", "--batch-sizes", "2", "--beams", "3x3"])
  assert (o.dtype, o.attention, o.batch_sizes, o.beams) == ("bfloat16", "cudnn", [2],
                                                             [bench_decode.Beams(3, 3)])
  o = suite.parse_args(["--beams", "1x4+3, 2x5, 1x4+3/5", "--main-beams", "1x6+2"])
  assert o.beams == [bench_decode.Beams(1, 4, 3), bench_decode.Beams(2, 5),
                     bench_decode.Beams(1, 4, 3, 5)]
  assert o.main_beams == bench_decode.Beams(1, 6, 2)
  methods = [m for m in suite.build_methods(o) if m.temperature == 0 and m.beam_width]
  assert [m.key for m in methods] == [
      "redrafter_W1_L4_lookup3", "redrafter_W2_L5", "redrafter_W1_L4_lookup3_N5"]
  assert methods[2].beams.config().num_tree_tokens == 5
  assert methods[0].beams.config().num_tree_tokens == 7
  assert suite.parse_args(["--gpu"]).batch_sizes == [1, 2, 4, 8, 16]
  o = suite.parse_args(["--quick", "--max-new-tokens", "7"])
  assert (o.max_new_tokens, o.per_category, o.temperatures) == (7, 1, [0.7])


def test_timed_excludes_compilation():
  import jax
  import jax.numpy as jnp

  calls = []
  fn = jax.jit(lambda x: x * 3 + 1)

  def body():
    calls.append(1)
    return fn(jnp.arange(7.0)).block_until_ready()

  _runner.timed(body)
  assert len(calls) == 2  # the first call compiled, so it was timed again
  _runner.timed(body)
  assert len(calls) == 3


@pytest.mark.slow
def test_quick_suite_on_smollm2(spec_bench_path, tmp_path):
  """The real --quick run (SmolLM2-135M, transformers peers): every file, sane numbers."""
  assert suite.main(["--quick", "--prompts", str(spec_bench_path), "--out", str(tmp_path),
                     "--no-progress"]) == 0
  folder = the_folder(tmp_path)
  assert {p.name for p in folder.iterdir()} == {"measurements.json", "results.md"} | PNGS
  data = json.loads((folder / "measurements.json").read_text())
  assert len(data["runs"]) == 2
  for runs in data["runs"].values():
    assert len(runs) == 9
    for key in ("redrafter_W1_L4_lookup3", "redrafter_W4_L5"):
      assert runs[key]["output_ids"] == runs["ar_greedy"]["output_ids"]


def test_step_split_leaves_a_bf16_model_as_it_was(tiny):
  """The draft is timed with the embedding table converted (as the decode loop has it); the
  model itself keeps its bf16 table, and the parts come out as positive times."""
  import jax.numpy as jnp

  from redrafter_jax.weights.llama_weights import load_llama

  llm, cfg = load_llama(tiny[0], param_dtype=jnp.bfloat16)
  drafter = _common.load_drafter_arg("random", cfg, 32)
  split = bench_decode.step_split(llm, drafter, [5, 6, 7, 8], bench_decode.Beams(2, 3).config(
      max_new_tokens=8), repeat=2)
  assert llm.embed_tokens.embedding[...].dtype == jnp.bfloat16
  assert min(split["draft_ms"], split["verify_ms"], split["accept_commit_ms"]) > 0


def test_bench_decode_compares_weight_layouts_side_by_side(tiny, capsys):
  """``bench decode --weight-layouts oi,io``: every row once per layout, greedy ReDrafter equal
  to AR in each (the tiny model's float32 weights, both layouts); bad layouts are a usage error."""
  model, prompts = tiny
  args = ["--model", str(model), "--prompts", str(prompts), "--drafter", "random",
          "--exit-dim", "32", "--num-prompts", "3", "--max-new-tokens", "8", "--beams", "2x3",
          "--repeat", "1"]
  assert bench_decode.main(args + ["--weight-layouts", "oi,io"]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith(("| oi |", "| io |"))]
  assert [r.split(" | ")[:2] for r in rows] == [
      ["| oi", "AR greedy"], ["| oi", "ReDrafter W=2 L=3"], ["| io", "AR greedy"],
      ["| io", "ReDrafter W=2 L=3"], ["| oi", "W=2 L=3"], ["| io", "W=2 L=3"]]
  assert rows[1].endswith("| 3/3 |") and rows[3].endswith("| 3/3 |")
  for row in rows[1], rows[3]:  # tokens/step = 1 + the accepted tokens of each beam source
    cells = row.split(" | ")
    assert sum(map(float, cells[5].split(" / "))) == pytest.approx(float(cells[4]) - 1, abs=0.02)
  for bad in ("oi,oi", "io,xy"):
    with pytest.raises(SystemExit):
      bench_decode.main(args + ["--weight-layouts", bad])
  assert "--weight-layouts: want distinct values" in capsys.readouterr().err


@pytest.mark.parametrize("bf16, dtype, want", [(True, "float32", "bfloat16"),
                                              (False, "float32", "float32"),
                                              (True, "bfloat16", "bfloat16")])
def test_param_dtype_auto_follows_the_platform(tiny, monkeypatch, bf16, dtype, want):
  """``--param-dtype auto`` (what `make bench` passes) is the platform's faster weights with
  float32 activations, and the activations' dtype otherwise; bfloat16 weights bring the float32
  AR baseline."""
  from redrafter_jax.models import linear

  monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: bf16)
  monkeypatch.setattr(linear, "on_cpu", lambda: True)
  o = suite.parse_args(quick_args(tiny, "unused") + ["--param-dtype", "auto", "--dtype", dtype])
  assert o.param_dtype == want
  keys = {m.key for m in suite.build_methods(o)}
  assert (suite.FP32_AR in keys) == (want == "bfloat16" and dtype == "float32")
