#!/usr/bin/env bash
# The checks to run on a GPU host (CI here has none): CUDA tensors on NCCL
# worlds, simulated worlds sharing one device, and the property suite on a
# GPU host (which joins its worlds as cpu:gloo,cuda:nccl). Each step has its
# own time limit and the script goes on after a failure; logs go to $OUT
# (default ./gpu-check).
#   bash tools/gpu_check.sh
set -u
OUT=${OUT:-gpu-check}
export PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 6 "$OUT/$name.log"
}
step env 30 bash -c 'nvidia-smi -L; $PY -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.distributed.is_nccl_available())"'
step install 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
step cuda_plain 100 "$PY" -m pytest tests/test_cuda_dist.py -v -rs -p no:cacheprovider
step cuda_torchrun1 60 "$PY" -m torch.distributed.run --nproc_per_node=1 -m pytest tests/test_cuda_dist.py -rs -q -p no:cacheprovider
step cuda_sim 60 "$PY" -m pytest --dist-sim tests/test_cuda_dist.py -v -rs -p no:cacheprovider
step main_job 240 "$PY" -m torch.distributed.run --nproc_per_node=4 -m pytest tests/properties -q -x --hypothesis-profile=ci -p no:cacheprovider
