#!/usr/bin/env bash
# One GPU loan, end to end, on an H100 / H200 (bench/README.md, "GPU loan"). Run it from the
# repository root of the copied tree as
#
#     OUT="$OUT" LCSM_GIT_COMMIT=<short sha> GPU_TOTAL_SECONDS=<from the loan's time left> bash bench/gpu.sh
#
# $OUT passed on: results written anywhere else stay on the machine. The copy has no git history,
# so the tables name the commit given in LCSM_GIT_COMMIT (add " (with uncommitted changes)" where
# the copied tree has any).
#
# The steps, within GPU_TOTAL_SECONDS (default 540): the Python environment (gpu_env.log); the CUDA
# test subset (gpu_tests.log, each failure's traceback in gpu_test_failures.log as it happens),
# with fla's autotuning warmed beside it (fla_warmup.log); the operators and ~100M-parameter models
# against fla's Triton kernels and attention (gpu.md and gpu_bench.log: bench/gpu_bench.py); fla's
# official layers on the device against lcsm's (gpu_peers.md and gpu_peers.log: bench/gpu_peers.py);
# the efficiency bench on the device (efficiency_gpu.md and efficiency_gpu.log). Results go to $OUT
# (default bench/results).
#
# fla comes from the wheels in .whl/ where it holds any (a machine without network: fla_core and
# flash_linear_attention 0.6.0, einops and packaging, all pure Python, unpacked onto PYTHONPATH),
# else from pip where fla's ops do not import.
set -u
cd "$(dirname "$0")/.."
for var in GPU_TOTAL_SECONDS GPU_TESTS_SECONDS GPU_WARMUP_SECONDS GPU_BENCH_BUDGET; do
    case ${!var:-} in
    *[!0-9]*)
        echo "gpu.sh: $var must be a whole number of seconds, got '${!var}'" >&2
        exit 2
        ;;
    esac
done
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
repo_path=$PYTHONPATH
[ -n "${LCSM_GIT_COMMIT:-}" ] || [ -e .git ] || echo "gpu.sh: no .git and no LCSM_GIT_COMMIT: the tables' commit reads unknown"

# unpack_wheels DIR [GLOB]: every wheel of .whl/ but those named like GLOB, into a fresh DIR put on
# PYTHONPATH after the repository (Python's zipfile: neither pip nor unzip needed)
unpack_wheels() {
    rm -rf "$1" && mkdir -p "$1"
    for w in .whl/*.whl; do
        case ${w##*/} in
        ${2:-}) ;;
        *) "$PY" -m zipfile -e "$w" "$1" ;;
        esac
    done
    export PYTHONPATH="$repo_path:$1"
}
wheels=0
if compgen -G ".whl/*.whl" >/dev/null; then
    wheels=1
    unpack_wheels /tmp/lcsm-site
fi
"$PY" -m bench.gpu_env >"$OUT/gpu_env.log" 2>&1
fla=$?
if [ "$fla" -eq 3 ] && compgen -G ".whl/flash_linear_attention-*.whl" >/dev/null; then
    # flash_linear_attention's fla.layers and fla.models need transformers >= 5.6.2, and fla's
    # __init__ imports them: an older transformers fails every fla import. fla-core alone imports
    # without it (fla's ops: gpu_bench's fla pass; gpu_peers and fla's models are lost)
    unpack_wheels /tmp/lcsm-site-core "flash_linear_attention-*"
    echo "== fla-core alone (fla.ops.gla did not import with both fla wheels)" >>"$OUT/gpu_env.log"
    "$PY" -m bench.gpu_env >>"$OUT/gpu_env.log" 2>&1
    fla=$?
elif [ "$fla" -eq 3 ] && [ "$wheels" -eq 0 ]; then
    # a machine with network; without one, pip's retries would stall the loan for minutes
    timeout 60 "$PY" -m pip install --quiet --retries 0 --timeout 10 \
        fla-core==0.6.0 flash-linear-attention==0.6.0 einops packaging
    echo "== after pip install (exit $?)" >>"$OUT/gpu_env.log"
    "$PY" -m bench.gpu_env >>"$OUT/gpu_env.log" 2>&1
    fla=$?
fi
cat "$OUT/gpu_env.log"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# The whole run within GPU_TOTAL_SECONDS (default 540: the device tool stops a command at 600 s,
# sooner where the loan has less left), the benchmark's report (gpu.md, the issue's evidence)
# before fla's layers and the efficiency bench: each step gets what the steps before it left, and
# is stopped (its report kept: gpu_bench.py rewrites it after every case) when that runs out.
# SECONDS counts from the script's start.
TOTAL=${GPU_TOTAL_SECONDS:-540}
left() { echo $((TOTAL - SECONDS)); }

# fla autotunes each kernel at its first call in a process (in the loan of 2026-12-04, most of a
# 240 s budget for one op) and keeps the winners on disk: tuned here, beside the tests, which leave
# the device mostly idle, the benchmark's and gpu_peers' first calls find them
warm=""
if [ "$fla" -eq 0 ]; then
    timeout "${GPU_WARMUP_SECONDS:-170}" "$PY" -m bench.fla_warmup >"$OUT/fla_warmup.log" 2>&1 &
    warm=$!
fi
# The Triton kernels' own tests first (the newest code: where the cap cuts, it cuts the mixers'),
# one line per test as it ends (-v), each failure's traceback on disk as it happens (pytest's own
# report comes only at the end, lost to the cap); -n 8 only where xdist is installed (pytest
# refuses the option without it, and runs nothing). The cap: a hung test must not take the loan.
xdist=""
"$PY" -c "import xdist" 2>/dev/null && xdist="-n 8"
: >"$OUT/gpu_test_failures.log"
# ($xdist unquoted: no word, or the two of "-n 8")
LCSM_LIVE_FAILURES="$OUT/gpu_test_failures.log" timeout "${GPU_TESTS_SECONDS:-180}" "$PY" -m pytest -v \
    --durations=25 -rfE $xdist -p no:cacheprovider -p bench._live_failures tests/ops/test_triton_chunk.py \
    tests/ops/test_triton_delta.py tests/ops/test_triton_scan.py tests/test_cuda.py 2>&1 |
    tee "$OUT/gpu_tests.log" | tail -25
if [ -n "$warm" ]; then
    wait "$warm"
    status=$?
    echo "gpu.sh: fla's warm-up ended at $SECONDS s (exit $status; 124: stopped at its cap)"
    tail -3 "$OUT/fla_warmup.log"
fi

# the benchmark's budget leaves ~260 s for fla's layers and the efficiency bench after it
budget=${GPU_BENCH_BUDGET:-$(($(left) - 260))}
[ "$budget" -ge 60 ] || budget=60
# its log (each failed cell's exception: the table shows "-"; each cell's first call) beside the report
timeout "$(($(left) > 30 ? $(left) - 20 : 10))" "$PY" -m bench.gpu_bench --budget "$budget" --out "$OUT/gpu.md" \
    2> >(tee "$OUT/gpu_bench.log" >&2)
# fla's layers: at most 180 s, leaving the efficiency bench its 120
peers=$(($(left) - 120 < 180 ? $(left) - 120 : 180))
if [ "$peers" -ge 30 ]; then
    timeout "$peers" "$PY" -m bench.gpu_peers 2>"$OUT/gpu_peers.log" | tee "$OUT/gpu_peers.md"
else
    echo "gpu.sh: no time left for bench/gpu_peers.py ($(left) s of $TOTAL)"
fi
# The efficiency bench rewrites its report after each stage (a training length, the decoding), so
# a cut keeps what it measured; it starts only with 120 s left, what its first stage may take (44 s
# for the whole bench in the loan of 2026-12-04, before mode "auto" sent its models through the
# Triton kernels, which compile at their first call)
if [ "${SKIP_EFFICIENCY:-0}" = 1 ]; then
    echo "gpu.sh: efficiency bench skipped (SKIP_EFFICIENCY=1)"
elif [ "$(left)" -ge 120 ]; then
    timeout "$(left)" "$PY" -m bench.efficiency_bench --device cuda --repeats 1 --out "$OUT/efficiency_gpu.md" 2>&1 |
        tee "$OUT/efficiency_gpu.log" | tail -5
else
    echo "gpu.sh: no time left for the efficiency bench (it needs 120 s; $(left) s of $TOTAL left)"
fi
echo "gpu.sh: done in $SECONDS s"
