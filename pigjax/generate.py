r"""Generate text from the command line.

  python -m pigjax.generate --config configs/smollm2_135m.py \
      --prompt "What is the capital of France?" --chat
  python -m pigjax.generate --config configs/smollm2_135m.py --config.attention.kind=magicpig \
      --prompt_file long.txt --config.sampling.max_new_tokens=64

A user error (bad flag, setting, path or prompt) prints one line and exits with status 2;
`--debug` (or PIGJAX_DEBUG=1) shows the traceback instead.
"""

import os
import sys

import jax

from absl import app, flags
from ml_collections import config_flags

from pigjax import cli
from pigjax import config as config_lib
from pigjax import pipeline, placement
from pigjax.pipeline import Pipeline

_CONFIG = config_flags.DEFINE_config_file("config", "configs/smollm2_135m.py",
                                          "A configs/*.py file with get_config().")
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt text; repeat for a batch.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Read the prompt from this file.")
_CHAT = flags.DEFINE_bool("chat", False, "Render the prompt with the model's chat template.")
_SYSTEM = flags.DEFINE_string("system", None, "System message (with --chat).")
_CACHE = flags.DEFINE_string("compilation_cache", os.path.expanduser("~/.cache/pigjax/jax"),
                             "Persistent XLA compilation cache ('' disables it): later runs with "
                             "the same shapes skip most of the compile time.")
flags.DEFINE_bool("debug", False, "Show the traceback of every error (for bug reports).")


def generate(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  cfg = config_lib.from_config_dict(_CONFIG.value)
  pipeline.validate(cfg)
  prompts = list(_PROMPT.value or [])
  if _PROMPT_FILE.value:
    prompts.append(cli.read_prompt_file(_PROMPT_FILE.value))
  if not prompts:
    raise app.UsageError("Give --prompt or --prompt_file.")
  # Tokenise and check the prompts before the (slow) weight load.
  tokenizer = pipeline.load_tokenizer(cfg.checkpoint)
  ids = [pipeline.encode_prompt(tokenizer, p, _CHAT.value, _SYSTEM.value) for p in prompts]
  pipeline.check_prompt_lengths(ids, cfg.sampling.max_new_tokens, cfg.max_seq_len)

  placement.quiet_jax_logs()
  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  pipe = Pipeline.load(cfg, tokenizer=tokenizer)
  streaming = len(prompts) == 1

  def on_text(slot: int, piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()

  results, stats = pipe.generate(prompts, chat=_CHAT.value, system=_SYSTEM.value,
                                 on_text=on_text if streaming else None, progress=True)
  if streaming:
    print()
  else:
    for i, r in enumerate(results):
      print(f"--- [{i}] {r.text}")
  extra = ""
  if "pool_fraction" in stats.extra:
    extra = f", attended {100 * stats.extra['pool_fraction']:.2f}% of the pool"
  if "index_bytes_per_token" in stats.extra:  # the proxy estimator also scans its whole index
    extra += f" (and scanned its {stats.extra['index_bytes_per_token']:g}-byte index per token)"
  print(f"[pigjax] {cfg.attention.kind} attention | prompt {stats.prompt_tokens} tokens | "
        f"time to first token {stats.prefill_s:.2f} s | {stats.generated_tokens} new tokens, "
        f"decode {stats.decode_tokens_per_s:.1f} tokens/s | load {pipe.load_s:.1f} s, compile "
        f"{stats.compile_s:.1f} s{extra}", file=sys.stderr)


def main(argv):
  cli.run_main(generate, argv)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
