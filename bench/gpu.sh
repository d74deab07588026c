#!/usr/bin/env bash
# One GPU loan, end to end (at most GPU_TOTAL_SECONDS, 540 by default, on an H100 / H200): the CUDA test subset, the operators
# and ~100M-parameter models against fla's Triton kernels and attention (bench/gpu_bench.py), and
# the efficiency bench on the device. Results go to $OUT (default bench/results): gpu.md,
# efficiency_gpu.md, gpu_peers.md (fla's official layers on the device against lcsm's, bench/gpu_peers.py)
# and the test log gpu_tests.log.
#
# fla comes from wheels in .whl/ where that folder exists (a machine without network: fla_core and
# flash_linear_attention 0.6.0, both pure Python, unpacked onto PYTHONPATH), else from pip if it is
# missing. Without a git history (a copied tree), set LCSM_GIT_COMMIT to the commit it came from.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    mkdir -p /tmp/lcsm-site
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" /tmp/lcsm-site; done
    export PYTHONPATH="$PYTHONPATH:/tmp/lcsm-site"
elif ! "$PY" -c "import fla.models" 2>/dev/null; then
    "$PY" -m pip install --quiet fla-core==0.6.0 flash-linear-attention==0.6.0
fi
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# The whole run within GPU_TOTAL_SECONDS (default 540: a loan's commands stop at 600 s), the
# benchmark's report (gpu.md, the issue's evidence) before fla's layers and the efficiency bench:
# each step gets what the steps before it left, and is stopped (its report kept: gpu_bench.py
# rewrites it after every case) when that runs out. SECONDS counts from the script's start.
TOTAL=${GPU_TOTAL_SECONDS:-540}
left() { echo $((TOTAL - SECONDS)); }
# (the tests take about a minute; a hung one must not take the loan)
timeout "${GPU_TESTS_SECONDS:-180}" "$PY" -m pytest -q -n 8 -p no:cacheprovider tests/test_cuda.py tests/ops/test_triton_chunk.py \
    tests/ops/test_triton_delta.py tests/ops/test_triton_scan.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
# the benchmark's budget leaves ~200 s for fla's layers and the efficiency bench after it
budget=${GPU_BENCH_BUDGET:-$(($(left) - 260))}
[ "$budget" -ge 60 ] || budget=60
# its log (each failed cell's exception: the table shows "-") beside the report
timeout "$(($(left) > 30 ? $(left) - 20 : 10))" "$PY" -m bench.gpu_bench --budget "$budget" --out "$OUT/gpu.md" \
    2> >(tee "$OUT/gpu_bench.log" >&2)
peers=$(($(left) - 70 < 180 ? $(left) - 70 : 180))
if [ "$peers" -ge 30 ]; then
    timeout "$peers" "$PY" -m bench.gpu_peers 2>&1 | tee "$OUT/gpu_peers.md"
else
    echo "gpu.sh: no time left for bench/gpu_peers.py ($(left) s of $TOTAL)"
fi
if [ "${SKIP_EFFICIENCY:-0}" != 1 ] && [ "$(left)" -ge 30 ]; then
    timeout "$(left)" "$PY" -m bench.efficiency_bench --device cuda --repeats 1 --out "$OUT/efficiency_gpu.md" 2>&1 | tail -5
fi
echo "gpu.sh: done in $SECONDS s"
