"""Llama-3.1-8B-Instruct from a local Hugging Face directory (set --config.checkpoint=PATH).

MagicPIG's paper setting: (num_bits, num_tables) = (10, 150), layers 0 and 16 dense.
"""

from pigjax import config


def get_config():
  return config.to_config_dict(config.Config(
      checkpoint="",  # a Hugging Face Llama-3.1 directory or an Orbax checkpoint; required
      dtype="bfloat16",
      max_seq_len=131072,
      prefill_chunk=2048,
      attention=config.AttentionConfig(kind="magicpig", num_bits=10, num_tables=150,
                                       dense_layers=(0, 16)),
  ))
