#!/usr/bin/env bash
# One device call's worth of work on a lent GPU (under 10 minutes), failing loudly instead of reporting success:
#   bash benchmarks/gpu_session.sh tests    # the whole GPU test suite (-m gpu), at most 470 s, xdist on every core
#   bash benchmarks/gpu_session.sh suite    # the rest of the suite (-m "not gpu": NumPy backend, emulated kernels, JAX,
#                                           # PyTorch) where its compilers and CUDA-enabled JAX differ from CI's
#   bash benchmarks/gpu_session.sh bench    # the full benchmark, CUDA backend only, at most 540 s
#   bash benchmarks/gpu_session.sh [all]    # both, about half the time each; no benchmark if a test failed
#   bash benchmarks/gpu_session.sh sanitize # compute-sanitizer memcheck, racecheck, synccheck, initcheck on every
#                                           # kernel family at small shapes (benchmarks/kernel_cases.py)
#   bash benchmarks/gpu_session.sh profile  # ncu on the main kernels at the benchmark's shapes
# Before the call, where ../shared/golden exists (the copy of the tree sent to the GPU has no ../shared):
#   mkdir -p .golden && cp ../shared/golden/*.npz .golden/      then name ".golden" in the device tool's carry,
#   and write the commit into the command (the copy has no .git):  GPU_SESSION_COMMIT=<sha> bash benchmarks/...
# $OUT gets at most 8 files: session.json (commit, date, device, driver, NVRTC, CuPy, every step's outcome),
# session.txt (this log), gpu_tests.txt + gpu_tests.xml, bench.txt, results.tar.gz (the benchmark's JSON/PNG);
# sanitize: sanitize.txt (every tool's report); profile: ncu.txt (the report as text) and profile.ncu-rep.
# Then here: tar -xzf <files_at>/results.tar.gz -C benchmarks/results/<device>/ && git add benchmarks/results
#
# GPU_SESSION_DRY_RUN=1: the same steps at toy size on a fake GPU (tests/fake_gpu: CuPy is tests/fake_cupy.py's
# fake, kernels run on the CPU emulator, nvidia-smi answers for FAKE_GPUS); session.json says "dry_run": true.
# tests/test_gpu_session.py runs it in CI. PYTHON names the interpreter (default python3); GPU_SESSION_WORKERS the
# pytest-xdist workers (default auto: one per core); GPU_SESSION_SECONDS the wall time the call allows (default 580,
# inside the device tool's 600): every step's time limit is scaled from it, so that reports are written before the
# call is killed. GPU_SESSION_BENCH_ARGS: more options for benchmarks.run, after the mode's own (e.g. "--only
# throughput --impl cuflash,torch-flash"), so that a short lease measures what changed. A kill the script sees
# (SIGINT, SIGTERM, SIGHUP) still writes session.json, with that signal's status and each unfinished step as
# "unfinished"; the benchmark's files are packed into $OUT every 20 s. GPU_SESSION_CASES: comma-separated
# benchmarks.kernel_cases names that sanitize or profile takes alone (python -m benchmarks.kernel_cases --list).
set -euo pipefail

what="${1:-all}"
case "$what" in
    tests | suite | bench | all | sanitize | profile) ;;
    *) echo "usage: bash benchmarks/gpu_session.sh [tests|suite|bench|all|sanitize|profile]" >&2; exit 2 ;;
esac
OUT="${OUT:-/tmp/cuflash-out}"
# a relative OUT names a folder under the caller's, as any path argument would: resolved before the cd below, which
# made it one under the checkout
[[ "$OUT" = /* ]] || OUT="$PWD/$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$PWD"
py="${PYTHON:-python3}"
# 0 or 1 (empty: 0), and nothing else: the script tested "= 1" where session.py read the value as JSON, so that
# GPU_SESSION_DRY_RUN=true ran for real on the device while session.json said "dry_run": true
dry="${GPU_SESSION_DRY_RUN:-0}"
[[ "$dry" =~ ^[01]$ ]] ||
    { echo "GPU_SESSION_DRY_RUN must be 1 (a dry run on a fake GPU) or 0 (the real one), got '$dry'" >&2; exit 2; }
budget="${GPU_SESSION_SECONDS:-580}"
[[ "$budget" =~ ^[0-9]{1,9}$ ]] && [ "$((10#$budget))" -ge 150 ] ||
    { echo "GPU_SESSION_SECONDS must be a whole number of seconds from 150 to 999999999, got '$budget'" >&2; exit 2; }
# in decimal from here on: shell arithmetic reads a leading 0 as octal (0600 was 384 s, 0900 an error that ended
# the script before its report); at most 9 digits, so that the arithmetic below cannot overflow
budget=$((10#$budget))
mkdir -p "$OUT"
log="$OUT/session.txt"
: > "$log"
work="$(mktemp -d)"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
    export PATH="$root/tests/fake_gpu/bin:$PATH"
    export PYTHONPATH="$root/tests/fake_gpu:$root/tests:$PYTHONPATH"
    t_tests=120; t_bench=120; bench_args=(--smoke --only tiles,decode --impl cuflash --time-limit 20)
    t_tool=120; cases_args=(--only f16-d64-causal,float32-3xtf32-d64); profile_args=("${cases_args[@]}")
elif [ "$what" = all ]; then  # 580 s: tests 240 (warm-up included), bench 270 (its cases stop 40 s before)
    t_tests=$((budget * 24 / 58)); t_bench=$((budget * 27 / 58)); bench_args=(--full --time-limit $((t_bench - 40)))
else  # 580 s: tests 470 (+30 s kill grace), bench 540
    t_tests=$((budget - 110)); t_bench=$((budget - 40)); bench_args=(--full --time-limit $((t_bench - 40)))
fi
if [ "$dry" != 1 ]; then
    # sanitize: a warm-up and four tools, 5 x (95 s + 5 s grace) = 500 s of 580; profile: 480 s
    t_tool=$(((budget - 80) / 5 - 5)); cases_args=(); profile_args=(--profile)
fi
if [ -n "${GPU_SESSION_CASES:-}" ]; then  # a short lease profiles or sanitizes only the cases named
    cases_args=(--only "$GPU_SESSION_CASES")
    if [ "$dry" = 1 ]; then profile_args=("${cases_args[@]}"); else profile_args=(--profile "${cases_args[@]}"); fi
fi
t_profile=$((budget - 100))
commit="${GPU_SESSION_COMMIT:-$(git rev-parse HEAD 2> /dev/null || echo unknown)}"
date_utc="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
failure="" golden="" n_golden=0 smi="" tests_rc=null bench_rc=null sanitize_rc=null profile_rc=null tool_path=""
tool_versions="" packer=""

say() { echo "$*" | tee -a "$log"; }
fail() {
    failure="$*"
    say "gpu_session: FAIL: $*"
    exit 1
}

pack() {  # the benchmark's files so far into $OUT/results.tar.gz (through a temporary name: never half a file)
    if [ -d "$work/bench" ] && [ -n "$(ls -A "$work/bench")" ]; then
        tar -czf "$work/results.tar.gz" -C "$work/bench" . && mv -f "$work/results.tar.gz" "$OUT/results.tar.gz"
    fi
}

start_packing() {  # pack() every 20 s in the background until stop_packing, or until this script is gone
    local parent=$$
    (
        n=0
        while [ ! -e "$work/packing.stop" ] && kill -0 "$parent" 2> /dev/null; do
            sleep 1
            n=$((n + 1))
            [ $((n % 20)) != 0 ] || pack
        done
    ) &
    packer=$!
}

stop_packing() {  # waits for the packer's last pack to end, so that the final pack() is the one that stays
    [ -n "$packer" ] || return 0
    touch "$work/packing.stop"
    wait "$packer" 2> /dev/null || true
    packer=""
}

write_session() {  # session.json as things stand; $1: the status to record
    local extra=() junit=()
    [ -z "$failure" ] || extra+=("failed=$failure")
    # the test report only where this session ran the tests: an earlier session's gpu_tests.xml left in OUT was
    # reported as this one's (with tests_rc null)
    [ "$tests_rc" = null ] || junit=(--junit "$OUT/gpu_tests.xml")
    "$py" -m benchmarks.session finish --out "$OUT/session.json" --probe "$work/probe.json" \
        "${junit[@]}" --set "what=$what" "dry_run=$dry" "commit=$commit" "date=$date_utc" \
        "nvidia_smi=$smi" "golden_dir=$golden" "golden_files=$n_golden" "tests_rc=$tests_rc" "bench_rc=$bench_rc" \
        "sanitize=$sanitize_rc" "profile_rc=$profile_rc" "tools=$tool_versions" "budget_s=$budget" \
        "status=$1" "${extra[@]}" >> "$log" 2>&1
}

finish() {  # on every exit: pack the benchmark's files and write session.json, whatever happened before
    local status=$?
    set +e
    trap '' INT TERM HUP  # a second signal must not cut the report short
    stop_packing
    pack
    write_session "$status" ||
        printf '{"status": %d, "failed": "session.json could not be written (see session.txt)"}\n' "$status" \
            > "$OUT/session.json"
    rm -rf "$work"
    say "gpu_session: exit $status; in $OUT: $(ls "$OUT" | tr '\n' ' ')"
    exit "$status"
}
trap finish EXIT
# a kill the script sees ends it with that signal's status (the EXIT trap then records it), never 0
trap 'failure="killed by SIGINT"; exit 130' INT
trap 'failure="killed by SIGTERM"; exit 143' TERM
trap 'failure="killed by SIGHUP"; exit 129' HUP

probe() {
    say "gpu_session $what: commit $commit, $date_utc, $budget s$([ "$dry" = 1 ] && echo ', DRY RUN on a fake GPU')"
    if [ "$commit" = unknown ]; then
        # benchmark numbers without their commit cannot be committed as anyone's results
        [ "$what" = tests ] || [ "$what" = suite ] || [ "$what" = sanitize ] || [ "$what" = profile ] ||
            fail "commit unknown (this copy has no .git): put GPU_SESSION_COMMIT=<sha> in the command"
        say "note: commit unknown (this copy has no .git): put GPU_SESSION_COMMIT=<sha> in the command"
    fi
    command -v "$py" > /dev/null || fail "$py not found"
    command -v nvidia-smi > /dev/null || fail "nvidia-smi not found: no NVIDIA driver here"
    smi="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)" ||
        fail "no GPU visible to nvidia-smi: $smi"
    say "nvidia-smi: $smi"
    local need=()
    [ "$what" != tests ] && [ "$what" != suite ] && [ "$what" != all ] || need=(--need-pytest)
    # the probe prints its own FAIL line and stores it in probe.json, which session.json takes up
    "$py" -m benchmarks.session probe --json "$work/probe.json" "${need[@]}" 2>&1 | tee -a "$log"
    write_session running  # a session.json from the start: a run killed outright still says what it was
}

find_golden() {  # the same order as tests/conftest.py: $CUFLASH_GOLDEN_DIR alone if set, else .golden, ../shared/golden
    local candidates=("$root/.golden" "$root/../shared/golden") files d
    [ -z "${CUFLASH_GOLDEN_DIR:-}" ] || candidates=("$CUFLASH_GOLDEN_DIR")
    shopt -s nullglob
    for d in "${candidates[@]}"; do
        files=("$d"/*.npz)
        if [ "${#files[@]}" -gt 0 ]; then
            golden="$(cd "$d" && pwd)" n_golden="${#files[@]}"
            break
        fi
    done
    shopt -u nullglob
    [ "$n_golden" -gt 0 ] || fail "golden vectors not found (looked in ${candidates[*]}): before the device call run" \
        "'mkdir -p .golden && cp ../shared/golden/*.npz .golden/' and name .golden in carry, or set CUFLASH_GOLDEN_DIR"
    export CUFLASH_GOLDEN_DIR="$golden"  # every golden test reads it (tests/golden.py)
    say "golden: $n_golden vectors in $golden"
}

run_tests() {
    local select=(-m gpu tests/) workers=() blas=()
    # suite: the tests CI runs, on the device machine's g++, JAX (with CUDA) and PyTorch (the sixth run found the
    # emulator's shim broken by that g++'s libstdc++, and CPU-JAX tests fed GPU arrays)
    [ "$what" != suite ] || select=(-m "not gpu" tests/)
    # the dry run: one real test (a golden case: on the fake GPU for tests), so that the marker and paths are exercised
    if [ "$dry" = 1 ]; then
        select=(-m gpu tests/test_gpu_forward.py -k "test_golden and plain")
        [ "$what" != suite ] || select=(-m "not gpu" tests/test_golden.py -k "test_golden_set_covers_the_semantics")
    fi
    if "$py" -c "import xdist" 2> /dev/null; then
        workers=(-n "${GPU_SESSION_WORKERS:-auto}")
        # one BLAS thread per worker (the pytest command only): the first H100 run's 16 workers each ran a
        # 16-thread BLAS for the CPU-side references (256 threads on 16 cores); its tests summed 1911 s in 240 s
        # of wall time, 8 at a time
        blas=(env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1)
    else
        say "note: pytest-xdist is not importable: the tests run serially"
    fi
    # every kernel compiled first, on every core, out of the tests' time (what is left uncompiled, the tests compile)
    local t0=$SECONDS warm=()
    [ "$dry" != 1 ] || warm=(--quick)
    if [ "$what" != suite ]; then  # the suite's kernels are emulated (g++), not NVRTC's
        timeout -s INT -k 5 60 "$py" -m benchmarks.session warm "${warm[@]}" 2>&1 | tee -a "$log" ||
            say "note: the kernel warm-up failed or ran out of time; the tests compile what is left"
    fi
    t_tests=$((t_tests - (SECONDS - t0)))
    say "tests: pytest ${select[*]} ${workers[*]} (SIGINT after ${t_tests}s, so that the XML is written)"
    local rc=0
    tests_rc=unfinished
    rm -f "$OUT/gpu_tests.xml"  # an earlier session's: a pytest that dies before its report must leave none to read
    # Up to 10 failures, not 1: a device call is scarce, so one call should show every broken feature (the
    # derandomized ci profile, so a failure reproduces; the XML lists every test's outcome).
    HYPOTHESIS_PROFILE=ci "${blas[@]}" timeout -s INT -k 30 "$t_tests" "$py" -m pytest -q -rf "${select[@]}" "${workers[@]}" \
        --maxfail=10 -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1 || rc=$?
    tests_rc=$rc
    tail -5 "$OUT/gpu_tests.txt" | tee -a "$log"
    [ "$tests_rc" != 124 ] || say "tests: time limit reached"
    # zero tests run, or no golden case among them, is a failure even when pytest says otherwise
    "$py" -m benchmarks.session junit "$OUT/gpu_tests.xml" --require-golden 2>&1 | tee -a "$log" ||
        { [ "$tests_rc" != 0 ] || tests_rc=1; }
    say "tests rc=$tests_rc"
}

run_bench() {
    [ "$commit" = unknown ] || bench_args+=(--commit "$commit")
    local extra=()
    read -r -a extra <<< "${GPU_SESSION_BENCH_ARGS:-}"
    bench_args+=("${extra[@]}")
    say "bench: benchmarks.run ${bench_args[*]} --device cuda --require-device cuda (SIGINT after ${t_bench}s)"
    local rc=0
    bench_rc=unfinished
    start_packing  # what was measured comes back even if the call is killed outright
    # --require-device cuda: numbers of any other backend must never be packed as GPU results; status 3: cuflash
    # raised in some case (benchmarks/run.py)
    timeout -s INT -k 30 "$t_bench" "$py" -m benchmarks.run "${bench_args[@]}" --device cuda --require-device cuda \
        --no-progress --out "$work/bench" > "$OUT/bench.txt" 2>&1 || rc=$?
    bench_rc=$rc
    stop_packing
    pack
    tail -40 "$OUT/bench.txt" | tee -a "$log"
    say "bench rc=$bench_rc"
}

find_tool() {  # $1 on PATH, else where CUDA toolkits and Nsight Compute install it; fails the session when absent
    local found
    found="$(command -v "$1" || true)"
    if [ -z "$found" ]; then
        found="$(ls -d "${CUDA_HOME:-/usr/local/cuda}/bin/$1" /usr/local/cuda*/bin/"$1" \
            /opt/nvidia/nsight-compute/*/"$1" /usr/local/cuda*/nsight-compute*/"$1" 2> /dev/null | head -1 || true)"
    fi
    [ -n "$found" ] || fail "$1 not found (on PATH, in \$CUDA_HOME/bin, /usr/local/cuda*/bin or Nsight Compute's folder)"
    local version
    version="$("$found" --version 2>&1 | grep -m1 -iE 'version|release' || echo 'version unknown')"
    say "$1: $found ($version)"
    tool_versions="${tool_versions:+$tool_versions; }$1 $version"
    tool_path="$found"
}

run_sanitize() {  # every tool over every case; the kernels compiled once first, into CuPy's cache
    local tool rc results=() sanitizer
    sanitize_rc=unfinished
    find_tool compute-sanitizer
    sanitizer="$tool_path"
    say "sanitize: warm-up, benchmarks.kernel_cases ${cases_args[*]} (every case once, without a tool)"
    timeout -s INT -k 5 "$t_tool" "$py" -m benchmarks.kernel_cases "${cases_args[@]}" > "$OUT/sanitize.txt" 2>&1 ||
        { sanitize_rc="warm-up=$?"; fail "the kernel cases fail without a sanitizer (see sanitize.txt)"; }
    for tool in memcheck racecheck synccheck initcheck; do
        rc=0
        echo "==== compute-sanitizer --tool $tool" >> "$OUT/sanitize.txt"
        # --no-pool: each array its own allocation, so memcheck sees its bounds rather than a pool block's
        timeout -s INT -k 5 "$t_tool" "$sanitizer" --tool "$tool" --error-exitcode 86 --print-limit 20 \
            "$py" -m benchmarks.kernel_cases "${cases_args[@]}" --no-pool > "$work/$tool.txt" 2>&1 || rc=$?
        cat "$work/$tool.txt" >> "$OUT/sanitize.txt"
        results+=("$tool:$rc")
        # racecheck ends with a RACECHECK SUMMARY (hazards) where the other tools print an ERROR SUMMARY (H100, 2025.3)
        say "sanitize: $tool rc=$rc, $(grep -E '(ERROR|RACECHECK) SUMMARY' "$work/$tool.txt" | tail -1 ||
            echo 'no SUMMARY line')"
    done
    sanitize_rc="$(IFS=,; echo "${results[*]}")"
}

run_profile() {  # ncu: throughput, occupancy, shared-memory bank conflicts and stall reasons of the main kernels
    # (--clock-control none: at the clocks the card runs at; ncu's default would lock them to base for the run)
    local ncu rc=0
    profile_rc=unfinished
    find_tool ncu
    ncu="$tool_path"
    say "profile: ncu over benchmarks.kernel_cases ${profile_args[*]}"
    timeout -s INT -k 10 "$t_profile" "$ncu" --clock-control none --target-processes all \
        --kernel-name regex:flash_ --launch-count 36 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
        -o "$work/profile" -f "$py" -m benchmarks.kernel_cases "${profile_args[@]}" > "$OUT/ncu.txt" 2>&1 ||
        rc=$?
    # ncu can end 0 having profiled nothing (no access to the counters: ERR_NVGPUCTRPERM): no report is a failure
    if [ ! -f "$work/profile.ncu-rep" ] || grep -q '^==ERROR==' "$OUT/ncu.txt"; then
        [ "$rc" != 0 ] || rc=1
        say "profile: no report, or ncu printed an error (see ncu.txt)"
    else
        # the report as text is what comes back for sure: failing to read it is a failed profile
        "$ncu" --import "$work/profile.ncu-rep" --page details >> "$OUT/ncu.txt" 2>&1 ||
            { rc=1; say "profile: ncu --import could not read the report (see ncu.txt)"; }
        # the report itself only where it can come back from a device call (16 MiB a file)
        if [ "$(stat -c %s "$work/profile.ncu-rep")" -le $((16 * 1024 * 1024)) ]; then
            cp "$work/profile.ncu-rep" "$OUT/"
        else
            say "profile: profile.ncu-rep is over 16 MiB and stays behind (ncu.txt has its details page)"
        fi
    fi
    profile_rc=$rc
    tail -5 "$OUT/ncu.txt" | tee -a "$log"
    say "profile rc=$profile_rc"
}

probe
if [ "$what" = sanitize ] || [ "$what" = profile ]; then
    "run_$what"
    [ "$sanitize_rc" = null ] || [[ "$sanitize_rc" =~ ^(memcheck:0,racecheck:0,synccheck:0,initcheck:0)$ ]] ||
        fail "compute-sanitizer found errors or did not finish ($sanitize_rc; see sanitize.txt)"
    [ "$profile_rc" = null ] || [ "$profile_rc" = 0 ] || fail "ncu failed (rc $profile_rc; see ncu.txt)"
    say "gpu_session: $what done"
    exit 0
fi
if [ "$what" != bench ]; then
    find_golden
    run_tests
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    if [ "$tests_rc" != null ] && [ "$tests_rc" != 0 ]; then
        say "bench skipped: the GPU tests failed, so its numbers would mean nothing"
    else
        run_bench
    fi
fi
[ "$tests_rc" = null ] || [ "$tests_rc" = 0 ] || fail "tests failed (rc $tests_rc; see gpu_tests.txt)"
[ "$bench_rc" = null ] || [ "$bench_rc" = 0 ] || fail "benchmark failed or was refused (rc $bench_rc; see bench.txt)"
say "gpu_session: $what done"
