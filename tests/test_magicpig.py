"""The MagicPIG backend inside the jitted decode step: equivalences with dense decoding, the HLO,
generated tokens joining the pool, and the step's outputs against the pure-jnp reference."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as golden
import tiny_checkpoint
from pigjax import lsh, reference
from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.engine import Engine
from pigjax.magicpig import MagicPigBackend
from pigjax.pipeline import Pipeline

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  tiny_checkpoint.write_tiny_llama(d, num_layers=3, max_position=2048)
  cfg = Config(checkpoint=str(d), max_seq_len=2048, prefill_chunk=128,
               attention=AttentionConfig(kind="magicpig", num_bits=4, num_tables=16, sink=4,
                                         window=16, dense_layers=(0,), generated_buffer=8,
                                         store_dtype="float32"))
  return Pipeline.load(cfg, progress=False)


def engine_with(pipe, **attention):
  cfg = dataclasses.replace(pipe.cfg, attention=dataclasses.replace(pipe.cfg.attention,
                                                                    **attention))
  backend = MagicPigBackend(cfg) if cfg.attention.kind == "magicpig" else None
  return Engine(cfg, pipe.model, backend)


def prompt(n, seed=0):
  return list(np.random.default_rng(seed).integers(3, 250, n))


def test_exact_when_everything_fits_in_sink_and_window(tiny):
  """sink + window >= prompt and a generated buffer that never fills: nothing is sampled."""
  dense = engine_with(tiny, kind="dense")
  pig = engine_with(tiny, sink=4, window=200, generated_buffer=64)
  sc = SamplingConfig(max_new_tokens=20)
  prompts = [prompt(150), prompt(37, 1)]
  want, _, _ = dense.generate(prompts, sc)
  got, _, stats = pig.generate(prompts, sc)
  assert got == want
  assert stats.extra["pool_fraction"] == 0.0


def test_all_layers_dense_equals_dense(tiny):
  dense = engine_with(tiny, kind="dense")
  pig = engine_with(tiny, dense_layers=(0, 1, 2))
  sc = SamplingConfig(max_new_tokens=12)
  assert pig.generate([prompt(300)], sc)[0] == dense.generate([prompt(300)], sc)[0]


def test_long_generation_moves_generated_tokens_into_the_pool(tiny):
  """With an 8-token generated buffer, 60 new tokens evict several blocks into the host store;
  the exact buffer stays bounded and small tables still find most of the pool (num_bits=4)."""
  pig = engine_with(tiny)
  ids, _, stats = pig.generate([prompt(200), prompt(90, 2)], SamplingConfig(max_new_tokens=60))
  assert all(len(x) == 60 for x in ids)
  store = pig.backend.store
  for b, n in enumerate((200, 90)):
    # prompt pool (n - sink - window) + evicted generated tokens (multiples of buffer // 2)
    pool = store.num_tokens(0, b)
    assert pool >= n - 20 + 60 - 8 - 4 and (pool - (n - 20)) % 4 == 0
  assert 0.05 < stats.extra["pool_fraction"] <= 1.0


def test_decode_step_hlo_has_ffi_calls_and_no_store_copies(tiny):
  pig = engine_with(tiny)
  pig.generate([prompt(100)], SamplingConfig(max_new_tokens=2))
  (decode,) = pig.programs.compiled("decode")
  hlo = decode.as_text()
  sparse = len(pig.backend.sparse_layers)
  assert len(re.findall(r"custom_call_target=\"pigjax_attend\"", hlo)) == sparse
  assert "pigjax_insert" not in hlo  # inserts happen after prefill and between steps, not per step
  # Nothing pool-sized is copied per step: the largest copy is at most one exact buffer.
  copies = re.findall(r"= \w+\[([\d,]*)\]\S* copy\(", hlo)
  biggest = max((int(np.prod([int(d) for d in c.split(",") if d])) for c in copies), default=0)
  assert biggest <= 1 * 2 * 2048 * 16  # one dense-layer cache [B, K, S, D]


def test_split_prefill_inserts_the_right_pool(tiny):
  """after_prefill puts prompt positions [sink, n - window) of each sparse layer into the store,
  centred on their mean: the store's sampled attention equals reference.pool_attention_ref on them."""
  from pigjax.attention import dense_attend
  from pigjax.store import store_attend
  pig = engine_with(tiny)
  backend, a, m = pig.backend, pig.cfg.attention, tiny.model
  n = 300
  cache = backend.create_cache(1, 512, jnp.float32)
  _, cache = m(jnp.asarray([prompt(n)], jnp.int32), jnp.arange(n)[None], dense_attend, cache)
  cache = dataclasses.replace(cache, lengths_B=jnp.array([n], jnp.int32))
  layer = backend.sparse_layers[-1]
  k = np.asarray(cache.k[layer][:, :, a.sink:n - a.window])
  v = np.asarray(cache.v[layer][:, :, a.sink:n - a.window])
  mp = backend.after_prefill(cache, np.array([n]))
  assert int(mp.pool_len_B[0]) == n - a.sink - a.window
  valid = jnp.ones(k.shape[:3], bool)
  w = lsh.simhash_matrix(a.seed, layer, 16, a.num_bits, a.num_tables, a.per_layer_hash)
  mu, _ = lsh.centre_and_hash(k, valid, w, a.num_bits, a.num_tables)
  np.testing.assert_allclose(mp.mu[layer], mu, rtol=1e-5, atol=1e-6)
  q = jax.random.normal(jax.random.key(0), (1, 4, 16)) * 3
  o_ref, lse_ref, cnt_ref = reference.pool_attention_ref(q, k, v, valid, mp.mu[layer], w, a.num_bits,
                                                   a.num_tables)
  qc = lsh.hash_codes(q, w, a.num_bits, a.num_tables)
  o, lse, cnt = store_attend(backend.store.handle, backend.store_index[layer],
                             jnp.zeros((1,), jnp.int32), q, qc, mp.pool_len_B)
  np.testing.assert_array_equal(cnt, cnt_ref)
  assert np.all(np.asarray(cnt) > 0)
  np.testing.assert_allclose(lse, lse_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-4)


def test_bad_magicpig_settings_are_refused(tiny):
  with pytest.raises(ValueError, match="dense_layers"):
    engine_with(tiny, dense_layers=(7,))
  with pytest.raises(ValueError, match="num_bits"):
    engine_with(tiny, num_bits=0)


def test_smollm2_magicpig_with_everything_exact_equals_dense():
  """On the real model: sink + window cover the prompt -> token-for-token equal to dense."""
  gpl = golden.load("smollm2_135m_gpl3_400.json")
  cfg = Config(checkpoint="smollm2", max_seq_len=1024,
               attention=AttentionConfig(kind="magicpig", sink=4, window=512,
                                         generated_buffer=64))
  pipe = Pipeline.load(cfg, progress=False)
  got, _, _ = pipe.engine.generate([gpl["prompt_ids"]], SamplingConfig(max_new_tokens=24))
  assert got[0] == gpl["greedy_new_ids"]
