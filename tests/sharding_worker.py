"""Runs greedy generation on several meshes in a fresh process (for tests/test_sharding.py).

The pytest process has already started jax with one CPU device; the number of CPU devices can
only be chosen before jax's backends start, so the mesh tests run this file in a subprocess:

  python tests/sharding_worker.py --devices 4 --checkpoint DIR --meshes 1x1,2x2 \
      --kinds dense,magicpig --out result.json

It writes {kind: {mesh: [token ids per prompt]}} and, for each sharded MagicPIG run, the operand
shapes of the FFI attend calls in the compiled decode step (to show each device's call sees only
its own rows and heads).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--devices", type=int, required=True)
  parser.add_argument("--checkpoint", required=True)
  parser.add_argument("--meshes", default="1x1,2x2")
  parser.add_argument("--kinds", default="dense,magicpig")
  parser.add_argument("--prompt_lens", default="150,90,30,120")
  parser.add_argument("--prompts_json", default="",
                      help="A JSON file of prompt token-id lists (replaces --prompt_lens).")
  parser.add_argument("--max_new_tokens", type=int, default=12)
  parser.add_argument("--out", required=True)
  args = parser.parse_args()

  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)
  from pigjax.config import AttentionConfig, Config, MeshConfig, SamplingConfig
  from pigjax.engine import Engine
  from pigjax.pipeline import Pipeline, make_backend

  sc = SamplingConfig(max_new_tokens=args.max_new_tokens)
  # Prompts of distinct token ids in the tiny vocabulary (>= 259 ids; SmolLM2's is larger).
  prompts = [[3 + (7 * i + 11 * r) % 250 for i in range(n)]
             for r, n in enumerate(int(x) for x in args.prompt_lens.split(","))]
  if args.prompts_json:
    with open(args.prompts_json) as f:
      prompts = json.load(f)
  result: dict = {"ids": {}, "attend_operands": {}}
  pipe = None
  for kind in args.kinds.split(","):
    # Small tables and buffers: a pool of ~100 tokens, and the generated buffer moves into the
    # pool during the run (store_insert inside the decode loop too).
    att = AttentionConfig(kind=kind, num_bits=4, num_tables=8, sink=4, window=16,
                          dense_layers=(0,), generated_buffer=8)
    result["ids"][kind] = {}
    for mesh in args.meshes.split(","):
      data, model = (int(x) for x in mesh.split("x"))
      cfg = Config(checkpoint=args.checkpoint, attention=att, weights="dense",
                   mesh=MeshConfig(data=data, model=model), max_seq_len=512)
      if pipe is None:
        pipe = Pipeline.load(cfg, progress=False)
      else:  # the same weights, another backend and mesh
        cfg = dataclasses.replace(cfg, model=pipe.cfg.model)
        pipe = dataclasses.replace(pipe, cfg=cfg,
                                   engine=Engine(cfg, pipe.model, make_backend(cfg)))
      ids, _, _ = pipe.engine.generate(prompts, sc)
      result["ids"][kind][mesh] = ids
      if kind == "magicpig" and mesh != "1x1":
        hlo = "\n".join(c.as_text() for c in pipe.engine.programs.compiled("decode"))
        result["attend_operands"][mesh] = [
            re.findall(r"f32\[[0-9,]+\]", line.split("custom_call_target")[0])
            for line in hlo.splitlines() if 'custom_call_target="pigjax_attend"' in line]
  with open(args.out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
