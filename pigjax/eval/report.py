"""Tables (markdown) and plots (PNG) from the harness's results.json."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np

from pigjax.eval.harness import ORDER


def _mean(xs):
  xs = [float(x) for x in xs]
  return float(np.mean(xs)) if xs else float("nan")


def _method_order(records):
  names = {r["method"]: (ORDER.index(r["kind"]),
                         -(r["budget"][1] if r["budget"] else 0)) for r in records}
  return sorted(names, key=lambda n: names[n])


def summarise(records) -> dict:
  """{(protocol, length, method): {metric: mean}}."""
  by = collections.defaultdict(list)
  for r in records:
    by[(r["task"], r["protocol"], r["length"], r["method"])].append(r)
  out = collections.defaultdict(dict)
  for (task, protocol, length, method), rs in by.items():
    protos = ("paper", "strict") if task in ("ppl", "error") else (protocol,)
    for p in protos:
      s = out[(p, length, method)]
      if task == "copy":
        s["copy_top1"] = _mean(r["top1"] for r in rs)
        s["cost_copy"] = _mean(r["fraction"] for r in rs)
      elif task in ("passkey", "multikey"):
        pre = "pk" if task == "passkey" else "mk"
        s[f"{pre}_forced"] = _mean(r["exact"] for r in rs)
        s[f"{pre}_digits"] = _mean(r["top1"] for r in rs)
        s[f"{pre}_free"] = _mean(r["free_exact"] for r in rs)
        s[f"{pre}_logprob"] = _mean(r["gold_logprob"] for r in rs)
        s[f"{pre}_n"] = len(rs)
      elif task == "ppl":
        s["ppl_nll"] = _mean(r["nll"] for r in rs)
      elif task == "error":
        s["error"] = _mean(r["mean_error"] for r in rs)
        s["layer_error"] = np.mean([r["layer_error"] for r in rs], axis=0).tolist()
      if task != "error":
        s.setdefault("_kl", []).extend(r["kl"] for r in rs if "kl" in r)
        s.setdefault("_agree", []).extend(r["agree"] for r in rs if "agree" in r)
        s.setdefault("_frac", []).extend(r["fraction"] for r in rs)
  for s in out.values():
    s["kl"] = _mean(s.pop("_kl", []))
    s["agree"] = _mean(s.pop("_agree", []))
    s["cost"] = _mean(s.pop("_frac", []))
  return out


def _L(length: int) -> str:
  return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def _fmt(x, pct=False, digits=3):
  if x is None or (isinstance(x, float) and np.isnan(x)):
    return "-"
  return f"{100 * x:.1f}%" if pct else f"{x:.{digits}f}"


def tables(results) -> str:
  records = results["records"]
  if not records:
    return "(no records)"
  s = summarise(records)
  lengths = sorted({r["length"] for r in records})
  methods = _method_order(records)
  multikey = any(r["task"] == "multikey" for r in records)
  lines = ["### Matched budgets (magicpig's measured attended fraction of the pool)", "",
           "| length | (num_bits,num_tables) | measured fraction | measured on | topk k | quest pages |",
           "| --- | --- | --- | --- | --- | --- |"]
  for length, bs in sorted(results.get("budgets", {}).items(), key=lambda kv: int(kv[0])):
    for name, b in bs.items():
      lines.append(f"| {length} | ({name}) | {_fmt(b['fraction'], True)} | {b['measured_on']} | "
                   f"{b['k_keep']} | {b['n_pages']} |")
  for protocol in ("paper", "strict"):
    lines += ["", f"### {protocol} protocol", ""]
    head = ["method"]
    for length in lengths:
      k = _L(length)
      head += [f"cost {k}", f"copy top-1 {k}", f"passkey forced {k}", f"passkey free {k}"]
      head += [f"multikey forced {k}", f"multikey free {k}"] if multikey else []
      head += [f"ppl NLL {k}", f"KL {k}", f"top-1 agree {k}"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for m in methods:
      row = [m]
      for length in lengths:
        x = s.get((protocol, length, m), {})
        row += [_fmt(x.get("cost"), True), _fmt(x.get("copy_top1"))]
        for pre in ("pk", "mk") if multikey else ("pk",):
          n = x.get(f"{pre}_n")
          row += [f"{round(x[f'{pre}_{what}'] * n)}/{n}" if n else "-" for what in ("forced", "free")]
        row += [_fmt(x.get("ppl_nll")), _fmt(x.get("kl"), digits=4), _fmt(x.get("agree"))]
      lines.append("| " + " | ".join(row) + " |")
  lines += ["", "### Attention-output error (relative L2 vs dense, dense activations)", "",
            "| method | " + " | ".join(f"mean error {_L(l)} | layers <= magicpig {_L(l)}"
                                      for l in lengths) + " |",
            "|" + " --- |" * (1 + 2 * len(lengths))]
  for m in methods:
    row = [m]
    any_err = False
    for length in lengths:
      x = s.get(("strict", length, m), {})
      if "error" not in x:
        row += ["-", "-"]
        continue
      any_err = True
      budget = m[m.index("("):] if "(" in m else None
      mp = s.get(("strict", length, f"magicpig{budget}"), {}) if budget else {}
      if m.startswith("magicpig") or "layer_error" not in mp:
        wins = "-"
      else:
        e, e_mp = np.array(x["layer_error"]), np.array(mp["layer_error"])
        wins = f"{int(np.sum(e_mp <= e))}/{len(e)}"
      row += [_fmt(x["error"]), wins]
    if any_err:
      lines.append("| " + " | ".join(row) + " |")
  lines += ["", "`layers <= magicpig`: sparse layers where magicpig at the matched budget has an "
            "error no larger than this method's."]
  return "\n".join(lines)


def plots(results, out: Path) -> list[Path]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  records = results["records"]
  s = summarise(records)
  lengths = sorted({r["length"] for r in records})
  methods = _method_order(records)
  family = lambda m: m.split("(")[0].rstrip("~")
  colours = {"dense": "k", "magicpig": "C0", "magicpig_ffi": "C5", "topk": "C1", "proxy": "C4", "quest": "C2",
             "streaming": "C3"}
  written = []
  fig, axes = plt.subplots(len(lengths), 4, figsize=(13, 3 * len(lengths)), squeeze=False)
  for i, length in enumerate(lengths):
    for j, (protocol, metric, label) in enumerate([
        ("paper", "copy_top1", "copy top-1"), ("strict", "copy_top1", "copy top-1"),
        ("paper", "pk_forced", "passkey forced"), ("strict", "pk_forced", "passkey forced")]):
      ax = axes[i, j]
      for m in methods:
        x = s.get((protocol, length, m), {})
        if metric in x:
          ax.scatter(100 * x["cost"], x[metric], color=colours[family(m)], s=18,
                     label=family(m))
      ax.set_xscale("symlog", linthresh=1)
      ax.set_title(f"{label}, {protocol}, {_L(length)}", fontsize=9)
      ax.set_xlabel("attended % of pool", fontsize=8)
      ax.tick_params(labelsize=7)
  handles = {h.get_label(): h for ax in axes.flat for h in ax.collections}
  fig.legend(handles.values(), handles.keys(), loc="upper center", ncol=6, fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 0.94))
  p = out / "accuracy_vs_cost.png"
  fig.savefig(p, dpi=80)
  plt.close(fig)
  written.append(p)

  fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 3.2), squeeze=False)
  for i, length in enumerate(lengths):
    ax = axes[0, i]
    for fam in ("magicpig", "topk", "proxy", "quest"):
      pts = sorted((int(m.split(",")[1].rstrip(")")), s[("strict", length, m)]["error"])
                   for m in methods if family(m) == fam and "error" in s.get(("strict", length, m), {}))
      if pts:
        ax.plot(*zip(*pts), "o-", color=colours[fam], label=fam + ("" if fam == "magicpig" else
                                                                    " (matched)"))
    x = s.get(("strict", length, "streaming"), {})
    if "error" in x:
      ax.axhline(x["error"], color=colours["streaming"], ls="--", label="streaming")
    ax.set_xlabel("num_tables (budget)")
    ax.set_ylabel("mean relative L2 error")
    ax.set_title(f"attention-output error, {_L(length)}", fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  p = out / "error_vs_num_tables.png"
  fig.savefig(p, dpi=80)
  plt.close(fig)
  written.append(p)
  return written


def write(out, merge=()) -> str:
  """Writes out/results.md and out/*.png from out/results.json plus the results of `merge` (other
  output directories, e.g. one run per length), and returns the markdown."""
  out = Path(out)
  results = json.loads((out / "results.json").read_text())
  for other in merge:
    extra = json.loads((Path(other) / "results.json").read_text())
    results["records"] += extra["records"]
    for length, b in extra.get("budgets", {}).items():
      results["budgets"].setdefault(length, {}).update(b)
  md = tables(results)
  (out / "results.md").write_text(md + "\n")
  try:
    plots(results, out)
  except ImportError as e:  # matplotlib is an optional extra
    md += f"\n\n(plots skipped: {e})"
  return md
