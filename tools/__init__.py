"""Benchmark, soak and documentation tooling: long benchmark contexts, decode-speed
measurements, soak runs and the generator of docs/configuration.md, imported by `scripts/` and by the tests that check them on tiny sizes. It is not part of the
installed library (the wheel ships only `pigjax/`); it uses pigjax's modules the way a caller of
the library would, and `scripts/` puts the repository root on `sys.path` to import it."""
