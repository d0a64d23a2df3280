#!/usr/bin/env bash
# One device call that uses a lent GPU fully: GPU tests, then the full benchmark, results packed
# for the trip back (the device tool returns at most 8 files from $OUT).
#   run (device tool):  bash benchmarks/gpu_session.sh
#   then here:          tar -xzf <files_at>/results.tar.gz -C benchmarks/results/ && git add benchmarks/results
set -uo pipefail
OUT="${OUT:-/tmp/cuflash-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi; python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"; } \
    > "$OUT/device.txt" 2>&1
# The GPU tests first: a wrong kernel makes every number after it meaningless.
timeout 240 python3 -m pytest -q -m gpu tests/ -x -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.txt"
tail -3 "$OUT/gpu_tests.txt"
timeout 330 python3 -m cuflash bench --full --no-progress --time-limit 300 --out "$OUT/bench" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?"
tail -40 "$OUT/bench.txt"
(cd "$OUT/bench" 2>/dev/null && tar -czf "$OUT/results.tar.gz" .) && rm -rf "$OUT/bench"
