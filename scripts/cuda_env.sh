# Finds what Horovod's NCCL build needs: a CUDA toolkit (nvcc and headers) and NCCL (nccl.h and the
# library), each either installed on the machine or provided by pip's nvidia-* wheels next to torch.
# Sourced by scripts/setup.sh (HVDTRAIN_CUDA=1) and scripts/gpu_check.sh; defines functions only.
#
# cuda_detect PYTHON LINK_DIR
#   On success exports HOROVOD_CUDA_HOME, HOROVOD_NCCL_INCLUDE, HOROVOD_NCCL_LIB and
#   HOROVOD_NCCL_LINK=SHARED, and sets CUDA_FROM and NCCL_FROM to where each was found.
#   On failure returns 1 with CUDA_PROBLEM saying what is missing and where it was looked for.
#   LINK_DIR holds a libnccl.so link when only the wheel's libnccl.so.2 exists (the linker wants
#   the unversioned name; at run time torch has already loaded libnccl.so.2 from its wheel).
#   HVDTRAIN_CUDA_PREFIXES: the machine's install prefixes searched last (default below).

CUDA_PREFIXES="${HVDTRAIN_CUDA_PREFIXES:-/usr/local/cuda /usr /usr/local}"

# The nvidia/ directory of PYTHON's site-packages, where the nvidia-* wheels unpack (empty if none).
_cuda_wheels_dir() {
  local site; site="$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)" || return 0
  [ -d "$site/nvidia" ] && echo "$site/nvidia"
  return 0
}

# The toolkit an nvcc belongs to. nvcc on PATH may be a wrapper script, so nvcc is asked: its dry
# run prints the TOP directory it runs from.
_cuda_toolkit_of() {
  local top
  top="$("$1" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)"
  [ -n "$top" ] && [ -d "$top/include" ] && { readlink -f "$top"; return; }
  dirname "$(dirname "$(readlink -f "$1")")"
}

# A CUDA toolkit on the machine: CUDA_HOME / CUDA_PATH, nvcc on PATH, then CUDA_PREFIXES.
_cuda_machine_toolkit() {
  local dir nvcc
  for dir in "${HOROVOD_CUDA_HOME:-}" "${CUDA_HOME:-}" "${CUDA_PATH:-}"; do
    [ -n "$dir" ] && [ -x "$dir/bin/nvcc" ] && { echo "$dir"; return; }
  done
  nvcc="$(command -v nvcc || true)"
  [ -n "$nvcc" ] && { _cuda_toolkit_of "$nvcc"; return; }
  for dir in $CUDA_PREFIXES; do
    [ -x "$dir/bin/nvcc" ] && { echo "$dir"; return; }
  done
  return 0
}

# NCCL on the machine: NCCL_HOME / HOROVOD_NCCL_HOME, the CUDA toolkit, then CUDA_PREFIXES.
# Prints "INCLUDE_DIR LIB_DIR".
_cuda_machine_nccl() {
  local toolkit="$1" base inc lib
  for base in "${HOROVOD_NCCL_HOME:-}" "${NCCL_HOME:-}" "$toolkit" $CUDA_PREFIXES; do
    [ -n "$base" ] && [ -f "$base/include/nccl.h" ] || continue
    inc="$base/include"
    for lib in "$base/lib" "$base/lib64" "$base/lib/x86_64-linux-gnu" "$base/lib/aarch64-linux-gnu"; do
      ls "$lib"/libnccl.so* >/dev/null 2>&1 && { echo "$inc $lib"; return; }
    done
  done
  return 0
}

cuda_detect() {
  local py="$1" link_dir="$2" wheels toolkit nccl nvcc header lib
  wheels="$(_cuda_wheels_dir "$py")"
  toolkit="$(_cuda_machine_toolkit)"
  CUDA_FROM="the machine ($toolkit)"
  if [ -z "$toolkit" ] && [ -n "$wheels" ]; then
    nvcc="$(find "$wheels" -path '*/bin/nvcc' -type f 2>/dev/null | head -n 1)"
    [ -n "$nvcc" ] && toolkit="$(dirname "$(dirname "$nvcc")")" && CUDA_FROM="pip's nvidia-* wheels ($toolkit)"
  fi
  nccl="$(_cuda_machine_nccl "$toolkit")"
  NCCL_FROM="the machine (${nccl% *})"
  if [ -z "$nccl" ] && [ -n "$wheels" ]; then
    header="$(find "$wheels" -name nccl.h -path '*include*' 2>/dev/null | head -n 1)"
    lib="$(find "$wheels" -name 'libnccl.so*' 2>/dev/null | head -n 1)"
    if [ -n "$header" ] && [ -n "$lib" ]; then
      mkdir -p "$link_dir"
      ln -sf "$lib" "$link_dir/libnccl.so"
      nccl="$(dirname "$header") $link_dir"
      NCCL_FROM="pip's nvidia-nccl wheel ($(dirname "$(dirname "$header")"))"
    fi
  fi
  local where="looked in HOROVOD_CUDA_HOME, CUDA_HOME, CUDA_PATH, PATH, NCCL_HOME, $CUDA_PREFIXES and ${wheels:-the site-packages of $py (no nvidia/ directory)}"
  if [ -z "$toolkit" ] || [ -z "$nccl" ]; then
    CUDA_PROBLEM="HVDTRAIN_CUDA=1 needs the CUDA toolkit (nvcc) and NCCL (nccl.h, libnccl): found "
    CUDA_PROBLEM+="toolkit: ${toolkit:-none}, NCCL: ${nccl:-none} ($where). Install the CUDA toolkit and "
    CUDA_PROBLEM+="libnccl-dev, or pip install nvidia-cuda-nvcc and nvidia-nccl wheels matching torch's CUDA, then rerun"
    return 1
  fi
  export HOROVOD_CUDA_HOME="$toolkit" HOROVOD_NCCL_INCLUDE="${nccl% *}" HOROVOD_NCCL_LIB="${nccl#* }"
  export HOROVOD_NCCL_LINK=SHARED
}
