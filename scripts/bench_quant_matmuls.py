r"""The decode step's quantized matmuls alone: SmolLM2-135M's 121 per-token matmuls (30 layers x
qkv, o, gate/up, down, and the LM head) as one jitted chain on synthetic weights in the GGUF's
formats (Q4_1 layers, Q8_0 head: 96 MB), in the packed layout and in the GGUF layout, timed
alternately in one process.

  python scripts/bench_quant_matmuls.py --rounds=3 --steps=20

PIGJAX_MATMUL_THREADS=1 runs the kernel on one thread (the default: all cores).
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pigjax import _pigjax_ffi, quant

_LAYERS = flags.DEFINE_integer("layers", 30, "Decoder layers (SmolLM2-135M: 30).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating rounds per layout.")
_STEPS = flags.DEFINE_integer("steps", 20, "Chains timed per layout and round.")
_ACT_BITS = flags.DEFINE_integer("act_bits", 16, "Activation bits of the kernel.")

HIDDEN, QKV, MLP, VOCAB = 576, 960, 1536, 49152  # SmolLM2-135M (q, k, v fused; gate, up fused)


def _weights(packed: bool, seed: int = 0):
  rng = np.random.default_rng(seed)

  def w(n, k, fmt="q4_1"):
    t = quant.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, fmt,
                       _ACT_BITS.value)
    return quant.pack(t) if packed else t

  layers = [(w(QKV, HIDDEN), w(HIDDEN, HIDDEN), w(2 * MLP, HIDDEN), w(HIDDEN, MLP))
            for _ in range(_LAYERS.value)]
  return layers, w(VOCAB, HIDDEN, "q8_0")


@jax.jit
def _chain(x, layers, head):
  """The matmuls of one decode token, each fed by the previous (cheap elementwise glue)."""
  for qkv, o, gate_up, down in layers:
    x = x + quant.matmul(jnp.tanh(quant.matmul(x, qkv)[:, :HIDDEN]), o)
    g = quant.matmul(x, gate_up)
    x = x + quant.matmul(jax.nn.silu(g[:, :MLP]) * g[:, MLP:], down)
  return quant.matmul(x, head)


def main(argv):
  del argv
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, HIDDEN)).astype(np.float32))
  layouts = {"gguf": _weights(False), "packed": _weights(True)}
  nbytes = sum(t.nbytes for layer in layouts["gguf"][0] for t in layer) + layouts["gguf"][1].nbytes
  for layers, head in layouts.values():  # compile and warm up
    for _ in range(3):
      _chain(x, layers, head).block_until_ready()
  times = {name: [] for name in layouts}
  for _ in range(_ROUNDS.value):
    for name, (layers, head) in layouts.items():
      for _ in range(_STEPS.value):
        t0 = time.perf_counter()
        _chain(x, layers, head).block_until_ready()
        times[name].append(time.perf_counter() - t0)
  print(f"{4 * _LAYERS.value + 1} matmuls, {nbytes / 1e6:.1f} MB of weights, kernel "
        f"{_pigjax_ffi.quant_isa()} on {_pigjax_ffi.quant_num_threads()} threads")
  for name, ts in times.items():
    med = statistics.median(ts)
    print(f"  {name:6s} median {1e3 * med:.2f} ms per chain ({nbytes / med / 1e9:.1f} GB/s), "
          f"min {1e3 * min(ts):.2f} ms")


if __name__ == "__main__":
  app.run(main)
