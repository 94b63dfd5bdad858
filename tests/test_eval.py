"""The quality harness on a tiny random model: policy equivalences, reference vs FFI, and a
resumable end-to-end run of scripts/eval_quality.py's loop (fast: tiny shapes)."""

import dataclasses
import json
import math

import numpy as np
import pytest

import tiny_checkpoint
from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.engine import Engine
from pigjax.eval import harness, policies, report, tasks
from pigjax.eval.runner import Runner
from pigjax.magicpig import MagicPigBackend
from pigjax.pipeline import Pipeline

SINK, WINDOW = 4, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny_eval")
  tiny_checkpoint.write_tiny_llama(d, num_layers=2, max_position=1024)
  cfg = Config(checkpoint=str(d), max_seq_len=1024, prefill_chunk=64,
               attention=AttentionConfig(num_bits=4, num_tables=16, sink=SINK, window=WINDOW,
                                         dense_layers=(0,), generated_buffer=64,
                                         store_dtype="float32"))
  return Pipeline.load(cfg, progress=False)


@pytest.fixture(scope="module")
def prefilled(tiny):
  runner = Runner(tiny.cfg, tiny.model, chunk=64)
  rng = np.random.default_rng(0)
  ctx = rng.integers(3, 250, (2, 150)).astype(np.int32)
  feed = rng.integers(3, 250, (2, 6)).astype(np.int32)
  dense, _ = runner.prefill(ctx, 192)
  want, _ = runner.teacher_force(policies.PoolPolicyBackend(tiny.cfg, "dense"),
                                 runner.start(policies.PoolPolicyBackend(tiny.cfg, "dense"), dense),
                                 feed)
  return runner, dense, feed, want


def _run(runner, backend, dense, feed):
  return runner.teacher_force(backend, runner.start(backend, dense), feed)


def test_dense_policy_equals_engine_dense_decoding(tiny):
  sc = SamplingConfig(max_new_tokens=10)
  prompts = [list(np.random.default_rng(1).integers(3, 250, 120))]
  want, _, _ = Engine(tiny.cfg, tiny.model).generate(prompts, sc)
  got, _, stats = Engine(tiny.cfg, tiny.model,
                         policies.PoolPolicyBackend(tiny.cfg, "dense")).generate(prompts, sc)
  assert got == want
  assert stats.extra["pool_fraction"] == 1.0


@pytest.mark.parametrize("policy,kw", [("topk", {"k_keep": 1000}), ("quest", {"n_pages": 100}),
                                       ("proxy", {"k_keep": 1000})])
def test_full_budget_policies_equal_dense(tiny, prefilled, policy, kw):
  """topk with k >= pool and quest with every page are dense attention; smaller budgets not."""
  runner, dense, feed, want = prefilled
  be = policies.PoolPolicyBackend(tiny.cfg, policy, **kw)
  got, cache = _run(runner, be, dense, feed)
  np.testing.assert_allclose(got, want, atol=2e-4)
  assert be.stats(cache)["pool_fraction"] == pytest.approx(1.0)
  small = {"topk": {"k_keep": 8}, "quest": {"n_pages": 1}, "proxy": {"k_keep": 8}}[policy]
  be = policies.PoolPolicyBackend(tiny.cfg, policy, **small)
  got, cache = _run(runner, be, dense, feed)
  assert np.abs(got - want).max() > 1e-4 and be.stats(cache)["pool_fraction"] < 0.2


def _rows_read_fraction_ok(got: float, fraction: float, pool: int) -> bool:
  """k_keep = ceil(fraction * pool) rows per query head, plus the keys whose integer scan score
  ties the k_keep-th (estimators.query_weights; a few on the tiny model's 16-wide heads)."""
  want = math.ceil(fraction * pool) / pool
  return want <= got <= want * 1.05


def test_estimator_proxy_is_selected_by_config(tiny, prefilled):
  """attention.estimator="proxy" turns the magicpig policy into proxy top-k: reading the whole
  pool is dense; a small fraction reads that fraction of rows (counted) and differs from dense."""
  runner, dense, feed, want = prefilled
  for fraction, tol in [(1.0, 2e-4), (0.05, None)]:
    cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(
        tiny.cfg.attention, estimator="proxy", proxy_fraction=fraction))
    be = policies.PoolPolicyBackend(cfg, "magicpig")
    got, cache = _run(runner, be, dense, feed)
    pool = 150 - SINK - WINDOW
    if tol:
      np.testing.assert_allclose(got, want, atol=tol)
      assert be.stats(cache)["pool_fraction"] == pytest.approx(1.0)
    else:
      assert np.abs(got - want).max() > 1e-4
      assert _rows_read_fraction_ok(be.stats(cache)["pool_fraction"], 0.05, pool)


def test_estimator_proxy_in_the_product_path(tiny):
  """--config.attention.kind=magicpig --config.attention.estimator=proxy decodes through the
  engine (make_backend) and reports the attended fraction; reading the whole pool is dense."""
  from pigjax.pipeline import make_backend
  sc = SamplingConfig(max_new_tokens=6)
  prompts = [list(np.random.default_rng(2).integers(3, 250, 120))]
  want, _, _ = Engine(tiny.cfg, tiny.model).generate(prompts, sc)
  for fraction in (1.0, 0.1):
    cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(
        tiny.cfg.attention, kind="magicpig", estimator="proxy", proxy_fraction=fraction))
    got, _, stats = Engine(cfg, tiny.model, make_backend(cfg)).generate(prompts, sc)
    pool = 120 - SINK - WINDOW
    assert _rows_read_fraction_ok(stats.extra["pool_fraction"], fraction, pool)
    if fraction == 1.0:
      assert got == want


def test_streaming_with_window_covering_context_equals_dense(tiny, prefilled):
  runner, dense, feed, want = prefilled
  cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(tiny.cfg.attention,
                                                                    window=400))
  got, cache = _run(runner, policies.PoolPolicyBackend(cfg, "streaming"), dense, feed)
  np.testing.assert_allclose(got, want, atol=2e-4)
  # and with a short window it is not dense
  got, cache = _run(runner, policies.PoolPolicyBackend(tiny.cfg, "streaming"), dense, feed)
  assert np.abs(got - want).max() > 1e-3


def test_magicpig_reference_agrees_with_ffi(tiny, prefilled):
  runner, dense, feed, _ = prefilled
  cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(tiny.cfg.attention,
                                                                    kind="magicpig"))
  ref_be = policies.PoolPolicyBackend(cfg, "magicpig")
  ffi_be = MagicPigBackend(cfg)
  ref, ref_cache = _run(runner, ref_be, dense, feed)
  ffi, ffi_cache = _run(runner, ffi_be, dense, feed)
  np.testing.assert_allclose(ffi, ref, atol=2e-4)
  f_ref, f_ffi = ref_be.stats(ref_cache)["pool_fraction"], ffi_be.stats(ffi_cache)["pool_fraction"]
  assert 0 < f_ref < 1 and f_ref == pytest.approx(f_ffi, rel=1e-6)


def test_reference_pools_generated_tokens_like_ffi(tiny, prefilled):
  """pool_generated: with a 4-token generated buffer the 6 fed tokens cause two evictions of 2
  tokens; the reference then agrees with the FFI backend (outputs, candidates, pool sizes)."""
  runner, dense, feed, _ = prefilled
  cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(
      tiny.cfg.attention, kind="magicpig", generated_buffer=4))
  ref_be = policies.PoolPolicyBackend(cfg, "magicpig", pool_generated=True)
  ffi_be = MagicPigBackend(cfg)
  ref, ref_cache = _run(runner, ref_be, dense, feed)
  ffi, ffi_cache = _run(runner, ffi_be, dense, feed)
  prompt_pool = 150 - SINK - WINDOW
  assert int(ref_cache.gen_pooled) == 4 and int(ref_cache.gen_count) == 2
  np.testing.assert_array_equal(ffi_cache.pool_len_B, prompt_pool + 4)
  np.testing.assert_allclose(ffi, ref, atol=2e-4)
  f_ref, f_ffi = ref_be.stats(ref_cache)["pool_fraction"], ffi_be.stats(ffi_cache)["pool_fraction"]
  assert 0 < f_ref < 1 and f_ref == pytest.approx(f_ffi, rel=1e-6)
  with pytest.raises(ValueError, match="pool_generated"):
    policies.PoolPolicyBackend(cfg, "quest", n_pages=2, pool_generated=True)


@pytest.mark.parametrize("tail", ["mean", "none"])
def test_proxy_reference_agrees_with_ffi(tiny, prefilled, tail):
  """estimator="proxy": the host store's kernel (MagicPigBackend) and the jnp reference
  (PoolPolicyBackend) agree on every decode step's output and count the same rows read."""
  runner, dense, feed, want = prefilled
  cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(
      tiny.cfg.attention, kind="magicpig", estimator="proxy", proxy_fraction=0.1, proxy_tail=tail))
  ref_be, ffi_be = policies.PoolPolicyBackend(cfg, "magicpig"), MagicPigBackend(cfg)
  ref, ref_cache = _run(runner, ref_be, dense, feed)
  ffi, ffi_cache = _run(runner, ffi_be, dense, feed)
  np.testing.assert_allclose(ffi, ref, atol=2e-4)
  assert np.abs(ffi - want).max() > 1e-4  # a tenth of the pool is not dense
  pool = 150 - SINK - WINDOW
  f_ref, f_ffi = ref_be.stats(ref_cache)["pool_fraction"], ffi_be.stats(ffi_cache)["pool_fraction"]
  assert f_ref == pytest.approx(f_ffi, rel=1e-6) and _rows_read_fraction_ok(f_ffi, 0.1, pool)


def test_proxy_ffi_greedy_decode_equals_reference(tiny):
  """Greedy decoding through the engine: the FFI proxy path picks the reference's tokens, with a
  generated buffer small enough that generated keys are appended to the pool (the reference
  keeps them exact, so only the tokens before the first append are compared exactly)."""
  sc = SamplingConfig(max_new_tokens=8)
  prompts = [list(np.random.default_rng(3).integers(3, 250, 140))]
  cfg = dataclasses.replace(tiny.cfg, attention=dataclasses.replace(
      tiny.cfg.attention, kind="magicpig", estimator="proxy", proxy_fraction=0.1))
  want, _, _ = Engine(cfg, tiny.model, policies.PoolPolicyBackend(cfg, "magicpig")).generate(
      prompts, sc)
  got, _, stats = Engine(cfg, tiny.model, MagicPigBackend(cfg)).generate(prompts, sc)
  assert got == want
  small = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention,
                                                                 generated_buffer=4))
  be = MagicPigBackend(small)
  got2, _, _ = Engine(small, tiny.model, be).generate(prompts, sc)
  assert got2[0][:5] == want[0][:5] and len(got2[0]) == len(want[0])
  assert be.store.num_tokens(0, 0) > 140 - SINK - WINDOW  # generated keys joined the pool


def test_probe_mode_keeps_dense_activations(tiny, prefilled):
  runner, dense, feed, want = prefilled
  be = policies.PoolPolicyBackend(tiny.cfg, "streaming")
  got, cache = runner.teacher_force(be, policies.set_probe(runner.start(be, dense), True), feed)
  np.testing.assert_allclose(got, want, atol=2e-4)
  err = policies.layer_errors(cache)
  assert err.shape == (2, 1) and np.all(err > 0) and np.all(err < 1.5)


def test_harness_writes_json_report_and_resumes(tiny, tmp_path, monkeypatch):
  docs = ["A long and winding road, number %d, leads to the door. " % i * 12 for i in range(4)]
  methods = harness.expand_methods(["dense", "magicpig", "topk", "streaming"], [(4, 16)], [])
  kw = dict(seed=0, span=8, error_tokens=3, free_tokens=3, progress=False)
  h = harness.Harness(tiny.cfg, tiny.model, tiny.tokenizer, docs, tmp_path, **kw)
  h.runner.chunk = 64
  res = h.run(methods, [160], ["copy", "ppl", "passkey", "error"], 2)
  recs = res["records"]
  # copy and passkey x 2 protocols + ppl for 4 methods, error for 3; 2 examples each
  assert len(recs) == 2 * (4 * 5 + 3)
  # Four needles need a longer context (byte-level tokenizer): 2 protocols x 4 methods x 2.
  res = h.run(methods, [520], ["multikey"], 2)
  recs = res["records"]
  assert len([r for r in recs if r["task"] == "multikey"]) == 2 * 4 * 2
  assert res["budgets"]["160"]["4,16"]["k_keep"] >= 1
  dense_copy = [r for r in recs if r["method"] == "dense" and r["task"] == "copy"]
  assert all(r["kl"] == 0 and r["agree"] == 1 for r in dense_copy)
  saved = json.loads((tmp_path / "results.json").read_text())
  assert len(saved["records"]) == len(recs)

  md = report.write(tmp_path)
  assert "magicpig(4,16)" in md and (tmp_path / "results.md").exists()
  assert "multikey forced" in md

  h2 = harness.Harness(tiny.cfg, tiny.model, tiny.tokenizer, docs, tmp_path, **kw)
  monkeypatch.setattr(h2.runner, "prefill",
                      lambda *a, **k: pytest.fail("a finished run must not prefill again"))
  h2.run(methods, [160], ["copy", "ppl", "passkey", "error"], 2)
  res2 = h2.run(methods, [520], ["multikey"], 2)
  assert len(res2["records"]) == len(recs)
  with pytest.raises(ValueError, match="Unknown task"):
    h2.run(methods, [160], ["needle"], 2)


def test_harness_batches_give_the_same_examples(tiny, tmp_path):
  """--batch splits the examples over several prefills; each example's text, needle and scores
  are those of the one-batch run (up to float32 batching noise)."""
  docs = ["A long and winding road, number %d, leads to the door. " % i * 12 for i in range(4)]
  methods = harness.expand_methods(["dense", "topk"], [(4, 16)], [])
  kw = dict(seed=0, span=8, error_tokens=3, free_tokens=3, progress=False)
  runs = {}
  for batch in (0, 1):
    h = harness.Harness(tiny.cfg, tiny.model, tiny.tokenizer, docs, tmp_path / str(batch), **kw)
    h.runner.chunk = 64
    # topk's k is matched to magicpig's measured fraction; give it one without running magicpig.
    h.results["budgets"]["160"] = {"4,16": {"fraction": 0.1, "pool": 88, "k_keep": 9,
                                             "n_pages": 1, "measured_on": "test"}}
    runs[batch] = h.run(methods, [160], ["copy", "passkey"], 3, batch=batch)["records"]
  key = lambda r: (r["task"], r["protocol"], r["example"], r["method"])  # noqa: E731
  one, split = sorted(runs[0], key=key), sorted(runs[1], key=key)
  assert [key(r) for r in one] == [key(r) for r in split] and len(one) == 2 * 2 * 2 * 3
  for a, b in zip(one, split):
    assert a.get("key") == b.get("key") and a.get("depth") == b.get("depth")
    np.testing.assert_allclose(a["nll"], b["nll"], rtol=1e-4, atol=1e-4)
    assert a["top1"] == b["top1"]
  with pytest.raises(ValueError, match="batch must be"):
    h.run(methods, [160], ["copy"], 3, batch=-1)


def test_examples_are_deterministic():
  enc = lambda s: [ord(c) % 250 + 3 for c in s]
  docs = ["alpha beta gamma " * 40, "delta epsilon " * 50, "zeta eta theta " * 30]
  a = tasks.passkey_batch(docs, enc, 300, range(2), seed=3)
  b = tasks.passkey_batch(docs, enc, 300, range(2), seed=3)
  np.testing.assert_array_equal(a.context, b.context)
  assert a.info == b.info and a.context.shape[0] == 2
  m1 = tasks.multikey_batch(docs, enc, 600, range(3), seed=3)
  m2 = tasks.multikey_batch(docs, enc, 600, range(3), seed=3)
  np.testing.assert_array_equal(m1.context, m2.context)
  np.testing.assert_array_equal(m1.query, m2.query)
  assert m1.info == m2.info
  for b, info in enumerate(m1.info):
    text = "".join(chr((i - 3) % 250) for i in m1.context[b])  # enc is invertible on ASCII
    assert len(set(info["keys"])) == 4 and info["key"] in info["keys"]
    for name, key in zip(tasks.MULTI_NAMES, info["keys"]):
      assert f"pass key of door {name} is {key}" in text
    assert f"door {info['name']}?" in "".join(chr((i - 3) % 250) for i in m1.query[b])
    assert [chr((i - 3) % 250) for i in m1.answer[b]] == list(f" {info['key']}")
  s = tasks.free_scores(np.array([[ord(c) for c in " 12345x"]]), [12345],
                        lambda ids: "".join(chr(i) for i in ids))
  assert s[0]["exact"]
