"""pigjax: MagicPIG LSH-sampled attention for Llama models in JAX/Flax."""
