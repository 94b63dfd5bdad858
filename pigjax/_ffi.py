"""Registers the extension's XLA FFI handlers with jax (once, on import)."""

import jax

from pigjax import _pigjax_ffi

# Stateful handler types need the CPU backend to exist before registration (jaxlib 0.12).
jax.devices("cpu")
for _name, _capsule in _pigjax_ffi.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
