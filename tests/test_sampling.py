"""Tests for pigjax.sampling: greedy, temperature, top-k/p, min-p, repetition penalty, stops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pigjax.sampling import StopChecker, apply_repetition_penalty, filter_logits, validate_sampling
from pigjax.sampling import sample as _eager_sample

# Jitted with the parameters static, as a decode loop would call it (one compile per setting,
# far cheaper than op-by-op eager execution).
sample = jax.jit(_eager_sample,
                 static_argnames=("temperature", "top_k", "top_p", "min_p", "repetition_penalty"))

LOGITS_V = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
N = 20_000  # draws per distribution test: one batch of N identical rows, one key


def _draw(key=0, **kw):
  logits_NV = jnp.broadcast_to(jnp.asarray(LOGITS_V), (N, LOGITS_V.size))
  return np.asarray(sample(logits_NV, jax.random.key(key), **kw))


def _counts(ids):
  return np.bincount(ids, minlength=LOGITS_V.size)


def test_greedy_is_argmax():
  logits_BV = jax.random.normal(jax.random.key(1), (4, 50))
  want = np.argmax(np.asarray(logits_BV), axis=-1)
  got = sample(logits_BV, jax.random.key(2), temperature=0.0)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, want)
  # top_k=1 is greedy at any temperature, and a traced temperature of 0 is greedy too.
  top1 = sample(logits_BV, jax.random.key(3), temperature=5.0, top_k=1)
  np.testing.assert_array_equal(top1, want)
  jitted = jax.jit(lambda l, k, t: _eager_sample(l, k, temperature=t, top_p=0.9))
  np.testing.assert_array_equal(jitted(logits_BV, jax.random.key(4), jnp.float32(0.0)), want)


def test_fixed_key_is_reproducible_and_keys_differ():
  a, b, c = _draw(key=7), _draw(key=7), _draw(key=8)
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_frequencies_match_softmax(temperature):
  counts = _counts(_draw(temperature=temperature))
  expected = N * np.asarray(jax.nn.softmax(LOGITS_V / temperature))
  chi2 = ((counts - expected) ** 2 / expected).sum()
  assert chi2 < 30.0, (counts, expected)  # 5 dof: P(chi2 > 30) ~ 1.5e-5


def test_top_k_top_p_min_p_exclude_tokens():
  p = np.asarray(jax.nn.softmax(LOGITS_V))  # [0.55, 0.20, 0.12, 0.07, 0.03, 0.00]
  assert (_counts(_draw(top_k=3))[3:] == 0).all()
  # top_p=0.7: 0.55 < 0.7 so the second token is needed; 0.75 >= 0.7 so the third is not.
  counts = _counts(_draw(top_p=0.7))
  assert (counts[2:] == 0).all() and (counts[:2] > 0).all()
  # min_p=0.2: keep p >= 0.2 * 0.55 = 0.11 -> tokens 0, 1, 2.
  counts = _counts(_draw(min_p=0.2))
  assert (counts[3:] == 0).all() and (counts[:3] > 0).all()
  assert p[2] > 0.2 * p[0] > p[3]
  # Kept tokens keep their relative odds (renormalised softmax over the top 2).
  counts = _counts(_draw(top_k=2))
  np.testing.assert_allclose(counts[0] / counts[:2].sum(), p[0] / p[:2].sum(), atol=0.02)


def _hf_keep_mask(logits_V, top_k, top_p, min_p):
  """Hugging Face's TopK -> TopP -> MinP warpers in numpy (descending-sort formulation)."""
  x = logits_V.astype(np.float64).copy()
  if top_k:
    x[x < np.sort(x)[::-1][top_k - 1]] = -np.inf
  order = np.argsort(-x, kind="stable")
  p = np.exp(x[order] - x[order][0])
  p /= p.sum()
  mass_before = np.cumsum(p) - p
  drop = order[(mass_before >= top_p) & (np.arange(x.size) > 0)]
  x[drop] = -np.inf
  p = np.exp(x - x.max())
  x[p < min_p * p.max()] = -np.inf
  return np.isfinite(x)


_traced_filter = jax.jit(lambda l, k, p, m: filter_logits(l, top_k=k, top_p=p, min_p=m))
# Four rows from flat to peaked, so the nucleus ranges from hundreds of tokens to a handful.
_FILTER_LOGITS_BV = (np.asarray(jax.random.normal(jax.random.key(5), (4, 500)))
                     * np.array([[0.5], [1], [2], [4]]))


@pytest.mark.parametrize("top_k, top_p, min_p", [
    (0, 0.9, 0.0), (0, 0.3, 0.0), (20, 0.8, 0.0), (0, 1.0, 0.05), (10, 0.95, 0.02)])
def test_filter_matches_sort_based_reference(top_k, top_p, min_p):
  # Traced parameters: one compilation serves every case (top_k takes the sorting path).
  got = np.isfinite(np.asarray(_traced_filter(jnp.asarray(_FILTER_LOGITS_BV), top_k, top_p, min_p)))
  want = np.stack([_hf_keep_mask(row, top_k, top_p, min_p) for row in _FILTER_LOGITS_BV])
  np.testing.assert_array_equal(got, want)
  assert 1 <= got.sum(axis=1).min() and got.sum(axis=1).max() < 500


def test_static_filter_matches_traced():
  # Static parameters (lax.top_k path, stages skipped at trace time) on the richest case.
  logits_BV = jnp.asarray(_FILTER_LOGITS_BV)
  static = jax.jit(functools.partial(filter_logits, top_k=10, top_p=0.95, min_p=0.02))(logits_BV)
  np.testing.assert_array_equal(static, _traced_filter(logits_BV, 10, 0.95, 0.02))


def test_repetition_penalty_math():
  logits_BV = jnp.array([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, -2.0, 0.0]])
  prev_BT = jnp.array([[0, 1, 1, -1], [2, -1, -1, -1]], jnp.int32)
  got = jax.jit(apply_repetition_penalty)(logits_BV, prev_BT, 2.0)
  want = np.array([[1.0, -2.0, 0.5, 3.0], [1.0, 1.0, -4.0, 0.0]])
  np.testing.assert_allclose(got, want)
  # Greedy picks token 0 of row 0 without the penalty, token 3 with a strong one.
  logits = jnp.array([[3.0, 0.0, 0.0, 2.0]])
  prev = jnp.array([[0]], jnp.int32)
  assert int(sample(logits, jax.random.key(0), temperature=0.0, prev_tokens_BT=prev)[0]) == 0
  got = sample(logits, jax.random.key(0), temperature=0.0, repetition_penalty=2.0,
               prev_tokens_BT=prev)
  assert int(got[0]) == 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), r"temperature must be >= 0.*got -0\.1"),
        (dict(top_k=-1), r"top_k must be an integer >= 0.*got -1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\].*got 0\.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\].*got 1\.5"),
        (dict(min_p=1.0), r"min_p must be in \[0, 1\).*got 1\.0"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0.*got 0\.0"),
        (dict(max_new_tokens=0), r"max_new_tokens must be an integer >= 1, got 0"),
        (dict(temperature=float("nan")), r"temperature.*got nan"),
    ],
)
def test_validate_sampling_rejects(kwargs, match):
  args = dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
              max_new_tokens=16)
  validate_sampling(**args)
  with pytest.raises(ValueError, match=match):
    validate_sampling(**(args | kwargs))


class _CharTokenizer:
  """One character per id: decode(ids) = "".join(chr(i))."""

  def decode(self, ids):
    return "".join(chr(i) for i in ids)


def test_stop_checker():
  tok = _CharTokenizer()
  ids = [ord(c) for c in "Hello###world"]
  checker = StopChecker(stop_ids=[0], stop_strings=["###", "xyz"], tokenizer=tok)
  assert checker.check(ids[:5]) == checker.check(ids[:5])
  status = checker.check(ids[:5])
  assert not status.stopped and status.text == "Hello" and status.num_tokens == 5
  assert not checker.check(ids[:7]).stopped  # "Hello##" is not yet a stop
  status = checker.check(ids)
  assert status.stopped and status.reason == "stop_string"
  assert status.text == "Hello" and status.num_tokens == 8  # through the token completing "###"
  status = checker.check([ord("a"), ord("b"), 0, ord("#")])
  assert status.stopped and status.reason == "stop_id"
  assert status.text == "ab" and status.num_tokens == 2
  assert StopChecker(stop_ids=[2]).check([5, 2]).num_tokens == 1
  with pytest.raises(ValueError, match="stop_strings need a tokenizer"):
    StopChecker(stop_strings=["x"])
