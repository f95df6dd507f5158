"""KL and top-1 against the reference's top-k: exact with the whole vocabulary, a lower bound within its stated
gap otherwise; the relative output error; the reference cache's distributions file."""

import json

import torch

from eval import distribution, refcache
from quantize.methods import output_error


def _pair(t: int = 64, v: int = 300, noise: float = 0.5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, v, generator=g) * 3
    return torch.log_softmax(x, -1), torch.log_softmax(x + noise * torch.randn(t, v, generator=g), -1)


def _exact(lp, lq):
    return (lp.exp() * (lp - lq)).sum(-1)


def test_whole_vocabulary_gives_the_exact_kl_and_top1():
    lp, lq = _pair()
    c = distribution.compare(lq, *distribution.reference_topk(lp, lp.shape[1]))
    assert torch.allclose(c["kl"], _exact(lp, lq), atol=1e-5)
    assert torch.equal(c["top1"].bool(), lp.argmax(-1) == lq.argmax(-1))
    assert float(c["tail_mass"].max()) < 1e-5


def test_top_k_is_a_lower_bound_within_its_gap_bound():
    lp, lq = _pair(noise=1.0)
    exact = _exact(lp, lq)
    for k in (4, 16, 64):
        c = distribution.compare(lq, *distribution.reference_topk(lp, k))
        assert (c["kl"] <= exact + 1e-5).all()
        assert (exact <= c["kl"] + c["gap_bound"] + 1e-4).all()
        assert torch.equal(c["top1"].bool(), lp.argmax(-1) == lq.argmax(-1))  # top-1 needs only k >= 1
    assert float(distribution.compare(lp, *distribution.reference_topk(lp, 8))["kl"].abs().max()) < 1e-5


def test_summary_names_the_worst_windows():
    lp, lq = _pair()
    good = distribution.compare(lp, *distribution.reference_topk(lp, 8))
    bad = distribution.compare(lq, *distribution.reference_topk(lp, 8))
    s = distribution.summary([good, bad, good], 8)
    assert s["worst_windows"][0]["window"] == 1 and s["tokens"] == 3 * lp.shape[0]
    assert s["kl_median"] <= s["kl_p99"] <= s["kl_max"] and 0 < s["top1"] < 1


def test_output_error_from_hessian_equals_from_inputs():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(500, 32, generator=g), torch.randn(16, 32, generator=g)
    q = w + 0.1 * torch.randn(16, 32, generator=g)
    H = 2 * x.t() @ x / x.shape[0]
    a, b = output_error.from_hessian(w, q, H), output_error.from_inputs(w, q, x)
    direct = torch.linalg.norm(x @ (w - q).t()) / torch.linalg.norm(x @ w.t())
    assert torch.allclose(a, direct, rtol=1e-4) and torch.allclose(b, direct, rtol=1e-4)
    assert float(output_error.from_hessian(w, w, H)) == 0
    errors = {"0": {"q_proj": 0.1, "down_proj": 0.3}, "1": {"q_proj": 0.2}}
    assert [r["error"] for r in output_error.worst(errors, 2)] == [0.3, 0.2]
    assert output_error.by_depth(errors)["q_proj"] == [(0, 0.1), (1, 0.2)]


def test_cache_keeps_the_distributions_and_reads_an_entry_without_them(tmp_path):
    key = {"model_sha256": "ab", "protocol": {"windows": 2}, "dtype": "float32", "device": "cpu", "versions": {}}
    lp, _ = _pair(t=10)
    vals, idx = distribution.reference_topk(lp, 4)
    result = {"ppl": 12.5, "nll_sum": 1.0, "tokens": 20, "per_window_nll": [0.1, 0.2], "seconds": 1.0,
              "topk": {"k": 4, "logp": torch.stack([vals, vals]), "idx": torch.stack([idx, idx])}}
    path = refcache.store(key, result, tmp_path)
    got = refcache.lookup(key, tmp_path)
    assert got["ppl"] == 12.5 and torch.equal(got["topk"]["idx"], result["topk"]["idx"]) and got["topk"]["k"] == 4
    entry = json.loads(path.read_text())
    side = tmp_path / entry["distribution"]["file"]
    side.write_bytes(side.read_bytes()[:-4] + b"\0\0\0\0")  # altered: its sha256 no longer matches the entry
    assert refcache.lookup(key, tmp_path)["ppl"] == 12.5 and "topk" not in refcache.lookup(key, tmp_path)
    del entry["distribution"]  # an entry written before distributions were kept: its perplexity still counts
    path.write_text(json.dumps(entry))
    assert refcache.lookup(key, tmp_path)["ppl"] == 12.5 and "topk" not in refcache.lookup(key, tmp_path)
