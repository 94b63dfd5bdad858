"""A tiny random-weight Llama for tests and smoke runs (set --config.checkpoint to its directory)."""

from pigjax import config


def get_config():
  return config.to_config_dict(config.Config(
      checkpoint="",
      max_seq_len=512,
      prefill_chunk=64,
      attention=config.AttentionConfig(num_bits=6, num_tables=20, sink=2, window=8,
                                       dense_layers=(0,), generated_buffer=16),
  ))
