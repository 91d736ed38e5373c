#!/usr/bin/env bash
# The gate the compiled async wrappers stay the default behind (tests/stress/compiled_wrappers.py says what it
# runs). The C part is built again with AddressSanitizer and UndefinedBehaviorSanitizer, loaded in place of the
# installed one, under an allocator that frees for real (PYTHONMALLOC=malloc) and fills what it frees, so an object
# freed under the wrapper is garbage when libpython (not instrumented) reads it. Each run happens in a private
# network namespace (Mooncake's handshake binds every interface): the compiled path, the compiled path with
# interrupts, and the Python path (the reference) under the same load. Needs what scripts/setup.sh installed.
#   KVT_STRESS_SOURCE=path/to/_async_compiled.c  stress another version of the C part (to show the gate failing)
#   KVT_STRESS_SECONDS=N                          seconds per run (default 8)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${KVT_PYTHON:-$(bash "$ROOT/scripts/setup.sh" | tail -n 1)}"
SOURCE="${KVT_STRESS_SOURCE:-$ROOT/otel_kvtransfer/engines/mooncake/_async_compiled.c}"
SECONDS_PER_RUN="${KVT_STRESS_SECONDS:-8}"
[ -r "$SOURCE" ] || { echo "stress: no C source at $SOURCE" >&2; exit 2; }
command -v unshare >/dev/null && command -v ip >/dev/null \
  || { echo "stress: needs unshare (util-linux) and ip (iproute2)" >&2; exit 2; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
include="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
suffix="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
module="$work/_async_compiled$suffix"
cc -shared -fPIC -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined \
  -I"$include" "$SOURCE" -o "$module"
libasan="$(cc -print-file-name=libasan.so)"
libubsan="$(cc -print-file-name=libubsan.so)"
[ -e "$libasan" ] && [ -e "$libubsan" ] \
  || { echo "stress: the compiler's sanitizer runtimes are missing (apt-get install libasan8 libubsan1)" >&2; exit 2; }

sanitized() {  # COMMAND...: under the sanitizers, in a private network namespace
  unshare --net sh -c 'ip link set lo up && exec "$@"' sh \
    env LD_PRELOAD="$libasan:$libubsan" PYTHONMALLOC=malloc PYTHONFAULTHANDLER=1 KVT_COMPILED_MODULE="$module" \
      ASAN_OPTIONS="detect_leaks=0:alloc_dealloc_mismatch=0:max_free_fill_size=4096:free_fill_byte=204:abort_on_error=1" \
      UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" MC_LOG_LEVEL=ERROR "$@"
}

run() {  # HOT_PATH [extra arguments]
  local path="$1"; shift
  sanitized env OTEL_KVTRANSFER_HOT_PATH="$path" OTEL_KVTRANSFER_QUEUE_SIZE=64 OTEL_KVTRANSFER_MAX_PENDING_ASYNC=24 \
    OTEL_KVTRANSFER_FLUSH_INTERVAL_MS=20 timeout -k 10 180 "$PY" "$ROOT/tests/stress/compiled_wrappers.py" \
      --module "$module" --seconds "$SECONDS_PER_RUN" "$@"
}

rc=0
# The wrappers' cases where Python code runs inside them (ids, lengths, answers, interrupts), on the sanitizer build
(cd "$ROOT" && sanitized timeout -k 10 300 "$PY" -m pytest -q -p no:cacheprovider \
  tests/engines/test_mooncake_async_wrappers.py) || rc=1
run compiled --engines 2 --threads 3 || rc=1
run compiled --engines 2 --threads 3 --interrupts || rc=1
run python --engines 2 --threads 3 || rc=1
[ "$rc" = 0 ] && echo "stress: the compiled wrappers held" || echo "stress: FAILED (see the lines above)" >&2
exit "$rc"
