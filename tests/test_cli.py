"""End to end on a tiny random Hugging Face checkpoint: the CLI, config overrides, Orbax, errors."""

import dataclasses
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
  out = subprocess.run([sys.executable, "-m", "pigjax.generate", *args], cwd=REPO,
                       capture_output=True, text=True)
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
