#!/usr/bin/env bash
# Every GPU check in two commands, each about 9 minutes (one device call runs at most 10), each part
# capped in time so that a part cut short keeps what it measured (gpu_bench.py and vs_torch.py write
# their JSON after every variant and row); the speed set comes first:
#   bash benchmarks/gpu_all.sh OUT_DIR [speed]   # COLA_REPO=/path/to/CoLA adds the official CoLA rows
#   bash benchmarks/gpu_all.sh OUT_DIR checks
# speed: OUT_DIR gets nvidia-smi.txt, train256.json/.log (the targets' four rows first, then one change
# at a time, one process; cola_1b auto and its XLA-norm twin traced into profile.tgz) and vs_torch.json/.log (PyTorch +
# torch.compile at the same widths and shapes, a process per row; the project's own rows are
# train256's, from the same machine minutes before).
# checks: kernels.json/.log (device, kernel tests, rmsnorm, attention), train1b.json/.log, layer7b.json/.log
# (train steps; each variant in its own process) and train_default.log (the README's first command,
# `python -m boost_jax.train`, for at most 60 s).
set -u
out=${1:?usage: gpu_all.sh OUT_DIR [speed|checks]}
set_=${2:-speed}
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
case $set_ in
speed)
  part train256 ${TRAIN256_S:-330} --parts device,train256 --one-process --steps 8 --profile "$out/profile" \
      --profile-only "cola_1b auto,cola_1b auto xla norm"
  rows=hf_cola_compile,hf_compile${COLA_REPO:+,cola_compile}
  echo "== vs_torch (at most ${VS_TORCH_S:-200}s)"
  timeout -k 10 "${VS_TORCH_S:-200}" $py benchmarks/vs_torch.py --rows "$rows" --steps 8 \
      ${COLA_REPO:+--cola-repo "$COLA_REPO"} --json "$out/vs_torch.json" >"$out/vs_torch.log" 2>&1
  echo "   exit $? after ${SECONDS}s in all"
  # one file for the traces (a device call brings back at most 8 files, 2 folders down)
  [ -d "$out/profile" ] && tar czf "$out/profile.tgz" -C "$out" --exclude='*.trace' profile && rm -rf "$out/profile"
  ;;
checks)
  part kernels 140 --parts device,tests,rmsnorm,attention
  part train1b 240 --parts device,train1b --steps 5
  echo "== train_default (at most 60s)"
  timeout -k 5 60 $py -m boost_jax.train --config.run_dir="$(mktemp -d)/run" >"$out/train_default.log" 2>&1
  echo "   exit $? after ${SECONDS}s in all"
  part layer7b 60 --parts device,layer7b --steps 5
  ;;
*) echo "gpu_all.sh: unknown set '$set_' (speed or checks)" >&2; exit 2 ;;
esac
