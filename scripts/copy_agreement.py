r"""Greedy agreement of MagicPIG with dense decoding on a passage-copy prompt.

The prompt is the first --doc_tokens tokens of a real document followed by its first --cue_tokens
tokens again, so the model's best continuation is to keep copying the document's opening from
~doc_tokens positions back. Dense and MagicPIG (one run per --budgets entry) decode greedily;
we report how many of the first --new_tokens tokens agree, where they first diverge, and the
measured fraction of the pool MagicPIG attended.

  python scripts/copy_agreement.py --budgets=10:150,9:120,8:75
"""

import dataclasses
import time

from absl import app, flags

from pigjax.config import AttentionConfig, Config, SamplingConfig
from pigjax.engine import Engine
from pigjax.magicpig import MagicPigBackend
from pigjax.pipeline import Pipeline

_DOC = flags.DEFINE_string("doc", "/usr/share/common-licenses/GPL-3", "A long plain-text file.")
_DOC_TOKENS = flags.DEFINE_integer("doc_tokens", 3900, "Document tokens before the repeat.")
_CUE = flags.DEFINE_integer("cue_tokens", 64, "Tokens of the opening repeated at the end.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Greedy tokens compared.")
_BUDGETS = flags.DEFINE_list("budgets", ["10:150"], "num_bits:num_tables pairs.")
_DENSE_LAYERS = flags.DEFINE_list("dense_layers", ["0", "16"], "Layers kept dense.")


def main(argv):
  del argv
  pipe = Pipeline.load(Config(checkpoint="smollm2", max_seq_len=8192), progress=False)
  with open(_DOC.value, encoding="utf-8") as f:
    ids = pipe.tokenizer.encode(f.read())
  if len(ids) < _DOC_TOKENS.value:
    raise app.UsageError(f"{_DOC.value} has {len(ids)} tokens, fewer than --doc_tokens.")
  prompt = ids[:_DOC_TOKENS.value] + ids[:_CUE.value]
  sc = SamplingConfig(max_new_tokens=_NEW.value)
  t0 = time.perf_counter()
  (dense,), _, _ = pipe.engine.generate([prompt], sc)
  print(f"prompt {len(prompt)} tokens; dense continuation ({time.perf_counter() - t0:.0f} s): "
        f"{pipe.tokenizer.decode(dense)!r}")
  copied = sum(a == b for a, b in zip(dense, ids[_CUE.value:]))
  print(f"dense copies {copied}/{len(dense)} tokens of the document verbatim")
  print("| num_bits | num_tables | agree | first divergence | attended | decode tok/s |")
  print("| --- | --- | --- | --- | --- | --- |")
  for budget in _BUDGETS.value:
    num_bits, num_tables = (int(x) for x in budget.split(":"))
    cfg = dataclasses.replace(pipe.cfg, attention=AttentionConfig(
        kind="magicpig", num_bits=num_bits, num_tables=num_tables,
        dense_layers=tuple(int(x) for x in _DENSE_LAYERS.value)))
    engine = Engine(cfg, pipe.model, MagicPigBackend(cfg))
    (got,), _, stats = engine.generate([prompt], sc)
    agree = sum(a == b for a, b in zip(got, dense))
    first = next((i for i, (a, b) in enumerate(zip(got, dense)) if a != b), len(dense))
    print(f"| {num_bits} | {num_tables} | {agree}/{len(dense)} | {first} | "
          f"{100 * stats.extra['pool_fraction']:.2f}% | {stats.decode_tokens_per_s:.1f} |",
          flush=True)


if __name__ == "__main__":
  app.run(main)
