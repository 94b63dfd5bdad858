"""Blocked causal attention and chunked prefill: the same numbers as one-shot full-cache attention.

The full-cache path (`attention.dense_attend_full`: one masked softmax over every cache position)
is the pre-blocking implementation; the golden-logit tests in test_model.py pin it (and the
blocked path) to Hugging Face transformers.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_checkpoint
from pigjax import attention
from pigjax.attention import DenseCache
from pigjax.config import Config, SamplingConfig
from pigjax.pipeline import Pipeline

ATOL = 2e-5  # float32, different summation order (online softmax) on O(1) activations


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny_prefill")
  # 3 query heads per kv head: exercises the GQA grouping of the blocked einsums.
  tiny_checkpoint.write_tiny_llama(d, num_layers=2, heads=6, kv_heads=2, max_position=1024)
  return Pipeline.load(Config(checkpoint=str(d), max_seq_len=1024), progress=False)


def _qkv(seed, B, T, H, K, D, S):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, K, S, D)),
          jax.random.normal(ks[2], (B, K, S, D)))


@functools.partial(jax.jit, static_argnums=4)
def _both(q, k, v, pos_BT, block):
  """(one masked softmax over the whole cache, blocked attention), in one program."""
  full, _ = attention.attend_with_lse(q, k, v, attention.causal_visibility(pos_BT, k.shape[2]))
  return full, attention.causal_attend_blocked(q, k, v, pos_BT, block)


@pytest.mark.parametrize("T,block", [(1, 32), (1, 256), (7, 16), (64, 128)])
def test_blocked_equals_full_attention(T, block):
  """Ragged rows (one near the start, one mid-cache, one ending at the last position)."""
  B, H, K, D, S = 3, 6, 2, 16, 256
  q, k, v = _qkv(T, B, T, H, K, D, S)
  start_B = jnp.array([0, 100, S - T])
  pos_BT = start_B[:, None] + jnp.arange(T)[None]
  want, got = _both(q, k, v, pos_BT, block)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)


def test_blocked_never_reads_blocks_past_the_last_visible_position():
  """Keys and values past every query's position are NaN: the result must not see them (a
  masked-but-read NaN would poison the softmax sums)."""
  B, T, H, K, D, S, block = 2, 8, 4, 2, 16, 256, 32
  q, k, v = _qkv(1, B, T, H, K, D, S)
  pos_BT = jnp.array([[10], [40]]) + jnp.arange(T)[None]
  last_block_end = (40 + T - 1) // block * block + block
  poison = jnp.arange(S)[None, None, :, None] >= last_block_end
  want, _ = _both(q, k, v, pos_BT, block)
  _, got = _both(q, jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v), pos_BT, block)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)


def test_key_block_divides_the_cache():
  assert attention.key_block(4096) == 512
  assert attention.key_block(300) == 300  # a short cache is one block
  assert attention.key_block(1000) == 500
  assert attention.key_block(1031) == 1031  # a prime: one block (the unblocked path)
  for s in (768, 1536, 2560, 8192 + 256):
    assert s % attention.key_block(s) == 0


@functools.partial(nnx.jit, static_argnames=("attend",))
def _prefill_step(model, tokens_BT, cache, n_valid_B, attend):
  positions_BT = cache.lengths_B[:, None] + jnp.arange(tokens_BT.shape[1])[None]
  h, cache = model(tokens_BT, positions_BT, attend, cache)
  cache = DenseCache(k=cache.k, v=cache.v, lengths_B=cache.lengths_B + n_valid_B)
  return model.logits(h), cache


def prefill_logits(model, prompts, chunk, cache_len, attend):
  """Logits at every prompt position, prefilling `chunk` tokens per call for every row at once
  (as the engine does: a row's padding is written past its length and never becomes visible)."""
  cfg = model.cfg
  B, P = len(prompts), -(-max(map(len, prompts)) // chunk) * chunk
  tokens_BP = np.zeros((B, P), np.int32)
  for b, p in enumerate(prompts):
    tokens_BP[b, :len(p)] = p
  lengths_B = np.array([len(p) for p in prompts])
  cache = DenseCache.create(cfg.num_layers, B, cfg.num_kv_heads, cache_len, cfg.head_dim,
                            jnp.float32)
  out = []
  for s in range(0, P, chunk):
    n_valid = np.clip(lengths_B - s, 0, chunk).astype(np.int32)
    logits, cache = _prefill_step(model, jnp.asarray(tokens_BP[:, s:s + chunk]), cache,
                                  jnp.asarray(n_valid), attend=attend)
    out.append(np.asarray(logits))
  logits_BPV = np.concatenate(out, axis=1)
  return [logits_BPV[b, :n] for b, n in enumerate(lengths_B)]


PROMPT_LENGTHS = (5, 150, 397)  # ragged: one row ends in the first chunk, one mid-way


@pytest.fixture(scope="module")
def one_shot(tiny):
  """Every position's logits from one 400-token chunk: full-cache attention, and blocked."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 300, n).tolist() for n in PROMPT_LENGTHS]
  # A 1024-position cache: key blocks of 512, so later chunks cross a block boundary.
  full = prefill_logits(tiny.model, prompts, 400, 1024, attention.dense_attend_full)
  blocked = prefill_logits(tiny.model, prompts, 400, 1024, attention.dense_attend)
  return prompts, full, blocked


def test_one_chunk_blocked_equals_full_cache_attention(one_shot):
  _, full, blocked = one_shot
  for f, b in zip(full, blocked):
    np.testing.assert_allclose(b, f, atol=1e-4)


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_equals_one_chunk(tiny, one_shot, chunk):
  prompts, full, _ = one_shot
  got = prefill_logits(tiny.model, prompts, chunk, 1024, attention.dense_attend)
  for f, g in zip(full, got):
    np.testing.assert_allclose(g, f, atol=1e-4)


def test_chunked_prefill_with_small_key_blocks(tiny, one_shot, monkeypatch):
  """Many key blocks per chunk, and chunks that end mid-block (chunk 48, blocks of 32)."""
  monkeypatch.setattr(attention, "KEY_BLOCK", 32)
  prompts, full, _ = one_shot
  got = prefill_logits(tiny.model, prompts, 48, 1024, attention.dense_attend)
  for f, g in zip(full, got):
    np.testing.assert_allclose(g, f, atol=1e-4)


def test_engine_greedy_tokens_do_not_depend_on_the_prefill_chunk(tiny):
  from pigjax.engine import Engine
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 300, n).tolist() for n in (70, 300)]
  sc = SamplingConfig(max_new_tokens=6)
  outs = []
  for chunk in (32, 512):
    cfg = dataclasses.replace(tiny.cfg, prefill_chunk=chunk)
    new, _, _ = Engine(cfg, tiny.model).generate(prompts, sc)
    outs.append(new)
  assert outs[0] == outs[1]
