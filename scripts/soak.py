r"""Soak benchmark: long MagicPIG generations whose generated buffer moves into
the host pool again and again; memory, attended fraction and speed every N steps
(tools/soak.py), and a shorter prefix checked token for token against the pure-jnp reference.

Runs (--runs, any of):
  smollm2  the embedded SmolLM2-135M: a real-text prompt of --prompt_tokens plus --new_tokens
           generated (1024 + 7168 = its 8,192 positions), EOS ignored.
  tiny     a random 4-layer tiny Llama (tests/tiny_checkpoint.py) with max_position
           --tiny_max_position: --tiny_new_tokens generated after the same kind of prompt.
  check    SmolLM2, --check_tokens generated with generated_buffer=--check_buffer: the FFI
           backend against PoolPolicyBackend(pool_generated=True), and dense for contrast.

One process per run keeps each run's memory readings its own:

  python scripts/soak.py --runs=smollm2 --out benchmarks/soak_smollm2.json
  python scripts/soak.py --runs=tiny --out benchmarks/soak_tiny.json
  python scripts/soak.py --runs=check --out benchmarks/soak_check.json
"""

import glob
import json
import os
import platform
import sys
import tempfile
import time

from absl import app, flags

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)  # tools/ is a top-level package beside pigjax/, not installed

from pigjax.config import AttentionConfig, Config
from pigjax.pipeline import Pipeline
from tools import soak

_RUNS = flags.DEFINE_list("runs", ["check", "tiny", "smollm2"], "Which runs, in order.")
_TEXT = flags.DEFINE_string("text_dir", os.path.join(_ROOT, "data", "text"),
                            "Real text for the prompt: every *.txt below it, sorted, concatenated "
                            "(scripts/fetch_data.py makes data/text).")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 1024, "Prompt length in tokens.")
_NEW = flags.DEFINE_integer("new_tokens", 7168, "SmolLM2 tokens generated (EOS ignored).")
_EVERY = flags.DEFINE_integer("every", 256, "Record memory, attended fraction, speed every N "
                              "decode steps.")
_BUFFER = flags.DEFINE_integer("generated_buffer", 256, "attention.generated_buffer of the soak "
                               "runs: its older half joins the pool whenever it fills.")
_WARMUP = flags.DEFINE_integer("warmup_step", 1024, "Memory growth is reported from the first "
                               "sample at or after this step to the end.")
_TINY_MAX = flags.DEFINE_integer("tiny_max_position", 32768, "max_position of the tiny model.")
_TINY_NEW = flags.DEFINE_integer("tiny_new_tokens", 20000, "Tiny-model tokens generated.")
_CHECK_NEW = flags.DEFINE_integer("check_tokens", 400, "Tokens compared with the reference.")
_CHECK_BUF = flags.DEFINE_integer("check_buffer", 32, "generated_buffer of the reference check.")
_TABLE = flags.DEFINE_integer("table_every", 1024, "The closing markdown table shows every Nth "
                              "step's sample (and the last).")
_TABLE_FROM = flags.DEFINE_string("table_from", None, "Only print the markdown tables of a JSON "
                                   "file this script wrote, and stop.")
_OUT = flags.DEFINE_string("out", None, "Write the results here as JSON.")


def read_text(text_dir: str) -> str:
  paths = sorted(glob.glob(os.path.join(text_dir, "**", "*.txt"), recursive=True))
  if not paths:
    raise app.UsageError(f"No *.txt files under --text_dir={text_dir}; run "
                         "scripts/fetch_data.py or point --text_dir at real text.")
  parts, size = [], 0
  for p in paths:  # a few documents are plenty for 1k-4k tokens
    with open(p, encoding="utf-8", errors="replace") as f:
      parts.append(f.read())
    size += len(parts[-1])
    if size > 200_000:
      break
  return "\n\n".join(parts)


def prompt_ids(pipe: Pipeline, text: str, n: int) -> list[int]:
  ids = pipe.tokenizer.encode(text)
  if len(ids) < n:
    raise app.UsageError(f"--text_dir gives {len(ids)} tokens, fewer than --prompt_tokens={n}.")
  return ids[:n]


def print_sample(s: soak.Sample) -> None:
  print(f"  step {s.step:6d}  {s.tokens_per_s:7.1f} tok/s  rss {s.rss_mb:8.1f} MB  "
        f"peak {s.hwm_mb:8.1f} MB  pool {s.pool_tokens:6d} = {s.pool_mb:6.1f} MB  "
        f"attended {100 * s.attended:6.2f}%", flush=True)


def print_table(samples: list[soak.Sample]) -> None:
  """Markdown rows for BENCHMARKS.md."""
  print("| step | pool tokens | pool MB | RSS MB | peak RSS MB | attended | tok/s |\n"
        "|---|---|---|---|---|---|---|")
  for s in samples:
    if s.step % _TABLE.value == 0 or s is samples[-1]:
      print(f"| {s.step} | {s.pool_tokens} | {s.pool_mb:.1f} | {s.rss_mb:.1f} | {s.hwm_mb:.1f} | "
            f"{100 * s.attended:.2f}% | {s.tokens_per_s:.1f} |")


def run_soak(name: str, pipe: Pipeline, prompt: list[int], new_tokens: int) -> dict:
  cfg = pipe.cfg
  print(f"{name}: {len(prompt)}-token prompt + {new_tokens} generated, generated_buffer="
        f"{cfg.attention.generated_buffer}, every {_EVERY.value} steps", flush=True)
  t0 = time.perf_counter()
  samples, ids, summary = soak.soak(cfg, pipe.model, prompt, new_tokens, _EVERY.value,
                                    print_sample)
  growth = soak.growth_after(samples, min(_WARMUP.value, samples[-1].step // 2))
  print(f"{name}: growth after warm-up {growth}; {summary}", flush=True)
  print_table(samples)
  return {"prompt_tokens": len(prompt), "new_tokens": new_tokens, "wall_s":
          time.perf_counter() - t0, "attention": vars(cfg.attention) | {
              "dense_layers": list(cfg.attention.dense_layers)},
          "samples": [vars(s) for s in samples], "growth_after_warmup": growth,
          "summary": summary, "distinct_tokens": len(set(ids))}


def smollm2_pipe(buffer: int) -> Pipeline:
  cfg = Config(checkpoint="smollm2", max_seq_len=8192,
               attention=AttentionConfig(kind="magicpig", generated_buffer=buffer))
  return Pipeline.load(cfg, progress=False)


def tiny_pipe(directory: str) -> Pipeline:
  sys.path.insert(0, os.path.join(_ROOT, "tests"))
  import tiny_checkpoint  # the tests' random-checkpoint writer: a model with any max_position
  tiny_checkpoint.write_tiny_llama(directory, num_layers=4, max_position=_TINY_MAX.value)
  tiny_checkpoint.write_tiny_tokenizer(directory)
  cfg = Config(checkpoint=directory, max_seq_len=_TINY_MAX.value,
               attention=AttentionConfig(kind="magicpig", dense_layers=(0,),
                                         generated_buffer=_BUFFER.value))
  return Pipeline.load(cfg, progress=False)


def main(argv):
  del argv
  if _TABLE_FROM.value:
    with open(_TABLE_FROM.value) as f:
      for name, run in json.load(f)["runs"].items():
        if "samples" in run:
          print(f"{name}: growth after warm-up {run['growth_after_warmup']}")
          print_table([soak.Sample(**x) for x in run["samples"]])
    return
  text = read_text(_TEXT.value)
  result = {"command": " ".join(sys.argv), "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} cores", "runs": {}}
  pipe = None
  for run in _RUNS.value:
    if run in ("check", "smollm2") and pipe is None:
      pipe = smollm2_pipe(_BUFFER.value)
    if run == "check":
      check_pipe = pipe.with_attention(AttentionConfig(kind="magicpig",
                                                       generated_buffer=_CHECK_BUF.value))
      print(f"check: {_CHECK_NEW.value} tokens, generated_buffer={_CHECK_BUF.value}", flush=True)
      out = soak.compare_with_reference(check_pipe.cfg, pipe.model,
                                        prompt_ids(pipe, text, _PROMPT.value), _CHECK_NEW.value)
      print(f"check: first mismatch FFI vs reference {out['first_mismatch']}, vs dense "
            f"{out['first_mismatch_vs_dense']}; attended ffi {out['ffi']['pool_fraction']:.4f} "
            f"reference {out['reference']['pool_fraction']:.4f}; evictions {out['evictions']}",
            flush=True)
      tf = out["teacher_forced"]
      print(f"check, teacher-forced on the FFI's tokens ({tf['steps']} steps): max |logprob "
            f"diff| {tf['max_abs_logprob_diff']:.2e}, top-1 disagreements "
            f"{tf['top1_disagreements']}, attended {tf['pool_fraction']}", flush=True)
      result["runs"]["check"] = out
    elif run == "smollm2":
      result["runs"]["smollm2"] = run_soak("smollm2", pipe, prompt_ids(pipe, text, _PROMPT.value),
                                           _NEW.value)
    elif run == "tiny":
      with tempfile.TemporaryDirectory() as d:
        tiny = tiny_pipe(d)
        result["runs"]["tiny"] = run_soak("tiny", tiny, prompt_ids(tiny, text, _PROMPT.value),
                                          _TINY_NEW.value)
    else:
      raise app.UsageError(f"Unknown run {run!r} in --runs; use check, tiny, smollm2.")
    if _OUT.value:  # after every run, so a long soak's finished runs survive an interruption
      with open(_OUT.value, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
