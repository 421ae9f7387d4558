#!/usr/bin/env bash
# Run the engine's determinism / batch-invariance tests and the model consistency tests on a GPU
# (the XLA path of JAX's CUDA backend), on the tiny checkpoint. Used through the device tool:
#   bash benchmarks/gpu_invariance.sh          (on the GPU machine, from the repo root)
set -euo pipefail
# XLA's default "excess precision" keeps some bf16 intermediates in fp32 depending on fusion decisions;
# turning it off makes bf16 rounding follow the program (needed for the bitwise cache-format test).
export XLA_FLAGS="--xla_allow_excess_precision=false ${XLA_FLAGS:-}"
export JAX_PLATFORMS=cuda PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import jax; print(jax.__version__, jax.devices())'
# Arguments starting with tests/ replace the file list (one device call does not fit them all: one
# invariance test alone took 286 s on the H200); other arguments go to pytest.
files=(tests/test_invariance.py tests/test_scheduler.py tests/test_sampling.py tests/test_model_consistency.py
       tests/test_kv_cache.py tests/test_kv_cache_v4.py tests/test_model_vs_numpy.py)
if [ $# -gt 0 ] && [[ "$1" == tests/* ]]; then
  files=()
  while [ $# -gt 0 ] && [[ "$1" == tests/* ]]; do files+=("$1"); shift; done
fi
python3 -m pytest -q -p no:cacheprovider "${files[@]}" "$@"
