#!/usr/bin/env bash
# bash scripts/gpu_check.sh      (on a machine with a CUDA GPU; at most 15 minutes, 17 with two GPUs; writes docs/gpu.md after each part)
# Everything that needs a GPU: the tests with CUDA skips, the benchmark's GPU rows (host pageable, host pinned
# and device-resident data: the windowed step on one GPU against a raw CUDA loop), where two GPUs are present DDP x2
# against raw DDP x2 over NCCL (benchmark.py --ddp --device cuda; with fewer, the report says it was not checked),
# batch.effective's fit then one epoch of training (default budget with the data kept on
# the GPU, and a 256 MiB budget with host data), model=mlp at the MLP benchmark's sizes (d=1000, hidden [2048, 2048],
# B=1024) at 32-true, bf16-mixed, 16-mixed and with compile=true, each with its mfu against the GPU's measured matmul
# rate at that precision, the study's GPU claims (transfer, batch, batch_fit), and `python advise.py` for the seed's
# Linear and an MLP [1024, 1024], each checked against full runs of its command and the user's (scripts/advice_check.py:
# the predicted speed-up within 15% of the measured one). Needs .wheels/ from
# scripts/gpu_wheels.sh when the machine has no package index (Hydra and its launchers are installed from it).
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: no CUDA GPU is visible to PyTorch here; scripts/gpu_check.sh runs only where one is" >&2
  echo "not checked here: the CUDA tests; the benchmark's GPU rows; DDP x2 over NCCL; batch.effective on a GPU;"
  echo "  model=mlp at d=1000, hidden [2048, 2048], B=1024 at 32-true, bf16-mixed, 16-mixed and compile=true, and"
  echo "  its mfu against the GPU's measured matmul rate; the study's GPU claims; the advice (python advise.py) for the"
  echo "  Linear and an MLP [1024, 1024] on a GPU, against full runs of its commands"
  exit 1
fi
if ! python3 -c "import hydra, omegaconf, hydra_plugins.hydra_joblib_launcher, hydra_plugins.hydra_submitit_launcher" 2>/dev/null; then
  python3 -m pip install --quiet --no-index --no-deps --find-links .wheels .wheels/*.whl || {
    echo "error: Hydra is missing and .wheels/ could not supply it; run scripts/gpu_wheels.sh where pip can" >&2
    exit 1
  }
fi
python3 -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1

OUT=docs/gpu.md
LOG=$(mktemp -d)
status=0
DONE=()
report() {  # docs/gpu.md from the parts run so far: rewritten after each, so a check cut short keeps what it did
  {
    echo "# GPU check"
    echo
    echo "Written by \`bash scripts/gpu_check.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC') (do not edit by hand)."
    echo
    echo "## Machine"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    python3 -c "import torch, lightning, platform; print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| lightning', lightning.__version__)"
    echo '```'
    for name in "${DONE[@]}"; do
      echo
      echo "## $name (exit $(cat "$LOG/$name.rc"))"
      echo
      echo '```'
      tail -n 60 "$LOG/$name"
      echo '```'
    done
    if [ -e docs/study_gpu.md ]; then
      echo
      echo "The study's GPU sections: [study_gpu.md](study_gpu.md)."
    fi
  } >"$OUT"
}
run() {  # run NAME SECONDS COMMAND...: its output into $LOG/NAME, its exit status kept, the report rewritten
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*" >&2
  timeout "$seconds" "$@" >"$LOG/$name" 2>&1
  local rc=$?
  echo "$rc" >"$LOG/$name.rc"
  [ "$rc" -eq 0 ] || status=1
  DONE+=("$name")
  report
}
# The tests marked cuda (tests/conftest.py skips them without a GPU), from the files that have them: the others
# may import what this machine lacks (Optuna).
CUDA_TESTS=$(grep -l "mark\.cuda" tests/test_*.py | tr '\n' ' ')
run tests 180 python3 -m pytest -q -rfEs -m cuda $CUDA_TESTS
run benchmark 150 python3 scripts/benchmark.py --gpu-sweep --batch-sizes 1024
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
  run ddp 120 python3 scripts/benchmark.py --ddp --device cuda --reps 2 --batch-sizes 4096
else
  echo "not checked: DDP x2 against raw DDP x2 over NCCL needs 2 GPUs; $GPUS visible to PyTorch" >"$LOG/ddp"
  echo 0 >"$LOG/ddp.rc"
  DONE+=(ddp)
  report
fi
FIT=(train.py trainer.accelerator=gpu data.num_samples=1000000 data.num_features=1000 batch.effective=65536
     trainer.max_epochs=1 trainer.enable_progress_bar=false logger=none)
run batch_fit 90 bash -c "python3 ${FIT[*]} hydra.run.dir=$LOG/fit-default && python3 ${FIT[*]} \
  data.on_device=false batch.memory_mb=256 hydra.run.dir=$LOG/fit-256 && grep -h -A3 '\"batch_fit\"' $LOG/fit-*/metrics.json"
MLP=(train.py trainer.accelerator=gpu model=mlp "model.hidden=[2048,2048]" data=teacher data.num_features=1000
     data.num_samples=131072 data.batch_size=1024 trainer.max_steps=400 trainer.max_epochs=-1
     trainer.limit_val_batches=0 trainer.enable_progress_bar=false logger=none)
FIGURES='import json, sys; m = json.load(open(sys.argv[1])); print(sys.argv[2], m["status"], *(f"{k} {m[k]:.4g}" for k in
  ("step_time_ms", "samples_per_sec", "model_tflops", "peak_tflops", "mfu")))'
run mlp 240 bash -c "for variant in trainer.precision=32-true trainer.precision=bf16-mixed trainer.precision=16-mixed \
  compile=true; do python3 ${MLP[*]} \$variant hydra.run.dir=$LOG/mlp-\${variant#*=} \
  && python3 -c '$FIGURES' $LOG/mlp-\${variant#*=}/metrics.json \$variant || exit 1; done"
run advice 330 bash -c "python3 scripts/advice_check.py --reps 2 trainer.accelerator=gpu \
  && python3 scripts/advice_check.py --reps 2 trainer.accelerator=gpu model=mlp 'model.hidden=[1024,1024]'"
run study 150 python3 scripts/study.py --only transfer --only batch --only batch_fit --out docs/study_gpu.md

echo "$OUT"
exit $status
