#!/usr/bin/env bash
# The experiments of one GPU loan (issue: experiments with seeds): the cells at the paper's scale that
# 2 CPU cores cannot afford, 14 runs at a time on one GPU, under a hard deadline.
#
#   bash experiments/gpu/loan.sh [EXPERIMENT] [lcsm sweep options...]
#
# EXPERIMENT defaults to experiments/gpu/metala_mqar.yaml. The sweep writes to $SWEEP (default
# /tmp/gpu_sweep); at DEADLINE seconds (default 480) it is sent SIGTERM, and its running runs finish
# their step, checkpoint and stop (lcsm's trainer), so a later `lcsm sweep` continues them. The runs'
# results, logs and configs (not their checkpoints, too large to bring back) are packed into
# $OUT/sweep.tar.gz; unpack it into results/<experiment name>/ and run `lcsm report` there.
# DEVICE (default cuda) and PARALLEL (default 14) choose where and how many; DEVICE=cpu with tiny
# `--set` overrides is this script's smoke test.
set -u
cd "$(dirname "$0")/../.."
EXPERIMENT=${1:-experiments/gpu/metala_mqar.yaml}
shift || true
OUT=${OUT:-/tmp}
SWEEP=${SWEEP:-/tmp/gpu_sweep}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$SWEEP"
# One CPU thread per run: 14 processes share the GPU machine's cores.
timeout -s TERM -k 90 "${DEADLINE:-480}" "$PY" -m lcsm sweep "$EXPERIMENT" --out "$SWEEP" \
    --parallel "${PARALLEL:-14}" --set run.device="${DEVICE:-cuda}" --set run.threads=1 "$@"
echo "sweep exit status $? (124: stopped at the deadline; the unfinished runs checkpointed)"
"$PY" -m lcsm sweep "$EXPERIMENT" --out "$SWEEP" --dry-run --set run.device="${DEVICE:-cuda}" --set run.threads=1 "$@"
tar czf "$OUT/sweep.tar.gz" --exclude=checkpoints -C "$(dirname "$SWEEP")" "$(basename "$SWEEP")"
ls -la "$OUT/sweep.tar.gz"
