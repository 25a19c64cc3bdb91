"""``bench step_costs`` at the tiny shape: a row per program, byte counts that match the
parameter and KV-cache sizes computed here from the architecture, positive ratios, the JSON
beside the table, and bad arguments refused with exit status 2 and one line."""

import json

import jax
import jax.numpy as jnp
import pytest

from redrafter_jax.bench import step_costs

ROWS = ["ar step b=1", "verify N=8", "verify N=16", "verify N=32", "verify N=64",
        "draft W=4 L=5", "copy 64 MiB"]


def llm_params(c: dict) -> int:
  """Parameters of an untied Llama, from its architecture."""
  D, F, V, H, K, E = (c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_heads"],
                      c["num_kv_heads"], c["head_dim"])
  layer = D * H * E + 2 * D * K * E + H * E * D + 3 * D * F + 2 * D  # attention, MLP, 2 norms
  return V * D + c["num_layers"] * layer + D + D * V  # embedding, layers, final norm, lm_head


def drafter_params(D: int, C: int, V: int) -> int:
  """A ReDrafter head with 2 ResBlocks, an RNN and an input projection (C != 2D)."""
  return (2 * D * C + C) + 2 * (C * C + C) + C * V + (D * D + D) + D * D


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  out = tmp_path_factory.mktemp("step_costs") / "step_costs.md"
  assert step_costs.main(["--shape", "tiny", "--reps", "2", "--out", str(out)]) == 0
  return out


def table_rows(text: str) -> dict[str, list[str]]:
  rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in text.splitlines()
          if line.startswith("| ") and not line.startswith("| program")]
  return {r[0]: r[1:] for r in rows}


def test_rows_and_bytes(report):
  c = step_costs.SHAPES["tiny"]
  assert (c["num_layers"], c["hidden_size"], c["tie_word_embeddings"]) == (2, 128, False)
  rows = table_rows(report.read_text())
  assert list(rows) == ROWS
  llm = 2 * llm_params(c)  # bf16
  kv = 2 * c["num_layers"] * c["num_kv_heads"] * c["head_dim"] * 512 * 2  # prefix 512, bf16
  want = {name: llm + kv for name in ROWS[:5]}
  want["draft W=4 L=5"] = 4 * 2 * drafter_params(c["hidden_size"], c["hidden_size"],
                                                 c["vocab_size"])
  want["copy 64 MiB"] = 2 * 64 * 2 ** 20
  for name, cells in rows.items():
    batch, tokens, ms, compile_s, nbytes, read_ms, ratio, x_ar = cells
    assert int(nbytes) == want[name], name
    assert float(ms) > 0 and float(read_ms) > 0 and float(ratio) > 0 and float(x_ar) > 0
    assert float(ms) / float(read_ms) == pytest.approx(float(ratio), rel=0.02, abs=0.01)
  assert rows["copy 64 MiB"][6] == "1.00"  # the bandwidth's own row reads at that bandwidth
  assert rows["ar step b=1"][7] == "1.00"
  assert [rows[n][1] for n in ROWS[1:5]] == ["8", "16", "32", "64"]
  assert all(float(rows[n][3]) > 0 for n in ROWS[:6])  # each model program compiled first


def test_header_and_json(report, capsys):
  text = report.read_text()
  head = text.split("\n| program")[0]
  assert jax.devices()[0].device_kind in head and "tiny" in head and "bfloat16" in head
  data = json.loads(report.with_suffix(".json").read_text())
  assert [r["program"] for r in data["rows"]] == ROWS
  assert data["llm_param_bytes"] == 2 * llm_params(step_costs.SHAPES["tiny"])
  assert all(r["recompiled"] == 0 for r in data["rows"])
  assert "`python -m redrafter_jax.bench step_costs --shape tiny --reps 2 --out " in text
  bandwidth = data["copy_bytes_moved"] / data["rows"][-1]["seconds"]
  assert data["read_bandwidth_Bps"] == pytest.approx(bandwidth)


def test_llama3_8b_shape_has_its_parameter_count():
  from flax import nnx

  from redrafter_jax.models.llama import Llama

  cfg = step_costs.shape_config(step_costs.parse_args([]))
  model = nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
  assert llm_params(cfg.to_dict()) == 8_030_261_248  # Llama-3-8B's published count
  assert step_costs.param_bytes(model) == 2 * 8_030_261_248


@pytest.mark.parametrize("tokens", [1, 8, 13, 64])
def test_verify_tree_fills_every_slot(tokens):
  tree = step_costs.verify_tree(tokens, 5, 1024)
  assert tree.size == tokens and bool(tree.valid_BN.all())
  assert int(tree.mask_BNN.sum()) > tokens or tokens == 1  # a tree, not N separate tokens


@pytest.mark.parametrize("argv", [["--verify-tokens", "0"], ["--shape", "llama4"],
                                  ["--prefix", "1000"], ["--reps", "0"], ["--batch", "2,x"],
                                  ["--beam-length", "1"]])
def test_bad_arguments(argv, capsys):
  with pytest.raises(SystemExit) as e:
    step_costs.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "error:" in err


def test_attention_falls_back_when_cudnn_refuses(tmp_path, monkeypatch):
  # On a CPU cuDNN attention fails when traced, as it would on a GPU whose cuDNN refuses a shape.
  monkeypatch.setattr(step_costs, "attention_backends", lambda choice, platform: ["cudnn", "xla"])
  out = tmp_path / "sc.md"
  assert step_costs.main(["--shape", "tiny", "--layers", "1", "--reps", "1", "--verify-tokens",
                          "8", "--copy-mib", "1", "--out", str(out)]) == 0
  data = json.loads(out.with_suffix(".json").read_text())
  assert data["attention"] == "xla" and data["attention_failed"][0].startswith("cudnn failed")
  assert data["config"]["num_layers"] == 1
  assert "(after cudnn failed" in out.read_text()
  assert [r["program"] for r in data["rows"]] == ["ar step b=1", "verify N=8", "draft W=4 L=5",
                                                  "copy 1 MiB"]
