r"""Prints README.md's "What to expect" tables from the benchmark and quality JSON files.

    python scripts/readme_table.py            # the files scripts/bench_table.sh writes

The speed table takes every SmolLM2 row of the decode JSONs (`scripts/bench_decode.py`) and the
llama.cpp step at the same context where the JSON has one; the quality table takes the 8k
records of the quality JSONs (`scripts/eval_quality.py`). `tests/test_docs.py` checks that
README.md holds exactly this output, so the README cannot drift from the files it cites.
"""

import json
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pigjax.eval import report  # noqa: E402

_DECODE = flags.DEFINE_list(
    "decode", ["benchmarks/decode_4k_8k.json", "benchmarks/decode_32k_rope4.json",
               "benchmarks/decode_128k_rope16.json"], "bench_decode.py results, in table order.")
_QUALITY = flags.DEFINE_list(
    "quality", ["magicpig=benchmarks/quality_8k_magicpig.json",
                "proxy=benchmarks/quality_8k_proxy.json"],
    "estimator=eval_quality.py results: each file holds the dense and magicpig_ffi records of a "
    "run with that --config.attention.estimator.")
_LENGTH = flags.DEFINE_integer("length", 8192, "Context length of the quality table.")
_DETAIL = flags.DEFINE_bool("detail", False, "Print BENCHMARKS.md's detailed decode table instead.")


def _context(row: dict) -> str:
  n = f"{row['context'] // 1024}k"
  return n if not row["rope_scaling_factor"] else f"{n}, RoPE x{row['rope_scaling_factor']:g}"


def _peer(ms: float, dense_ms: float, magicpig_ms: float) -> str:
  """llama.cpp's step, and how many times faster pigjax's dense and MagicPIG steps are."""
  return f"{ms:.1f} ms (dense {ms / dense_ms:.2f}x, MagicPIG {ms / magicpig_ms:.2f}x)"


def speed_table(results: list[dict]) -> str:
  lines = ["| context | dense | MagicPIG | proxy | llama.cpp | MagicPIG reads |",
           "| --- | --- | --- | --- | --- | --- |"]
  for res in results:
    peer = {r["context"]: r["llamacpp_ms"] for r in res.get("llamacpp", [])}
    for r in res["smollm2"]:
      if r["batch"] != 1:
        continue
      d = r["dense_ms"]
      cells = [_context(r), f"{d:.1f} ms",
               f"{r['magicpig_ms']:.1f} ms ({d / r['magicpig_ms']:.2f}x)",
               f"{r['proxy_ms']:.1f} ms ({d / r['proxy_ms']:.2f}x)" if "proxy_ms" in r else "-",
               _peer(peer[r["context"]], d, r["magicpig_ms"]) if r["context"] in peer else "-",
               f"{100 * r['candidate_fraction']:.1f}%"]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def detail_table(results: list[dict]) -> str:
  """BENCHMARKS.md's decode table: medians with their IQR, and where MagicPIG's kernel time goes."""
  lines = ["| context | dense ms | MagicPIG ms | proxy ms | MagicPIG reads | proxy reads | "
           "kernel ms MagicPIG / proxy | MagicPIG lookup / score / softmax ms | kernel MB |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for res in results:
    for r in res["smollm2"]:
      if r["batch"] != 1:
        continue
      ms = lambda k: f"{r[k + '_ms']:.1f} ({r[k + '_iqr_ms']:.1f})"  # noqa: E731
      cells = [_context(r), ms("dense"), ms("magicpig"), ms("proxy"),
               f"{100 * r['candidate_fraction']:.1f}%", f"{100 * r['proxy_read_fraction']:.1f}%",
               f"{r['kernel_ms_per_step']:.1f} / {r['proxy_kernel_ms_per_step']:.1f}",
               f"{r['lookup_ms']:.1f} / {r['score_ms']:.1f} / {r['softmax_ms']:.1f}",
               f"{r['kernel_bytes_per_step'] / 1e6:.0f}"]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def quality_table(results: dict[str, dict], length: int) -> str:
  lines = ["| estimator | rows read | KL to dense paper / strict | top-1 agreement paper / strict "
           "| copy top-1 paper / strict |",
           "| --- | --- | --- | --- | --- |"]
  rows = {}
  for estimator, res in results.items():
    s = report.summarise([r for r in res["records"] if r["length"] == length])
    for (protocol, _, method), m in s.items():
      name = "dense" if method == "dense" else estimator
      rows.setdefault(name, {})[protocol] = m
  for name in ("dense", "magicpig", "proxy"):
    if name not in rows:
      continue
    p, s = rows[name]["paper"], rows[name]["strict"]
    lines.append(f"| {name} | {100 * p['cost']:.1f}% | {p['kl']:.4f} / {s['kl']:.4f} | "
                 f"{p['agree']:.3f} / {s['agree']:.3f} | "
                 f"{p['copy_top1']:.3f} / {s['copy_top1']:.3f} |")
  return "\n".join(lines)


def tables(decode_paths, quality_paths, length: int) -> str:
  decode = [json.loads((ROOT / p).read_text()) for p in decode_paths]
  quality = {}
  for item in quality_paths:
    estimator, path = item.split("=", 1)
    quality[estimator] = json.loads((ROOT / path).read_text())
  return speed_table(decode) + "\n\n" + quality_table(quality, length) + "\n"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if _DETAIL.value:
    print(detail_table([json.loads((ROOT / p).read_text()) for p in _DECODE.value]))
    return
  print(tables(_DECODE.value, _QUALITY.value, _LENGTH.value), end="")


if __name__ == "__main__":
  app.run(main)
