#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, CUDA PyTorch, nvcc, cmake and no network, builds
# Horovod with NCCL against that PyTorch from the Horovod sdist carried with the tree, then trains
# hvdtrain's ResNet-18 on synthetic images at one rank in fp32, bf16 and fp16 beside a plain
# PyTorch loop (scripts/gpu_check.py) and prints samples/s, the ratio and the final losses.
#
# Environment:
#   HVDTRAIN_GPU_PYTHON  the interpreter with CUDA PyTorch (default python3)
#   HOROVOD_SDIST        the Horovod 0.28.1 sdist (default: the first horovod-0.28.1.tar.gz found
#                        in shared/, vendor/ or ~/.cache/hvdtrain)
#   GPU_CHECK_ARGS       extra options for scripts/gpu_check.py (e.g. "--steps 30")
#   OUT                  where the build and the results go (default a temporary directory)
#
# Exit codes: 0 checked; 77 no GPU here (nothing was checked); 1 a step failed (named).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${HVDTRAIN_GPU_PYTHON:-python3}"
WORK="${OUT:-$(mktemp -d)}"
mkdir -p "$WORK"

say() { printf '==> [gpu_check] %s\n' "$*"; }
fail() { printf '!!! [gpu_check] %s\n' "$*" >&2; exit 1; }

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

# 2. Horovod with NCCL, built here against this PyTorch.
export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c 'import sys, horovod.torch as h; sys.exit(0 if h.nccl_built() else 1)' 2>/dev/null; then
  # shellcheck source=scripts/cuda_env.sh
  source "$ROOT/scripts/cuda_env.sh"
  cuda_detect "$PY" "$WORK/nccl-link" || fail "$CUDA_PROBLEM"
  say "CUDA toolkit from $CUDA_FROM; NCCL from $NCCL_FROM"
  sdist="${HOROVOD_SDIST:-$(ls "$ROOT"/shared/horovod-0.28.1.tar.gz "$ROOT"/vendor/horovod-0.28.1.tar.gz \
    "$HOME"/.cache/hvdtrain/horovod-0.28.1.tar.gz 2>/dev/null | head -n 1 || true)}"
  [ -f "$sdist" ] || fail "no Horovod sdist: set HOROVOD_SDIST or carry horovod-0.28.1.tar.gz in shared/"
  tar -xzf "$sdist" -C "$WORK"
  src="$WORK/horovod-0.28.1"
  # The same C++17 fix as scripts/setup.sh (torch >= 2.1 headers need it), for nvcc too.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
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
"$PY" -c 'import sys, horovod.torch as h; sys.exit(0 if h.nccl_built() else 1)' \
  || fail "horovod.torch is not built with NCCL"
missing="$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("yaml", "numpy") if not u.find_spec(m)))')"
[ -z "$missing" ] || fail "hvdtrain needs the Python packages: $missing"

# 3. The measurements.
say "training ResNet-18 (synthetic images, one rank) in fp32, bf16, fp16: hvdtrain and plain PyTorch"
# shellcheck disable=SC2086
"$PY" "$ROOT/scripts/gpu_check.py" --out "$WORK/runs" ${GPU_CHECK_ARGS:-} | tee "$WORK/results.md"
say "done: $(date -u +%Y-%m-%d); table in $WORK/results.md (copy it into docs/benchmarks.md)"
