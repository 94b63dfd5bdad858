r"""Time to first token: pigjax's prefill vs llama.cpp's, same GGUF, same prompt, same cores.

For each prompt length, every engine prefills the same real-text token ids (GPL-3 and the other
license texts of /usr/share/common-licenses, concatenated) and produces the first token; the
engines alternate round by round and the medians are compared. pigjax's time is
`GenerationStats.prefill_s` (compilation excluded); MagicPIG's includes
building the host store (`after_prefill`). llama.cpp's is `Llama.eval` of the prompt
(llama-cpp-python, the `bench` extra), which ends with the last position's logits.

  python scripts/bench_ttft.py --lengths=2048,4096,8192 --rounds=2 --out benchmarks/ttft.json
"""

import glob
import json
import os
import statistics
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/ is a top-level package beside pigjax/, not installed

from pigjax import weights
from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.pipeline import Pipeline
from tools import bench

_LENGTHS = flags.DEFINE_list("lengths", ["2048", "4096", "8192"], "Prompt lengths in tokens.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Timed rounds per engine and length.")
_ATTENTION = flags.DEFINE_list("attention", ["dense", "magicpig"], "pigjax attention kinds.")
_WEIGHTS = flags.DEFINE_string("weights", "gguf", "pigjax Config.weights (decode weights; "
                               "prefill runs on the dequantized float32 weights either way).")
_THREADS = flags.DEFINE_integer("threads", 0, "llama.cpp threads (0: every core).")
_LLAMACPP = flags.DEFINE_bool("llamacpp", True, "Also time llama.cpp (needs llama-cpp-python).")
_WARMUP = flags.DEFINE_bool("warmup", True, "One untimed round per length first (llama.cpp's "
                             "graph set-up; pigjax excludes compilation from prefill_s itself).")
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")


def real_text() -> str:
  """GPL-3 first, then the other license texts: real prose, long enough for 8k+ tokens."""
  paths = sorted(glob.glob("/usr/share/common-licenses/*"), key=lambda p: not p.endswith("GPL-3"))
  parts = []
  for p in paths:
    if os.path.isfile(p):
      with open(p, encoding="utf-8", errors="replace") as f:
        parts.append(f.read())
  return "\n\n".join(parts)


def main(argv):
  del argv
  lengths = sorted(int(n) for n in _LENGTHS.value)
  max_len = lengths[-1] + 16
  engines = {}
  for kind in _ATTENTION.value:
    cfg = Config(checkpoint="smollm2", weights=_WEIGHTS.value, max_seq_len=max_len,
                 attention=AttentionConfig(kind=kind))
    engines[f"pigjax {kind}"] = Pipeline.load(cfg, progress=False)
  first_pipe = next(iter(engines.values()))
  tok = first_pipe.tokenizer
  # The prompt plus the first token must fit the model's positions (8192 for SmolLM2).
  limit = first_pipe.cfg.model.max_position - 1
  if lengths[-1] > limit:
    print(f"Prompt lengths above {limit} are lowered to {limit} (the model's max_position - 1).")
    lengths = sorted({min(n, limit) for n in lengths})
  ids = tok.encode(real_text())
  if len(ids) < lengths[-1]:
    raise SystemExit(f"Only {len(ids)} tokens of real text; lower --lengths.")
  threads = _THREADS.value or os.cpu_count()
  peer = None
  if _LLAMACPP.value:
    peer = bench.LlamaCppPeer(weights.smollm2_gguf_path(), max_len, threads)
  first = SamplingConfig(max_new_tokens=1, stop_strings=())

  def pigjax_ttft(pipe, prompt):
    return lambda: pipe.engine.generate([prompt], first)[2].prefill_s

  result = {"cpu": bench.cpu_model(), "threads": threads, "weights": _WEIGHTS.value, "rows": []}
  for n in lengths:
    prompt = ids[:n]
    runs = {name: pigjax_ttft(pipe, prompt) for name, pipe in engines.items()}
    if peer is not None:
      runs["llama.cpp"] = lambda: peer.fill(prompt)
    if _WARMUP.value:  # pigjax's compile time is excluded from prefill_s anyway
      for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(_ROUNDS.value):
      for name, run in runs.items():
        times[name].append(run())
    row = {"prompt_tokens": n, "ttft_s": {k: statistics.median(v) for k, v in times.items()},
           "all_s": times}
    if peer is not None:
      row["vs_llamacpp"] = {k: v / row["ttft_s"]["llama.cpp"] for k, v in row["ttft_s"].items()
                            if k != "llama.cpp"}
    result["rows"].append(row)
    print(f"{n:6d} tokens: " + "  ".join(f"{k} {v:.2f} s" for k, v in row["ttft_s"].items())
          + ("  (" + ", ".join(f"{k} {r:.2f}x llama.cpp" for k, r in row["vs_llamacpp"].items())
             + ")" if peer is not None else ""), flush=True)
    if _OUT.value:
      with open(_OUT.value, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
