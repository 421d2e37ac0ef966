#!/usr/bin/env bash
# A GPU machine's checks, in order: build the C++ extension (timed), then each step named on the
# command line: native (the native runtime's GPU tests), gpu (every GPU test), gpu:<n>[:<test paths joined by +>] (every GPU test, or
# those paths' tests, shared out among n pytest processes at once: the time is mostly compiling on the host), host (the host-cost table),
# e2e:<e2e.py arguments joined by +> (end-to-end rows, merged into a copy of bench/results/e2e.json, or of
# $E2E_NAME.json where E2E_NAME is set; by default e2e.json on an H200 and e2e_h100.json on an H100; several e2e steps add to the same copy), ab:<ab.py arguments joined by +> (likewise: ab.json or ab_h100.json, or $AB_NAME.json), triton (the Triton kernels' tests
# on the GPU; triton:depthwise, triton:depthwise_band, triton:depthwise_strip, triton:depthwise_rows, triton:grouped or triton:folded one family's, for a call's time limit), depthwise:<depthwise.py arguments joined by +> (added to a copy of bench/results/<its --name, default depthwise>.json), warm:<network>:<batch>[:<dtype>] (bench/warm_start.py,
# written as warm_start_<network>_b<batch>), dynamic:<dynamic_shapes.py arguments joined by +> (new input shapes
# during training), margins (bench/verification_margins.py on CUDA: every cuDNN execution plan against
# find's element bound and allocation check), margins:<network>:<batch>[:<dtypes>[:<minutes>]] (the same on a
# built-in network's layers, for at most <minutes>, default 5), probe (the host's CPUs and topology).
# sweep:<minutes>[:<sweep.py arguments joined by +>] (bench/sweep.py for that long, going on from
# bench/data/sweep.jsonl.gz where it exists: the measurements get's learned model is trained on; e.g.
# sweep:8:--networks+all measures the built-in networks' layers, which bench/learned_get.py holds out one at a
# time; the whole dataset comes back as $OUT/sweep.jsonl.gz).
# coldtune:<network>:<batch>[:<threads>[:<tag>]] (bench/tuning_cost.py --whole --layers 0: a cold tuning of the
# network's training problems profiled, Triton's disk cache empty, find compiling ahead on <threads> threads, default
# the setting's; written as tuning_cost_<network>_b<batch>[_t<threads>][_<tag>]: steps with threads 8 and 0 taking
# turns in one call, tagged a and b, compare what the threads save on one host).
# layerhost:<network>:<batch>[:<dtype>[:grad]] (bench/layer_host.py: each tuned layer's host and GPU time per call
# against PyTorch's).
# compileprofile:<compile_profile.py arguments joined by +> (bench/compile_profile.py, Inductor's generated code
# in $OUT/compile_output_code.txt).
# order (bench/cudnn_order.py: cuDNN's own order of its plans for every problem of the dataset, as
# $OUT/cudnn_order.json.gz, which bench/learned_get.py reads beside the dataset off the GPU).
# learned (bench/learned_get.py on bench/data/sweep.jsonl.gz, on the GPU: cuDNN's heuristics A and B judged too).
# layers:<layers.py arguments joined by +> (bench/layers.py, e.g. layers:--all: get, find, cuDNN's heuristics and
# exhaustive best and PyTorch per layer; a run cut short keeps the configurations it finished). budgets
# (bench/plan_budgets.py's committed configuration: network workspace plans under budgets). heuristics
# (bench/heuristics_cost.py: the host time of asking cuDNN's heuristics A and B for a new problem's plans).
# tiepaths[:<tie_paths.py arguments joined by +>] (bench/tie_paths.py: the paths of a layer whose pick is PyTorch's own
# call, five copies of a network timed in one process).
# getlatency (bench/get_latency.py: how long get takes on a problem new to the process, and on it again).
# timermethods[:<timer_methods.py arguments joined by +>] (bench/timer_methods.py: the timer's methods, their cost
# and their picks, on a network's first problems).
# Everything lands in $OUT (default /tmp/out), the last lines of each step on stdout.
# Run it as `BENCH_REVISION=<revision> BENCH_SOURCE=<src tree> bash bench/gpu_checks.sh ...` with both values
# written out as `git rev-parse --short HEAD` and `git rev-parse --short HEAD:src` give them where the tree was
# committed, not computed on the device: the copy of the tree there may carry an older .git (a $(git ...) in the
# device's command line reads that one), and the result files name the revision (and src/ tree) they measured.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CONVTUNE_CACHE_DIR=/tmp/convtune-cache CONVTUNE_EXTENSION_DIR=/tmp/convtune-ext CONVTUNE_PROGRESS=0
# Inductor's caches per src/ tree: they key a graph by its ops' names, not by the extension's C++, so a warm machine
# would serve a graph traced by an earlier version of the layer ops.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-${BENCH_SOURCE:-$(git rev-parse --short HEAD:src 2>/dev/null || date +%s)}
# AOTAutograd's cache off: torch 2.11 keys a graph by whether autocast is on, not by its dtype (pytorch/pytorch#181564,
# fixed later), so a network compiled under bfloat16 after float16 would run the float16 graph (its stem measured 3x faster).
export TORCHINDUCTOR_AUTOGRAD_CACHE=0
# The cuDNN frontend's wheel: .whl/ here, or WHL_DIR (a frozen tree of an older revision, run from its own folder,
# names the checkout's: WHL_DIR=../.whl). Without it cuDNN's plans are no candidates: said on stderr, since an A/B
# of two trees is meaningless where one of them lacks it.
WHL_DIR=${WHL_DIR:-.whl}
if ls "$WHL_DIR"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL_DIR"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  echo "gpu_checks.sh: no cuDNN frontend wheel in $WHL_DIR: cuDNN's execution plans are no candidates in this run" >&2
  export PYTHONPATH=$PWD/src
fi
# The extension's build status on stdout only: $OUT is kept for result files.
python3 -m convtune.cli native --json 2>&1
# The results files of another GPU than the H200 carry its name (e2e_h100.json): each file holds one GPU's rows.
GPU_SUFFIX=$(python3 -c 'import torch; n = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""; print("_h100" if "H100" in n else "")' 2>/dev/null)
# The first line of a test log: when, where, what software and which revision it tested.
header() { echo "# pytest $1 on $(date -u '+%Y-%m-%d %H:%M UTC'), $(python3 -c 'import platform, torch; g = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"; print(g + ", torch", torch.__version__ + ", cuDNN", str(torch.backends.cudnn.version()) + ", CUDA", str(torch.version.cuda) + ", Python", platform.python_version())'); revision ${BENCH_REVISION:-unknown} (bench/gpu_checks.sh)"; }
# Exit-time lines of the cuDNN frontend's bindings (objects it reports as leaked), not test output.
quiet() { grep -v -E 'nanobind|^ - (leaked|\.\.\. skipped)|refleaks'; }
# pytest into its log file directly (a run cut short by a time limit keeps what it wrote), each test's phases timed as
# they end into <log>_times.txt (tests/conftest.py: CONVTUNE_TEST_TIMES), then the log's last lines.
tests() { local log=$1; shift; header "$*" > "$log"
          CONVTUNE_TEST_TIMES="${log%.txt}_times.txt" python3 -m pytest -q -p no:cacheprovider --durations=15 "$@" >> "$log" 2>&1
          quiet < "$log" | tail -25; }
for step in "$@"; do
  case "$step" in
    native) tests "$OUT/gpu_tests_native.txt" -rP tests/gpu/test_gpu_native.py ;;
    gpu) tests "$OUT/gpu_tests.txt" tests/gpu ;;
    gpu:*) IFS=: read -r _ parts paths <<< "$step"; paths=${paths:-tests/gpu}; log="$OUT/gpu_tests.txt"
           first=${paths%%+*}; [ "$paths" = tests/gpu ] || log="$OUT/gpu_tests_$(basename "${first%%::*}" .py).txt"
           header "${paths//+/ } in $parts processes" > "$log"
           mapfile -t ids < <(python3 -m pytest --collect-only -q -p no:cacheprovider ${paths//+/ } 2>/dev/null | grep '::')
           echo "# ${#ids[@]} tests collected; process i runs the tests whose place in the collection is i modulo $parts" >> "$log"
           for ((i = 0; i < parts; i++)); do
             share=(); for j in "${!ids[@]}"; do (( j % parts == i )) && share+=("${ids[j]}"); done
             CONVTUNE_TEST_TIMES="${log%.txt}_${i}_times.txt" python3 -m pytest -q -p no:cacheprovider --durations=10 \
               "${share[@]}" > "${log%.txt}_$i.txt" 2>&1 &
           done; wait
           for ((i = 0; i < parts; i++)); do quiet < "${log%.txt}_$i.txt" | grep -E '^(FAILED|ERROR)|passed|failed|skipped' | tail -8; done
           # one log and one times file a step: the device sends back at most 8 files
           for ((i = 0; i < parts; i++)); do echo "## process $i"; quiet < "${log%.txt}_$i.txt"; done >> "$log"
           for ((i = 0; i < parts; i++)); do cat "${log%.txt}_${i}_times.txt" 2>/dev/null; done > "${log%.txt}_times.txt"
           for ((i = 0; i < parts; i++)); do rm -f "${log%.txt}_$i.txt" "${log%.txt}_${i}_times.txt"; done ;;
    host) python3 bench/tuning_cost.py --layers 1 --out "$OUT" --name tuning_cost_native 2>&1 | tail -40 ;;
    coldtune:*) IFS=: read -r _ network batch threads tag <<< "$step"
                python3 bench/tuning_cost.py --network "$network" --batch "$batch" --layers 0 --whole \
                  ${threads:+--compile-threads "$threads"} --out "$OUT" \
                  --name "tuning_cost_${network}_b${batch}${threads:+_t$threads}${tag:+_$tag}" 2>&1 | sed -n '/whole network, cold/,/Host cost/p' ;;
    e2e:*) name=${E2E_NAME:-e2e$GPU_SUFFIX}; [ -e "$OUT/$name.json" ] || cp "bench/results/$name.json" "$OUT/" 2>/dev/null; args=${step#e2e:}
           python3 bench/e2e.py ${args//+/ } --out "$OUT" --name "$name" 2>&1 | tail -30 ;;
    tiepaths|tiepaths:*) args=${step#tiepaths}; args=${args#:}
                        python3 bench/tie_paths.py ${args//+/ } --out "$OUT" 2>&1 | quiet | tail -14 ;;
    ab:*) name=${AB_NAME:-ab$GPU_SUFFIX}; [ -e "$OUT/$name.json" ] || cp "bench/results/$name.json" "$OUT/" 2>/dev/null
          args=${step#ab:}; python3 bench/ab.py ${args//+/ } --out "$OUT" --name "$name" 2>&1 | quiet | tail -30 ;;
    triton) tests "$OUT/triton_tests.txt" tests/test_triton_depthwise.py tests/test_triton_depthwise_band.py tests/test_triton_depthwise_strip.py \
              tests/test_triton_depthwise_rows.py tests/test_triton_grouped.py tests/test_triton_folded.py ;;
    triton:*) tests "$OUT/triton_tests_${step#triton:}.txt" "tests/test_triton_${step#triton:}.py" ;;
    warm:*) IFS=: read -r _ network batch dtype <<< "$step"
            python3 bench/warm_start.py --network "$network" --batch "$batch" --dtype "${dtype:-float16}" --out "$OUT" 2>&1 | sed -n '8,14p' ;;
    layerhost:*) IFS=: read -r _ network batch dtype grad <<< "$step"
                 [ "$grad" = grad ] && grad=--grad || grad=
                 python3 bench/layer_host.py --network "$network" --batch "$batch" --dtype "${dtype:-float16}" \
                   $grad --out "$OUT" 2>&1 | quiet | grep -v '^[a-z_0-9.]*: host' | head -40 ;;
    dynamic:*) args=${step#dynamic:}; python3 bench/dynamic_shapes.py ${args//+/ } --out "$OUT" 2>&1 | quiet | tail -12 ;;
    depthwise:*) args=${step#depthwise:}; name=$(sed -n 's/.*+--name+\([^+]*\)+.*/\1/p' <<< "+$args+")
                 # (the committed results of the file it adds to, as e2e and ab do: rows measured now replace theirs)
                 name=${name:-depthwise}; [ -e "$OUT/$name.json" ] || cp "bench/results/$name.json" "$OUT/" 2>/dev/null
                 python3 bench/depthwise.py ${args//+/ } --out "$OUT" 2>&1 | quiet | tail -40 ;;
    compileprofile:*) args=${step#compileprofile:}
                      TORCH_LOGS=output_code python3 bench/compile_profile.py ${args//+/ } --out "$OUT" \
                        2> "$OUT/compile_output_code.txt" | tail -40
                      grep -E -A2 '^[A-Za-z.]*(Error|Exception)' "$OUT/compile_output_code.txt" | tail -12 ;;
    margins) python3 bench/verification_margins.py --device cuda --out "$OUT" 2>&1 | quiet | tail -30 ;;
    margins:*) IFS=: read -r _ network batch dtypes minutes <<< "$step"
               python3 bench/verification_margins.py --device cuda --network "$network" --batch "$batch" \
                 --dtypes "${dtypes:-float16,bfloat16}" --minutes "${minutes:-5}" --out "$OUT" 2>&1 | quiet | tail -12 ;;
    sweep:*) db=/tmp/sweep.sqlite; rm -f "$db"
             if [ -e bench/data/sweep.jsonl.gz ]; then python3 -m convtune.cli cache --db "$db" import bench/data/sweep.jsonl.gz; fi
             IFS=: read -r _ minutes args <<< "$step"
             python3 bench/sweep.py --minutes "$minutes" ${args//+/ } --db "$db" --export "$OUT/sweep.jsonl.gz" 2>&1 | quiet | tail -8 ;;
    learned) db=/tmp/learned.sqlite; rm -f "$db"; python3 -m convtune.cli cache --db "$db" import bench/data/sweep.jsonl.gz
             python3 bench/learned_get.py --db "$db" --measured-on auto --out "$OUT" 2>&1 | quiet | tail -30 ;;
    order) db=/tmp/order.sqlite; rm -f "$db"; python3 -m convtune.cli cache --db "$db" import bench/data/sweep.jsonl.gz
           python3 bench/cudnn_order.py --db "$db" --out "$OUT" 2>&1 | quiet | tail -5 ;;
    layers:*) args=${step#layers:}; python3 bench/layers.py ${args//+/ } --out "$OUT" 2>&1 | quiet | tail -14 ;;
    budgets) python3 bench/plan_budgets.py --out "$OUT" 2>&1 | quiet | tail -12 ;;
    heuristics) python3 bench/heuristics_cost.py --out "$OUT" 2>&1 | quiet | tail -12 ;;
    getlatency) python3 bench/get_latency.py --out "$OUT" 2>&1 | quiet | tail -12 ;;
    timermethods|timermethods:*) args=${step#timermethods}; args=${args#:}
                python3 bench/timer_methods.py ${args//+/ } --out "$OUT" 2>&1 | quiet | tail -12 ;;
    probe) { nproc; lscpu | grep -i -E 'model name|numa|socket'; cat /proc/loadavg; nvidia-smi topo -m; } 2>&1 | tee "$OUT/host.txt" ;;
  esac
done
