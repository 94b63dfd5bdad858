"""Decode-step benchmark: dense vs MagicPIG at long context, roofline, prefill overhead, peers.

  .venv/bin/python scripts/bench_decode.py --out benchmarks/results.json

--estimators=magicpig,proxy adds the proxy estimator (pigjax/estimators/proxy.py) to the SmolLM2 rows,
timed interleaved with dense and MagicPIG (its own host store), for example:

  nice -n 19 .venv/bin/python scripts/bench_decode.py --contexts=8192,32768 \
      --estimators=magicpig,proxy --llama8b_contexts= --llamacpp_contexts= \
      --context_source=tiled --plots= --out=benchmarks/proxy.json

Writes one JSON with every measurement and the figures of BENCHMARKS.md (--plots; or redraw
them from a JSON with --plot_only). See tools/bench.py for how long contexts are built.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tools/ is a top-level package beside pigjax/, not installed

from pigjax import store, weights
from pigjax.config import AttentionConfig, Config
from pigjax.engine import Engine
from pigjax.magicpig import MagicPigBackend
from pigjax.pipeline import Pipeline
from pigjax.store import HostKVStore
from tools import bench, bench_contexts

FLAGS = flags.FLAGS
flags.DEFINE_list("contexts", ["4096", "32768", "131072"], "Context lengths.")
flags.DEFINE_list("batches", ["1"], "Batch sizes, each at every context where memory allows "
                  "(rows are copies of the one tiled context).")
flags.DEFINE_enum("context_source", "documents", ["documents", "tiled"],
                  "documents: long caches stitched from pieces of many different real documents "
                  "(tools/bench_contexts.py; run scripts/fetch_data.py first); tiled: one GPL-3 "
                  "prefill of --source_tokens repeated.")
flags.DEFINE_integer("source_tokens", 2048, "Tokens per piece (documents) or of the tiled source, "
                     "and of the real prefill timed for the prefill overhead.")
flags.DEFINE_string("piece_cache", str(bench_contexts.DEFAULT_CACHE_DIR),
                    "Where prefilled document pieces are cached (git-ignored data/).")
flags.DEFINE_string("store_dtype", AttentionConfig.store_dtype,
                    "MagicPIG host K/V: bfloat16, float32 or int8.")
flags.DEFINE_enum("cache_dtype", "auto", ["auto", "float32", "bfloat16"],
                  "Dense KV cache (and MagicPIG's exact buffer): auto = the model's float32, "
                  "bfloat16 where that does not fit in memory.")
flags.DEFINE_string("weights", "", "Config.weights for both methods (dense | auto | gguf | q8_0 | "
                    "q4_0 | q4_1); '' keeps the default.")
flags.DEFINE_float("rope_scaling_factor", 0.0,
                   "If > 0, run SmolLM2 with Llama-3.1 ('llama3') RoPE scaling by this factor over "
                   "its trained 8192 tokens, as one runs a model past its context "
                   "(bench.with_rope_scaling; e.g. 4 for 32k, 16 for 128k); every method and "
                   "context of the run uses it. 0: the checkpoint's RoPE.")
flags.DEFINE_integer("rounds", 5, "Interleaved rounds per context.")
flags.DEFINE_integer("steps", 3, "Decode steps per method per round.")
flags.DEFINE_integer("num_bits", 10, "MagicPIG K.")
flags.DEFINE_integer("num_tables", 150, "MagicPIG L.")
flags.DEFINE_integer("threads", 0, "Host kernel threads (0 = all cores).")
flags.DEFINE_list("estimators", ["magicpig"], "Pool estimators timed beside dense in the SmolLM2 "
                  "rows: magicpig (always) and optionally proxy (attention.proxy_* defaults).")
flags.DEFINE_list("llama8b_contexts", ["32768", "131072"], "Attention-only Llama-3.1-8B shapes.")
flags.DEFINE_integer("llama8b_layers", 2, "Layers in the attention-only configuration.")
flags.DEFINE_list("llamacpp_contexts", ["1024", "2048", "4096"],
                  "Contexts llama.cpp is filled to by its own prefill ('' to skip).")
flags.DEFINE_float("memory_margin_gb", 3.0, "RAM left free for other processes.")
flags.DEFINE_string("plots", "benchmarks", "Folder for the PNG figures ('' for none).")
flags.DEFINE_bool("plot_only", False, "Only redraw the figures from --out.")
flags.DEFINE_string("out", "benchmarks/results.json", "Where to write the results.")


def log(*a):
  print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def smollm2(res):
  contexts = [int(c) for c in FLAGS.contexts if c]
  if not contexts:  # --contexts= times only the peers and the attention-only configuration
    res["smollm2"] = []
    return
  att = AttentionConfig(kind="magicpig", num_bits=FLAGS.num_bits, num_tables=FLAGS.num_tables,
                        threads=FLAGS.threads, store_dtype=FLAGS.store_dtype)
  cfg = make_config(max(contexts) + 512, att)
  pipe = Pipeline.load(cfg, progress=False)
  cfg = bench.with_rope_scaling(pipe, FLAGS.rope_scaling_factor)
  dense_cfg = dataclasses.replace(cfg, attention=dataclasses.replace(att, kind="dense"))
  dense_engine = Engine(dense_cfg, pipe.model)
  backend = MagicPigBackend(cfg)
  a, m = cfg.attention, cfg.model
  batches = [int(b) for b in FLAGS.batches]
  backend.store = HostKVStore(num_layers=len(backend.sparse_layers), num_slots=max(batches),
                              num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                              num_bits=a.num_bits, num_tables=a.num_tables,
                              capacity=max(contexts), dtype=a.store_dtype,
                              threads=a.threads)
  pig_engine = Engine(cfg, pipe.model, backend)
  proxy = None
  if "proxy" in FLAGS.estimators:
    pcfg = dataclasses.replace(cfg, attention=dataclasses.replace(a, estimator="proxy"))
    pbackend = MagicPigBackend(pcfg)
    pbackend.store = HostKVStore(num_layers=len(pbackend.sparse_layers), num_slots=max(batches),
                                 num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                                 num_bits=a.num_bits, num_tables=a.num_tables,
                                 capacity=max(contexts), dtype=a.store_dtype, threads=a.threads,
                                 estimator="proxy", proxy_bits=pcfg.attention.proxy_bits,
                                 proxy_fraction=pcfg.attention.proxy_fraction,
                                 proxy_tail=pcfg.attention.proxy_tail)
    proxy = (pbackend, Engine(pcfg, pipe.model, pbackend))

  ids = bench.prompt_ids(pipe.tokenizer, FLAGS.source_tokens)
  src, prefill_s = bench.real_prefill(dense_engine, ids)
  log(f"real prefill of {len(ids)} tokens: {prefill_s:.1f} s")
  # Prefill overhead: MagicPigBackend.after_prefill (centre + hash + FFI insert of every sparse
  # layer) on the real prefill's cache, relative to that prefill. First call compiles.
  for timed in (False, True):
    copy = jax.tree.map(jnp.copy, src)
    backend.store.reset(0)
    bench.set_profiling(backend.store, True)
    t0 = time.perf_counter()
    jax.block_until_ready(backend.after_prefill(copy, np.array([len(ids)], np.int32)))
    after_s = time.perf_counter() - t0
  prof = bench.kernel_profile(backend.store)
  bench.set_profiling(backend.store, False)
  res["prefill"] = dict(tokens=len(ids), dense_prefill_s=prefill_s, after_prefill_s=after_s,
                        insert_kernel_s=prof["insert_ns"] * 1e-9, overhead=after_s / prefill_s,
                        per_1k_tokens_s=after_s / len(ids) * 1024,
                        dense_per_1k_tokens_s=prefill_s / len(ids) * 1024)
  log("prefill overhead", res["prefill"])

  pieces = None
  if FLAGS.context_source == "documents":
    count = bench_contexts.pieces_needed(max(contexts), FLAGS.source_tokens, a.sink)
    piece_ids = bench_contexts.document_pieces(pipe.tokenizer.encode, count, FLAGS.source_tokens)
    pieces = [bench_contexts.piece_kv(dense_engine, p, FLAGS.piece_cache, log) for p in piece_ids]
    log(f"{count} document pieces of {FLAGS.source_tokens} tokens ready")
  res["smollm2"] = []
  for n in contexts:
    for batch in batches:
      _smollm2_row(res, n, batch, src, ids, pieces, m, a, backend, dense_engine, pig_engine,
                   pipe, proxy)
  backend.store.close()
  if proxy:
    proxy[0].store.close()


def make_config(max_seq_len, att):
  """The one Config both methods start from (--weights sets Config.weights for both)."""
  extra = {"weights": FLAGS.weights} if FLAGS.weights else {}
  return Config(checkpoint="smollm2", max_seq_len=max_seq_len, attention=att, **extra)


def _smollm2_row(res, n, batch, src, ids, pieces, m, a, backend, dense_engine, pig_engine, pipe,
                 proxy=None):
  """Dense vs MagicPIG (and the proxy estimator when proxy = (backend, engine)) at context n and
  `batch` rows, interleaved; appends a row to res."""
  capacity = n + 256
  # Both caches live at once (they are timed interleaved). Where the f32 dense cache would not
  # fit next to the store with room to spare for the machine's other users, the dense cache
  # (and so the MagicPIG step's dense layers and exact buffer) is bfloat16; past that, skip.
  # The previous context's pool is freed first, so that it does not count against this one.
  for b in [backend] + ([proxy[0]] if proxy else []):
    for slot in range(b.store.num_slots):
      b.store.reset(slot)
  store_need = sum(HostKVStore.estimate_bytes(
      num_layers=len(backend.sparse_layers), num_slots=batch, num_kv_heads=m.num_kv_heads,
      head_dim=m.head_dim, num_bits=a.num_bits, num_tables=a.num_tables, capacity=n,
      dtype=a.store_dtype, estimator=est) for est in ["magicpig"] + (["proxy"] if proxy else []))
  avail = store.available_bytes() or 1 << 50
  dtype = None
  choices = {"auto": ((4, None), (2, jnp.bfloat16)), "float32": ((4, jnp.float32),),
             "bfloat16": ((2, jnp.bfloat16),)}[FLAGS.cache_dtype]
  for itemsize, dt in choices:
    need = store_need + itemsize * 2 * m.num_layers * m.num_kv_heads * capacity * m.head_dim * batch
    if need + FLAGS.memory_margin_gb * 2**30 < avail:
      dtype = dt or pipe.model.dtype
      break
  if dtype is None:
    res["smollm2"].append(dict(context=n, batch=batch, skipped=f"needs {need / 2**30:.1f} GiB with a "
                               f"{jnp.dtype(choices[-1][1] or jnp.float32).name} dense cache; "
                               f"{avail / 2**30:.1f} GiB available"))
    log(res["smollm2"][-1])
    save(res)
    return
  if pieces is None:
    one = bench.tile_cache(src, len(ids), n, capacity, m, dtype=dtype)
  else:
    one = bench_contexts.stitched_cache(pieces, n, capacity, m, a.sink, dtype)
  dense = bench.repeat_rows(one, batch)
  del one
  tm = {}
  pc = bench.magicpig_cache(backend, dense, n, tm)
  mem = backend.store.memory_bytes()
  fns = {"dense": bench.decode_stepper(dense_engine, dense, batch, capacity),
         "magicpig": bench.decode_stepper(pig_engine, pc, batch, capacity)}
  if proxy:
    ppc = bench.magicpig_cache(proxy[0], dense, n)
    fns["proxy"] = bench.decode_stepper(proxy[1], ppc, batch, capacity)
    del ppc
  del dense, pc
  bench.interleaved(fns, 1, 1)
  times = bench.interleaved(fns, FLAGS.rounds, FLAGS.steps, warmup=0)
  bench.set_profiling(backend.store, True)
  kt = bench.interleaved({"magicpig": fns["magicpig"]}, 1, FLAGS.steps, warmup=0)
  prof = bench.kernel_profile(backend.store)
  bench.set_profiling(backend.store, False)
  steps = FLAGS.steps
  row = dict(context=n, batch=batch, dense_cache_dtype=jnp.dtype(dtype).name,
             context_source=FLAGS.context_source, store_dtype=a.store_dtype,
             rope_scaling_factor=m.rope_scaling_factor,
             **bench.summarise(times, batch), hash_s=tm["hash_s"],
             insert_s=tm["insert_s"], store_bytes=mem,
             kernel_ms_per_step=prof["attend_ns"] * 1e-6 / steps,
             kernel_bytes_per_step=prof["bytes"] / steps,
             lookup_ms=prof["lookup_ns"] * 1e-6 / steps, score_ms=prof["score_ns"] * 1e-6 / steps,
             softmax_ms=prof["softmax_ns"] * 1e-6 / steps,
             candidate_fraction=prof["candidates"] / max(1, prof["heads"]) / (n - 68),
             candidate_fraction_by_slice=bench.candidate_slices(prof, n - 68),
             profiled_step_ms=1e3 * sorted(kt["magicpig"])[len(kt["magicpig"]) // 2])
  row["speedup"] = row["dense_ms"] / row["magicpig_ms"]
  if proxy:
    ps = proxy[0].store
    bench.set_profiling(ps, True)
    bench.interleaved({"proxy": fns["proxy"]}, 1, steps, warmup=0)
    pp = bench.kernel_profile(ps)
    bench.set_profiling(ps, False)
    # Rows read per query head over the pool; bytes: the index scanned plus the rows read.
    row.update(proxy_store_bytes=ps.memory_bytes(),
               proxy_kernel_ms_per_step=pp["attend_ns"] * 1e-6 / steps,
               proxy_kernel_bytes_per_step=pp["bytes"] / steps,
               proxy_read_fraction=pp["candidates"] / max(1, pp["heads"]) / (n - 68),
               proxy_over_magicpig=row["proxy_ms"] / row["magicpig_ms"],
               proxy_speedup=row["dense_ms"] / row["proxy_ms"])
  res["smollm2"].append(row)
  log(json.dumps(row))
  save(res)
  del fns


def llama8b(res):
  res["llama8b_attention"] = []
  for n in [int(c) for c in FLAGS.llama8b_contexts if c]:
    fns, store, info = bench.attention_only_steps(FLAGS.llama8b_layers, 32, 8, 128, n, 1,
                                                  FLAGS.num_bits, FLAGS.num_tables,
                                                  threads=FLAGS.threads)
    times = bench.interleaved(fns, FLAGS.rounds, FLAGS.steps)
    bench.set_profiling(store, True)
    bench.interleaved({"magicpig": fns["magicpig"]}, 1, FLAGS.steps, warmup=0)
    prof = bench.kernel_profile(store)
    row = dict(context=n, layers=FLAGS.llama8b_layers, **bench.summarise(times),
               kernel_ms_per_step=prof["attend_ns"] * 1e-6 / FLAGS.steps,
               kernel_bytes_per_step=prof["bytes"] / FLAGS.steps,
               candidate_fraction=prof["candidates"] / max(1, prof["heads"]) / (n - 68),
               store_bytes=store.memory_bytes(), **info)
    row["speedup"] = row["dense_ms"] / row["magicpig_ms"]
    res["llama8b_attention"].append(row)
    log(json.dumps(row))
    store.close()
    del fns


def llamacpp(res):
  contexts = [int(c) for c in FLAGS.llamacpp_contexts if c]
  if not contexts:
    return
  try:
    peer = bench.LlamaCppPeer(weights.smollm2_gguf_path(), max(contexts) + 64,
                              FLAGS.threads or bench.os.cpu_count())
  except ImportError as e:
    res["llamacpp"] = {"error": f"llama-cpp-python is not installed ({e})"}
    return
  from pigjax.tokenizer import Tokenizer
  tok = Tokenizer.from_gguf(weights.smollm2_gguf_path())
  ids = bench.prompt_ids(tok, max(contexts))
  rows = []
  for n in contexts:
    fill_s = peer.fill(ids[:n])
    t = bench.interleaved({"llamacpp": peer.stepper()}, FLAGS.rounds, FLAGS.steps)
    rows.append(dict(context=n, fill_s=fill_s, **bench.summarise(t)))
    log(json.dumps(rows[-1]))
  res["llamacpp"] = rows


def save(res):
  with open(FLAGS.out, "w") as f:
    json.dump(res, f, indent=1)


def main(argv):
  del argv
  if FLAGS.plot_only:
    with open(FLAGS.out) as f:
      print(bench.plot_results(json.load(f), FLAGS.plots))
    return
  res = {"cpu": bench.cpu_model(), "flags": FLAGS.flags_into_string()}
  res["bandwidth"] = bench.memory_bandwidth(threads=FLAGS.threads)
  log("bandwidth", res["bandwidth"])
  res["host_bytes_per_token"] = bench.host_bytes_per_token(64, FLAGS.num_tables,
                                                          FLAGS.store_dtype)
  # Peers and the small configuration first: the largest SmolLM2 contexts come last.
  for part in (llamacpp, llama8b, smollm2):
    part(res)
    save(res)
  res["bandwidth_end"] = bench.memory_bandwidth(threads=FLAGS.threads)
  log("bandwidth", res["bandwidth_end"])
  save(res)
  if FLAGS.plots:
    log(bench.plot_results(res, FLAGS.plots))


if __name__ == "__main__":
  app.run(main)
