"""Sharding on a device mesh and multi-process runs (docs/scaling.md).

The number of CPU devices is fixed when jax starts, and this pytest process started it with one:
the mesh runs happen in subprocesses (tests/sharding_worker.py, and `python -m pigjax.generate`
under jax.distributed on a free localhost port), each with a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pigjax import multihost, pipeline, sharding
from pigjax.config import Config, MeshConfig, ModelConfig

import reference
from tiny_checkpoint import write_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharding_worker.py"
TIMEOUT_S = 420  # generous: the machine that runs CI may be shared


def _env() -> dict:
  env = dict(os.environ)
  for name in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", multihost.ENV_COORDINATOR,
               multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
    env.pop(name, None)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _worker(tmp_path, *args) -> dict:
  out = tmp_path / "result.json"
  proc = subprocess.run([sys.executable, str(WORKER), *args, "--out", str(out)], cwd=tmp_path,
                        env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
  """A tiny checkpoint with 4 KV heads (8 query heads), so the model axis can split them."""
  path = tmp_path_factory.mktemp("tiny4")
  write_tiny_llama(path, num_layers=2, heads=8, kv_heads=4, max_position=1024)
  return path


def test_2x2_mesh_gives_the_one_device_tokens_dense_and_magicpig(tiny4, tmp_path):
  r = _worker(tmp_path, "--devices", "4", "--checkpoint", str(tiny4), "--meshes", "1x1,2x2",
              "--kinds", "dense,magicpig")
  for kind in ("dense", "magicpig"):
    one, mesh = r["ids"][kind]["1x1"], r["ids"][kind]["2x2"]
    assert len(one) == 4 and all(len(ids) == 12 for ids in one)
    assert mesh == one, kind
  # MagicPIG's answer differs from dense (the pool is sampled), so the magicpig runs did use it.
  assert r["ids"]["magicpig"]["1x1"] != r["ids"]["dense"]["1x1"]
  # Each device's FFI attend returns [B / data, H / model, D] = [2, 4, 16]: it saw only its own
  # rows and heads, nothing gathered.
  calls = r["attend_operands"]["2x2"]
  assert len(calls) == 1  # one sparse layer
  assert calls[0][:2] == ["f32[2,4,16]", "f32[2,4]"]


def test_smollm2_on_a_data_axis_of_2_gives_the_reference_tokens(tmp_path):
  # Two chat prompts whose greedy continuations transformers computed (tests/data/reference);
  # tests/test_model.py checks that one device gives them.
  ref = reference.load("smollm2_135m_transformers.json")
  prompts = tmp_path / "prompts.json"
  prompts.write_text(json.dumps([ref["chat_prompt_ids"], ref["chat2_prompt_ids"]]))
  n = len(ref["greedy_new_ids"]) - 1  # the last reference token is the stop token
  r = _worker(tmp_path, "--devices", "2", "--checkpoint", "smollm2", "--meshes", "2x1",
              "--kinds", "dense", "--prompts_json", str(prompts), "--max_new_tokens", str(n))
  assert r["ids"]["dense"]["2x1"] == [ref["greedy_new_ids"][:n], ref["chat2_greedy_new_ids"][:n]]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_give_the_one_process_output(tiny4, tmp_path):
  args = [sys.executable, "-m", "pigjax.generate", "--config", str(ROOT / "configs/tiny.py"),
          f"--config.checkpoint={tiny4}", "--config.weights=dense",
          "--config.attention.kind=magicpig", "--config.attention.num_bits=4",
          "--config.attention.num_tables=8", "--config.attention.window=8",
          "--config.attention.dense_layers=(0,)", "--config.attention.generated_buffer=4",
          "--config.sampling.max_new_tokens=8", "--compilation_cache=",
          "--prompt", "The first prompt, long enough to fill a pool.", "--prompt", "Second",
          "--prompt", "A third one, also longer than sink and window.", "--prompt", "Fourth!"]
  port = _free_port()
  run = lambda extra: subprocess.Popen(args + extra, cwd=ROOT, env=_env(), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  procs = [run([f"--coordinator_address=localhost:{port}", "--num_processes=2",
                f"--process_id={i}"]) for i in range(2)]
  single = run([])
  outs = []
  try:
    for p in [*procs, single]:
      outs.append(p.communicate(timeout=TIMEOUT_S))
  finally:
    for p in [*procs, single]:
      p.kill()
  for p, (_, err) in zip([*procs, single], outs):
    assert p.returncode == 0, err[-4000:]
  rows = lambda text: [line for line in text.splitlines() if line.startswith("--- [")]
  want = rows(outs[2][0])
  assert len(want) == 4
  assert rows(outs[0][0]) == want  # process 0 prints every process's rows
  assert rows(outs[1][0]) == []  # the others print nothing
  assert "magicpig attention" in outs[0][1]


# -- fast checks in this process ---------------------------------------------------------------


def test_mesh_settings_are_checked():
  m = ModelConfig(num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
  with pytest.raises(ValueError, match="mesh.model=2 must divide the model's num_kv_heads=3"):
    sharding.validate_mesh(MeshConfig(data=1, model=2), m)
  with pytest.raises(ValueError, match="must be >= 1"):
    sharding.validate_mesh(MeshConfig(data=0, model=1))
  with pytest.raises(ValueError, match="= 4 devices, but jax has 1"):
    sharding.validate_mesh(MeshConfig(data=2, model=2), None, 1)
  # This process has one device: a 2 x 2 mesh names the fix.
  with pytest.raises(ValueError, match="JAX_NUM_CPU_DEVICES"):
    sharding.Sharding.create(MeshConfig(data=2, model=2), None)
  assert not sharding.Sharding.create(MeshConfig(), None).active


def test_quantized_weights_are_refused_on_a_mesh_and_auto_becomes_dense():
  cfg = Config(mesh=MeshConfig(data=2, model=1))
  assert pipeline.resolve_weights(cfg) == "dense"
  with pytest.raises(ValueError, match="weights='q8_0' is not supported on a device mesh"):
    pipeline.resolve_weights(Config(weights="q8_0", mesh=MeshConfig(data=1, model=2)))
  assert pipeline.resolve_weights(Config(weights="q8_0")) == "q8_0"  # one device: unchanged


def test_multihost_settings(monkeypatch):
  for name in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
    monkeypatch.delenv(name, raising=False)
  assert multihost.initialize() is False  # nothing given: a single-process run
  with pytest.raises(ValueError, match="needs all of the coordinator address"):
    multihost.initialize("localhost:1234")
  monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES='two' is not an integer"):
    multihost.initialize("localhost:1234")
  with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes\)"):
    multihost.initialize("localhost:1234", num_processes=2, process_id=2)
  # One process: its share is everything, and gathering returns its own rows.
  assert multihost.split(["a", "b", "c"]) == ["a", "b", "c"]
  assert multihost.gather_strings(["x", "é", ""]) == ["x", "é", ""]
  assert multihost.global_max(7) == 7 and multihost.all_true(True)
  assert not multihost.all_true(False)


def test_serving_refuses_a_mesh():
  from pigjax.serving.batch import SlotBatch
  cfg = Config(mesh=MeshConfig(data=2, model=1))
  with pytest.raises(ValueError, match="Serving runs on one device"):
    SlotBatch(cfg, None, slots=2, cache_len=64)


def test_proxy_estimator_is_refused_on_a_mesh():
  from pigjax.config import AttentionConfig
  cfg = Config(mesh=MeshConfig(data=2, model=1),
               attention=AttentionConfig(kind="magicpig", estimator="proxy"))
  with pytest.raises(ValueError, match="estimator='proxy' runs on one device"):
    pipeline.make_backend(cfg)
