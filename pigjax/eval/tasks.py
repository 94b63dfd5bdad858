"""Examples and scores for the quality tasks (QUALITY.md, "Method").

Every task is (context, query, answer) token ids. Under the *paper* protocol context + query are
prefilled densely and only the answer tokens go through the sampled decode path; under the
*strict* protocol only the context is prefilled and query + answer go through it. Examples of one
batch have identical token counts, so a batch shares one compiled step.

  copy     context = real text; query = 8 tokens copied from near its start (position 32);
           answer = the next `span` tokens of that passage. Teacher-forced top-1 accuracy.
  ppl      context = real text; answer = its next `span` tokens. NLL per token (one protocol:
           there is no query).
  passkey  a needle "The pass key is NNNNN. Remember it. ..." at a random depth of real text;
           query "What is the pass key? The pass key is"; answer " NNNNN" (digits split).
           Forced (the leading space forced with the prefix; teacher-forced digits: exact match,
           digit accuracy, gold log-prob) and free-form (greedy, digit-restricted exact match).
  multikey four needles "The pass key of door A is NNNNN. ..." (doors A-D, distinct keys) at
           random depths in random order; the query asks for one door's key.
           Scored like passkey (retrieval of the right needle among similar ones).
  error    dense activations fed over the ppl answer; relative L2 error of each sparse layer's
           attention output against dense (see policies.py, probe mode).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pigjax.eval import data

COPY_START, COPY_CUE = 32, 8
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


MULTI_NEEDLE = "\nThe pass key of door {name} is {key}. Remember it. {key} opens door {name}.\n"
MULTI_QUESTION = "\nWhat is the pass key of door {name}? The pass key of door {name} is"
MULTI_NAMES = ("A", "B", "C", "D")


@dataclasses.dataclass
class Batch:
  """Equal-length examples: context [B, N], query [B, Q], answer [B, A] int32."""
  context: np.ndarray
  query: np.ndarray
  answer: np.ndarray
  info: list[dict]


def _rng(seed: int, length: int, example: int, salt: int) -> np.random.Generator:
  return np.random.default_rng([seed, length, example, salt])


def doc_batch(docs, encode, length: int, examples: range, seed: int, span: int) -> Batch:
  """Shared by copy, ppl and error: context of length - 2 * span tokens of real text."""
  n = length - 2 * span
  ctx, cont = [], []
  for e in examples:
    ids = data.haystack_ids(docs, encode, n + span, _rng(seed, length, e, 0))
    ctx.append(ids[:n]), cont.append(ids[n:])
  return Batch(np.array(ctx, np.int32), np.zeros((len(ctx), 0), np.int32),
               np.array(cont, np.int32), [{"context_tokens": n} for _ in ctx])


def copy_parts(batch: Batch, span: int) -> tuple[np.ndarray, np.ndarray]:
  """(query, answer) of the copy task: a passage from the start of each context."""
  src = batch.context[:, COPY_START:COPY_START + COPY_CUE + span]
  return src[:, :COPY_CUE], src[:, COPY_CUE:]


def passkey_batch(docs, encode, length: int, examples: range, seed: int) -> Batch:
  q = encode(QUESTION)
  ctx, ans, info = [], [], []
  for e in examples:
    rng = _rng(seed, length, e, 1)
    key = int(rng.integers(10000, 100000))
    needle = encode(NEEDLE.format(key=key))
    n_hay = length - 64 - len(needle) - len(q)
    hay = data.haystack_ids(docs, encode, n_hay, rng)
    depth = float(rng.uniform(0.1, 0.9))
    at = int(depth * n_hay)
    ctx.append(hay[:at] + needle + hay[at:])
    ans.append(encode(f" {key}"))
    info.append({"key": key, "depth": round(depth, 3), "needle_at": at,
                 "context_tokens": len(ctx[-1])})
  return Batch(np.array(ctx, np.int32), np.array([q] * len(ctx), np.int32),
               np.array(ans, np.int32), info)


def multikey_batch(docs, encode, length: int, examples: range, seed: int) -> Batch:
  """Needles for every name in MULTI_NAMES with distinct keys; the query names one of them.

  The questions of all names must encode to the same number of tokens (one batch, one query
  length); a tokenizer for which they do not is refused."""
  questions = [encode(MULTI_QUESTION.format(name=n)) for n in MULTI_NAMES]
  if len({len(q) for q in questions}) != 1:
    raise ValueError("multikey: the questions for " + ", ".join(MULTI_NAMES) + " encode to "
                     f"{[len(q) for q in questions]} tokens; they must be equally long.")
  ctx, qs, ans, info = [], [], [], []
  for e in examples:
    rng = _rng(seed, length, e, 2)
    keys = [int(k) for k in rng.choice(np.arange(10000, 100000), len(MULTI_NAMES), replace=False)]
    target = int(rng.integers(len(MULTI_NAMES)))
    needles = [encode(MULTI_NEEDLE.format(name=n, key=k)) for n, k in zip(MULTI_NAMES, keys)]
    order = rng.permutation(len(MULTI_NAMES))  # which needle goes shallowest
    n_hay = length - 64 - sum(len(x) for x in needles) - len(questions[target])
    if n_hay < 1:
      raise ValueError(f"multikey: length {length} leaves no room for text around four needles "
                       f"of {sum(len(x) for x in needles)} tokens; use a longer length.")
    hay = data.haystack_ids(docs, encode, n_hay, rng)
    depths = np.sort(rng.uniform(0.1, 0.9, len(MULTI_NAMES)))
    cuts = [int(d * n_hay) for d in depths]
    ids, prev = [], 0
    for cut, j in zip(cuts, order):
      ids += hay[prev:cut] + needles[j]
      prev = cut
    ctx.append(ids + hay[prev:])
    qs.append(questions[target])
    ans.append(encode(f" {keys[target]}"))
    info.append({"key": keys[target], "name": MULTI_NAMES[target], "keys": keys,
                 "depth": round(float(depths[list(order).index(target)]), 3),
                 "context_tokens": len(ctx[-1])})
  return Batch(np.array(ctx, np.int32), np.array(qs, np.int32), np.array(ans, np.int32), info)


# -- scores ---------------------------------------------------------------------------------

def forced_scores(lp_BTV: np.ndarray, answer_BT: np.ndarray,
                  dense_lp_BTV: np.ndarray | None) -> list[dict]:
  """Per example: top-1 accuracy, exact match, gold log-prob / NLL, and against dense the
  top-1 agreement and KL(dense || method) of the next-token distributions (means per token)."""
  gold = np.take_along_axis(lp_BTV, answer_BT[..., None], axis=-1)[..., 0]
  top1 = np.argmax(lp_BTV, axis=-1) == answer_BT
  out = []
  for b in range(lp_BTV.shape[0]):
    r = {"top1": float(top1[b].mean()), "exact": bool(top1[b].all()),
         "gold_logprob": float(gold[b].sum()), "nll": float(-gold[b].mean())}
    if dense_lp_BTV is not None:
      p = np.exp(dense_lp_BTV[b])
      r["kl"] = float(np.mean(np.sum(p * (dense_lp_BTV[b] - lp_BTV[b]), axis=-1)))
      r["agree"] = float(np.mean(np.argmax(dense_lp_BTV[b], -1) == np.argmax(lp_BTV[b], -1)))
    out.append(r)
  return out


def free_scores(generated_BT: np.ndarray, keys: list[int], decode) -> list[dict]:
  """Digit-restricted exact match of a greedy continuation."""
  out = []
  for b, key in enumerate(keys):
    text = decode([int(t) for t in generated_BT[b]])
    digits = "".join(c for c in text if c.isdigit())
    out.append({"exact": digits[:len(str(key))] == str(key), "text": text})
  return out
