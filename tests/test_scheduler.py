"""Continuous batching without a socket: a request's tokens do not depend on its neighbours or on
when it joined, per-row sampling needs no recompilation, cancelled, timed-out and finished
requests free their rows, stop strings and limits end requests, a bounded queue refuses past its
bound, and MagicPIG placement picks the CPU."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tiny_checkpoint
from pigjax import placement, sampling
from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.pipeline import Pipeline
from pigjax.serving.batch import SlotBatch
from pigjax.serving.scheduler import (PromptTooLong, QueueFull, RequestParams, Scheduler,
                                     _safe_prefix)

SLOTS = 3
CACHE = 256


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
  d = tmp_path_factory.mktemp("tiny")
  tiny_checkpoint.write_tiny_llama(d, num_layers=3, max_position=1024)
  cfg = Config(checkpoint=str(d), max_seq_len=CACHE, prefill_chunk=32,
               attention=AttentionConfig(num_bits=4, num_tables=16, sink=4, window=16,
                                         dense_layers=(0,), generated_buffer=8,
                                         store_dtype="float32"))
  return Pipeline.load(cfg, progress=False)


def _cfg(pipe, kind):
  return dataclasses.replace(pipe.cfg, attention=dataclasses.replace(pipe.cfg.attention,
                                                                     kind=kind))


@pytest.fixture(scope="module", params=["dense", "magicpig"])
def sched(request, pipe):
  cfg = _cfg(pipe, request.param)
  return Scheduler(SlotBatch(cfg, pipe.model, SLOTS, CACHE), pipe.tokenizer, CACHE)


def prompt(n, seed=0):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def run(sched, prompts, params, stagger=0):
  """Submits the prompts (`stagger` scheduler steps apart), steps until idle; returns each
  request's generated ids and finish reason."""
  outs = {}
  ids = []
  for p, prm in zip(prompts, params):
    ids.append(sched.submit(p, prm, lambda o: outs.setdefault(o.request_id, []).append(o)))
    for _ in range(stagger):
      sched.step()
  sched.run_until_idle()
  return ([[t for o in outs[i] for t in o.token_ids] for i in ids],
          [outs[i][-1].finish_reason for i in ids])


PROMPTS = [prompt(90), prompt(7, 1), prompt(45, 2), prompt(30, 3), prompt(60, 4)]


def test_batched_and_staggered_equal_alone(sched):
  """More requests than rows (one waits), long prompts prefilled in chunks beside running rows,
  generated buffers that fill and move into the pool (MagicPIG): every request gets exactly the
  greedy tokens it gets alone."""
  greedy = [RequestParams(max_tokens=20)] * len(PROMPTS)
  alone = [run(sched, [p], greedy[:1])[0][0] for p in PROMPTS]
  together, reasons = run(sched, PROMPTS, greedy)
  staggered, _ = run(sched, PROMPTS, greedy, stagger=3)
  assert together == alone and staggered == alone
  assert set(reasons) <= {"length", "stop"} and "length" in reasons
  assert sched.num_running == 0 and sched.num_waiting == 0


def test_per_row_sampling_is_seeded_and_compiles_once(sched):
  """Rows with different sampling settings share one compiled step; a seeded request draws the
  same tokens alone and beside others, and new settings do not add programs."""
  hot = RequestParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=5)
  cool = RequestParams(max_tokens=12, temperature=0.7, min_p=0.05, repetition_penalty=1.3, seed=9)
  greedy = RequestParams(max_tokens=12)
  alone_hot = run(sched, [PROMPTS[1]], [hot])[0][0]
  alone_cool = run(sched, [PROMPTS[2]], [cool])[0][0]
  both, _ = run(sched, [PROMPTS[1], PROMPTS[2], PROMPTS[3]], [hot, cool, greedy], stagger=2)
  assert both[0] == alone_hot and both[1] == alone_cool
  assert run(sched, [PROMPTS[1]], [dataclasses.replace(hot, seed=6)])[0][0] != alone_hot
  programs = len(sched.batch.programs)
  other = RequestParams(max_tokens=12, temperature=0.3, top_k=7, top_p=0.5, min_p=0.1,
                        repetition_penalty=1.1, seed=1)
  run(sched, [PROMPTS[0], PROMPTS[4]], [other, hot])
  assert len(sched.batch.programs) == programs


def test_cancel_frees_the_row_for_a_waiting_request(sched):
  long = RequestParams(max_tokens=200, ignore_eos=True)
  outs = {}
  ids = [sched.submit(prompt(20, s), long, lambda o: outs.setdefault(o.request_id, []).append(o))
         for s in range(SLOTS + 1)]
  for _ in range(8):
    sched.step()
  assert sched.num_running == SLOTS and sched.num_waiting == 1
  sched.cancel(ids[0])
  for _ in range(4):
    sched.step()
  assert outs[ids[0]][-1].finish_reason == "cancelled"
  assert sched.num_running == SLOTS and sched.num_waiting == 0  # the waiting one got the row
  assert len(outs[ids[SLOTS]]) > 0
  for i in ids[1:]:
    sched.cancel(i)
  sched.run_until_idle()
  assert sched.num_running == 0
  assert all(outs[i][-1].finish_reason == "cancelled" for i in ids)


def test_stop_string_ends_and_is_never_sent(sched):
  tok = sched.tokenizer
  ids, _ = run(sched, [PROMPTS[3]], [RequestParams(max_tokens=16)])
  text = tok.decode(ids[0])
  stop = next(text[i:i + 2] for i in range(4, len(text) - 2)
              if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)
  outs = []
  sched.submit(PROMPTS[3], RequestParams(max_tokens=16, stop=(stop,)), outs.append)
  sched.run_until_idle()
  assert outs[-1].finish_reason == "stop"
  assert "".join(o.text for o in outs) == text[:text.find(stop)]


def test_limits_are_checked_before_work(sched):
  with pytest.raises(PromptTooLong, match="context is 256 tokens"):
    sched.submit(prompt(250), RequestParams(max_tokens=10), lambda o: None)
  with pytest.raises(ValueError, match="max_tokens"):
    sched.submit(prompt(5), RequestParams(max_tokens=0), lambda o: None)
  with pytest.raises(ValueError, match="temperature"):
    sched.submit(prompt(5), RequestParams(temperature=-1.0), lambda o: None)
  outs = []
  sched.submit(prompt(5), RequestParams(max_tokens=1), outs.append)
  sched.run_until_idle()
  assert outs[-1].finish_reason in ("length", "stop") and outs[-1].completion_tokens == 1


def test_safe_prefix_holds_back_partial_stops():
  assert _safe_prefix("hello wor", ["world"]) == "hello "
  assert _safe_prefix("hello", ["xyz"]) == "hello"
  assert _safe_prefix("ab\ufffd", []) == "ab"
  assert _safe_prefix("say END", ["ENDING", "D!"]) == "say "


def test_sample_rows_matches_per_row_sample():
  logits_BV = jax.random.normal(jax.random.key(0), (4, 64)) * 3
  rows = sampling.RowSampling.from_rows([
      SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0, top_k=1),
      SamplingConfig(temperature=0.8, top_p=0.5), SamplingConfig(temperature=1.2, min_p=0.2)])
  keys_B = sampling.row_keys(jnp.arange(4), jnp.zeros(4, jnp.int32))
  sample_rows = jax.jit(sampling.sample_rows, static_argnames=("penalize", "stochastic"))
  got = np.asarray(sample_rows(logits_BV, keys_B, rows, penalize=False))
  argmax = np.argmax(np.asarray(logits_BV), -1)
  assert got[0] == argmax[0] and got[1] == argmax[1]
  for b, kw in [(2, dict(temperature=0.8, top_p=0.5)), (3, dict(temperature=1.2, min_p=0.2))]:
    want = jax.jit(functools.partial(sampling.sample, **kw))(logits_BV[b:b + 1], keys_B[b])
    assert got[b] == int(want[0])
  greedy = sample_rows(logits_BV, keys_B, rows, penalize=False, stochastic=False)
  np.testing.assert_array_equal(greedy, argmax)


def test_host_store_platform_decision():
  assert placement.host_store_platform("magicpig", "gpu", ["cpu", "gpu"]) == "cpu"
  assert placement.host_store_platform("magicpig", "tpu", ["cpu", "tpu"]) == "cpu"
  assert placement.host_store_platform("magicpig", "cpu", ["cpu"]) is None
  assert placement.host_store_platform("dense", "gpu", ["cpu", "gpu"]) is None
  with pytest.raises(ValueError, match="CPU device"):
    placement.host_store_platform("magicpig", "gpu", ["gpu"])


def test_place_for_moves_magicpig_to_the_cpu_when_jax_defaults_elsewhere(monkeypatch, capsys):
  """As on a Colab GPU runtime: jax's default backend is not the CPU, so MagicPIG makes the CPU
  jax's default device (its host-store FFI handlers are CPU-only); dense changes nothing."""
  assert jax.config.jax_default_device is None
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  try:
    placement.place_for("dense")
    assert jax.config.jax_default_device is None
    placement.place_for("magicpig")
    assert jax.config.jax_default_device == jax.devices("cpu")[0]
    assert "runs on the CPU" in capsys.readouterr().err
  finally:
    jax.config.update("jax_default_device", None)


class _Unchecked(RequestParams):
  """Settings that skip `validate`, as a caller that forgot to validate would submit them."""

  def validate(self) -> None:
    pass


def _collecting():
  outs = {}
  return outs, lambda o: outs.setdefault(o.request_id, []).append(o)


def _finals(outs, rid):
  return [o for o in outs[rid] if o.finish_reason is not None]


def test_a_row_that_fails_admission_fails_alone(sched, monkeypatch):
  """A top_k past int32 (the operand it is copied into) fails in admission: that request ends
  with one error Output and its row is freed; the requests beside it get the tokens they get
  alone, and so does one admitted into the failed request's row afterwards."""
  greedy = RequestParams(max_tokens=20)
  alone = [run(sched, [p], [greedy])[0][0] for p in PROMPTS[:3]]
  outs, emit = _collecting()
  good = sched.submit(PROMPTS[0], greedy, emit)
  for _ in range(2):
    sched.step()
  bad = sched.submit(PROMPTS[1], _Unchecked(max_tokens=20, temperature=0.5, top_k=2**31), emit)
  later = sched.submit(PROMPTS[2], greedy, emit)
  sched.run_until_idle()
  [final] = _finals(outs, bad)
  assert final.finish_reason == "error" and "OverflowError" in final.error
  for rid, want in [(good, alone[0]), (later, alone[2])]:
    assert [f.finish_reason for f in _finals(outs, rid)] == ["length"]
    assert [t for o in outs[rid] for t in o.token_ids] == want
  assert sched.num_running == 0 and sched.num_waiting == 0
  with pytest.raises(ValueError, match="top_k"):  # validated submits never get that far
    sched.submit(PROMPTS[1], RequestParams(top_k=2**31), emit)


@pytest.mark.parametrize("stage", ["prefill_chunk", "admit"])
def test_an_exception_in_one_prefill_or_admission_ends_only_that_request(sched, monkeypatch,
                                                                          stage):
  greedy = RequestParams(max_tokens=16)
  alone = run(sched, [PROMPTS[3]], [greedy])[0][0]
  real = getattr(sched.batch, stage)

  def flaky(p, *args):
    if p.prompt_ids == PROMPTS[4]:
      raise RuntimeError("injected fault")
    return real(p, *args)

  monkeypatch.setattr(sched.batch, stage, flaky)
  outs, emit = _collecting()
  good = sched.submit(PROMPTS[3], greedy, emit)
  sched.step()
  bad = sched.submit(PROMPTS[4], greedy, emit)
  sched.run_until_idle()
  assert [(f.finish_reason, f.error) for f in _finals(outs, bad)] == [
      ("error", "RuntimeError: injected fault")]
  assert [f.finish_reason for f in _finals(outs, good)] == ["length"]
  assert [t for o in outs[good] for t in o.token_ids] == alone
  assert sched.num_running == 0 and sched.num_waiting == 0


def test_a_failed_decode_step_ends_every_running_row_and_serving_goes_on(sched, monkeypatch):
  """The shared step failing ends each running request with one error Output (none is left
  hanging); the request being prefilled meanwhile, and later ones, decode as they do alone on
  the rebuilt running cache."""
  greedy = RequestParams(max_tokens=12)
  alone = run(sched, [PROMPTS[0]], [greedy])[0][0]
  real = sched.batch.step
  calls = []

  def fails_once(*args):
    calls.append(1)
    if len(calls) == 4:
      raise RuntimeError("injected decode fault")
    return real(*args)

  monkeypatch.setattr(sched.batch, "step", fails_once)
  outs, emit = _collecting()
  running = [sched.submit(PROMPTS[i], greedy, emit) for i in (1, 2)]
  while sched.num_running < 2:
    sched.step()
  prefilling = sched.submit(PROMPTS[0], greedy, emit)  # 90 tokens: 3 chunks, across the fault
  sched.run_until_idle()
  for rid in running:
    assert [(f.finish_reason, f.error) for f in _finals(outs, rid)] == [
        ("error", "RuntimeError: injected decode fault")]
  assert [t for o in outs[prefilling] for t in o.token_ids] == alone
  assert run(sched, [PROMPTS[0]], [greedy])[0][0] == alone
  assert sched.num_running == 0 and sched.num_waiting == 0


def test_a_deadline_ends_a_request_wherever_it_is_and_frees_its_row(sched):
  """Past its deadline a request ends with finish_reason "timeout" (one final Output, no token
  sent twice) whether it was decoding, being prefilled or waiting; its row is free at once and
  the requests without a deadline get the tokens they get alone."""
  greedy = RequestParams(max_tokens=12)
  alone = run(sched, [PROMPTS[2]], [greedy])[0][0]
  long = RequestParams(max_tokens=200, ignore_eos=True)
  outs, emit = _collecting()
  deadline = time.monotonic() + 3600
  decoding = [sched.submit(prompt(20, s), long, emit, deadline=deadline) for s in range(SLOTS)]
  waiting = sched.submit(prompt(20, 9), long, emit, deadline=deadline)
  for _ in range(8):
    sched.step()
  assert sched.num_running == SLOTS and sched.num_waiting == 1
  # Move the deadlines into the past (the requests hold them as given to submit).
  for req in [r for r in sched._rows if r is not None] + list(sched._waiting):
    req.deadline = time.monotonic() - 1
  good = sched.submit(PROMPTS[2], greedy, emit)
  sched.step()
  for rid in decoding + [waiting]:
    [final] = _finals(outs, rid)
    assert final.finish_reason == "timeout" and final.token_ids == []
    sent = [t for o in outs[rid] for t in o.token_ids]
    assert len(sent) == final.completion_tokens
  assert len(outs[waiting]) == 1 and outs[waiting][0].completion_tokens == 0
  assert sched.num_running == 0  # every row freed in that one step; `good` is being prefilled
  sched.run_until_idle()
  assert [t for o in outs[good] for t in o.token_ids] == alone
  # A deadline that passes while its request is being prefilled (90 tokens: 3 chunks).
  late = sched.submit(PROMPTS[0], greedy, emit, deadline=time.monotonic() + 3600)
  sched.step()
  assert sched._prefill is not None and sched._prefill[0].id == late
  sched._prefill[0].deadline = time.monotonic() - 1
  sched.step()
  assert [f.finish_reason for f in _finals(outs, late)] == ["timeout"]
  assert sched.num_running == 0 and sched.num_waiting == 0 and not sched.has_work()
  with pytest.raises(ValueError, match="deadline"):
    sched.submit(PROMPTS[0], greedy, emit, deadline=float("nan"))


def test_a_bounded_queue_refuses_past_max_waiting_and_accepts_again(sched):
  bounded = Scheduler(sched.batch, sched.tokenizer, CACHE, max_waiting=2)
  outs, emit = _collecting()
  ids = [bounded.submit(prompt(5, s), RequestParams(max_tokens=2), emit) for s in range(2)]
  with pytest.raises(QueueFull, match="max_waiting"):
    bounded.submit(prompt(5, 7), RequestParams(max_tokens=2), emit)
  bounded.step()  # one leaves the queue for its prefill: room for one more
  ids.append(bounded.submit(prompt(5, 7), RequestParams(max_tokens=2), emit))
  bounded.run_until_idle()
  assert all(_finals(outs, i)[0].finish_reason in ("length", "stop") for i in ids)
  assert bounded.num_running == 0 and bounded.num_waiting == 0
