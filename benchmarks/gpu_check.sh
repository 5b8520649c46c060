#!/usr/bin/env bash
# One call on a lent GPU host (see ../shared/gpu/README.md): the `gpu` tests the defaults rest
# on, the GPU benchmark, the engine tests on CUDA, the other `gpu` tests, then HF's compiled
# baseline, each stage under its own time
# limit and all of them under DEADLINE_S, logs and profiler tables in /tmp/gpu-logs, packed
# at the end into $OUT/gpu-logs.tgz (timelines beside it: the device tool returns at most 8
# files). Stages run in order of value, so a call cut short still returns what ran; a stage's
# failure does not stop the next.
# STAGES (space-separated names) runs only those; CONCURRENCY sets the benchmark's (1 32 64).
#
#   bash .gpu/setup.sh && export PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi \
#       FLASHINFER_CUDA_ARCH_LIST=9.0a && DEADLINE_S=530 bash benchmarks/gpu_check.sh
set -u
out=/tmp/gpu-logs
mkdir -p "$out"
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${DEADLINE_S:-560} ))
PYTEST=(python3 -m pytest -q -p no:cacheprovider --durations=10)

stage() {  # stage NAME MAX_SECONDS COMMAND...: run under min(MAX, time left), log to $out/NAME.log
    local name=$1 max=$2; shift 2
    if [[ -n "${STAGES:-}" && " $STAGES " != *" $name "* ]]; then return; fi
    local left=$(( deadline - $(date +%s) ))
    local limit=$(( max < left ? max : left ))
    if (( limit < 20 )); then echo "== $name: skipped (${left}s left)"; return; fi
    echo "== $name (limit ${limit}s) $(date +%T)"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $(( $(date +%s) - t0 ))s"
    grep -E "passed|failed|error|Error|ms/step|built|TTFT|step split|verify of|^\{" "$out/$name.log" | tail -25
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)"
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
    lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|NUMA node\(s\)"
    # the host's Python speed: host-bound steps scale with it (0.137 s on the 2-core dev box,
    # 0.24 s on run H's GPU host, docs/benchmarks.md)
    python3 -c "import time; t = time.perf_counter(); sum(range(10**7)); print('python: sum(range(1e7))', round(time.perf_counter() - t, 3), 's')"
} 2>&1 | tee "$out/env.log"

# first, what the defaults rest on: overlap's launch never waits for the device (on a forward
# thread and inline, the CUDA default), speculation's verify steps replay graphs (77 s in run
# T), and the fast decode plan (on by default) gives plan()'s tokens (never yet run: runs S and
# T cut the stage that held it)
stage new_gpu_tests 150 "${PYTEST[@]}" -m gpu tests/unit/replicas/test_speculative_decoding.py \
    tests/unit/replicas/test_overlap_schedule.py \
    "tests/unit/replicas/test_device_path.py::test_the_fast_decode_plan_gives_the_regular_plans_tokens"
# then the overlapped step at 1, 32 and 64 on a forward thread and inline (overlap_mean_ms,
# overlap_inline_mean_ms: means, as a step() call may leave work to the next), then at 32 and
# 64 in each order (landing the last step first, waiting for the next one's launch:
# Engine.await_launch, inline), alternating, and a timeline of the first two; read them with
# benchmarks/trace_stalls.py where they land (runs N, P and Q found the forward thread's launch
# waiting for the GIL while the GPU idled)
# BENCH_FLAGS replaces the extras (e.g. "--switch-intervals 0.0005 0.002" for a shorter call)
stage benchmark 330 python3 -m benchmarks.gpu --concurrency ${CONCURRENCY:-1 32 64} --backends flashinfer \
    --graph-modes on --skip-hf --compile on \
    ${BENCH_FLAGS:---verify-cost --trace-steps 20 --switch-intervals --fast-plan} \
    --log-dir "$out"   # + spec step split, host profiles, a session turn's profile
# the engine suite on CUDA (60 s on an H200)
stage cuda_suite 150 "${PYTEST[@]}" --device cuda -m "not gpu" \
    tests/unit/replicas/test_overlap_schedule.py tests/unit/replicas/test_equivalence.py \
    tests/unit/replicas/test_speculative_decoding.py tests/unit/replicas/test_engine_sessions.py
# (73 s in run Q; cut at 35 s in run T before a result)
stage gpu_tests 120 "${PYTEST[@]}" -m gpu tests/unit/replicas/test_device_path.py \
    tests/unit/replicas/test_loader_and_backends.py tests/unit/replicas/test_compiled_forward.py
# the compiled HF baseline at 32 (issue 23's ratio_vs_hf_static_32: 2.37x in run O by a
# median, ~1.7x by run R's mean; run T's inline mean against run O's HF would be 2.43x), ours
# beside it in the same run
stage hf_static 130 python3 -m benchmarks.gpu --concurrency 32 --backends flashinfer \
    --graph-modes on --compile on --hf-static-concurrency 32 --held 1000
echo "== done $(date +%T)"
# timelines travel as files of their own (the tool returns files of up to 16 MiB each)
mkdir -p "${OUT:-.}" && tar czf "${OUT:-.}/gpu-logs.tgz" --exclude 'trace_*' -C "$out" .
cp "$out"/trace_*.json.gz "${OUT:-.}/" 2>/dev/null || true
ls -la "${OUT:-.}"
