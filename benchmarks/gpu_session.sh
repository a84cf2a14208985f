#!/usr/bin/env bash
# Issue 15's GPU measurements, for a session lent a GPU machine (the `device` tool of the library).
#
# The machine is bare and offline: its python3 holds PyTorch, transformers, pyarrow, pandas and
# pytest, but `../shared` does not travel. So, once, here (on the session's own machine):
#
#     bash benchmarks/gpu_session.sh pack      # the GPT-2 tokenizer, WikiText-103 and a duckdb wheel into .gpu/
#
# then one device `run` per part, each under its 10-minute limit, naming `.gpu` in `carry`:
#
#     bash benchmarks/gpu_session.sh tests     # GPU tests: same triggers as the CPU, no host sync, reducer on CUDA;
#                                              # explain and score with --device cuda as on the CPU
#     bash benchmarks/gpu_session.sh ratios    # GPT-2 small (per-batch timing, a profiler timeline) and the paper's shape
#     bash benchmarks/gpu_session.sh llama     # the 8B shape: tokens/s, ratio, peak memory, 95M-token projection
#     bash benchmarks/gpu_session.sh compile   # torch.compile and the capture
#     bash benchmarks/gpu_session.sh select    # the GPU tests, GPT-2 small and the 8B shape: the candidates selected
#                                              # once in the merge against once per layer (issue 44, item 6)
#     bash benchmarks/gpu_session.sh pass      # the GPU tests; GPT-2 small's whole pass on 1x and 4x the corpus
#                                              # with a host profile; the 8B shape's pass and peak memory with
#                                              # the merge in blocks (issue 44, item 6)
#
# Every part prints its figures and also writes them to $OUT/PART.log when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
part="${1:-}"

if [ "$part" = "pack" ]; then
    shared="${FFKV_SHARED_DATA:-../shared/data}"
    mkdir -p .gpu/data/tokenizers .gpu/data/wikitext-103
    cp -r "$shared/tokenizers/gpt2" .gpu/data/tokenizers/
    cp "$shared"/wikitext-103/wiki.valid.raw "$shared"/wikitext-103/wiki.test.raw .gpu/data/wikitext-103/
    # The tests import duckdb, which the machine's image lacks (KINDS.md's package list): carried as a wheel.
    version=$(python3 -c "import duckdb; print(duckdb.__version__)" 2>/dev/null || .venv/bin/python -c "import duckdb; print(duckdb.__version__)")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        -d .gpu/whl "duckdb==$version"
    exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
    grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
    du -sh .gpu
    exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export FFKV_SHARED_DATA="$PWD/.gpu/data" PYTHONPATH="$PWD/src:$PWD/tests:/tmp/site" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}/$part.log"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || echo "no nvidia-smi"; } | tee "$log"
case "$part" in
    tests)
        python3 -m pytest -p no:cacheprovider -q tests/indexing/test_gpu_index.py tests/indexing/test_signed.py \
            tests/tools/test_gpu_explain.py 2>&1 | tee -a "$log"
        ;;
    ratios)
        python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --sentences 20000 --batch-size 512 \
            --max-batch-tokens 65536 --repeats 2 --per-batch --timeline "${OUT:-/tmp}/timeline" 2>&1 | tee -a "$log"
        python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --shape paper --sentences 20000 \
            --corpus-repeats 8 --batch-size 512 --max-batch-tokens 65536 --repeats 2 2>&1 | tee -a "$log"
        ;;
    llama)
        python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --shape llama-8b --top-k 100 --sign both \
            --unit line --max-tokens 95 --sentences 20000 --batch-size 256 --max-batch-tokens 32768 --repeats 2 \
            2>&1 | tee -a "$log"
        ;;
    select)
        # Issue 44, item 6: the merge's one selection for all layers and directions against a selection per layer
        # (`--per-batch` times both, and the index's default, taking turns, and checks their states are equal).
        timeout 150 python3 -m pytest -p no:cacheprovider -q -rA tests/indexing/test_gpu_index.py \
            tests/indexing/test_signed.py tests/indexing/test_sparse.py tests/indexing/test_extremes.py \
            > /tmp/tests.log 2>&1 || true
        { grep -E "^(FAILED|ERROR)|^E " /tmp/tests.log | head -n 30 || true
          echo "GPU tests: $(grep -c '^PASSED' /tmp/tests.log) passed, $(grep -cE '^(FAILED|ERROR)' /tmp/tests.log)" \
               "failed, skipped: $(grep '^SKIPPED' /tmp/tests.log | tr '\n' ' ')"; } | tee -a "$log"
        timeout 150 python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --sentences 20000 \
            --batch-size 512 --max-batch-tokens 65536 --repeats 2 --per-batch --timeline /tmp/timeline 2>&1 \
            | tee -a "$log" || true
        timeout 270 python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --shape llama-8b --top-k 100 \
            --sign both --unit line --max-tokens 95 --sentences 20000 --batch-size 256 --max-batch-tokens 32768 \
            --repeats 1 --per-batch --timeline /tmp/timeline-8b 2>&1 | tee -a "$log" || true
        ;;
    pass)
        timeout 120 python3 -m pytest -p no:cacheprovider -q -rA tests/indexing/test_gpu_index.py \
            tests/indexing/test_signed.py tests/indexing/test_sparse.py tests/indexing/test_extremes.py \
            tests/indexing/test_topk.py > /tmp/tests.log 2>&1 || true
        { grep -E "^(FAILED|ERROR)|^E " /tmp/tests.log | head -n 30 || true
          echo "GPU tests: $(grep -c '^PASSED' /tmp/tests.log) passed, $(grep -cE '^(FAILED|ERROR)' /tmp/tests.log)" \
               "failed, skipped: $(grep '^SKIPPED' /tmp/tests.log | tr '\n' ' ')"; } | tee -a "$log"
        for repeats in 1 4; do
            timeout 100 python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --sentences 20000 \
                --corpus-repeats $repeats --batch-size 512 --max-batch-tokens 65536 --repeats 3 \
                --host-profile $(( repeats == 1 ? 25 : 0 )) 2>&1 | tee -a "$log" || true
        done
        timeout 240 python3 benchmarks/index_overhead.py --device cuda --dtype bfloat16 --shape llama-8b --top-k 100 \
            --sign both --unit line --max-tokens 95 --sentences 20000 --batch-size 256 --max-batch-tokens 32768 \
            --repeats 1 2>&1 | tee -a "$log" || true
        ;;
    compile)
        python3 benchmarks/compile_capture.py --device cuda --dtype bfloat16 --layers 12 --sentences 2048 2>&1 | tee -a "$log"
        ;;
    *)
        echo "usage: bash benchmarks/gpu_session.sh pack|tests|ratios|llama|compile|select|pass" >&2
        exit 2
        ;;
esac
