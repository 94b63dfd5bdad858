r"""Quality of MagicPIG against dense, oracle topk, Quest and StreamingLLM (QUALITY.md, "Method").

  python scripts/fetch_data.py
  python scripts/eval_quality.py --config configs/smollm2_135m.py --lengths 2048,4096 \
      --examples 3 --out runs/quality

Writes <out>/results.json (resumable: finished records are skipped), <out>/results.md and plots
<out>/*.png. `--report_only` rebuilds the table and plots from the JSON.
"""

import dataclasses
import time
from pathlib import Path

from absl import app, flags

from pigjax import cli
from pigjax import config as config_lib
from pigjax.eval import data, harness, report

_CONFIG = cli.define_config()
_METHODS = flags.DEFINE_list("methods", list(harness.ORDER), "Methods to run.")
_BUDGETS = flags.DEFINE_list("budgets", ["10:150", "9:120", "8:75"],
                             "num_bits:num_tables pairs for magicpig (topk/quest are matched).")
_FFI_BUDGETS = flags.DEFINE_list("ffi_budgets", ["10:150"], "Budgets for the FFI path.")
_LENGTHS = flags.DEFINE_list("lengths", ["2048", "4096"], "Context lengths in tokens.")
_TASKS = flags.DEFINE_list("tasks", ["copy", "ppl", "passkey", "error"],
                          "Tasks to run: some of copy, ppl, passkey, multikey, error.")
_EXAMPLES = flags.DEFINE_integer("examples", 3, "Examples per task and length.")
_BATCH = flags.DEFINE_integer("batch", 0, "Most examples run together (0: all in one batch); "
                              "smaller batches need less memory and give the same examples.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the examples.")
_SPAN = flags.DEFINE_integer("span", 32, "Teacher-forced tokens of the copy and ppl tasks.")
_ERROR_TOKENS = flags.DEFINE_integer("error_tokens", 16, "Decode steps probed by the error task.")
_DATA = flags.DEFINE_string("data", str(data.DEFAULT_DIR / "debian-handbook"),
                            "Directory of cached text (scripts/fetch_data.py).")
_OUT = flags.DEFINE_string("out", "runs/quality", "Output directory.")
_MERGE = flags.DEFINE_list("merge", [], "Other output directories merged into the report.")
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Only rebuild results.md and the plots.")


def _pairs(items):
  return [tuple(int(x) for x in s.split(":")) for s in items]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  out = Path(_OUT.value)
  if not _REPORT_ONLY.value:
    from pigjax.pipeline import Pipeline
    cfg = config_lib.from_config_dict(_CONFIG.value)
    lengths = [int(x) for x in _LENGTHS.value]
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, max(lengths) + 128),
                              attention=dataclasses.replace(cfg.attention, kind="dense"))
    methods = harness.expand_methods(_METHODS.value, _pairs(_BUDGETS.value),
                                     _pairs(_FFI_BUDGETS.value))
    docs = data.load_documents(Path(_DATA.value))
    t0 = time.time()
    pipe = Pipeline.load(cfg)
    h = harness.Harness(pipe.cfg, pipe.model, pipe.tokenizer, docs, out, seed=_SEED.value,
                        span=_SPAN.value, error_tokens=_ERROR_TOKENS.value)
    h.run(methods, lengths, _TASKS.value, _EXAMPLES.value, _BATCH.value)
    print(f"evaluation took {time.time() - t0:.0f} s")
  print(report.write(out, _MERGE.value))


if __name__ == "__main__":
  app.run(main)
