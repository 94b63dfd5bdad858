r"""Estimator probe (issue 12): attention-output error vs cost of pool estimators on real text.

  python scripts/fetch_data.py
  XLA_FLAGS=--xla_cpu_multi_thread_eigen=false nice -n 19 python scripts/probe_estimators.py \
      --out runs/probe.json

Captures the decode queries and K/V of the embedded model (SmolLM2-135M) on `--tokens` of real
text held out from the quality harness (Python documentation by default; the harness uses the
Debian handbook) and compares, per sparse layer, the paper's estimator over (num_bits,
num_tables), score-proxy top-k selectors and oracle top-k at each one's measured fraction. See
pigjax/eval/probe.py for the cost accounting.
"""

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from pigjax import config as config_lib
from pigjax import lsh
from pigjax.eval import data, probe

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py",
                                          "A configs/*.py file with get_config().")
_DATA = flags.DEFINE_string("data", str(data.DEFAULT_DIR / "python3.11-doc"),
                            "Directory of cached text (scripts/fetch_data.py).")
_TOKENS = flags.DEFINE_integer("tokens", 3000, "Prompt tokens (pool = tokens - sink - window).")
_QUERIES = flags.DEFINE_integer("queries", 8, "Decode queries probed (teacher-forced).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the document order and of tail samples.")
_BUDGETS = flags.DEFINE_list("budgets", ["10:150", "9:120", "11:300", "12:600"],
                             "num_bits:num_tables of the paper's estimator.")
_PROXIES = flags.DEFINE_list(
    "proxies", ["q4:none", "q2:none", "c16q8:none", "c16q4:none", "q4:mean", "q2:mean",
                "c16q4:mean", "q4:sample0.5"],
    "proxy:tail selectors (pigjax.eval.probe.ProxyTopK); sampleX = a tail sample of X%.")
_PROXY_FRACTION = flags.DEFINE_float("proxy_fraction", 0.03,
                                     "Fraction of the pool the proxy selectors keep (top-k).")
_OUT = flags.DEFINE_string("out", "runs/probe.json", "JSON output.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  from pigjax.pipeline import Pipeline
  cfg = config_lib.from_config_dict(_CONFIG.value)
  n_total = _TOKENS.value + _QUERIES.value
  cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, n_total),
                            attention=dataclasses.replace(cfg.attention, kind="dense"))
  t0 = time.time()
  pipe = Pipeline.load(cfg, progress=False)
  docs = data.load_documents(Path(_DATA.value))
  ids = data.haystack_ids(docs, pipe.tokenizer.encode, n_total, np.random.default_rng(_SEED.value))
  cap = probe.capture(pipe.model, pipe.cfg, ids, _QUERIES.value)
  print(f"captured {n_total} tokens in {time.time() - t0:.0f} s")
  a, m = pipe.cfg.attention, pipe.cfg.model
  sparse = [l for l in range(m.num_layers) if l not in set(a.dense_layers)]

  def simhash(layer, b, l):
    return lsh.simhash_matrix(a.seed, layer, m.head_dim, b, l, a.per_layer_hash)

  t_pool = _TOKENS.value - a.sink - a.window
  k_proxy = max(1, round(_PROXY_FRACTION.value * t_pool))
  ests = [probe.MagicPig(*map(int, b.split(":"))) for b in _BUDGETS.value]
  for p in _PROXIES.value:
    proxy, tail = p.split(":")
    if tail.startswith("sample"):
      tail = f"sample{float(tail[6:]) / 100 * t_pool:g}"
    ests.append(probe.ProxyTopK(proxy, k_proxy, tail, seed=_SEED.value))
  res = probe.evaluate(cap, a.sink, a.window, sparse, ests, simhash, m.num_kv_heads)
  ks = sorted({max(1, round(r["read"] * t_pool)) for r in res.values()})
  res.update(probe.evaluate(cap, a.sink, a.window, sparse, [probe.Oracle(k) for k in ks],
                            simhash, m.num_kv_heads))
  print(f"{'estimator':34s} {'read':>6s} {'median':>7s} {'mean':>7s} {'topk@read':>9s} "
        f"{'index B/tok':>11s} {'lookup B/tok':>12s}")
  for name, r in res.items():
    if name.startswith("topk("):
      continue
    o = res[f"topk({max(1, round(r['read'] * t_pool))})"]
    r["oracle_at_read"] = {"median_error": o["median_error"], "mean_error": o["mean_error"]}
    print(f"{name:34s} {100 * r['read']:5.2f}% {r['median_error']:7.4f} {r['mean_error']:7.4f} "
          f"{o['median_error']:9.4f} {r['index_bytes']:11.1f} {r['lookup_bytes']:12.2f}")
  out = Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"flags": {f: flags.FLAGS[f].value for f in (
      "tokens", "queries", "seed", "budgets", "proxies", "proxy_fraction", "data")},
                             "results": res}, indent=1))
  print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
  app.run(main)
