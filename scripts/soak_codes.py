"""Diagnostic for BENCHMARKS.md, "Long generations": do the FFI backend and the pure-jnp
reference hash the same prompt pool into the same codes? The FFI path centres the gathered pool [B, K, S - sink - window,
D]; the reference centres the full cache [B, K, S, D] under a mask. Prints, per sparse layer,
the largest difference of the two pool means and the number of table codes that differ.

  python scripts/soak_codes.py [TEXT_DIR]   # SmolLM2, the same 1024-token prompt as scripts/soak.py
"""
import numpy as np, jax, jax.numpy as jnp, sys
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from pigjax import lsh
from pigjax.config import AttentionConfig, Config
from pigjax.pipeline import Pipeline
from pigjax.eval.runner import Runner
import soak as S
cfg = Config(checkpoint="smollm2", max_seq_len=8192, attention=AttentionConfig(kind="magicpig"))
pipe = Pipeline.load(cfg, progress=False)
text = S.read_text(sys.argv[1] if len(sys.argv) > 1 else "/work/main/data/text")
ids = pipe.tokenizer.encode(text)[:1024]
a, m = pipe.cfg.attention, pipe.cfg.model
runner = Runner(pipe.cfg, pipe.model, chunk=512)
dense, _ = runner.prefill(np.asarray([ids], np.int32), 1536)
n, S_ = 1024, 1536
exact = a.sink + a.window
P = S_ - exact
pool_len = n - exact
@jax.jit
def ffi_style(k, w):
  kp = jnp.take(k, jnp.minimum(jnp.arange(P) + a.sink, S_ - 1), axis=2)
  valid = jnp.broadcast_to((jnp.arange(P) < pool_len)[None, None], kp.shape[:3])
  return lsh.centre_and_hash(kp, valid, w, a.num_bits, a.num_tables)
@jax.jit
def ref_style(k, w):
  pos = jnp.arange(S_)
  pool = (pos >= a.sink) & (pos < n - a.window)
  valid = jnp.broadcast_to(pool[None, None], k.shape[:3])
  return lsh.centre_and_hash(k.astype(jnp.float32), valid, w, a.num_bits, a.num_tables)
tot = 0; mus = 0
for layer in range(m.num_layers):
  if layer in a.dense_layers: continue
  w = lsh.simhash_matrix(a.seed, layer, m.head_dim, a.num_bits, a.num_tables, a.per_layer_hash)
  mu1, c1 = ffi_style(dense.k[layer], w)
  mu2, c2 = ref_style(dense.k[layer], w)
  c1 = np.asarray(c1)[:, :, :pool_len]; c2 = np.asarray(c2)[:, :, a.sink:n - a.window]
  d = int((c1 != c2).sum()); tot += d
  mus = max(mus, float(np.abs(np.asarray(mu1) - np.asarray(mu2)).max()))
  print(layer, "code mismatches", d, "of", c1.size, "max |mu diff|", float(np.abs(np.asarray(mu1) - np.asarray(mu2)).max()), flush=True)
print("total mismatched codes", tot, "max mu diff", mus)
