#!/usr/bin/env bash
# FlashInfer 0.2.14.post1 for `prefixserve bench kernels` on a machine with no internet.
#
#   usage:  eval "$(benchmarks/flashinfer-setup.sh path/to/flashinfer_python-0.2.14.post1.tar.gz [DEST])"
#
# The PyPI sdist (3.6 MB) holds the Python package and the CUDA sources its JIT compiles on
# first use (two to four minutes on an H100/H200: where calls have a time limit, compile first
# with one custom row, `prefixserve bench kernels --grid custom --batch 32 --context 1024
# --shared 512 --kv-cache-dtype both`, then run the grid on the same warm machine, whose
# compiled ops stay under DEST: kernels-notes.md, issue 25 part twenty-four). Nothing is built
# or installed here: the sdist is extracted under DEST (default /tmp/flashinfer), the source
# folders are linked where flashinfer/jit/env.py looks for them
# (flashinfer/data/{include,csrc,tvm_binding,cutlass,spdlog}), `import flashinfer` is tried, and
# the environment to use it is printed on stdout as `export` lines (everything else goes to
# stderr).
#
# Imports: `import flashinfer` needs torch, triton, jinja2, filelock, packaging, requests and
# numpy at import time, and ninja + nvcc when a kernel is first compiled: all on the GPU image.
# Not needed, so not carried: nvidia-cudnn-frontend (`import cudnn`, absent from the image:
# FlashInfer imports it inside try/except in cudnn/*.py and gemm.py, and only its cuDNN
# backends use it); cuda-python (cuda.bindings: only green_ctx, deep_gemm, cuda_utils, comm/,
# none imported by flashinfer/__init__); einops (inside one sparse.py function); mpi4py and
# pynvml (comm/ only). `import flashinfer` was checked to succeed with none of these five.
set -euo pipefail

sdist=${1:?usage: $0 flashinfer_python-0.2.14.post1.tar.gz [DEST]}
dest=${2:-/tmp/flashinfer}
python=${PYTHON:-python3}
mkdir -p "$dest"
tar -xzf "$sdist" -C "$dest"
root=$(find "$dest" -maxdepth 1 -type d -name 'flashinfer_python-*' | sort | tail -n 1)
[ -f "$root/flashinfer/jit/env.py" ] || { echo "no flashinfer/jit/env.py under $dest" >&2; exit 1; }

data="$root/flashinfer/data"
mkdir -p "$data"
for src in include csrc tvm_binding 3rdparty/cutlass 3rdparty/spdlog; do
  [ -d "$root/$src" ] || { echo "the sdist has no $src/" >&2; exit 1; }
  ln -sfn "$root/$src" "$data/$(basename "$src")"
done

# The JIT runs `ninja` from PATH; the image has it as the Python package `ninja`.
path_add=""
if ! command -v ninja >/dev/null; then
  path_add=$("$python" -c 'import ninja; print(ninja.BIN_DIR)') \
    || { echo "no ninja on PATH or as a Python package: FlashInfer cannot compile" >&2; exit 1; }
fi
command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] \
  || echo "warning: no nvcc found (PATH, \$CUDA_HOME, /usr/local/cuda): FlashInfer cannot compile" >&2

PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$python" -c \
  'import sys, flashinfer; print("flashinfer", flashinfer.__version__, "imports from", flashinfer.__file__, file=sys.stderr)' \
  || { echo "import flashinfer failed (see above)" >&2; exit 1; }

# The JIT cache (compiled ops) goes under DEST, not $HOME: a rerun on a warm machine reuses it.
echo "export PYTHONPATH=$root\${PYTHONPATH:+:\$PYTHONPATH}"
echo "export FLASHINFER_WORKSPACE_BASE=$dest"
[ -z "$path_add" ] || echo "export PATH=$path_add:\$PATH"
