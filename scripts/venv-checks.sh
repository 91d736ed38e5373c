# Sourced by the set-up scripts (ROOT set): quick checks of a cached virtualenv, and this checkout installed into
# one. A venv cached outside the clone is shared between checkouts, and each CI job runs several set-up scripts:
# importing sglang or Phoenix only to see that they are there costs 5-15 s a time, reinstalling the checkout ~5 s.

# True when every module named is found in VENV (found, not imported: the stamps say whether it is current).
has_modules() {  # VENV MODULE...
  local venv="$1"
  shift
  "$venv/bin/python" -c 'import importlib.util, sys
sys.exit(not all(importlib.util.find_spec(name) for name in sys.argv[1:]))' "$@" >/dev/null 2>&1
}

# True when VENV imports the compiled part (asked from another directory: the checkout itself is no module there).
compiled_built() {  # VENV
  (cd / && "$1/bin/python" -I -c 'import otel_kvtransfer.engines.mooncake._async_compiled') >/dev/null 2>&1
}

# The compiled part (otel_kvtransfer/engines/mooncake/_async_compiled.c) is built into the checkout by the install: its
# source is in the stamp, and where a C compiler is the checkout counts as installed only with it built.
checkout_stamp() {
  echo "$ROOT $(cat "$ROOT/pyproject.toml" "$ROOT"/otel_kvtransfer/engines/mooncake/*.c | sha256sum | cut -c1-16)"
}

# True when VENV imports otel_kvtransfer from this checkout, installed from the pyproject.toml it has now (entry
# points and version come from there). Asked from another directory, with no PYTHON* variables: a venv pointing at
# a checkout since deleted would still import from the current directory.
checkout_installed() {  # VENV
  local venv="$1"
  [ "$(cat "$venv/.kvt-checkout" 2>/dev/null || true)" = "$(checkout_stamp)" ] || return 1
  (cd / && "$venv/bin/python" -I -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("otel_kvtransfer")
here = spec is not None and spec.origin is not None and os.path.dirname(os.path.dirname(spec.origin))
sys.exit(not (here and os.path.samefile(here, sys.argv[1])))' "$ROOT") >/dev/null 2>&1 || return 1
  ! command -v cc >/dev/null || compiled_built "$venv"
}

# This checkout into VENV, editable, unless it is there already.
install_checkout() {  # VENV WHO (the script's name, for its error line)
  local venv="$1" who="$2"
  checkout_installed "$venv" && return 0
  "$venv/bin/python" -m pip install -q --no-deps -e "$ROOT" 2>&1 | grep -v "^WARNING: Location\|^  \|^$\|!!" >&2 || true
  "$venv/bin/python" -c "import otel_kvtransfer" || { echo "$who: otel_kvtransfer did not install" >&2; exit 1; }
  if command -v cc >/dev/null && ! compiled_built "$venv"; then
    echo "$who: a C compiler is here but otel_kvtransfer's compiled part did not build (pip install -v -e . says why)" >&2
    exit 1
  fi
  checkout_stamp > "$venv/.kvt-checkout"
}

# A tool's own small virtualenv at VENV holding PACKAGE==VERSION, rebuilt when the pinned version changes, so a new
# release of the tool never changes what passes (the linter's and the type checker's).
pinned_tool() {  # VENV PACKAGE VERSION WHO (the script's name, for its line)
  local venv="$1" package="$2" version="$3" who="$4"
  [ "$(cat "$venv/.kvt-stamp" 2>/dev/null || true)" = "$version" ] && return 0
  echo "$who: installing $package $version into $venv" >&2
  rm -rf "$venv"
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$package==$version"
  echo "$version" > "$venv/.kvt-stamp"
}
