#!/usr/bin/env bash
# Re-measures README.md's "What to expect" tables and prints them.
#
#   bash scripts/bench_table.sh            # speed and quality (about 30 + 15 minutes on 2 cores)
#   bash scripts/bench_table.sh speed      # only the decode steps
#   bash scripts/bench_table.sh quality    # only the 8k quality runs
#
# Run it on a quiet machine: every speed number is a median of interleaved rounds, but other
# jobs still move them by 10-20%. The llama.cpp peer needs `pip install llama-cpp-python`
# (built from source, about 8 minutes); without it its column is left empty.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
what=${1:-all}

$py scripts/fetch_data.py
if [ "$what" = all ] || [ "$what" = speed ]; then
  # pigjax dense with a bfloat16 cache is the strongest dense baseline (half the bytes of float32).
  common=(--weights=gguf --estimators=magicpig,proxy --cache_dtype=bfloat16 --llama8b_contexts=
          --plots=)
  $py scripts/bench_decode.py "${common[@]}" --contexts=4096,8192 --llamacpp_contexts=4096,8192 \
      --rounds=4 --steps=3 --out benchmarks/decode_4k_8k.json
  $py scripts/bench_decode.py "${common[@]}" --contexts=32768 --rope_scaling_factor=4 \
      --llamacpp_contexts= --rounds=4 --steps=3 --out benchmarks/decode_32k_rope4.json
  $py scripts/bench_decode.py "${common[@]}" --contexts=131072 --rope_scaling_factor=16 \
      --llamacpp_contexts= --rounds=3 --steps=4 --out benchmarks/decode_128k_rope16.json
fi
if [ "$what" = all ] || [ "$what" = quality ]; then
  for estimator in magicpig proxy; do
    $py scripts/eval_quality.py --out "runs/quality_8k_$estimator" --lengths 8192 \
        --budgets 10:150 --methods dense,magicpig_ffi --tasks copy,ppl,error,passkey --batch 1 \
        --config.attention.estimator="$estimator"
    cp "runs/quality_8k_$estimator/results.json" "benchmarks/quality_8k_$estimator.json"
  done
fi
$py scripts/readme_table.py
