r"""One layer's dense decode attention in the host kernel, timed alone (SmolLM2 head shapes).

What one of MagicPIG's dense layers (and each layer of dense decoding) costs at a given context,
measured rather than estimated from whole steps. Times `host_attention.decode_attend` (the
`pigjax_decode_attend` handler) for one query row against a float32 and a bfloat16 cache. Four
caches are cycled, so that a call does not find its cache in the last level cache.

  python scripts/time_decode_attend.py --context=131072
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from pigjax import host_attention

_CONTEXT = flags.DEFINE_integer("context", 131072, "Filled cache rows.")
_CALLS = flags.DEFINE_integer("calls", 24, "Timed calls per dtype.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 3, "KV heads (SmolLM2-135M: 3).")
_Q_HEADS = flags.DEFINE_integer("q_heads", 9, "Query heads (SmolLM2-135M: 9).")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dim.")


def main(argv):
  del argv
  n, kv, h, d = _CONTEXT.value, _KV_HEADS.value, _Q_HEADS.value, _HEAD_DIM.value
  attend = jax.jit(host_attention.decode_attend)
  q = jnp.ones((1, h, d), jnp.float32)
  lengths = jnp.asarray([n], jnp.int32)
  for dtype in (jnp.float32, jnp.bfloat16):
    caches = [jnp.asarray(np.random.default_rng(i).normal(size=(1, kv, n, d)), dtype)
              for i in range(4)]
    times = []
    for i in range(4 + _CALLS.value):  # the first four warm up (compile, first touch)
      t0 = time.perf_counter()
      jax.block_until_ready(attend(q, caches[i % 4], caches[(i + 1) % 4], lengths))
      if i >= 4:
        times.append(time.perf_counter() - t0)
    mb = 2 * kv * n * d * jnp.dtype(dtype).itemsize / 1e6
    t = float(np.median(times))
    print(f"{jnp.dtype(dtype).name} cache, {n} rows: median {1e3 * t:.2f} ms per layer "
          f"(IQR {1e3 * (np.percentile(times, 75) - np.percentile(times, 25)):.2f}), "
          f"{mb:.0f} MB of K and V, {mb / 1e3 / t:.1f} GB/s")


if __name__ == "__main__":
  app.run(main)
