"""Converts a checkpoint (embedded SmolLM2, a GGUF file or a Hugging Face Llama directory) into a
pigjax Orbax checkpoint, which later loads much faster (no dequantisation, no safetensors casts).

  python scripts/convert_checkpoint.py --input smollm2 --output /tmp/smollm2_orbax
  python scripts/convert_checkpoint.py --input ~/Llama-3.1-8B --output ~/llama31_8b --dtype bfloat16
"""

import time

from absl import app, flags, logging

from pigjax import weights
from pigjax.pipeline import load_tokenizer

_INPUT = flags.DEFINE_string("input", "smollm2", "'smollm2', a .gguf file or an HF Llama dir.")
_OUTPUT = flags.DEFINE_string("output", None, "Orbax checkpoint directory to write.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", sorted(weights.DTYPES), "Stored weight dtype.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --output if it is not empty.")


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save step at INFO
  start = time.perf_counter()
  cfg, tensors, kind = weights.load_checkpoint(_INPUT.value, _DTYPE.value)
  loaded = time.perf_counter()
  path = weights.save_orbax(_OUTPUT.value, cfg, tensors, overwrite=_OVERWRITE.value)
  load_tokenizer(_INPUT.value).save(path)  # so the Orbax directory is self-contained
  done = time.perf_counter()
  num_params = sum(t.size for t in tensors.values())
  print(f"Read {_INPUT.value} ({kind}): {len(tensors)} tensors, {num_params / 1e6:.1f}M "
        f"parameters in {loaded - start:.1f} s.")
  print(f"Wrote {path} ({_DTYPE.value}) in {done - loaded:.1f} s; total {done - start:.1f} s.")
  print(f"Config: {cfg}")


if __name__ == "__main__":
  app.run(main)
