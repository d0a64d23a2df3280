#!/usr/bin/env bash
# Device calls that use a lent GPU fully: the GPU tests, then the full benchmark, results packed for the
# trip back (the device tool returns at most 8 files from $OUT). One command must end within 10 minutes:
#   bash benchmarks/gpu_session.sh tests    # GPU tests only (up to ~9 minutes)
#   bash benchmarks/gpu_session.sh bench    # full benchmark only (up to ~9 minutes)
#   bash benchmarks/gpu_session.sh          # both, with half the time each
# then here: tar -xzf <files_at>/results.tar.gz -C benchmarks/results/<device>/ && git add benchmarks/results
set -uo pipefail
what="${1:-all}"
OUT="${OUT:-/tmp/cuflash-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$what" = all ]; then t_tests=240; t_bench=270; else t_tests=540; t_bench=540; fi
{ nvidia-smi; python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"; } \
    > "$OUT/device.txt" 2>&1
if [ "$what" != bench ]; then
    # The GPU tests first: a wrong kernel makes every number after it meaningless. Up to 10 failures, not 1: a
    # device call is scarce, so one call should show every broken feature (the derandomized ci profile, so a
    # failure reproduces; the XML lists every test's outcome).
    HYPOTHESIS_PROFILE=ci timeout "$t_tests" python3 -m pytest -q -rf -m gpu tests/ --maxfail=10 \
        -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.txt"
    tail -5 "$OUT/gpu_tests.txt"
fi
if [ "$what" != tests ]; then
    timeout "$t_bench" python3 -m cuflash bench --full --no-progress --time-limit $((t_bench - 40)) \
        --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
    echo "bench rc=$?"
    tail -40 "$OUT/bench.txt"
    (cd "$OUT/bench" 2>/dev/null && tar -czf "$OUT/results.tar.gz" .) && rm -rf "$OUT/bench"
fi
