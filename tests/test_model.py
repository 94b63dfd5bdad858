"""Model numerics against Hugging Face transformers (tests/data/reference), and engine invariants.

The reference was produced by transformers + PyTorch (float32) from the same GGUF, through
transformers' own dequantiser and Q/K un-permutation: an independent implementation. Tolerances:
both sides run float32 with different summation orders over 30 layers; observed logit differences
are ~1e-5 on values of magnitude ~20, so 2e-3 absolute leaves two orders of margin while a wrong
RoPE, norm epsilon or permutation moves logits by whole units.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import reference
from pigjax import config
from pigjax.attention import DenseCache, dense_attend
from pigjax.config import Config, SamplingConfig
from pigjax.model import rope_inv_freq
from pigjax.pipeline import Pipeline

LOGIT_ATOL = 2e-3


@pytest.fixture(scope="module")
def ref():
  return reference.load("smollm2_135m_transformers.json")


@pytest.fixture(scope="module")
def gpl():
  return reference.load("smollm2_135m_gpl3_400.json")


@pytest.fixture(scope="module")
def pipe():
  # The float32 path (the quantized decode path is tested against the same reference in
  # tests/test_quant.py).
  return Pipeline.load(Config(checkpoint="smollm2", weights="dense"), progress=False)


def all_logits(pipe, ids):
  model = pipe.model
  cache = DenseCache.create(model.cfg.num_layers, 1, model.cfg.num_kv_heads, len(ids),
                            model.cfg.head_dim, jnp.float32)
  tokens = jnp.asarray([ids], jnp.int32)

  @nnx.jit
  def run(model, tokens, cache):
    h, _ = model(tokens, jnp.arange(tokens.shape[1])[None], dense_attend, cache)
    return model.logits(h)[0]

  return np.asarray(run(model, tokens, cache))


def greedy(pipe, ids, n):
  new, _, _ = pipe.engine.generate([ids], SamplingConfig(max_new_tokens=n))
  return new[0]


def test_fixed_prompt_last_logits(pipe, ref):
  ids = pipe.tokenizer.encode(ref["fixed_prompt"])
  assert ids == ref["fixed_prompt_ids"]
  last = all_logits(pipe, ids)[-1]
  np.testing.assert_allclose(last[:5], ref["last_logits_first5"], atol=LOGIT_ATOL)
  assert int(last.argmax()) == ref["last_argmax"]
  np.testing.assert_allclose(last.max(), ref["last_max"], atol=LOGIT_ATOL)
  # The sum over 49152 logits accumulates rounding: relative 1e-5.
  np.testing.assert_allclose(last.astype(np.float64).sum(), ref["logits_sum_last"], rtol=1e-5)


def test_gpl3_400_token_logits(pipe, gpl):
  logits = all_logits(pipe, gpl["prompt_ids"])
  for pos, want in gpl["positions"].items():
    got = logits[int(pos)]
    np.testing.assert_allclose(got[want["top5_ids"]], want["top5_logits"], atol=LOGIT_ATOL,
                               err_msg=f"position {pos}")
  full = reference.load("smollm2_135m_gpl3_400_last_logits.npy")
  np.testing.assert_allclose(logits[-1], full, atol=LOGIT_ATOL)


def test_chat_prompt_ids_and_greedy_answer(pipe, ref):
  # SmolLM2's template adds its default system message when none is given.
  ids = pipe.encode("What is the capital of France? Answer in one sentence.", chat=True)
  assert ids == ref["chat_prompt_ids"]
  assert pipe.encode("Write a short poem about the sea.", chat=True) == ref["chat2_prompt_ids"]
  new = greedy(pipe, ids, len(ref["greedy_new_ids"]))
  assert new == ref["greedy_new_ids"]
  assert pipe.tokenizer.decode(new) == ref["greedy_text"]


def test_long_greedy_continuations(pipe, ref, gpl):
  assert greedy(pipe, ref["chat2_prompt_ids"], 30) == ref["chat2_greedy_new_ids"]
  assert greedy(pipe, gpl["prompt_ids"], 24) == gpl["greedy_new_ids"]


def test_batch_of_different_lengths_matches_single(pipe, ref, gpl):
  """Right-padded batching (per-slot lengths and positions) changes nothing per sequence."""
  prompts = [ref["fixed_prompt_ids"], ref["chat2_prompt_ids"], gpl["prompt_ids"][:97]]
  batched, _, _ = pipe.engine.generate(prompts, SamplingConfig(max_new_tokens=12))
  for p, got in zip(prompts, batched):
    assert got == greedy(pipe, p, 12)


def test_chunked_prefill_matches_one_shot(pipe, gpl):
  import dataclasses
  from pigjax.engine import Engine
  small = Engine(dataclasses.replace(pipe.cfg, prefill_chunk=64), pipe.model)
  new, _, _ = small.generate([gpl["prompt_ids"]], SamplingConfig(max_new_tokens=24))
  assert new[0] == gpl["greedy_new_ids"]


def test_llama3_rope_scaling_bands():
  """Llama-3.1 scaling: high frequencies kept, low ones divided by the factor, a smooth band."""
  base = config.ModelConfig(head_dim=128, rope_theta=500000.0)
  scaled = config.ModelConfig(head_dim=128, rope_theta=500000.0, rope_scaling_factor=8.0,
                              rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                              rope_original_max_position=8192)
  f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
  wavelen = 2 * np.pi / f0
  high = wavelen < 8192 / 4
  low = wavelen > 8192 / 1
  np.testing.assert_allclose(f1[high], f0[high], rtol=1e-6)
  np.testing.assert_allclose(f1[low], f0[low] / 8, rtol=1e-6)
  mid = ~high & ~low
  assert mid.any() and np.all(f1[mid] < f0[mid]) and np.all(f1[mid] > f0[mid] / 8)
  assert np.all(np.diff(f1) < 0)  # still strictly decreasing


def test_prompt_too_long_is_refused_before_work(pipe):
  with pytest.raises(ValueError, match="exceeds the context limit"):
    pipe.engine.generate([[1] * 5000], SamplingConfig(max_new_tokens=10))
  with pytest.raises(ValueError, match="temperature"):
    pipe.engine.generate([[1, 2]], SamplingConfig(temperature=-1.0))
