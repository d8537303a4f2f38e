#!/usr/bin/env bash
# One-command set-up of hvdtrain: system packages, .venv, pinned Python packages, Horovod 0.28.1
# built from its sdist (with patches/ applied, for current torch, TensorFlow and Keras 3) and cached
# outside the clone.
#
# Idempotent: each step checks first and does only what is missing, so a second run takes seconds.
#
# Environment:
#   HVDTRAIN_CACHE   where the Horovod sdist and the wheels built from it are kept
#                    (default ~/.cache/hvdtrain; scripts/gpu_check.sh finds the sdist there)
#   HVDTRAIN_CUDA=1  GPU clusters: take PyPI's CUDA build of torch 2.13.0 and build Horovod with
#                    HOROVOD_GPU_OPERATIONS=NCCL, using the CUDA toolkit and NCCL of the machine or
#                    of pip's nvidia-* wheels, whichever is found (scripts/cuda_env.sh; says which).
#   HVDTRAIN_PYTHON  the interpreter that creates .venv (default python3)
#
# Usage: scripts/setup.sh           set up (or check) everything
#        scripts/setup.sh --freeze  rewrite constraints.txt from the current .venv
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
# shellcheck source=scripts/horovod_source.sh
source "$ROOT/scripts/horovod_source.sh"  # HOROVOD_VERSION, HOROVOD_SDIST_NAME, patch_horovod_source
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
UV_VERSION=0.13.9
CACHE="${HVDTRAIN_CACHE:-$HOME/.cache/hvdtrain}"
CUDA="${HVDTRAIN_CUDA:-0}"
CHANGED=0
APT_PACKAGES=(libopenmpi-dev openmpi-bin cmake g++ make patch python3-dev chromium)

say() { printf '==> [setup] %s\n' "$*"; }
fail() { printf '!!! [setup] step "%s" failed: %s\n' "$1" "$2" >&2; exit 1; }

# run_step NAME HINT CMD...: runs CMD, and on failure names the step and what to do.
run_step() {
  local name="$1" hint="$2"; shift 2
  say "$name"
  "$@" || fail "$name" "$hint"
}

# pip, minus the warnings about this machine's local indexes that hold no entry for a package.
pip_run() {
  "$PY" -m pip "$@" 2>&1 | grep -v "is neither a file nor a directory"
  return "${PIPESTATUS[0]}"
}

apt_missing() {
  local missing=() p
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  echo "${missing[@]:-}"
}

step_system_packages() {
  local missing; missing="$(apt_missing)"
  if [ -z "$missing" ]; then say "system packages: present (${APT_PACKAGES[*]})"; return; fi
  if [ "$(id -u)" != 0 ]; then
    fail "system packages" "missing: $missing. Install them (sudo apt-get install $missing) and rerun."
  fi
  run_step "system packages: apt-get install $missing" "check that apt-get can reach Debian's mirrors" \
    bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends $missing >/tmp/hvdtrain-apt.log 2>&1 || { tail -20 /tmp/hvdtrain-apt.log; exit 1; }"
}

step_venv() {
  if [ -x "$PY" ]; then say "virtual environment: $VENV exists"; return; fi
  run_step "virtual environment: create $VENV" "install python3-venv, or set HVDTRAIN_PYTHON" \
    "${HVDTRAIN_PYTHON:-python3}" -m venv "$VENV"
}

# The stamp is a hash of what was asked for, so an unchanged request skips pip entirely.
requirements_stamp() { cat "$ROOT/requirements.in" "$ROOT/constraints.txt" <(echo "cuda=$CUDA") | sha256sum | cut -c1-16; }

# uv installs from its own cache (~/.cache/uv) by hard links, so a second clone's environment takes
# seconds where pip would unpack every wheel again; the versions are those of constraints.txt either way.
step_uv() {
  if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" --version | grep -q " $UV_VERSION"; then return; fi
  run_step "installer: uv $UV_VERSION" "check that PyPI is reachable" pip_run install -q "uv==$UV_VERSION"
}

# uv pip install into .venv. Local wheel folders that pip is configured with (find-links) are passed on,
# since uv does not read pip's configuration and the CPU build of torch may lie only there; a CUDA
# set-up leaves them out, so that torch comes from PyPI, whose plain build is the CUDA one.
uv_install() {
  local links=() dir
  if [ "$CUDA" != 1 ]; then
    for dir in $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
      links+=(--find-links "$dir")
    done
  fi
  "$VENV/bin/uv" pip install --quiet --python "$PY" "${links[@]}" "$@"
}

step_python_packages() {
  local stamp="$VENV/.hvdtrain-requirements-$(requirements_stamp)"
  if [ -f "$stamp" ]; then say "python packages: up to date"; return; fi
  step_uv
  local torch_spec=()
  # The CPU wheel of torch ends in +cpu; PyPI's plain 2.13.0 is the CUDA build.
  [ "$CUDA" = 1 ] && torch_spec=("torch==$TORCH_VERSION")
  run_step "python packages: uv pip install (pinned by constraints.txt)" \
    "see uv's error above; check that PyPI is reachable" \
    uv_install -r "$ROOT/requirements.in" -c "$ROOT/constraints.txt" "${torch_spec[@]}"
  # keras-hub without its dependencies: its tensorflow-text would pull the `tensorflow` distribution
  # over tensorflow-cpu, and the causal LMs and local presets never import it (its other
  # dependencies are in requirements.in). The version is constraints.txt's.
  run_step "python packages: keras-hub (--no-deps)" "see uv's error above; check that PyPI is reachable" \
    uv_install --no-deps -c "$ROOT/constraints.txt" keras-hub
  rm -f "$VENV"/.hvdtrain-requirements-*
  touch "$stamp"
  CHANGED=1
}

python_tag() { "$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")'; }
# The patches' hash is part of the key, so a changed patch never reuses a wheel built without it.
patches_hash() { cat "$ROOT"/patches/*.patch | sha256sum | cut -c1-12; }
wheel_dir() {
  echo "$CACHE/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-tf$TF_VERSION-$(python_tag)-cuda$CUDA-patches$(patches_hash)"
}

# Written after the cached wheel is installed; its name carries the wheel's key.
horovod_stamp() { echo "$VENV/.hvdtrain-$(basename "$(wheel_dir)")"; }

build_horovod_wheel() {
  local out="$1" work sdist="$CACHE/$HOROVOD_SDIST_NAME"; work="$(mktemp -d)"
  # The sdist is kept beside the wheels: a rebuild needs no network, and a GPU check copies it.
  if [ ! -f "$sdist" ]; then
    run_step "horovod: download sdist $HOROVOD_VERSION (kept as $sdist)" "check that PyPI is reachable" \
      pip_run download -q --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
    { mkdir -p "$CACHE" && mv "$work/$HOROVOD_SDIST_NAME" "$sdist.tmp" && mv "$sdist.tmp" "$sdist"; } \
      || fail "horovod: keep the sdist" "make $CACHE writable, or set HVDTRAIN_CACHE"
  fi
  tar -xzf "$sdist" -C "$work"
  run_step "horovod: apply patches/ ($(ls "$ROOT"/patches/*.patch | wc -l) patches, each says why at its top)" \
    "a patch no longer applies to the sdist; see the patch named above" patch_horovod_source "$work/horovod-$HOROVOD_VERSION"
  local gpu_env=(HOROVOD_GPU_OPERATIONS=)
  [ "$CUDA" = 1 ] && gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL)
  say "horovod: building the wheel (about 8-15 minutes on 2 cores; log in $work/build.log)"
  if ! env "${gpu_env[@]}" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
      "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$work/dist" "$work/horovod-$HOROVOD_VERSION" \
      >"$work/build.log" 2>&1; then
    tail -n 40 "$work/build.log" >&2
    fail "horovod: build" "see $work/build.log; the usual causes are a missing libopenmpi-dev, cmake or g++"
  fi
  mkdir -p "$out"
  mv "$work"/dist/horovod-*.whl "$out/"
  rm -rf "$work"
}

# HVDTRAIN_CUDA=1: finds the CUDA toolkit and NCCL for Horovod's NCCL build (scripts/cuda_env.sh
# exports where they are for the build) and says where each came from; stops when one is missing.
step_cuda() {
  [ "$CUDA" = 1 ] || return 0
  [ -f "$(horovod_stamp)" ] && return 0
  # shellcheck source=scripts/cuda_env.sh
  source "$ROOT/scripts/cuda_env.sh"
  cuda_detect "$PY" "$CACHE/nccl-link" || fail "cuda: toolkit and NCCL" "$CUDA_PROBLEM"
  say "cuda: toolkit from $CUDA_FROM; NCCL from $NCCL_FROM"
}

step_horovod() {
  if [ -f "$(horovod_stamp)" ]; then say "horovod $HOROVOD_VERSION: installed"; return; fi
  local dir; dir="$(wheel_dir)"
  if ! ls "$dir"/horovod-*.whl >/dev/null 2>&1; then build_horovod_wheel "$dir"; fi
  say "horovod: cached wheel $(ls "$dir"/horovod-*.whl)"
  run_step "horovod: install cached wheel" "delete $dir and rerun to rebuild it" \
    pip_run install -q --no-deps --force-reinstall "$dir"/horovod-*.whl
  # One stamp only: it names the cache directory of the wheel that is installed.
  rm -f "$VENV"/.hvdtrain-horovod-*
  touch "$(horovod_stamp)"
  CHANGED=1
}

step_hvdtrain() {
  if "$PY" -c 'import hvdtrain' 2>/dev/null && [ -x "$VENV/bin/hvdtrain" ]; then
    say "hvdtrain: installed (editable)"; return
  fi
  run_step "hvdtrain: pip install -e ." "see pip's error above" \
    pip_run install -q --no-deps --no-build-isolation -e "$ROOT"
  CHANGED=1
}

# Bytecode for every installed module, written once here: a run then loads .pyc files instead of
# compiling torch's, TensorFlow's and scikit-learn's sources in every process it starts, which
# PYTHONDONTWRITEBYTECODE (set in many containers) would otherwise make it do on every start.
# Files for other Python versions (torch's py312 test helpers) fail to compile; they are never imported.
step_bytecode() {
  [ "$CHANGED" = 1 ] || return 0
  local site; site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  say "python bytecode: compileall $site"
  "$PY" -m compileall -qq -j 0 "$site" "$ROOT/hvdtrain" || true
}

freeze() {
  { echo "# Every Python package of .venv, pinned. Generated by scripts/setup.sh --freeze; edit requirements.in instead."
    "$PY" -m pip freeze --exclude-editable | grep -v -E '^(horovod|hvdtrain|uv)[ =]' |
      sed -E 's/^torch==([^+]*)\+.*/torch==\1/'; } >"$ROOT/constraints.tmp" && mv "$ROOT/constraints.tmp" "$ROOT/constraints.txt"
  say "wrote constraints.txt"
}

main() {
  if [ "${1:-}" = "--freeze" ]; then freeze; return; fi
  step_system_packages
  step_venv
  step_python_packages
  step_cuda
  step_horovod
  step_hvdtrain
  step_bytecode
  # The doctor imports both frameworks (seconds each), so it runs only after something was installed.
  if [ "$CHANGED" = 1 ]; then
    run_step "check: hvdtrain doctor" "read the doctor's report above" "$VENV/bin/hvdtrain" doctor --quiet
  fi
  say "done (.venv/bin/hvdtrain doctor gives a full report)"
}

main "$@"
