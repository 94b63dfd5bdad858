r"""One context's MagicPIG decode step, timed and with the store kernel's counters.

For kernel work: builds the benchmark's documents context (bench_contexts, the cached 2k pieces)
once, then times `--steps` decode steps (interleaved with the dense step when --dense) and prints
the store's per-step counters: attend wall time, lookup / score / softmax thread time, candidate
fraction, ids walked, bytes read, and `alone_ns` (time the calling thread ran a parallel call
before a worker joined). Quicker than scripts/bench_decode.py (no llama.cpp, one context).

  python scripts/profile_step.py --context=32768 --steps=6 --dense
"""

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/ is a top-level package beside pigjax/, not installed

from pigjax.config import AttentionConfig, Config
from pigjax.engine import Engine
from pigjax.step import kv_cache_dtype
from pigjax.magicpig import MagicPigBackend
from pigjax.pipeline import Pipeline
from pigjax.store import HostKVStore
from tools import bench, bench_contexts

_CONTEXT = flags.DEFINE_integer("context", 32768, "Context tokens.")
_STEPS = flags.DEFINE_integer("steps", 6, "Timed decode steps per method.")
_DENSE = flags.DEFINE_bool("dense", False, "Also time the dense step, interleaved.")
_WEIGHTS = flags.DEFINE_string("weights", "gguf", "Config.weights.")
_STORE_DTYPE = flags.DEFINE_string("store_dtype", AttentionConfig.store_dtype, "Host K/V dtype.")
_ESTIMATOR = flags.DEFINE_string("estimator", "magicpig", "attention.estimator.")
_NUM_BITS = flags.DEFINE_integer("num_bits", AttentionConfig.num_bits, "MagicPIG K.")
_NUM_TABLES = flags.DEFINE_integer("num_tables", AttentionConfig.num_tables, "MagicPIG L.")
_THREADS = flags.DEFINE_integer("threads", 0, "attention.threads: 0 runs the store on the "
                                "process's compute pool (all cores), N > 0 on its own N threads.")
_ROPE_SCALING = flags.DEFINE_float(
    "rope_scaling_factor", 0.0,
    "If > 0, run the model with Llama-3.1 ('llama3') RoPE scaling by this factor over its "
    "trained context (SmolLM2: 8192), as one runs a model past that context "
    "(bench.with_rope_scaling); both methods use it. 0: the checkpoint's RoPE.")
_CACHE_DTYPE = flags.DEFINE_enum("cache_dtype", "auto", ["auto", "float32", "bfloat16"],
                                 "Config.cache_dtype (the dense cache, MagicPIG's exact buffer).")


def main(argv):
  del argv
  n = _CONTEXT.value
  att = AttentionConfig(kind="magicpig", num_bits=_NUM_BITS.value, num_tables=_NUM_TABLES.value,
                        store_dtype=_STORE_DTYPE.value, estimator=_ESTIMATOR.value,
                        threads=_THREADS.value)
  pipe = Pipeline.load(Config(checkpoint="smollm2", max_seq_len=n + 512, attention=att,
                              weights=_WEIGHTS.value, cache_dtype=_CACHE_DTYPE.value),
                       progress=False)
  cfg = bench.with_rope_scaling(pipe, _ROPE_SCALING.value)
  a, m = cfg.attention, cfg.model
  dense_engine = Engine(dataclasses.replace(cfg, attention=dataclasses.replace(a, kind="dense")),
                        pipe.model)
  backend = MagicPigBackend(cfg)
  backend.store = HostKVStore(num_layers=len(backend.sparse_layers), num_slots=1,
                              num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                              num_bits=a.num_bits, num_tables=a.num_tables, capacity=n,
                              dtype=a.store_dtype, threads=a.threads, estimator=a.estimator,
                              proxy_bits=a.proxy_bits, proxy_fraction=a.proxy_fraction,
                              proxy_tail=a.proxy_tail)
  engine = Engine(cfg, pipe.model, backend)
  count = bench_contexts.pieces_needed(n, 2048, a.sink)
  piece_ids = bench_contexts.document_pieces(pipe.tokenizer.encode, count, 2048)
  pieces = [bench_contexts.piece_kv(dense_engine, p, bench_contexts.DEFAULT_CACHE_DIR, print)
            for p in piece_ids]
  capacity = n + 256
  dense = bench_contexts.stitched_cache(pieces, n, capacity, m, a.sink,
                                       kv_cache_dtype(cfg, pipe.model.dtype))
  t0 = time.perf_counter()
  pc = bench.magicpig_cache(backend, dense, n)
  print(f"store built in {time.perf_counter() - t0:.1f} s, {backend.store.memory_bytes() / 1e9:.2f} GB")
  fns = {"magicpig": bench.decode_stepper(engine, pc, 1, capacity)}
  if _DENSE.value:
    fns["dense"] = bench.decode_stepper(dense_engine, dense, 1, capacity)
  del pc, dense
  bench.interleaved(fns, 1, 2)
  steps = _STEPS.value
  times = bench.interleaved(fns, 3, max(1, steps // 3), warmup=0)
  for name, t in times.items():
    print(f"{name}: median {1e3 * np.median(t):.1f} ms per step "
          f"({', '.join(f'{1e3 * x:.1f}' for x in t)})")
  bench.set_profiling(backend.store, True)
  bench.interleaved({"magicpig": fns["magicpig"]}, 1, steps, warmup=0)
  p = bench.kernel_profile(backend.store)
  ms = lambda key: p[key] * 1e-6 / steps  # noqa: E731
  lookup = ""  # MagicPIG's table lookup only: the proxy scans its index instead
  if _ESTIMATOR.value == "magicpig":
    # distinct_candidates exists only in builds with -C cmake.define.PIGJAX_PROFILE=ON.
    distinct = (f" ({p['distinct_candidates'] / max(1, p['candidates']):.0%} of them distinct over "
                f"a kv head's query heads)" if "distinct_candidates" in p else "")
    lookup = f"{distinct}; ids walked per head {p['ids_walked'] / max(1, p['heads']):.0f}"
  print(f"store attend {ms('attend_ns'):.1f} ms per step (thread ms: lookup {ms('lookup_ns'):.1f}, "
        f"score {ms('score_ns'):.1f}, softmax {ms('softmax_ns'):.1f}; caller alone "
        f"{ms('alone_ns'):.1f}); candidates {p['candidates'] / max(1, p['heads']) / (n - 68):.2%} "
        f"of the pool{lookup}; "
        f"{p['bytes'] / steps / 1e6:.0f} MB per step = {p['bytes'] / max(1, p['attend_ns']):.2f} GB/s")
  if p["candidates"]:
    slices = bench.candidate_slices(p, n - 68)
    print(f"candidates by pool slice (oldest first, {len(slices)} slices of "
          f"{(n - 68) // len(slices)} tokens): {' '.join(f'{x:.1%}' for x in slices)}")


if __name__ == "__main__":
  app.run(main)
