#!/usr/bin/env bash
# Every GPU check in one command, each part capped in time so that the whole fits a fixed budget
# (about 14 minutes on one H100) and a part cut short keeps what it measured (gpu_bench.py and
# vs_torch.py write their JSON after every part, variant and row); the speed parts come first:
#   bash benchmarks/gpu_all.sh OUT_DIR            # COLA_REPO=/path/to/CoLA adds the official CoLA rows
# OUT_DIR gets: nvidia-smi.txt, train256.json/.log and profile/ (the defaults beside the defaults
# before them, one process, traced), vs_torch.json/.log (the project beside PyTorch, a process per row),
# kernels.json/.log (device, kernel tests, rmsnorm, attention), train1b.json/.log, layer7b.json/.log
# (train steps; each variant in its own process) and train_default.log (the README's first command,
# `python -m boost_jax.train`, for at most 60 s).
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
part train256 300 --parts device,train256 --one-process --steps 8 --profile "$out/profile" \
    --profile-only "cola_1b auto,llama_1b auto"
echo "== vs_torch (at most 240s)"
timeout -k 10 240 $py benchmarks/vs_torch.py --rows project,project_bf16,cola_compile,hf_compile \
    ${COLA_REPO:+--cola-repo "$COLA_REPO"} --json "$out/vs_torch.json" >"$out/vs_torch.log" 2>&1
echo "   exit $? after ${SECONDS}s in all"
part kernels 140 --parts device,tests,rmsnorm,attention
part train1b 260 --parts device,train1b --steps 5
echo "== train_default (at most 60s)"
timeout -k 5 60 $py -m boost_jax.train --config.run_dir="$(mktemp -d)/run" >"$out/train_default.log" 2>&1
echo "   exit $? after ${SECONDS}s in all"
part layer7b 60 --parts device,layer7b --steps 5
