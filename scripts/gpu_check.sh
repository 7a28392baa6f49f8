#!/usr/bin/env bash
# The prepared device check of issue 10 part 4, for a session lent one CUDA GPU (H100/H200).
# Under 10 minutes on one H100; prints one line per check and "gpu_check: OK" or "FAILED".
#
#   bash scripts/gpu_check.sh                              # from the repository root
#   bash scripts/gpu_check.sh --device cpu --tiny          # dry run of the same code on CPU
#
# 1. CP attention on fused kernels (both strategies, cp 1/2/4 emulated on the device), TE's THD CP
#    (attention_backend=te, 2 ranks; needs TE and 2 GPUs, else skipped) and the non-CP
#    THD path vs. the CPU float64 reference, fp32 and bf16;
# 2. one bf16 training step of a ~1.1B LLaMA on a 32K-token THD micro-batch: step time, MFU
#    (model FLOPs of the real tokens / 989 TFLOP/s) and peak GPU memory;
# 3. issue 39's runs: FSDP dp_shard memory vs plan mode, checkpoint save peak vs training peak,
#    calibration at bf16, device choice under one visible GPU, fake-CUDA rehearsal vs real counts.
# Details: scripts/gpu_check.py. Needs torch with CUDA (flash-attn is used when installed).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec timeout "${GPU_CHECK_TIMEOUT:-590}" python scripts/gpu_check.py "$@"
