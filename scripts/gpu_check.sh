#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, CUDA PyTorch, nvcc, cmake and no network, builds
# Horovod with NCCL against that PyTorch from the Horovod sdist carried with the tree, then trains
# hvdtrain's ResNet-18 on synthetic images at one rank in fp32, bf16 and fp16 beside a plain
# PyTorch loop (scripts/gpu_check.py) and prints samples/s, the ratio and the final losses.
#
# Preparing a GPU run (the GPU machine cannot download anything):
#   1. On a machine set up by `make setup`, copy the sdist that scripts/setup.sh keeps into the
#      tree's .cache/ (ignored by git):  mkdir -p .cache && cp ~/.cache/hvdtrain/horovod-0.28.1.tar.gz .cache/
#   2. Copy the tree to the GPU machine with .cache/ included (it is ignored, so name it: the
#      device tool's `carry: [".cache"]`), and there run:  OUT=/some/dir bash scripts/gpu_check.sh
#   The Python packages hvdtrain and Horovod need at run time (below) must already be there.
#
# Environment:
#   HVDTRAIN_GPU_PYTHON  the interpreter with CUDA PyTorch (default python3)
#   HOROVOD_SDIST        the Horovod 0.28.1 sdist; when unset, the first of .cache/horovod-0.28.1.tar.gz
#                        in the tree and $HVDTRAIN_CACHE/horovod-0.28.1.tar.gz (default
#                        ~/.cache/hvdtrain, where scripts/setup.sh keeps it); checked against PyPI's sha256
#   GPU_CHECK_ARGS       extra options for scripts/gpu_check.py (e.g. "--steps 30")
#   OUT                  where the build and the results go (default a temporary directory)
#
# The build applies patches/ exactly as scripts/setup.sh does (scripts/horovod_source.sh).
# Exit codes: 0 checked; 77 no GPU here (nothing was checked); 1 a step failed (named, one line).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${HVDTRAIN_GPU_PYTHON:-python3}"
WORK="${OUT:-$(mktemp -d)}"
mkdir -p "$WORK"
# Python packages a run imports besides torch: hvdtrain's (yaml, numpy, psutil) and Horovod's
# runtime ones (cloudpickle, packaging, psutil), which its wheel, installed without dependencies, lacks.
RUNTIME_MODULES="yaml numpy psutil cloudpickle packaging"
# shellcheck source=scripts/horovod_source.sh
source "$ROOT/scripts/horovod_source.sh"

say() { printf '==> [gpu_check] %s\n' "$*"; }
fail() { printf '!!! [gpu_check] %s\n' "$*" >&2; exit 1; }

# What horovod.torch is for this interpreter, in one line: "nccl" when it imports and was built
# with NCCL, else what is wrong (not installed, an import error, built without NCCL).
horovod_torch_state() {
  "$PY" - 2>/dev/null <<'PYEOF' || echo "cannot be asked ($PY failed)"
import importlib.util
if importlib.util.find_spec("horovod") is None:
    print("is not installed")
else:
    try:
        import horovod.torch as h
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0]
        print(f"does not import ({type(exc).__name__}: {first})")
    else:
        print("nccl" if h.nccl_built() else "is built without NCCL")
PYEOF
}

# 1. A GPU that PyTorch can use, or a clean stop.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi $(command -v nvidia-smi >/dev/null 2>&1 && echo 'lists none' || echo 'not found')); nothing checked"
  exit 77
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: $PY has no PyTorch with CUDA (torch.cuda.is_available() is false); nothing checked"
  exit 77
fi
say "GPU: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -n 1)"
say "torch $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"

# 2. What a run imports, checked before a build of minutes: nothing can be installed here.
# shellcheck disable=SC2086
missing="$("$PY" -c 'import importlib.util as u, sys; print(" ".join(m for m in sys.argv[1:] if not u.find_spec(m)))' $RUNTIME_MODULES)"
[ -z "$missing" ] || fail "$PY lacks the Python modules hvdtrain and Horovod import: $missing (carry their wheels and install them first)"

# 3. Horovod with NCCL, built here against this PyTorch.
export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
state="$(horovod_torch_state)"
if [ "$state" != nccl ]; then
  say "horovod.torch $state: building it"
  find_horovod_sdist "$ROOT" "${HVDTRAIN_CACHE:-$HOME/.cache/hvdtrain}" || fail "$SDIST_PROBLEM"
  # shellcheck source=scripts/cuda_env.sh
  source "$ROOT/scripts/cuda_env.sh"
  cuda_detect "$PY" "$WORK/nccl-link" || fail "$CUDA_PROBLEM"
  say "CUDA toolkit from $CUDA_FROM; NCCL from $NCCL_FROM; sdist $SDIST_FOUND"
  src="$WORK/horovod-$HOROVOD_VERSION"
  rm -rf "$src"
  tar -xzf "$SDIST_FOUND" -C "$WORK"
  patch_horovod_source "$src" || fail "a patch of patches/ does not apply to $SDIST_FOUND"
  # nvcc only: Horovod's kernels ask for C++11, which CUDA 12 deprecated and CUDA 13's headers no
  # longer take. Not in patches/: a new patch changes the key of every CPU set-up's cached wheel.
  sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
  grep -q 'set(CMAKE_CUDA_STANDARD 17)' "$src/horovod/common/ops/cuda/CMakeLists.txt" \
    || fail "the sdist's horovod/common/ops/cuda/CMakeLists.txt no longer sets CMAKE_CUDA_STANDARD 11"
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' .')"
  say "building Horovod with NCCL for sm_$cc (log $WORK/build.log)"
  if ! env HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_BUILD_CUDA_CC_LIST="$cc" HOROVOD_WITH_PYTORCH=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 \
      MAKEFLAGS="-j$(nproc)" "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$WORK/dist" "$src" \
      >"$WORK/build.log" 2>&1; then
    tail -n 40 "$WORK/build.log" >&2
    fail "Horovod build failed (log $WORK/build.log)"
  fi
  "$PY" -m pip install -q --no-deps --no-index --target "$WORK/site" "$WORK"/dist/horovod-*.whl \
    || fail "installing the Horovod wheel into $WORK/site"
fi
state="$(horovod_torch_state)"
[ "$state" = nccl ] || fail "horovod.torch $state"

# 4. The measurements.
say "training ResNet-18 (synthetic images, one rank) in fp32, bf16, fp16: hvdtrain and plain PyTorch"
# shellcheck disable=SC2086
"$PY" "$ROOT/scripts/gpu_check.py" --out "$WORK/runs" ${GPU_CHECK_ARGS:-} | tee "$WORK/results.md"
say "done: $(date -u +%Y-%m-%d); table in $WORK/results.md (copy it into docs/benchmarks.md)"
