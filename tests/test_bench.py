"""Smoke tests of tools.bench and tools.bench_contexts on tiny sizes: the tiled caches, the
per-layer MagicPIG cache builder (against the backend's own after_prefill), timing helpers and the
kernel counters."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_checkpoint
from pigjax.config import AttentionConfig, Config
from pigjax.engine import Engine
from pigjax.magicpig import MagicPigBackend
from pigjax.model import apply_rope, rope_inv_freq, rope_tables
from pigjax.pipeline import Pipeline
from tools import bench, bench_contexts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny_bench")
  tiny_checkpoint.write_tiny_llama(d, num_layers=3, max_position=4096)
  cfg = Config(checkpoint=str(d), max_seq_len=1024, prefill_chunk=64,
               attention=AttentionConfig(kind="magicpig", num_bits=4, num_tables=16, sink=4,
                                         window=16, dense_layers=(0,), generated_buffer=8,
                                         store_dtype="float32"))
  return Pipeline.load(cfg, progress=False)


def test_source_positions():
  src = bench.source_positions(10, 25, sink=4)
  np.testing.assert_array_equal(src[:10], np.arange(10))
  np.testing.assert_array_equal(src[10:16], np.arange(4, 10))
  assert src.min() >= 0 and src.max() < 10


def test_tile_cache_rerotates_keys(tiny):
  m = tiny.cfg.model
  dense_engine = Engine(dataclasses.replace(tiny.cfg, attention=AttentionConfig()), tiny.model)
  ids = list(np.random.default_rng(0).integers(3, 250, 64))
  src, _ = bench.real_prefill(dense_engine, ids)
  tiled = bench.tile_cache(src, 64, 200, 256, m)
  assert tiled.k[0].shape[2] == 256 and int(tiled.lengths_B[0]) == 200
  np.testing.assert_allclose(tiled.k[1][:, :, :64], src.k[1][:, :, :64], atol=1e-5)
  # Token 100 copies source token src(100); un-rotating both to position 0 must agree.
  p = 100
  s = int(bench.source_positions(64, 200, 4)[p])

  def unrotate(k_BKD, pos):
    sin, cos = rope_tables(jnp.array([[pos]]), m)
    return apply_rope(k_BKD[:, None], -sin, cos)[:, 0]

  np.testing.assert_allclose(unrotate(tiled.k[2][:, :, p], p), unrotate(src.k[2][:, :, s], s),
                             atol=1e-4)
  np.testing.assert_array_equal(tiled.v[2][:, :, p], src.v[2][:, :, s])
  assert float(jnp.abs(tiled.k[2][:, :, 200:]).max()) == 0.0


def test_stitch_positions():
  src, pos = bench_contexts.stitch_positions(10, 30, sink=4)
  np.testing.assert_array_equal(src[:10], np.arange(10))  # the first piece whole
  np.testing.assert_array_equal(pos[10:16], np.arange(4, 10))  # then pieces minus their sinks
  np.testing.assert_array_equal(src[10:16], 10 + np.arange(4, 10))
  np.testing.assert_array_equal(src[16:22], 20 + np.arange(4, 10))
  assert bench_contexts.pieces_needed(30, 10, 4) == 5 and src.max() < 5 * 10
  assert bench_contexts.pieces_needed(10, 10, 4) == 1 and bench_contexts.pieces_needed(11, 10, 4) == 2


def test_document_pieces_prefer_different_documents(tmp_path):
  for i, n in enumerate([30, 12, 25]):
    (tmp_path / f"d{i}.txt").write_text(" ".join(f"w{i}_{j}" for j in range(n)))
  encode = lambda text: [hash(w) % 1000 for w in text.split()]
  pieces = bench_contexts.document_pieces(encode, 5, 10, tmp_path)
  firsts = {tuple(encode(" ".join(f"w{i}_{j}" for j in range(10)))) for i in range(3)}
  assert {tuple(p) for p in pieces[:3]} == firsts  # one piece from each document first
  assert len(pieces) == 5 and all(len(p) == 10 for p in pieces)
  with pytest.raises(ValueError, match="fetch_data"):
    bench_contexts.document_pieces(encode, 7, 10, tmp_path)


def test_stitched_cache_rerotates_and_caches_pieces(tiny, tmp_path):
  m = tiny.cfg.model
  dense_engine = Engine(dataclasses.replace(tiny.cfg, attention=AttentionConfig()), tiny.model)
  rng = np.random.default_rng(3)
  ids = [list(rng.integers(3, 250, 64)) for _ in range(3)]
  pieces = [bench_contexts.piece_kv(dense_engine, p, tmp_path) for p in ids]
  assert len(list(tmp_path.glob("*.npy"))) == 3
  again = bench_contexts.piece_kv(dense_engine, ids[1], tmp_path)  # from disk, no prefill
  np.testing.assert_array_equal(again, pieces[1])
  src, _ = bench.real_prefill(dense_engine, ids[1])
  np.testing.assert_allclose(pieces[1][0, 2], src.k[2][0, :, :64], atol=1e-2, rtol=1e-3)

  cache = bench_contexts.stitched_cache(pieces, 150, 256, m, sink=4)
  assert cache.k[0].shape == (1, m.num_kv_heads, 256, m.head_dim)
  assert int(cache.lengths_B[0]) == 150
  p = 64 + 60 + 7  # piece 2 (third), its position 4 + 7
  assert bench_contexts.stitch_positions(64, 150, 4)[1][p] == 11

  def unrotate(k_BKD, pos):
    sin, cos = rope_tables(jnp.array([[pos]]), m)
    return apply_rope(k_BKD[:, None], -sin, cos)[:, 0]

  want = jnp.asarray(pieces[2][0, 1][None, :, 11].astype(np.float32))
  np.testing.assert_allclose(unrotate(cache.k[1][:, :, p], p), unrotate(want, 11), atol=1e-4)
  np.testing.assert_array_equal(cache.v[1][0, :, p], pieces[2][1, 1][:, 11].astype(np.float32))
  assert float(jnp.abs(cache.k[1][:, :, 150:]).max()) == 0.0


def _magicpig_engine_and_prefill(tiny, seed, batch, estimator="magicpig"):
  """A MagicPIG engine (store sized for `batch` slots) and a real dense prefill of 128 random
  tokens (one row) on the tiny model."""
  cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(tiny.cfg.attention,
                                                                    estimator=estimator))
  backend = MagicPigBackend(cfg)
  engine = Engine(cfg, tiny.model, backend)
  dense_engine = Engine(dataclasses.replace(tiny.cfg, attention=AttentionConfig()), tiny.model)
  ids = list(np.random.default_rng(seed).integers(3, 250, 128))
  src, _ = bench.real_prefill(dense_engine, ids)
  backend.create_cache(batch, 128, tiny.model.dtype)
  return backend, engine, src


@pytest.mark.parametrize("estimator", ["magicpig", "proxy"])
def test_magicpig_cache_matches_after_prefill(tiny, estimator):
  backend, engine, src = _magicpig_engine_and_prefill(tiny, 1, 1, estimator)
  want = backend.after_prefill(jax.tree.map(jnp.copy, src), np.array([128], np.int32))
  want_sizes = [backend.store.num_tokens(i, 0) for i in range(2)]
  timings = {}
  got = bench.magicpig_cache(backend, src, 128, timings)
  assert [backend.store.num_tokens(i, 0) for i in range(2)] == want_sizes
  assert set(timings) == {"hash_s", "insert_s"}
  for name in ("exact_pos_BX", "pool_len_B", "lengths_B"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
  for a, b in zip(got.k + got.v, want.k + want.v):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(got.mu, want.mu):
    if a is not None:
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # The same decode step on both caches gives the same token and the kernel counters count.
  step_got = bench.decode_stepper(engine, got, 1, 256)
  bench.set_profiling(backend.store, True)
  times = bench.interleaved({"pig": step_got}, rounds=2, steps=1, warmup=0)
  prof = bench.kernel_profile(backend.store)
  assert len(times["pig"]) == 2 and all(t > 0 for t in times["pig"])
  assert prof["attend_calls"] == 2 * 2 and prof["heads"] > 0 and prof["bytes"] > 0
  # Candidates by pool slice: magicpig counts each candidate in one slice; the proxy none.
  bins = prof["candidate_bins"]
  assert len(bins) == 16
  if estimator == "magicpig":
    assert sum(bins) == prof["candidates"] > 0
    pool = backend.store.num_tokens(0, 0)
    np.testing.assert_allclose(np.mean(bench.candidate_slices(prof, pool)),
                               prof["candidates"] / prof["heads"] / pool, rtol=1e-12)
  else:
    assert sum(bins) == 0
  res = bench.summarise(times)
  assert res["pig_ms"] > 0 and res["pig_tok_s"] > 0


def test_memory_bandwidth_and_bytes_per_token():
  bw = bench.memory_bandwidth(mbytes=8, repeats=1)
  assert bw["copy_gbps"] > 0 and bw["read_gbps"] > 0
  b = bench.host_bytes_per_token(64, 150)
  assert b["pigjax"]["total"] == 2 * 64 * 2 + 300  # bf16 K and V, 16-bit ids
  assert b["original"]["tables"] == 600 and b["original"]["total"] == 860
  assert bench.host_bytes_per_token(64, 150, "int8")["pigjax"]["total"] == 128 + 8 + 300  # scales


def test_attention_only_steps_run():
  fns, store, info = bench.attention_only_steps(1, 4, 2, 32, 512, 1, 4, 8)
  times = bench.interleaved(fns, rounds=1, steps=1)
  assert set(times) == {"dense", "magicpig"}
  assert store.num_tokens(0, 0) == 512 - 68
  store.close()


def test_batched_magicpig_cache_rows_match_single(tiny):
  """repeat_rows + magicpig_cache at batch 2 (the batched benchmark): both rows' pools hold what
  the one-row cache holds, and a decode step gives both rows the one-row token."""
  backend, engine, src = _magicpig_engine_and_prefill(tiny, 2, 2)
  one = bench.magicpig_cache(backend, src, 128)
  tok_one = bench.decode_stepper(engine, one, 1, 256)
  tok_one()
  want = int(tok_one.state["tok"][0])
  two = bench.magicpig_cache(backend, bench.repeat_rows(src, 2), 128)
  assert [backend.store.num_tokens(0, s) for s in range(2)] == [backend.store.num_tokens(0, 0)] * 2
  step = bench.decode_stepper(engine, two, 2, 256)
  step()
  assert [int(t) for t in step.state["tok"]] == [want, want]


def test_markdown_tables_have_a_batch_column():
  row = dict(context=4096, batch=4, dense_ms=50.0, magicpig_ms=40.0, speedup=1.25,
             dense_tok_s=80.0, magicpig_tok_s=100.0, kernel_ms_per_step=5.0,
             kernel_bytes_per_step=1e7, lookup_ms=1.0, score_ms=2.0, softmax_ms=1.0,
             candidate_fraction=0.04)
  bw = {"copy_gbps": 20.0, "read_gbps": 30.0, "threads": 2}
  md = bench.markdown_tables({"cpu": "x", "bandwidth": bw, "smollm2": [
      row, dict(context=8192, batch=8, skipped="needs 1 GiB")]})
  assert "| 4096 | 4 | 50 | 40 | 1.25x |" in md and "| 8192 | 8 | skipped: needs 1 GiB |" in md


def test_quant_matmul_chain_benchmark_runs_both_layouts():
  """scripts/bench_quant_matmuls.py (BENCHMARKS.md, "Quantized decode weights") on one layer, one
  step."""
  import subprocess
  import sys
  from pathlib import Path
  script = Path(__file__).resolve().parents[1] / "scripts" / "bench_quant_matmuls.py"
  out = subprocess.run([sys.executable, str(script), "--layers=1", "--rounds=1", "--steps=1"],
                       capture_output=True, text=True, timeout=300, check=True).stdout
  assert "5 matmuls" in out
  for layout in ("gguf", "packed"):
    assert f"  {layout} " in out and "ms per chain" in out


def test_with_rope_scaling(tiny):
  """The benchmark's RoPE scaling sets the model's config and the run's, and only the long
  wavelengths change (llama3 scaling leaves wavelengths under the trained context / 4 alone)."""
  pipe = types.SimpleNamespace(cfg=tiny.cfg, model=types.SimpleNamespace(cfg=tiny.cfg.model))
  assert bench.with_rope_scaling(pipe, 0) is tiny.cfg and pipe.model.cfg is tiny.cfg.model
  with pytest.raises(ValueError, match=">= 0"):
    bench.with_rope_scaling(pipe, -1)
  cfg = bench.with_rope_scaling(pipe, 4)
  assert cfg.model.rope_scaling_factor == 4 and pipe.model.cfg is cfg.model
  base, scaled = rope_inv_freq(tiny.cfg.model), rope_inv_freq(cfg.model)
  wavelen = 2 * np.pi / base
  short = wavelen < cfg.model.rope_original_max_position / cfg.model.rope_high_freq_factor
  np.testing.assert_array_equal(scaled[short], base[short])
  longest = np.argmax(wavelen)
  if wavelen[longest] > cfg.model.rope_original_max_position:
    np.testing.assert_allclose(scaled[longest], base[longest] / 4)
  with pytest.raises(ValueError, match="already scales"):
    bench.with_rope_scaling(pipe, 4)
