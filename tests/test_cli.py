"""End to end on a tiny random Hugging Face checkpoint: the CLI, config overrides, Orbax, errors."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tiny_checkpoint
from pigjax import config
from pigjax.config import Config, SamplingConfig
from pigjax.pipeline import Pipeline

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args, check=True):
  # Without JAX_PLATFORMS, as users run it: jax probes every backend at start.
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-m", "pigjax.generate", *args], cwd=REPO,
                       capture_output=True, text=True, env=env)
  if check and out.returncode != 0:
    raise AssertionError(out.stderr[-3000:])
  return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  tiny_checkpoint.write_tiny_llama(
      d, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
  return d


def test_cli_generates_and_reports(tiny_dir):
  out = run_cli("--config=configs/tiny.py", f"--config.checkpoint={tiny_dir}", "--prompt=hello",
                "--chat", "--config.sampling.max_new_tokens=6")
  assert "[pigjax] dense attention | prompt" in out.stderr
  assert "tokens/s" in out.stderr and "time to first token" in out.stderr
  # absl logs jax's backend probing at INFO ("Unable to initialize backend 'tpu'") unless quieted.
  assert "Unable to initialize backend" not in out.stderr and "xla_bridge" not in out.stderr


def test_cli_rejects_bad_input(tiny_dir):
  out = run_cli("--config=configs/tiny.py", f"--config.checkpoint={tiny_dir}", "--prompt=x",
                "--config.sampling.temperature=-1", check=False)
  assert out.returncode != 0 and "temperature" in out.stderr
  out = run_cli("--config=configs/tiny.py", "--config.checkpoint=/nonexistent/ckpt", "--prompt=x",
                check=False)
  assert out.returncode != 0 and "/nonexistent/ckpt" in out.stderr
  out = run_cli("--config=configs/tiny.py", "--config.attention.no_such_key=3", "--prompt=x",
                check=False)
  assert out.returncode != 0 and "no_such_key" in out.stderr
  out = run_cli("--config=configs/llama31_8b.py", "--prompt=x", check=False)
  assert out.returncode != 0 and "config.checkpoint is empty" in out.stderr


def test_unknown_config_key_is_named():
  d = config.to_config_dict(Config()).to_dict()
  d["sampling"]["temprature"] = 0.5
  with pytest.raises(ValueError, match="temprature"):
    config.from_config_dict(d)


def test_mistyped_override_without_config_file_is_one_line():
  # ml_collections reads the overrides when --config is defined (at import), against the
  # default config file: the key must be checked before that, not only in parse_flags.
  out = run_cli("--config.mesh.dat=2", "--prompt", "hi", check=False)
  assert out.returncode == 2, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert out.stderr.strip().splitlines()[-1] == (
      "pigjax: error: Unknown config key 'dat' in --config.mesh.dat; the keys of config.mesh "
      "are: data, model.")


def test_orbax_round_trip_generates_the_same(tiny_dir, tmp_path):
  subprocess.run([sys.executable, str(REPO / "scripts" / "convert_checkpoint.py"),
                  f"--input={tiny_dir}", f"--output={tmp_path / 'ox'}"], check=True,
                 capture_output=True)
  sc = SamplingConfig(max_new_tokens=8)
  hf = Pipeline.load(Config(checkpoint=str(tiny_dir), max_seq_len=256), progress=False)
  ox = Pipeline.load(Config(checkpoint=str(tmp_path / "ox"), max_seq_len=256), progress=False)
  assert ox.cfg.model == hf.cfg.model and ox.cfg.model.rope_scaling_factor == 8.0
  a, _ = hf.generate(["abc", "a longer prompt"], sampling_cfg=sc)
  b, _ = ox.generate(["abc", "a longer prompt"], sampling_cfg=sc)
  assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_sampling_is_seeded_and_bf16_runs(tiny_dir):
  pipe = Pipeline.load(Config(checkpoint=str(tiny_dir), max_seq_len=256), progress=False)
  sc = SamplingConfig(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=10, seed=3)
  a, _ = pipe.generate(["hi"], sampling_cfg=sc)
  b, _ = pipe.generate(["hi"], sampling_cfg=sc)
  c, _ = pipe.generate(["hi"], sampling_cfg=dataclasses.replace(sc, seed=4))
  assert a[0].token_ids == b[0].token_ids
  assert a[0].token_ids != c[0].token_ids  # 10 draws from a near-uniform random model
  bf = Pipeline.load(Config(checkpoint=str(tiny_dir), max_seq_len=256, dtype="bfloat16"),
                     progress=False)
  r, stats = bf.generate(["hi"], sampling_cfg=SamplingConfig(max_new_tokens=4))
  assert stats.generated_tokens >= 1 and np.all(np.array(r[0].token_ids) < 300)


# ------------------------------------------------------------------------------------------------
# Tuple overrides, and user errors as one line.


def _parse_overrides(*overrides):
  """The CLI's own parsing: absl + ml_collections' config_file flag, then from_config_dict."""
  from absl import flags
  from ml_collections import config_flags
  fv = flags.FlagValues()
  argv = ["prog", f"--config={REPO / 'configs' / 'tiny.py'}", *overrides]
  config_flags.DEFINE_config_file("config", "configs/tiny.py", flag_values=fv, sys_argv=argv)
  fv(argv)
  return config.from_config_dict(fv.config)


def test_every_field_including_tuples_can_be_overridden_from_flags():
  cfg = _parse_overrides("--config.attention.dense_layers=(0,8)",
                         "--config.sampling.stop_strings=('\\n\\n', 'END')",
                         "--config.model.eos_token_ids=(2,3)", "--config.attention.window=4",
                         "--config.sampling.temperature=0.5", "--config.attention.per_layer_hash=False")
  assert cfg.attention.dense_layers == (0, 8)
  assert cfg.sampling.stop_strings == ("\n\n", "END")
  assert cfg.model.eos_token_ids == (2, 3)
  assert (cfg.attention.window, cfg.sampling.temperature) == (4, 0.5)
  assert cfg.attention.per_layer_hash is False
  assert _parse_overrides("--config.attention.dense_layers=()").attention.dense_layers == ()
  assert _parse_overrides("--config.sampling.stop_strings=END").sampling.stop_strings == ("END",)
  # Every leaf of every section goes through the same parser.
  defaults = config.to_config_dict(Config())
  for section in ("model", "attention", "sampling"):
    for name, value in defaults[section].items():
      if isinstance(value, tuple):
        flag = f"--config.{section}.{name}={value!r}"
      else:
        flag = f"--config.{section}.{name}={value}"
      assert getattr(getattr(_parse_overrides(flag), section), name) == value, flag
  with pytest.raises(ValueError, match=r"dense_layers must be a tuple of int"):
    _parse_overrides("--config.attention.dense_layers=(0,'x')")


@pytest.fixture(scope="module")
def tokenizer_only_dir(tiny_dir, tmp_path_factory):
  """The tiny checkpoint with unreadable weights: any error about a prompt that reaches the user
  from here was raised before the weights were loaded."""
  d = tmp_path_factory.mktemp("noweights")
  for f in tiny_dir.iterdir():
    if f.is_file():
      (d / f.name).write_bytes(f.read_bytes())
  (d / "model.safetensors").write_bytes(b"not a safetensors file")
  return d


def _one_line_error(out):
  lines = [l for l in out.stderr.splitlines() if l.startswith("pigjax: error: ")]
  assert out.returncode == 2 and "Traceback" not in out.stderr and len(lines) == 1, out.stderr
  return lines[0]


def test_cli_user_errors_are_one_line_and_checked_before_loading(tiny_dir, tokenizer_only_dir):
  ck = f"--config.checkpoint={tokenizer_only_dir}"
  line = _one_line_error(run_cli("--config=configs/tiny.py", ck, "--prompt=x", "--config.foo=1",
                                 check=False))
  assert "Unknown config key 'foo'" in line and "max_seq_len, mesh, model, prefill_chunk" in line
  # The weights here are unreadable: the prompt is checked before they are loaded.
  line = _one_line_error(run_cli("--config=configs/tiny.py", ck, "--prompt=", check=False))
  assert "Prompt 0 is empty" in line
  # A tuple override reaches the model: layer 5 does not exist in the 2-layer checkpoint.
  line = _one_line_error(run_cli("--config=configs/tiny.py", f"--config.checkpoint={tiny_dir}",
                                 "--prompt=x", "--config.attention.kind=magicpig",
                                 "--config.attention.dense_layers=(0,5)", check=False))
  assert "dense_layers [5] out of range for a 2-layer model" in line
  # --debug keeps the traceback for bug reports.
  out = run_cli("--config=configs/tiny.py", ck, "--prompt=x", "--config.max_seq_len=1", "--debug",
                check=False)
  assert out.returncode != 0 and "Traceback" in out.stderr and "max_seq_len=1" in out.stderr


def test_user_error_messages_name_the_value_and_the_limit(tokenizer_only_dir, tmp_path):
  """The checks the CLI runs before loading weights, called as it calls them."""
  from pigjax import cli, pipeline
  with pytest.raises(ValueError, match=r"max_seq_len=1 is too small: .* at least 2"):
    pipeline.validate(Config(max_seq_len=1))
  bad = tmp_path / "latin1.txt"
  bad.write_bytes("caf\xe9".encode("latin-1"))
  with pytest.raises(ValueError, match=rf"--prompt_file {bad} is not UTF-8 text \(byte 0xe9 at "
                     r"offset 3\)"):
    cli.read_prompt_file(str(bad))
  with pytest.raises(ValueError, match=rf"Cannot read --prompt_file {tmp_path}/missing.txt"):
    cli.read_prompt_file(str(tmp_path / "missing.txt"))
  tok = pipeline.load_tokenizer(str(tokenizer_only_dir))
  ids = [pipeline.encode_prompt(tok, "hello " * 40)]
  with pytest.raises(ValueError, match=rf"Prompt 0 has {len(ids[0])} tokens; with max_new_tokens=8 "
                     rf"it needs {len(ids[0]) + 8} positions, above the context limit of 64 tokens "
                     r"\(config max_seq_len=64\)"):
    pipeline.check_prompt_lengths(ids, 8, 64)
  with pytest.raises(ValueError, match=r"Prompt 1 is empty"):
    pipeline.check_prompt_lengths([[1], []], 8, 64)
  with pytest.raises(ValueError, match=r"the model's max_position=32"):
    pipeline.check_prompt_lengths([[1] * 30], 8, 64, max_position=32)
  pipeline.check_prompt_lengths([[1] * 56], 8, 64)  # exactly fits
