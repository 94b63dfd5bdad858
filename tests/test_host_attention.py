"""The dense decode-attention host kernel (pigjax/host_attention.py, xla_ffi/decode_attention.h)
against the jnp reference `attention.attend_with_lse`, its operand checks, and the engine's
greedy output with it against the jnp decode path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pigjax import attention, host_attention
from pigjax.config import AttentionConfig, Config, MeshConfig, ModelConfig, SamplingConfig
from pigjax.attention import DenseBackend
from pigjax.engine import Engine
from pigjax.model import from_hf_tensors
from tests.test_quant import kernel  # noqa: F401  (the fixture: each kernel path, avx2 and scalar)
from tests.tiny_checkpoint import tiny_llama_tensors


def _reference(q_BHD, k_BKSD, v_BKSD, lengths_B):
  S = k_BKSD.shape[2]
  visible_B1S = (np.arange(S)[None, None, :] < np.asarray(lengths_B)[:, None, None])
  o_BTHD, lse_BTH = attention.attend_with_lse(q_BHD[:, None], k_BKSD.astype(jnp.float32),
                                              v_BKSD.astype(jnp.float32), jnp.asarray(visible_B1S))
  return np.asarray(o_BTHD[:, 0]), np.asarray(lse_BTH[:, 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K,G,D", [(3, 3, 64), (2, 1, 16), (1, 4, 20)])
def test_kernel_matches_jnp_reference(kernel, dtype, K, G, D):
  """Lengths at chunk edges (255, 256, 257 rows), an empty slot, a full cache and a length past
  the end (clamped), for GQA groups of 1-4 and head dims that are and are not multiples of 8."""
  S = 600
  lengths = np.array([0, 1, 255, 256, 257, 600, 700], np.int32)
  B = len(lengths)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, K * G, D)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, K, S, D)) * 2.0, dtype)
  v = jnp.asarray(rng.standard_normal((B, K, S, D)), dtype)
  o, lse = jax.jit(host_attention.decode_attend)(q, k, v, jnp.asarray(lengths))
  o_ref, lse_ref = _reference(q, k, v, np.minimum(lengths, S))
  np.testing.assert_allclose(np.asarray(o), o_ref, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), lse_ref, rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(o)[0] == 0) and np.all(np.isneginf(np.asarray(lse)[0]))


def test_kernel_ignores_rows_past_the_length():
  """Rows at and after a slot's length are never read: garbage (even NaN) there changes nothing."""
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 3, 64)), jnp.float32)
  k = rng.standard_normal((1, 1, 512, 64)).astype(np.float32)
  v = rng.standard_normal((1, 1, 512, 64)).astype(np.float32)
  want = host_attention.decode_attend(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray([300]))
  k[:, :, 300:], v[:, :, 300:] = np.nan, np.inf
  got = host_attention.decode_attend(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray([300]))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K,G,D", [(3, 3, 64), (1, 4, 20)])
def test_masked_kernel_matches_jnp_reference(kernel, dtype, K, G, D):
  """Any rows masked (MagicPIG's exact buffer: sink, window, then generated entries with unused
  ones between): random masks, a row with nothing valid, one valid row, all valid, and whole
  256-row chunks masked out next to valid ones. NaN K/V under the mask are never used."""
  S = 600
  rng = np.random.default_rng(3)
  valid = rng.random((6, S)) < 0.3
  valid[1] = False
  valid[2] = False
  valid[2, 417] = True
  valid[3] = True
  valid[4, :512] = False  # chunks 0 and 1 empty, chunk 2 partly valid
  valid[5, 256:] = False
  B = valid.shape[0]
  q = jnp.asarray(rng.standard_normal((B, K * G, D)), jnp.float32)
  k = rng.standard_normal((B, K, S, D)).astype(np.float32) * 2.0
  v = rng.standard_normal((B, K, S, D)).astype(np.float32)
  # (copies: jnp.asarray may alias a float32 numpy array, which is overwritten with NaN below)
  o_ref, lse_ref = attention.attend_with_lse(
      q[:, None], jnp.array(k, dtype).astype(jnp.float32), jnp.array(v, dtype).astype(jnp.float32),
      jnp.asarray(valid)[:, None])
  o_ref, lse_ref = np.asarray(o_ref), np.asarray(lse_ref)
  k[~valid[:, None, :, None].repeat(K, 1).repeat(D, 3)] = np.nan
  v[~valid[:, None, :, None].repeat(K, 1).repeat(D, 3)] = np.nan
  o, lse = jax.jit(host_attention.decode_attend_masked)(q, jnp.asarray(k, dtype),
                                                        jnp.asarray(v, dtype), jnp.asarray(valid))
  np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref[:, 0]), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref[:, 0]), rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(o)[1] == 0) and np.all(np.isneginf(np.asarray(lse)[1]))


def test_masked_kernel_checks_the_mask_shape():
  out = (jax.ShapeDtypeStruct((2, 6, 16), jnp.float32), jax.ShapeDtypeStruct((2, 6), jnp.float32))
  with pytest.raises(Exception, match="decode_attend_masked: valid must be int8 \\[2, 32\\]"):
    jax.block_until_ready(jax.ffi.ffi_call("pigjax_decode_attend_masked", out)(
        _Q, _KV, _KV, _LEN, np.ones((2, 31), np.int8)))


def _raw(q, k, v, lengths, o_shape=None):
  B, H, D = q.shape
  out = (jax.ShapeDtypeStruct(o_shape or (B, H, D), jnp.float32),
         jax.ShapeDtypeStruct((B, H), jnp.float32))
  return jax.ffi.ffi_call("pigjax_decode_attend", out)(q, k, v, lengths)


_Q = np.zeros((2, 6, 16), np.float32)
_KV = np.zeros((2, 3, 32, 16), np.float32)
_LEN = np.array([4, 5], np.int32)


@pytest.mark.parametrize("args,message", [
    (dict(q=_Q.astype(np.float16), k=_KV, v=_KV, lengths=_LEN), "q must be float32"),
    (dict(q=_Q, k=_KV.astype(np.int32), v=_KV, lengths=_LEN), "k must be float32 or bfloat16"),
    (dict(q=_Q, k=_KV, v=_KV.astype(jnp.bfloat16), lengths=_LEN), "v must have k's dtype"),
    (dict(q=_Q, k=_KV[0], v=_KV, lengths=_LEN), "k must have rank 4"),
    (dict(q=_Q, k=_KV[:, :, :, :8], v=_KV, lengths=_LEN), "head dim 16"),
    (dict(q=_Q[:, :5], k=_KV, v=_KV, lengths=_LEN), "multiple of k's 3 KV heads"),
    (dict(q=_Q, k=_KV, v=_KV[:, :, :16], lengths=_LEN), "v must have k's shape"),
    (dict(q=_Q, k=_KV, v=_KV, lengths=_LEN[:1]), "lengths must be int32 \\[2\\]"),
    (dict(q=_Q, k=_KV, v=_KV, lengths=_LEN, o_shape=(2, 6, 8)), "output o must be float32"),
])
def test_bad_operands_are_errors_that_name_them(args, message):
  with pytest.raises(Exception, match=message):
    jax.block_until_ready(_raw(**args))


def test_auto_picks_the_host_kernel_on_one_cpu_device(monkeypatch):
  def cfg(mesh=MeshConfig(), **attention):
    return Config(attention=AttentionConfig(**attention), mesh=mesh)
  use = host_attention.use_host_kernel
  assert use(cfg(kind="dense"))  # the test machine's default backend is the CPU
  assert not use(cfg(kind="dense", decode_kernel="xla"))
  assert not use(cfg(kind="dense", mesh=MeshConfig(data=2)))  # no shard_map wrapper yet
  with pytest.raises(ValueError, match="one device only"):
    use(cfg(decode_kernel="host", mesh=MeshConfig(model=2)))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not use(cfg(kind="dense"))
  assert use(cfg(kind="magicpig"))
  with pytest.raises(ValueError, match="decode_kernel must be one of"):
    use(cfg(decode_kernel="cuda"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_engine_greedy_output_equals_the_jnp_decode_path(dtype):
  """A tiny model decoding past a 256-row chunk edge: the host kernel and the blocked jnp path
  give the same greedy tokens and near-equal per-layer outputs."""
  cfg = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, max_position=512,
                    tie_embeddings=False)
  model = from_hf_tensors(cfg, tiny_llama_tensors(), dtype=dtype)
  prompts = [list(np.random.default_rng(0).integers(3, 300, 250)), [4, 8, 9]]
  sc = SamplingConfig(max_new_tokens=12)
  out = {}
  for kernel in ("host", "xla"):
    full = Config(checkpoint="", max_seq_len=320, prefill_chunk=64, model=cfg,
                  attention=AttentionConfig(decode_kernel=kernel))
    assert DenseBackend(full).decode_attend.keywords["host"] == (kernel == "host")
    out[kernel], _, _ = Engine(full, model).generate(prompts, sc)
  assert out["host"] == out["xla"]
