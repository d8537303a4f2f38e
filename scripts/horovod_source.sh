# The Horovod source that hvdtrain builds from: its version, where its sdist is found, and the
# patches/ applied to it. Sourced by scripts/setup.sh and scripts/gpu_check.sh, so that both build
# the same patched source.
# shellcheck shell=bash

HOROVOD_VERSION=0.28.1
HOROVOD_SDIST_NAME="horovod-$HOROVOD_VERSION.tar.gz"
# PyPI's sha256 of that sdist: a copy carried to another machine is checked against it.
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
HOROVOD_PATCHES="$(dirname "${BASH_SOURCE[0]}")/../patches"

# find_horovod_sdist ROOT CACHE: sets SDIST_FOUND to the sdist to build from, the first of
#   $HOROVOD_SDIST (when set), ROOT/.cache/$HOROVOD_SDIST_NAME (ignored by git; what a copy of the
#   tree carries to a machine without network), CACHE/$HOROVOD_SDIST_NAME (kept there by setup.sh).
# Returns 1 with SDIST_PROBLEM set (one line) when there is none, or the first found is not PyPI's.
# (Variables, not output: a caller's $(...) would lose SDIST_PROBLEM in its subshell.)
find_horovod_sdist() {
  local root="$1" cache="$2" candidate found=""
  SDIST_FOUND="" SDIST_PROBLEM=""
  if [ -n "${HOROVOD_SDIST:-}" ]; then
    [ -f "$HOROVOD_SDIST" ] || { SDIST_PROBLEM="HOROVOD_SDIST=$HOROVOD_SDIST: no such file"; return 1; }
    found="$HOROVOD_SDIST"
  else
    for candidate in "$root/.cache/$HOROVOD_SDIST_NAME" "$cache/$HOROVOD_SDIST_NAME"; do
      if [ -f "$candidate" ]; then found="$candidate"; break; fi
    done
  fi
  if [ -n "$found" ]; then
    if [ "$(sha256sum "$found" | cut -d' ' -f1)" = "$HOROVOD_SDIST_SHA256" ]; then
      SDIST_FOUND="$found"; return 0
    fi
    SDIST_PROBLEM="$found is not PyPI's $HOROVOD_SDIST_NAME (sha256 differs): replace it with that file"
    return 1
  fi
  SDIST_PROBLEM="no $HOROVOD_SDIST_NAME in $root/.cache or $cache: copy it to $root/.cache/ (scripts/setup.sh keeps one in $cache) or set HOROVOD_SDIST"
  return 1
}

# patch_horovod_source SRC: applies patches/*.patch in order to an unpacked sdist (each says why at
# its top).
patch_horovod_source() {
  local src="$1" p
  for p in "$HOROVOD_PATCHES"/*.patch; do
    patch -p1 --forward --silent -d "$src" <"$p" || { echo "patch failed: $p" >&2; return 1; }
  done
}
