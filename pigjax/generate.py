r"""Generate text from the command line.

  python -m pigjax.generate --config configs/smollm2_135m.py \
      --prompt "What is the capital of France?" --chat
  python -m pigjax.generate --config configs/smollm2_135m.py --config.attention.kind=magicpig \
      --prompt_file long.txt --config.sampling.max_new_tokens=64

Several processes (jax.distributed; every process runs this command with the same prompts and
its own --process_id; the batch is split over them and process 0 prints every row):

  python -m pigjax.generate --coordinator_address=localhost:1234 --num_processes=2 \
      --process_id=0 --prompt "Hi" --prompt "Bye" --config.weights=dense

A user error (bad flag, setting, path or prompt) prints one line and exits with status 2;
`--debug` (or PIGJAX_DEBUG=1) shows the traceback instead.
"""

import os
import sys

import jax

from absl import app, flags

from pigjax import cli, multihost, placement
from pigjax import config as config_lib

_CONFIG = cli.define_config()
_PROMPT = flags.DEFINE_multi_string("prompt", None, "Prompt text; repeat for a batch.")
_PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Read the prompt from this file.")
_CHAT = flags.DEFINE_bool("chat", False, "Render the prompt with the model's chat template.")
_SYSTEM = flags.DEFINE_string("system", None, "System message (with --chat).")
_CACHE = flags.DEFINE_string("compilation_cache", os.path.expanduser("~/.cache/pigjax/jax"),
                             "Persistent XLA compilation cache ('' disables it): later runs with "
                             "the same shapes skip most of the compile time.")
flags.DEFINE_bool("debug", False, "Show the traceback of every error (for bug reports).")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 for a multi-process run "
    f"(jax.distributed); default ${multihost.ENV_COORDINATOR}.")
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None,
    f"Processes in a multi-process run; default ${multihost.ENV_NUM_PROCESSES}.")
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, f"This process's id in [0, num_processes); default "
    f"${multihost.ENV_PROCESS_ID}.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "CPU devices per process (jax_num_cpu_devices), e.g. for "
    "--config.mesh.model=2 on one machine; 0 keeps jax's default.")


def generate(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  placement.quiet_jax_logs()
  # Before anything starts jax's backends (importing pigjax.pipeline registers the FFI targets).
  multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                       _CPU_DEVICES.value)
  from pigjax import pipeline
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

  if _CACHE.value:
    jax.config.update("jax_compilation_cache_dir", _CACHE.value)
  pipe = pipeline.Pipeline.load(cfg, tokenizer=tokenizer)
  main_process = jax.process_index() == 0
  prompts = multihost.split(prompts)  # this process's rows (all of them in a single process)
  streaming = len(prompts) == 1 and jax.process_count() == 1

  def on_text(slot: int, piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()

  results, stats = pipe.generate(prompts, chat=_CHAT.value, system=_SYSTEM.value,
                                 on_text=on_text if streaming else None, progress=True)
  texts = multihost.gather_strings([r.text for r in results])  # every process's rows, in order
  if streaming:
    print()
  elif main_process:
    for i, text in enumerate(texts):
      print(f"--- [{i}] {text}")
  multihost.shutdown()
  if not main_process:
    return
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
