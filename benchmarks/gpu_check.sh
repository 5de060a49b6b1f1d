#!/usr/bin/env bash
# The CUDA path's tests and benchmarks in one run on a lent GPU machine (well under 10 minutes):
#
#   bash benchmarks/gpu_check.sh OUT_DIR [quick]
#
# The machine has torch, transformers and Triton but none of our other dependencies and no
# network: wheels of the missing packages sit in .whl/ and tokenizer plus config folders of the
# benchmarked shapes in .gpu/ (both ignored by git, carried with the call; made by
# `python benchmarks/gpu_inputs.py`). Each step has its own time limit, so one that hangs
# leaves the others their figures; everything lands in OUT_DIR.
set -u
out=${1:?OUT_DIR}
quick=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, \
transformers.__version__)" | tee -a "$out/gpu.txt"

bench() {  # seconds, then gpu_throughput.py's arguments
    local limit=$1
    shift
    timeout "$limit" python3 benchmarks/gpu_throughput.py "$@" --json "$out/bench.json" \
        2>&1 | tail -n 4
}

small=.gpu/smollm2-135m
for variant in "--attention-backend torch --enforce-eager" \
    "--attention-backend triton --enforce-eager" "--attention-backend triton" "--batch-invariant"; do
    # shellcheck disable=SC2086
    bench 60 $small decode $variant
done

SLOTSERVE_TEST_TOKENIZER=.gpu/tokenizer timeout 240 python3 -m pytest -q -s -p no:cacheprovider \
    tests/runner/test_torch_cuda.py 2>&1 | tee "$out/test-torch-cuda.log" | tail -n 25

[ "$quick" = quick ] && exit 0
bench 150 .gpu/qwen3-0.6b nano --attention-backend triton --kv-memory 0 --hf
bench 45 $small prefill --input-len 6000 --attention-backend triton
bench 60 .gpu/qwen35-shapes prefill --input-len 6000
