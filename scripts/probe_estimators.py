r"""Estimator probe: attention-output error vs cost of pool estimators on real text.

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

from pigjax import cli
from pigjax import config as config_lib
from pigjax import lsh
from pigjax.eval import data, probe

_CONFIG = cli.define_config()
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
_PROXY_FRACTIONS = flags.DEFINE_list("proxy_fractions", ["0.03"],
                                     "Fractions of the pool the proxy selectors keep (top-k).")
_CAPTURE = flags.DEFINE_string("capture", "", "npz file caching the captured q/k/v: read if it "
                               "exists, else written (same --tokens/--queries/--seed/--data).")
_OUT = flags.DEFINE_string("out", "runs/probe.json", "JSON output.")
_PLOT = flags.DEFINE_string("plot", "", "PNG of the frontier (error vs rows read), optional.")
_PLOT_ONLY = flags.DEFINE_list("plot_only", [], "Only plot these result JSONs into --plot.")


def plot(results: dict, path: str) -> None:
  """Median error vs fraction of pool rows read, one series per estimator family, with the
  oracle top-k curve; marker size grows with index bytes per token."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fams: dict = {}
  for name, r in results.items():
    if name.startswith("topk("):
      fam = "oracle top-k"
    elif name.startswith("magicpig"):
      fam = "magicpig (K,L)"
    else:
      fam = name.split(",k=")[0] + ("]" if ",k=" in name else "")
    fams.setdefault(fam, []).append((100 * r["read"], r["median_error"], name))
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for fam, pts in sorted(fams.items()):
    pts.sort()
    style = "k--" if fam == "oracle top-k" else ("o" if fam.startswith("magicpig") else "s-")
    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=fam, ms=5)
    if fam.startswith("magicpig"):
      for x, y, name in pts:
        ax.annotate(name[len("magicpig"):], (x, y), fontsize=7)
  ax.axvline(4.0, color="grey", lw=0.5)
  ax.set_xlabel("pool K/V rows read per query head (%)")
  ax.set_ylabel("median relative attention-output error")
  ax.set_yscale("log")
  ax.legend(fontsize=7)
  ax.set_title("SmolLM2-135M, 28 sparse layers, real text (scripts/probe_estimators.py)",
               fontsize=8)
  fig.tight_layout()
  Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _PLOT_ONLY.value:
    merged = {}
    for f in _PLOT_ONLY.value:
      merged.update(json.loads(Path(f).read_text())["results"])
    plot(merged, _PLOT.value or "runs/probe_frontier.png")
    return
  from pigjax.pipeline import Pipeline
  cfg = config_lib.from_config_dict(_CONFIG.value)
  n_total = _TOKENS.value + _QUERIES.value
  cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, n_total),
                            attention=dataclasses.replace(cfg.attention, kind="dense"))
  t0 = time.time()
  if _CAPTURE.value and Path(_CAPTURE.value).exists():
    cap = probe.load_capture(_CAPTURE.value)
    if cap.prompt_len != _TOKENS.value or cap.q[0].shape[0] != _QUERIES.value:
      raise app.UsageError(f"{_CAPTURE.value} holds another capture; delete it or change flags.")
    m = config_lib.ModelConfig(num_layers=len(cap.q), num_heads=cap.q[0].shape[1],
                               num_kv_heads=cap.k[0].shape[1], head_dim=cap.q[0].shape[2])
  else:
    pipe = Pipeline.load(cfg, progress=False)
    docs = data.load_documents(Path(_DATA.value))
    ids = data.haystack_ids(docs, pipe.tokenizer.encode, n_total,
                            np.random.default_rng(_SEED.value))
    cap = probe.capture(pipe.model, pipe.cfg, ids, _QUERIES.value)
    m = pipe.cfg.model
    if _CAPTURE.value:
      probe.save_capture(cap, _CAPTURE.value)
    print(f"captured {n_total} tokens in {time.time() - t0:.0f} s")
  a = cfg.attention
  sparse = [l for l in range(m.num_layers) if l not in set(a.dense_layers)]

  def simhash(layer, b, l):
    return lsh.simhash_matrix(a.seed, layer, m.head_dim, b, l, a.per_layer_hash)

  t_pool = _TOKENS.value - a.sink - a.window
  ests = [probe.MagicPig(*map(int, b.split(":"))) for b in _BUDGETS.value]
  for frac in _PROXY_FRACTIONS.value:
    k_proxy = max(1, round(float(frac) * t_pool))
    for p in _PROXIES.value:
      proxy, tail = p.split(":")
      if tail.startswith("sample"):
        tail = f"sample{float(tail[6:]) / 100 * t_pool:g}"
      ests.append(probe.ProxyTopK(proxy, k_proxy, tail, seed=_SEED.value))
  res = probe.evaluate(cap, a.sink, a.window, sparse, ests, simhash, m.num_kv_heads)
  ks = sorted({max(1, round(r["read"] * t_pool)) for r in res.values()})
  res.update(probe.evaluate(cap, a.sink, a.window, sparse, [probe.Oracle(k) for k in ks],
                            simhash, m.num_kv_heads))
  print(f"{'estimator':40s} {'read':>6s} {'median':>7s} {'mean':>7s} {'topk@read':>9s} "
        f"{'index B/tok':>11s} {'lookup B/tok':>12s}")
  for name, r in res.items():
    if name.startswith("topk("):
      continue
    o = res[f"topk({max(1, round(r['read'] * t_pool))})"]
    r["oracle_at_read"] = {"median_error": o["median_error"], "mean_error": o["mean_error"]}
    print(f"{name:40s} {100 * r['read']:5.2f}% {r['median_error']:7.4f} {r['mean_error']:7.4f} "
          f"{o['median_error']:9.4f} {r['index_bytes']:11.1f} {r['lookup_bytes']:12.2f}")
  out = Path(_OUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"flags": {f: flags.FLAGS[f].value for f in (
      "tokens", "queries", "seed", "budgets", "proxies", "proxy_fractions", "data")},
                             "results": res}, indent=1))
  if _PLOT.value:
    plot(res, _PLOT.value)
  print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
  app.run(main)
