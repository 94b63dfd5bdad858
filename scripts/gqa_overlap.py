r"""How much the MagicPIG candidate sets of the query heads that share a KV head overlap.

Prefills --tokens tokens of a real text densely with SmolLM2, takes each probed layer's queries at
the last position and its pool keys (positions [sink, n - window)), and prints, per layer, the
candidate fraction and, over all layers, |union of a group's candidates| / sum of per-head counts
(1.0 = disjoint sets: sharing K/V row gathers across a group would save nothing).

  python scripts/gqa_overlap.py --tokens=2048 --num_bits=10 --num_tables=150
"""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/ is a top-level package beside pigjax/, not installed

from pigjax import lsh, reference
from pigjax.attention import DenseCache, dense_attend
from pigjax.config import Config
from pigjax.pipeline import Pipeline
from tools import bench

_TOKENS = flags.DEFINE_integer("tokens", 2048, "Prompt tokens (from /usr/share/common-licenses/GPL-3).")
_NUM_BITS = flags.DEFINE_integer("num_bits", 10, "Bits per table.")
_NUM_TABLES = flags.DEFINE_integer("num_tables", 150, "Tables.")
_LAYERS = flags.DEFINE_list("layers", [str(l) for l in range(1, 30, 3)], "Layers to probe.")


def main(argv):
  del argv
  n, sink, window = _TOKENS.value, 4, 64
  pipe = Pipeline.load(Config(checkpoint="smollm2", max_seq_len=max(n, 2048)), progress=False)
  m = pipe.model.cfg
  queries = {}

  def record(layer, q, k, v, cache):
    queries[layer] = q[:, -1]
    return dense_attend(layer, q, k, v, cache)

  cache = DenseCache.create(m.num_layers, 1, m.num_kv_heads, n, m.head_dim, jnp.float32)
  ids = bench.prompt_ids(pipe.tokenizer, n)
  _, cache = pipe.model(jnp.asarray([ids]), jnp.arange(n)[None], record, cache)
  group = m.num_heads // m.num_kv_heads
  total = union = 0
  for layer in (int(l) for l in _LAYERS.value):
    k = cache.k[layer][:, :, sink:n - window]
    valid = jnp.ones(k.shape[:3], bool)
    w = lsh.simhash_matrix(0, layer, m.head_dim, _NUM_BITS.value, _NUM_TABLES.value)
    _, codes = lsh.centre_and_hash(k, valid, w, _NUM_BITS.value, _NUM_TABLES.value)
    cand_HT = np.asarray(reference.candidate_mask(queries[layer], codes, valid, w, _NUM_BITS.value,
                                            _NUM_TABLES.value))[0]
    for kv in range(m.num_kv_heads):
      g = cand_HT[kv * group:(kv + 1) * group]
      total += int(g.sum())
      union += int(np.any(g, axis=0).sum())
    print(f"layer {layer}: candidate fraction {cand_HT.mean():.4f}")
  print(f"union / sum of per-head candidates over the probed layers: {union / total:.3f}")


if __name__ == "__main__":
  app.run(main)
