"""The quality evaluation loop: methods x tasks x lengths x protocols, resumable, JSON out.

For each length, a batch of examples is prefilled densely once per example kind (real text for
copy / ppl / error, a needle haystack for passkey); every method then starts from a copy of that
cache. Methods run in order dense, magicpig (each budget), magicpig_ffi, then topk and quest with
budgets matched to magicpig's *measured* attended fraction at that length (measured on the first
task of the first group), then streaming. Records are keyed by (task, protocol, length, example,
method); a method whose records all exist is skipped, so an interrupted run continues.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pigjax.config import Config
from pigjax.eval import policies, tasks
from pigjax.eval.runner import Runner
from pigjax.magicpig import MagicPigBackend

BUDGETED = ("magicpig", "magicpig_ffi", "topk", "proxy", "quest")
ORDER = ("dense", "magicpig", "magicpig_ffi", "topk", "proxy", "quest", "streaming")
TASKS = ("copy", "ppl", "passkey", "multikey", "error")


@dataclasses.dataclass(frozen=True)
class Method:
  kind: str  # one of ORDER
  budget: tuple[int, int] | None = None  # (num_bits, num_tables) it runs at or is matched to

  @property
  def name(self) -> str:
    if self.budget is None:
      return self.kind
    b = f"({self.budget[0]},{self.budget[1]})"
    return f"{self.kind}{b}" if self.kind.startswith("magicpig") else f"{self.kind}~{b}"


def expand_methods(kinds, budgets, ffi_budgets) -> list[Method]:
  bad = [k for k in kinds if k not in ORDER]
  if bad:
    raise ValueError(f"Unknown method(s) {bad}; use some of {ORDER}.")
  out = []
  for kind in ORDER:
    if kind not in kinds:
      continue
    if kind == "magicpig_ffi":
      out += [Method(kind, b) for b in ffi_budgets]
    elif kind in BUDGETED:
      out += [Method(kind, b) for b in budgets]
    else:
      out.append(Method(kind))
  return out


class Harness:

  def __init__(self, cfg: Config, model, tokenizer, docs: list[str], out_dir: Path, *,
               seed: int = 0, span: int = 32, error_tokens: int = 16, free_tokens: int = 8,
               progress: bool = True):
    self.cfg, self.tok, self.docs = cfg, tokenizer, docs
    self.runner = Runner(cfg, model)
    self.seed, self.span, self.error_tokens, self.free_tokens = seed, span, error_tokens, free_tokens
    self.progress = progress
    self.out_dir = Path(out_dir)
    self.out_dir.mkdir(parents=True, exist_ok=True)
    self.path = self.out_dir / "results.json"
    self.results = (json.loads(self.path.read_text()) if self.path.exists()
                    else {"records": [], "budgets": {}, "runs": []})
    self._done = {self._key(r) for r in self.results["records"]}
    self._backends: dict = {}

  @staticmethod
  def _key(r) -> tuple:
    return (r["task"], r["protocol"], r["length"], r["example"], r["method"])

  def _save(self) -> None:
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.results, indent=1))
    os.replace(tmp, self.path)

  def _add(self, records: list[dict]) -> None:
    for r in records:
      if self._key(r) not in self._done:
        self.results["records"].append(r)
        self._done.add(self._key(r))

  # -- backends -----------------------------------------------------------------------------

  def _attention_cfg(self, budget) -> Config:
    a = self.cfg.attention
    if budget is not None:
      a = dataclasses.replace(a, num_bits=budget[0], num_tables=budget[1])
    return dataclasses.replace(self.cfg, attention=a)

  def backend(self, m: Method, length: int):
    if m.kind == "magicpig_ffi":
      key = (m.kind, m.budget)
      if key not in self._backends:
        cfg = self._attention_cfg(m.budget)
        self._backends[key] = MagicPigBackend(dataclasses.replace(
            cfg, attention=dataclasses.replace(cfg.attention, kind="magicpig")))
      return self._backends[key]
    kw = {}
    if m.kind in ("topk", "proxy", "quest"):
      # topk and proxy read exactly as many pool rows as magicpig's measured fraction.
      b = self.results["budgets"][str(length)][f"{m.budget[0]},{m.budget[1]}"]
      kw = {"n_pages": b["n_pages"]} if m.kind == "quest" else {"k_keep": b["k_keep"]}
    key = (m.kind, m.budget, tuple(kw.items()))
    if key not in self._backends:
      policy = "magicpig" if m.kind == "magicpig" else m.kind
      self._backends[key] = policies.PoolPolicyBackend(self._attention_cfg(m.budget), policy, **kw)
    return self._backends[key]

  def _fraction(self, backend, cache) -> float:
    return backend.stats(cache).get("pool_fraction", 0.0)

  def _match_budget(self, length: int, m: Method, fraction: float, pool: int, on: str) -> None:
    b = self.results["budgets"].setdefault(str(length), {})
    name = f"{m.budget[0]},{m.budget[1]}"
    if name in b:
      return
    k = max(1, int(round(fraction * pool)))
    b[name] = {"fraction": fraction, "pool": pool, "k_keep": k,
               "n_pages": max(1, int(round(k / policies.PAGE))), "measured_on": on}

  # -- the loop -----------------------------------------------------------------------------

  def run(self, methods: list[Method], lengths, task_names, examples: int,
          batch: int = 0) -> dict:
    """Runs every method on `examples` examples per task and length, in batches of at most
    `batch` examples (0: all in one). Example e is the same whatever the batching (its text and
    needles come from the seed, the length and e alone), so a long context that does not fit in
    memory as one batch can run as several."""
    bad = [t for t in task_names if t not in TASKS]
    if bad:
      raise ValueError(f"Unknown task(s) {bad}; use some of {TASKS}.")
    if batch < 0:
      raise ValueError(f"batch must be >= 0 (0: one batch), got {batch}.")
    size = batch or max(1, examples)
    chunks = [range(s, min(examples, s + size)) for s in range(0, examples, size)]
    t_start = time.time()
    for length in lengths:
      for ex in chunks:
        if {"copy", "ppl", "error"} & set(task_names):
          self._doc_group(methods, length, task_names, ex)
        for task in ("passkey", "multikey"):
          if task in task_names:
            self._passkey_group(methods, length, ex, task)
    self.results["runs"].append({"seconds": round(time.time() - t_start, 1)})
    self._save()
    return self.results

  def _jobs_missing(self, jobs, length, ex: range, method) -> list:
    return [j for j in jobs if any(
        (j[0], j[1], length, e, method.name) not in self._done for e in ex)]

  def _todo(self, methods, length, ex: range, jobs) -> list[Method]:
    return [m for m in methods if self._jobs_missing(
        [j for j in jobs if m.kind not in j[2]], length, ex, m)]

  def _methods_loop(self, methods, length, ex: range, jobs, run_job, desc):
    """Runs run_job(method, job, dense_lp) -> records for every method missing records of the
    examples `ex` (one batch)."""
    from tqdm import tqdm
    todo = self._todo(methods, length, ex, jobs)
    if not todo:
      return
    if todo[0].kind != "dense":
      todo = [Method("dense")] + todo  # its log-probs are the reference for KL / agreement
    dense_lp: dict = {}
    bar = tqdm(todo, desc=f"{desc} @ {length}, examples {ex.start}-{ex.stop - 1}", unit="method",
               disable=not self.progress)
    for m in bar:
      bar.set_postfix_str(m.name)
      for job in jobs:
        if m.kind in job[2]:
          continue
        records = run_job(m, job, dense_lp)
        if m.kind == "dense" and m not in methods:
          continue
        self._add(records)
      self._save()

  def _record(self, task, protocol, length, example, m, fraction, **fields):
    return {"task": task, "protocol": protocol, "length": length, "example": example,
            "method": m.name, "kind": m.kind,
            "budget": list(m.budget) if m.budget else None, "fraction": fraction, **fields}

  def _doc_group(self, methods, length, task_names, ex: range):
    a = self.cfg.attention
    span = self.span
    # (task, protocol, method kinds that skip it)
    jobs = []
    if "copy" in task_names:
      jobs += [("copy", "strict", ()), ("copy", "paper", ())]
    if "ppl" in task_names:
      jobs.append(("ppl", "paper", ()))
    if "error" in task_names:
      jobs.append(("error", "strict", ("dense", "magicpig_ffi")))
    if not self._todo(methods, length, ex, jobs):
      return
    batch = tasks.doc_batch(self.docs, self.tok.encode, length, ex, self.seed, span)
    cue, copy_ans = tasks.copy_parts(batch, span)
    N = batch.context.shape[1]
    cache_len = length + 64
    t0 = time.time()
    dense, lp0 = self.runner.prefill(batch.context, cache_len)
    dense_cue, lp_cue = self.runner.extend(dense, cue, copy=True)
    prefill_s = time.time() - t0
    pool = {"paper": N + cue.shape[1] - a.sink - a.window, "strict": N - a.sink - a.window}

    def run_job(m, job, dense_lp):
      task, protocol, _ = job
      be = self.backend(m, length) if m.kind != "dense" else self._dense_backend()
      t1 = time.time()
      if task == "copy":
        if protocol == "paper":
          cache = self.runner.start(be, dense_cue)
          lp, cache = self.runner.teacher_force(be, cache, copy_ans[:, :-1])
          lp = np.concatenate([lp_cue[:, None], lp], axis=1)
        else:
          cache = self.runner.start(be, dense)
          lp, cache = self.runner.teacher_force(
              be, cache, np.concatenate([cue, copy_ans[:, :-1]], axis=1))
          lp = lp[:, cue.shape[1] - 1:]
        answer = copy_ans
      elif task == "ppl":
        cache = self.runner.start(be, dense)
        lp, cache = self.runner.teacher_force(be, cache, batch.answer[:, :-1])
        lp = np.concatenate([lp0[:, None], lp], axis=1)[:, 1:]  # token 0 is the dense prefill's
        answer = batch.answer[:, 1:]
      else:  # error: dense activations, policy outputs compared per layer
        cache = policies.set_probe(self.runner.start(be, dense), True)
        _, cache = self.runner.teacher_force(be, cache, batch.answer[:, :self.error_tokens])
        err_BY = policies.layer_errors(cache)
        frac = self._fraction(be, cache)
        return [self._record(task, protocol, length, e, m, frac,
                             layer_error=[float(x) for x in err_BY[i]],
                             sparse_layers=be.sparse_layers,
                             mean_error=float(err_BY[i].mean()))
                for i, e in enumerate(ex)]
      frac = self._fraction(be, cache)
      if m.kind == "magicpig":
        self._match_budget(length, m, frac, pool[protocol], f"{task}/{protocol}")
      if m.kind == "dense":
        dense_lp[(task, protocol)] = lp
      scores = tasks.forced_scores(lp, answer, dense_lp.get((task, protocol)))
      secs = round(time.time() - t1, 1)
      return [self._record(task, protocol, length, e, m, frac, seconds=secs, pool=pool[protocol],
                           **scores[i]) for i, e in enumerate(ex)]

    self._methods_loop(methods, length, ex, jobs, run_job, f"doc (prefill {prefill_s:.0f}s)")

  def _passkey_group(self, methods, length, ex: range, task="passkey"):
    """passkey or multikey: needles in real text, a question, a 5-digit answer."""
    a = self.cfg.attention
    jobs = [(task, "strict", ()), (task, "paper", ())]
    if not self._todo(methods, length, ex, jobs):
      return
    make = tasks.passkey_batch if task == "passkey" else tasks.multikey_batch
    batch = make(self.docs, self.tok.encode, length, ex, self.seed)
    N, Q = batch.context.shape[1], batch.query.shape[1]
    keys = [i["key"] for i in batch.info]
    t0 = time.time()
    dense, _ = self.runner.prefill(batch.context, length + 64)
    dense_q, lp_q = self.runner.extend(dense, batch.query, copy=True)
    prefill_s = time.time() - t0
    pool = {"paper": N + Q - a.sink - a.window, "strict": N - a.sink - a.window}
    ans = batch.answer

    def run_job(m, job, dense_lp):
      _, protocol, _ = job
      be = self.backend(m, length) if m.kind != "dense" else self._dense_backend()
      t1 = time.time()
      if protocol == "paper":
        cache = self.runner.start(be, dense_q)
        lp_last = lp_q
        snap = jax.tree.map(jnp.copy, cache)
        lp, cache = self.runner.teacher_force(be, cache, ans[:, :-1])
        lp = np.concatenate([lp_last[:, None], lp], axis=1)
      else:
        cache = self.runner.start(be, dense)
        lpq, cache = self.runner.teacher_force(be, cache, batch.query)
        lp_last = lpq[:, -1]
        snap = jax.tree.map(jnp.copy, cache)
        lp, cache = self.runner.teacher_force(be, cache, ans[:, :-1])
        lp = np.concatenate([lp_last[:, None], lp], axis=1)
      frac = self._fraction(be, cache)
      gen, _ = self.runner.greedy(be, snap, lp_last, self.free_tokens)
      if m.kind == "magicpig":
        self._match_budget(length, m, frac, pool[protocol], f"{task}/{protocol}")
      if m.kind == "dense":
        dense_lp[protocol] = lp
      # The answer's leading space is part of the forced prefix (QUALITY.md, "Method": the digits
      # are forced after the answer prefix); whether the model would emit it itself is `first_top1`.
      d = dense_lp.get(protocol)
      forced = tasks.forced_scores(lp[:, 1:], ans[:, 1:], None if d is None else d[:, 1:])
      first_ok = np.argmax(lp[:, 0], axis=-1) == ans[:, 0]
      free = tasks.free_scores(gen, keys, self.tok.decode)
      secs = round(time.time() - t1, 1)
      return [self._record(task, protocol, length, e, m, frac, seconds=secs,
                           pool=pool[protocol], key=keys[i], depth=batch.info[i]["depth"],
                           **forced[i], first_top1=bool(first_ok[i]),
                           free_exact=free[i]["exact"], free_text=free[i]["text"])
              for i, e in enumerate(ex)]

    self._methods_loop(methods, length, ex, jobs, run_job,
                       f"{task} (prefill {prefill_s:.0f}s)")

  def _dense_backend(self):
    if "dense" not in self._backends:
      self._backends["dense"] = policies.PoolPolicyBackend(self.cfg, "dense")
    return self._backends["dense"]
