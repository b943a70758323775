#!/usr/bin/env bash
# The check to run first on a GPU machine, from the repository root, in about 8 minutes:
# the cuda test tier and the training unit tests on the GPU, then `python -m benchmarks.run gpu`,
# whose timed parts wait until the tests are done. Writes under $OUT: env.txt, pytest.log,
# pytest.xml, gpu.json (benchmarks/results/gpu.json's new content) and run.log.
#
# The GPU machine described in docs/development.md has torch, numpy, pyarrow, tokenizers and
# pytest, and neither network nor the project's other dependencies: their wheels travel in .whl/
# (the command that fetches them is in docs/development.md), and the training core runs from the
# checkout on PYTHONPATH, without Prefect. BENCH_COMMIT names the commit measured (a copied tree's
# .git may be missing, or not its own).
set -u
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -V
  python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
python3 -c "import training.trainer.run, training.pipeline.plan_stage, webdataset" || exit 4

# The tests first, beside the benchmark's untimed parts; the timed parts wait for this file to go.
# Left out: tuning (Optuna) and S3 (boto3, moto), which have no GPU path and no package there.
QUIET=/tmp/gpu-check-tests-running
touch "$QUIET"
( timeout -k 5 "${TESTS_SECONDS:-220}" python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfE -n 8 --timeout 180 \
    --junitxml="$OUT/pytest.xml" tests/cuda tests/training -m "cuda or unit" --ignore=tests/training/tune \
    --ignore=tests/training/storage/test_s3_storage.py --ignore=tests/training/storage/test_trust_boundary.py \
    --ignore=tests/training/data/test_segment_catalog.py \
    > "$OUT/pytest.log" 2>&1
  echo "== pytest exit $? after $(( $(date +%s) - T0 )) s" >> "$OUT/pytest.log"; rm -f "$QUIET" ) &
TESTS=$!

GPU_CHECK_QUIET_AFTER=$QUIET python3 -m benchmarks.run gpu --out "$OUT"
wait "$TESTS"  # not a bare `wait`: that would wait on the tee above, which never ends
tail -30 "$OUT/pytest.log"
echo "== total $(( $(date +%s) - T0 )) s"
