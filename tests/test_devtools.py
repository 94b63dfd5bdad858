"""The build's test and benchmark helpers (_pigjax_devtools, xla_ffi/devtools.cc), which are not
part of pigjax: the trivial `pigjax_scale` FFI handler proves that a second extension built by
the same CMake registers with jax and runs inside a jitted program, and the bandwidth probe
returns sane numbers."""

import jax
import jax.numpy as jnp
import numpy as np

import _pigjax_devtools

jax.devices("cpu")  # the CPU backend exists before registration (as pigjax/_ffi.py does)
for _name, _capsule in _pigjax_devtools.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def _scale(x, factor):
  return jax.ffi.ffi_call("pigjax_scale", jax.ShapeDtypeStruct(x.shape, x.dtype))(
      x, scale=np.float32(factor))


def test_scale_handler_registers_and_runs_jitted():
  x = jnp.arange(7, dtype=jnp.float32)
  np.testing.assert_array_equal(jax.jit(_scale, static_argnums=1)(x, 2.5), np.arange(7) * 2.5)


def test_pigjax_does_not_register_the_dev_handlers():
  from pigjax import _pigjax_ffi

  assert "pigjax_scale" not in _pigjax_ffi.registrations()
  assert not hasattr(_pigjax_ffi, "stream_bandwidth")


def test_stream_bandwidth():
  copy, read = _pigjax_devtools.stream_bandwidth(4 << 20, 1, 2)
  assert copy > 0 and read > 0
