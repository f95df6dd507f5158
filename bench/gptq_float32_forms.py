"""The float32 parts of a 7B GPTQ layer against faster forms of them, on a GPU: down_proj's 18944-square Cholesky
(cuSOLVER, torch's MAGMA backend, a right-looking blocked factorisation whose trailing updates run in float32 or as
three TF32 products) and the sweep's cross-block updates of down_proj and gate/up (float32, TF32 operands, three TF32
products over K x 3), each timed (median of 3 after a warm-up) with its largest error against float64.

    python3 bench/gptq_float32_forms.py OUT.json        (CUDA only)
"""
import json
import statistics
import sys
import time

import torch


def _fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


if len(sys.argv) != 2:
    _fail("give one argument, the JSON file to write (python3 bench/gptq_float32_forms.py OUT.json)")
if not torch.cuda.is_available():
    _fail("this probe needs a CUDA device; run it on the GPU host")
dev = torch.device("cuda")
torch.manual_seed(0)
out = {"gpu": torch.cuda.get_device_name(0)}

def timed(fn, reps=3):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts), 5)

def tf32(x):
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)

def mm3(a, b):
    """a @ b by 3xTF32: (a_hi + a_lo)(b_hi + b_lo) less the lo·lo term, as one TF32 product over K x 3."""
    ah, bh = tf32(a), tf32(b)
    al, bl = a - ah, b - bh
    return torch.cat([ah, al, ah], 1), torch.cat([bh, bh, bl], 0)

def with_tf32(fn):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return fn()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before

# a Hessian like down_proj's
n, t = 18944, 65536
x = (torch.randn(t, n, device=dev) * torch.rand(n, device=dev).add_(0.1)).to(torch.bfloat16)
H = torch.mm(x.t(), x, out_dtype=torch.float32).mul_(2.0 / t)
del x
H.diagonal().add_(0.01 * H.diagonal().mean())
Hr = H.flip(0, 1).contiguous()
res = {}
res["cusolver_s"] = timed(lambda: torch.linalg.cholesky_ex(Hr))
L0 = torch.linalg.cholesky_ex(Hr)[0]
try:
    torch.backends.cuda.preferred_linalg_library("magma")
    res["magma_s"] = timed(lambda: torch.linalg.cholesky_ex(Hr))
    Lm = torch.linalg.cholesky_ex(Hr)[0]
    res["magma_max_rel_vs_cusolver"] = float((Lm - L0).abs().max() / L0.abs().max())
except Exception as e:
    res["magma"] = repr(e)[:200]
finally:
    torch.backends.cuda.preferred_linalg_library("default")

def blocked(A, nb, three):
    A = A.clone()
    m = A.shape[0]
    for k in range(0, m, nb):
        e = min(k + nb, m)
        L11, info = torch.linalg.cholesky_ex(A[k:e, k:e])
        A[k:e, k:e] = L11
        if e < m:
            L21 = torch.linalg.solve_triangular(L11, A[e:, k:e].t(), upper=False).t()  # A21 L11^-T
            A[e:, k:e] = L21
            if three:
                a, b = mm3(L21, L21.t())
                with_tf32(lambda: A[e:, e:].addmm_(a, b, alpha=-1))
            else:
                A[e:, e:].addmm_(L21, L21.t(), alpha=-1)
    return A.tril_()

Hd = Hr.double()
L64 = torch.linalg.cholesky(Hd)
res["cusolver_err_vs_f64"] = float(((L0.double() - L64).abs().max() / L64.abs().max()))
for nb in (512, 1024, 2048):
    for three in (False, True):
        key = f"blocked{nb}_{'tf32x3' if three else 'fp32'}"
        res[key + "_s"] = timed(lambda: blocked(Hr, nb, three))
        Lb = blocked(Hr, nb, three)
        res[key + "_err_vs_f64"] = float(((Lb.double() - L64).abs().max() / L64.abs().max()))
        del Lb
    print(json.dumps(res), flush=True)
out["cholesky_18944"] = res
del Hd, L64

# lazy updates: down [3584, 18944] and gate_up [37888, 3584], block 128
lz = {}
for name, (o, i) in {"down": (3584, 18944), "gate_up": (37888, 3584)}.items():
    W = torch.randn(o, i, device=dev) * 0.02
    A = torch.randn(i, i, device=dev).triu_().mul_(1e-2)
    D = torch.randn(o, 128, device=dev) * 1e-3
    def run(kind, W=W, A=A, D=D, i=i):
        Wc = W.clone()
        for i1 in range(0, i - 128, 128):
            i2 = i1 + 128
            if kind == "fp32":
                Wc[:, i2:].addmm_(D, A[i1:i2, i2:])
            elif kind == "tf32":
                with_tf32(lambda: Wc[:, i2:].addmm_(D, A[i1:i2, i2:]))
            else:
                a, b = mm3(D, A[i1:i2, i2:])
                with_tf32(lambda: Wc[:, i2:].addmm_(a, b))
        return Wc
    r = {k: timed(lambda k=k: run(k)) for k in ("fp32", "tf32", "tf32x3")}
    ref = run("fp32").double()
    exact = W.double().clone()
    for i1 in range(0, i - 128, 128):
        i2 = i1 + 128
        exact[:, i2:] += D.double() @ A[i1:i2, i2:].double()
    upd = (exact - W.double()).abs().max()
    for k in ("fp32", "tf32", "tf32x3"):
        r[k + "_max_err_rel_update"] = float((run(k).double() - exact).abs().max() / upd)
    lz[name] = r
    print(name, json.dumps(r), flush=True)
out["lazy"] = lz
json.dump(out, open(sys.argv[1], "w"), indent=1)
