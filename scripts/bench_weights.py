r"""Decode speed of quantized vs dense weights, side by side in one process.

Loads the embedded SmolLM2 twice (dense float32 decode weights, and the given quantized
formats), then generates greedily from the same real prompt, interleaving the engines round by
round, and reports median decode tokens/s and the ratio to dense.

  python scripts/bench_weights.py --prompt_tokens=1024 --new_tokens=64 --rounds=3 \
      --formats=gguf,q8_0 --out benchmarks/weights.json
"""

import json
import statistics

from absl import app, flags

from pigjax.config import Config, SamplingConfig
from pigjax.pipeline import Pipeline

_PROMPT_FILE = flags.DEFINE_string("prompt_file", "/usr/share/common-licenses/GPL-3",
                                   "Real text for the prompt.")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 1024, "Prompt length in tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds per engine.")
_FORMATS = flags.DEFINE_list("formats", ["gguf", "q8_0"], "Quantized formats besides dense.")
_ACT_BITS = flags.DEFINE_integer("act_bits", 16, "Activation bits of the quantized kernel.")
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")


def main(argv):
  del argv
  pipes = {}
  for fmt in ["dense", *_FORMATS.value]:
    pipes[fmt] = Pipeline.load(Config(checkpoint="smollm2", weights=fmt, act_bits=_ACT_BITS.value,
                                      max_seq_len=_PROMPT_TOKENS.value + _NEW.value + 8),
                               progress=False)
  with open(_PROMPT_FILE.value, encoding="utf-8") as f:
    ids = pipes["dense"].tokenizer.encode(f.read())[:_PROMPT_TOKENS.value]
  sc = SamplingConfig(max_new_tokens=_NEW.value, stop_strings=())
  rates = {fmt: [] for fmt in pipes}
  outputs = {}
  for fmt, pipe in pipes.items():  # warm-up: compile every program once
    outputs[fmt], _, _ = pipe.engine.generate([ids], sc)
  for _ in range(_ROUNDS.value):
    for fmt, pipe in pipes.items():
      _, _, stats = pipe.engine.generate([ids], sc)
      rates[fmt].append(stats.decode_tokens_per_s)
  dense = statistics.median(rates["dense"])
  result = {"prompt_tokens": len(ids), "new_tokens": _NEW.value, "act_bits": _ACT_BITS.value,
            "rows": []}
  for fmt, r in rates.items():
    row = {"weights": fmt, "resolved": pipes[fmt].weights, "tok_s": statistics.median(r),
           "all_tok_s": r, "speedup_vs_dense": statistics.median(r) / dense,
           "quant_mb": pipes[fmt].quant_bytes / 1e6,
           "greedy_equal_to_dense": outputs[fmt] == outputs["dense"]}
    result["rows"].append(row)
    print(f"{fmt:6s} {row['tok_s']:6.1f} tok/s  {row['speedup_vs_dense']:.2f}x dense  "
          f"{row['quant_mb']:.0f} MB quantized  greedy==dense: {row['greedy_equal_to_dense']}")
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
