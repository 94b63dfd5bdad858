"""tools.soak (scripts/soak.py's library): the /proc parser, a short recorded MagicPIG run with
evictions, and the token-for-token check against the pure-jnp reference."""

import numpy as np
import pytest

import tiny_checkpoint
from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.engine import Engine
from pigjax.magicpig import MagicPigBackend
from pigjax.pipeline import Pipeline
from tools import soak


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny_soak")
  tiny_checkpoint.write_tiny_llama(d, num_layers=2, max_position=1024)
  cfg = Config(checkpoint=str(d), max_seq_len=1024, prefill_chunk=64,
               attention=AttentionConfig(kind="magicpig", num_bits=4, num_tables=16, sink=4,
                                         window=16, dense_layers=(0,), generated_buffer=8))
  return Pipeline.load(cfg, progress=False)


def test_read_memory(tmp_path):
  status = tmp_path / "status"
  status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t   1024 kB\nThreads:\t3\n")
  assert soak.read_memory(str(status)) == {"rss": 1024 * 1024, "hwm": 2048 * 1024}
  status.write_text("Name:\tpython\nVmRSS:\t 1024 kB\n")
  with pytest.raises(ValueError, match="VmRSS/VmHWM"):
    soak.read_memory(str(status))
  mem = soak.read_memory()  # this process
  assert 0 < mem["rss"] <= mem["hwm"]


def test_recorded_run_samples_every_n_steps(tiny):
  """21 tokens = 20 decode steps with an 8-token buffer: evictions of 4 after steps 8, 12, 16
  and 20; samples at steps 0, 5, 10, 15, 20 see the pool grow by exactly those."""
  prompt = list(np.random.default_rng(0).integers(3, 250, 100))
  seen = []
  samples, ids, summary = soak.soak(tiny.cfg, tiny.model, prompt, 21, 5, seen.append)
  assert len(ids) == 21 and seen == samples
  assert [s.step for s in samples] == [0, 5, 10, 15, 20]
  pool0 = 100 - 4 - 16
  assert [s.pool_tokens for s in samples] == [pool0, pool0, pool0 + 4, pool0 + 8, pool0 + 16]
  assert all(0 < s.attended <= 1 for s in samples[1:]) and all(s.store_mb > 0 for s in samples)
  # Per pool token, 1 sparse layer x 2 KV heads x (a row of int8 K and V of 16 dims, a float32
  # scale for each row, and a 16-bit id in each of 16 tables).
  assert tiny.cfg.attention.store_dtype == "int8"
  per_token = 1 * 2 * (2 * 16 + 2 * 4 + 2 * 16)
  assert [s.pool_mb for s in samples] == [s.pool_tokens * per_token / soak.MB for s in samples]
  # Recording changes neither the tokens nor the run's attended fraction.
  plain = Engine(tiny.cfg, tiny.model, MagicPigBackend(tiny.cfg))
  want, _, stats = plain.generate([prompt], SamplingConfig(max_new_tokens=21))
  assert ids == want[0]
  assert summary["pool_fraction"] == pytest.approx(stats.extra["pool_fraction"], rel=1e-5)
  growth = soak.growth_after(samples, 10)
  assert growth["from_step"] == 10 and growth["to_step"] == 20


@pytest.mark.slow  # five decodes; tests/test_eval.py checks the same reference quickly
def test_compare_with_reference_over_evictions(tiny):
  prompt = list(np.random.default_rng(1).integers(3, 250, 120))
  out = soak.compare_with_reference(tiny.cfg, tiny.model, prompt, 30)
  assert out["evictions"] == 6  # 29 steps: after steps 8, 12, ..., 28
  assert out["first_mismatch"] is None
  assert out["ffi"]["pool_fraction"] == pytest.approx(out["reference"]["pool_fraction"], rel=1e-6)
  tf = out["teacher_forced"]
  assert tf["steps"] == 29 and tf["top1_disagreements"] == []
  assert tf["max_abs_logprob_diff"] < 2e-4
  assert tf["pool_fraction"]["ffi"] == pytest.approx(tf["pool_fraction"]["reference"], rel=1e-6)
