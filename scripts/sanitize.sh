#!/usr/bin/env bash
# Builds the extension with AddressSanitizer + UndefinedBehaviorSanitizer into build/sanitize and
# runs the store, FFI, robustness and fuzz tests against it. The build also compiles in the
# counters of PIGJAX_PROFILE (xla_ffi/CMakeLists.txt), so that their tests run here. Exits
# non-zero on any failure or any sanitizer report. Needs the repo's .venv (as .ci/run makes it);
# installs its build tools itself.
#
#   bash scripts/sanitize.sh            # PYTHON=... to use another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=build/sanitize
start=$(date +%s)

# 1. The sanitized build, with its own build dir, installed (python files + .so) into $OUT/site.
"$PY" -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.4"
rm -rf "$OUT/site" && mkdir -p "$OUT"
"$PY" -m pip install -q --no-deps --no-build-isolation --target "$OUT/site" \
  -C build-dir="$OUT/build" -C cmake.define.PIGJAX_SANITIZE=ON -C cmake.define.PIGJAX_PROFILE=ON .
echo "sanitize: build took $(( $(date +%s) - start )) s"

# 2. An interpreter that sees the venv's dependencies but not its editable pigjax: a bare venv
#    whose .pth names the main site-packages as a plain path (so its editable-install hook, a
#    .pth file there, is not run). Tests run from $OUT/site, so `import pigjax` is the sanitized
#    build, in pytest and in the subprocesses the tests start (cwd = the test root).
"$PY" -m venv --without-pip --clear "$OUT/venv"
purelib="import sysconfig; print(sysconfig.get_paths()['purelib'])"
main_site=$("$PY" -c "$purelib")
echo "$main_site" > "$("$OUT/venv/bin/python" -c "$purelib")/pigjax_main_venv.pth"
cp -r tests tools pyproject.toml "$OUT/site/"

# 3. The tests, with libasan (then libstdc++) preloaded: jaxlib aborts at import otherwise.
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export PIGJAX_SANITIZED=1
log="$OUT/pytest.log"
set +e
(cd "$OUT/site" && ../venv/bin/python -m pytest -q -n 0 -p no:cacheprovider \
   tests/test_store.py tests/test_store_proxy.py tests/test_robustness.py tests/test_fuzz.py) 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if grep -qE "ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer" "$log"; then
  echo "sanitize: sanitizer reports in $log"
  exit 1
fi
echo "sanitize: pytest exit $rc, $(( $(date +%s) - start )) s in all"
exit "$rc"
