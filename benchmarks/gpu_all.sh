#!/usr/bin/env bash
# Every GPU check in one command, each part capped in time so that the whole fits a fixed budget
# (about 9 minutes on one H100) and a part cut short keeps what it measured (gpu_bench.py writes its
# JSON after every part and train variant):
#   bash benchmarks/gpu_all.sh OUT_DIR
# OUT_DIR gets: nvidia-smi.txt, kernels.json/.log (device, kernel tests, rmsnorm, attention),
# train1b.json/.log, layer7b.json/.log (train steps; each variant in its own process) and
# train_default.log (the README's first command, `python -m boost_jax.train`, for at most 60 s).
set -u
out=${1:?usage: gpu_all.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
$py -c 'import jax; print(jax.__version__, jax.devices())' >>"$out/nvidia-smi.txt" 2>&1
part() {  # part NAME SECONDS ARGS...: one gpu_bench run, its table in NAME.log, its rows in NAME.json
  local name=$1 secs=$2; shift 2
  echo "== $name (at most ${secs}s)"
  timeout -k 10 "$secs" $py benchmarks/gpu_bench.py "$@" --json "$out/$name.json" >"$out/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s in all"
}
part kernels 140 --parts device,tests,rmsnorm,attention
part train1b 260 --parts device,train1b --steps 5
echo "== train_default (at most 60s)"
timeout -k 5 60 $py -m boost_jax.train --config.run_dir="$(mktemp -d)/run" >"$out/train_default.log" 2>&1
echo "   exit $? after ${SECONDS}s in all"
part layer7b 60 --parts device,layer7b --steps 5
