"""The record format and the grain pipeline: exact contents, order, resumption, splitting."""

import json

import numpy as np
import pytest

from redrafter_jax.training import data
from redrafter_jax.training.data import DataError


def _records(num=24, seed=0, max_len=40):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(num):
    n_prompt, n_resp = int(rng.integers(2, 8)), int(rng.integers(1, max_len - 8))
    tokens = rng.integers(1, 1000, n_prompt + n_resp).astype(np.int32)
    out.append((f"r{i}", tokens, np.array([0] * n_prompt + [1] * n_resp, np.uint8)))
  return out


def _folder(tmp_path, records, shards=3, name="data", settings=None):
  folder = tmp_path / name
  folder.mkdir()
  names = {}
  for k in range(shards):
    name = f"shard-{k:05d}.npz"
    data.write_shard(folder / name, [data.make_record(t, m, id=i, sampled=k % 2 == 1)
                                     for i, t, m in records[k::shards]])
    names[name] = {}
  (folder / data.MANIFEST).write_text(json.dumps({"settings": settings or {}, "shards": names}))
  return folder


def _sequences(batch):
  """The (tokens, loss_mask) of every packed sequence in a batch, using segment ids."""
  out = []
  for row in range(batch["tokens"].shape[0]):
    seg = batch["segment_ids"][row]
    for s in sorted(set(seg.tolist()) - {0}):
      where = seg == s
      assert batch["positions"][row][where].tolist() == list(range(int(where.sum())))
      out.append((tuple(batch["tokens"][row][where]), tuple(batch["loss_mask"][row][where])))
  return out


def test_record_roundtrip(tmp_path):
  records = _records(9)
  folder = _folder(tmp_path, records)
  back = {r["id"]: r for r in data.read_records(folder)}
  assert sorted(back) == sorted(i for i, _, _ in records)
  for i, tokens, mask in records:
    np.testing.assert_array_equal(back[i]["tokens"], tokens)
    np.testing.assert_array_equal(back[i]["mask"], mask)
    assert back[i]["tokens"].dtype == np.int32


def test_shard_roundtrip_is_exact_and_compact(tmp_path):
  rng = np.random.default_rng(1)
  records = [data.make_record(rng.integers(0, 49152, n), rng.integers(0, 2, n), id=f"é{n}",
                              sampled=n % 2 == 0) for n in (1, 7, 8, 9, 300)]
  data.write_shard(tmp_path / "s.npz", records)
  back = data.read_shard(tmp_path / "s.npz")
  assert [(r["id"], r["sampled"]) for r in back] == [(r["id"], r["sampled"]) for r in records]
  for a, b in zip(records, back):
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_array_equal(a["mask"], b["mask"])  # any mask, not only prompt-then-answer
    assert b["tokens"].dtype == np.int32 and b["mask"].dtype == np.uint8
  # Token ids as uint16 and the mask as bits: below the 5 bytes per token of int32 + uint8.
  total = sum(r["tokens"].size for r in records)
  assert (tmp_path / "s.npz").stat().st_size < 3 * total + 2048
  # Ids beyond uint16 (vocabularies over 65,536) are kept whole.
  wide = [data.make_record([70000, 5], [0, 1], id="w")]
  data.write_shard(tmp_path / "w.npz", wide)
  assert data.read_shard(tmp_path / "w.npz")[0]["tokens"].tolist() == [70000, 5]


def test_bad_records_and_shards_are_refused(tmp_path):
  with pytest.raises(DataError, match="must be equal 1-D"):
    data.make_record([1, 2, 3], [0, 1], id="x")
  with pytest.raises(DataError, match="negative token id"):
    data.make_record([1, -2], [0, 1], id="x")
  with pytest.raises(DataError, match="at least one record"):
    data.write_shard(tmp_path / "e.npz", [])
  (tmp_path / "junk.npz").write_bytes(b"not a shard")
  with pytest.raises(DataError, match="junk.npz: not a readable data shard"):
    data.read_shard(tmp_path / "junk.npz")


def test_padded_epoch_holds_every_record_once(tmp_path):
  records = _records(24)
  folder = _folder(tmp_path, records)
  it = data.make_iterator(folder, seq_len=48, global_batch=4, seed=3, pack=False)
  seen = sum((_sequences(next(it)) for _ in range(6)), [])
  assert sorted(seen) == sorted((tuple(t), tuple(m.astype(np.int32))) for _, t, m in records)


def test_several_folders_read_as_one_data_set(tmp_path):
  a, b = _records(12, seed=1), _records(9, seed=2)
  fa, fb = _folder(tmp_path, a, shards=3, name="a"), _folder(tmp_path, b, shards=3, name="b")
  it = data.make_iterator([fa, fb], seq_len=48, global_batch=3, seed=0, pack=False)
  seen = sum((_sequences(next(it)) for _ in range(7)), [])
  assert sorted(seen) == sorted((tuple(t), tuple(m.astype(np.int32))) for _, t, m in a + b)
  # Held-out shards: the last of EACH folder, never among the training shards.
  train = data.shard_paths([fa, fb], holdout=1)
  held = data.shard_paths([fa, fb], holdout=1, part="eval")
  assert held == [fa / "shard-00002.npz", fb / "shard-00002.npz"]
  assert len(train) == 4 and not set(train) & set(held)


def test_first_shards_pin_a_growing_folder(tmp_path):
  folder = _folder(tmp_path, _records(16), shards=4)
  shard = lambda k: folder / f"shard-{k:05d}.npz"
  assert data.shard_paths(folder, first=3) == [shard(0), shard(1), shard(2)]
  assert data.shard_paths(folder, first=3, holdout=1) == [shard(0), shard(1)]
  assert data.shard_paths(folder, first=3, holdout=1, part="eval") == [shard(2)]
  assert data.shard_paths(folder, first=0) == [shard(k) for k in range(4)]
  with pytest.raises(DataError, match="asked for its first 5 shards, but only 4 are complete"):
    data.shard_paths(folder, first=5)


def test_folders_made_by_different_models_are_refused(tmp_path):
  fa = _folder(tmp_path, _records(3), shards=1, name="a", settings={"vocab_size": 100})
  fb = _folder(tmp_path, _records(3), shards=1, name="b", settings={"vocab_size": 200})
  assert data.data_vocab_size([fa]) == 100
  with pytest.raises(DataError, match="different vocab_size"):
    data.data_vocab_size([fa, fb])
  with pytest.raises(DataError, match="data folder not found"):
    data.data_vocab_size([fa, tmp_path / "nope"])


def test_packed_rows_hold_whole_records(tmp_path):
  """Packing only concatenates records (never splits or alters one), and covers them all."""
  records = _records(24)
  folder = _folder(tmp_path, records)
  it = data.make_iterator(folder, seq_len=48, global_batch=4, seed=3, pack=True)
  seen = []
  while len(seen) < 2 * len(records):
    batch = next(it)
    assert (batch["segment_ids"] > 0).sum(axis=1).max() <= 48
    seen += _sequences(batch)
  expected = {(tuple(t), tuple(m.astype(np.int32))) for _, t, m in records}
  assert set(seen) == expected
  assert max(batch["segment_ids"].max() for batch in [next(it)]) >= 2  # several per row


def test_order_is_seeded_and_reshuffled_each_epoch(tmp_path):
  folder = _folder(tmp_path, _records(16))

  def ids(seed, n):
    it = data.make_iterator(folder, seq_len=48, global_batch=4, seed=seed, pack=False)
    return [tuple(next(it)["tokens"][:, 0]) for _ in range(n)]

  assert ids(0, 8) == ids(0, 8)
  assert ids(0, 8) != ids(1, 8)
  epoch1, epoch2 = ids(0, 8)[:4], ids(0, 8)[4:]
  assert sorted(sum(map(list, epoch1), [])) == sorted(sum(map(list, epoch2), []))
  assert epoch1 != epoch2


@pytest.mark.parametrize("pack", [False, True])
def test_iterator_state_resumes_exactly(tmp_path, pack):
  folder = _folder(tmp_path, _records(30))
  kw = dict(seq_len=32, global_batch=4, seed=5, pack=pack)
  it = data.make_iterator(folder, **kw)
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(6)]
  resumed = data.make_iterator(folder, **kw)
  resumed.set_state(json.loads(json.dumps(state)))  # as stored in a checkpoint
  for want in expected:
    got = next(resumed)
    for name in data.FIELDS:
      np.testing.assert_array_equal(got[name], want[name])


def test_process_rows_partition_the_global_batch(tmp_path):
  folder = _folder(tmp_path, _records(20))
  kw = dict(seq_len=32, global_batch=6, seed=0, pack=True)
  whole = data.make_iterator(folder, **kw)
  parts = [data.make_iterator(folder, rows=r, **kw) for r in ((0, 2), (2, 4), (4, 6))]
  for _ in range(4):
    want = next(whole)
    got = [next(p) for p in parts]
    for name in data.FIELDS:
      np.testing.assert_array_equal(np.concatenate([g[name] for g in got]), want[name])


def test_long_records_keep_the_response():
  mask = np.array([0] * 30 + [1] * 10, np.uint8)
  assert data.window(mask, 64) == slice(0, 40)  # fits: whole record
  assert data.window(mask, 16) == slice(22, 38)  # half a row of response after the prompt end
  assert data.window(mask, 36) == slice(4, 40)  # all 10 response tokens after 26 of prompt
  assert data.window(np.array([0] * 4 + [1] * 50, np.uint8), 16) == slice(0, 16)


def test_errors_name_the_problem(tmp_path):
  with pytest.raises(DataError, match="data folder not found"):
    data.make_iterator(tmp_path / "nope", seq_len=8, global_batch=1, seed=0)
  (tmp_path / "empty").mkdir()
  with pytest.raises(DataError, match="no manifest.json"):
    data.make_iterator(tmp_path / "empty", seq_len=8, global_batch=1, seed=0)
  folder = _folder(tmp_path, _records(6))
  (folder / "shard-00001.npz").unlink()
  with pytest.raises(DataError, match="missing.*shard-00001"):
    data.make_iterator(folder, seq_len=8, global_batch=1, seed=0)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
  folder = _folder(tmp_path, _records(6))
  it = data.make_iterator(folder, seq_len=32, global_batch=2, seed=0, vocab_size=100)
  with pytest.raises(DataError, match="vocab_size 100"):
    next(it)


def test_token_counts(tmp_path):
  recs = [("a", np.array([5, 7, 7, 9]), np.array([0, 1, 1, 1], np.uint8)),
          ("b", np.array([7, 9, 9, 9]), np.array([1, 0, 1, 1], np.uint8))]
  counts = data.token_counts(_folder(tmp_path, recs, shards=2), 12)
  assert counts.tolist() == [0, 0, 0, 0, 0, 0, 0, 3, 0, 3, 0, 0]


def test_first_fit_rows_fill_the_first_row_with_room():
  assert data.first_fit_rows([5, 4, 3, 2, 6, 1], 8) == [[0, 2], [1, 3, 5], [4]]
  assert data.first_fit_rows([], 8) == []
  with pytest.raises(DataError, match="item 1 has length 9"):
    data.first_fit_rows([1, 9], 8)


def _mixed_folder(tmp_path, records, sampled_every=3):
  """Two shards (the second held out), every ``sampled_every``-th record answered by sampling."""
  folder = tmp_path / "mixed"
  folder.mkdir()
  half = len(records) // 2
  for k, part in enumerate((records[:half], records[half:])):
    data.write_shard(folder / f"shard-{k:05d}.npz",
                     [data.make_record(t, m, id=i, sampled=j % sampled_every == 0)
                      for j, (i, t, m) in enumerate(part)])
  (folder / data.MANIFEST).write_text(json.dumps(
      {"settings": {}, "shards": {"shard-00000.npz": {}, "shard-00001.npz": {}}}))
  return folder


@pytest.mark.parametrize("pack", [True, False])
def test_held_out_batches_hold_every_greedy_answer_once_in_fixed_batches(tmp_path, pack):
  records = _records(30, max_len=40)
  folder = _mixed_folder(tmp_path, records)
  kw = dict(seq_len=32, global_batch=4, holdout=1, pack=pack)
  batches = list(data.held_out_batches(folder, **kw))
  held = data.read_shard(folder / "shard-00001.npz")
  want = [r for r in held if not r["sampled"]]
  assert 0 < len(want) < len(held)  # sampled answers are left out
  got = [s for b in batches for s in _sequences(b)]
  assert all(b["tokens"].shape == (4, 32) for b in batches)
  assert sorted(got) == sorted((tuple(r["tokens"][data.window(r["mask"], 32)]),
                                tuple(r["mask"][data.window(r["mask"], 32)])) for r in want)
  # No seed, no state: the same batches every time; a process's rows are a slice of them.
  again = list(data.held_out_batches(folder, **kw))
  part = list(data.held_out_batches(folder, rows=(2, 4), **kw))
  for a, b, c in zip(batches, again, part):
    for name in data.FIELDS:
      np.testing.assert_array_equal(a[name], b[name])
      np.testing.assert_array_equal(a[name][2:4], c[name])
  (tmp_path / "s").mkdir()
  everything_sampled = _mixed_folder(tmp_path / "s", records[:4], sampled_every=1)
  with pytest.raises(DataError, match="hold no greedy answer"):
    data.held_out_batches(everything_sampled, **kw)
