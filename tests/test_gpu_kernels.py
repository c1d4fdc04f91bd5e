"""Every kernel the training step runs on CUDA, at the seed model's shapes in bf16, against float64.

    python3 -m pytest -m gpu tests/test_gpu_kernels.py -v        (benchmarks/gpu_kernels.sh OUT keeps the record)

The Triton kernels everywhere, and on compute capability 9 the Gluon ones the step runs there (the MLP's derivative
product and the Q/K/V product); the FP8 head's (model.head=fp8) too: the loss kernel writing its gradient in e5m2,
and the tiled transpose. The interpreter checks (tests/test_kernels.py) run the Triton kernels in float32 at small
shapes on the CPU; here they run compiled, at the shapes and in the dtype of a step, and the Gluon kernels, which
have no interpreter, run at all.

Each reference is float64 arithmetic by plain torch ops (autograd where it is a gradient) on the very inputs the
kernel got, written here and sharing no code with the kernels or their torch fallbacks. Each output's error is
max |got - want| / max |want| (NaN anywhere fails), and its bound counts the bf16 roundings between exact inputs
and the stored output (see `bound`). Each comparison also runs against wrong variants of its reference (a wrong
epsilon, targets or tokens moved by one, a factor left out) and must fail every one of them: a bound that no
plausible mistake exceeds would check nothing.

With CREDITLAB_GPU_RESULTS naming a folder, each GPU test appends one JSON line of its measured errors to
gpu_kernels.jsonl there, passed or not. Without CUDA the GPU tests skip; the one CPU test runs every comparison,
at small shapes in float32, through the ops' torch fallbacks, so that the comparisons themselves are checked
wherever the tests run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from creditlab import ops
from creditlab.ops import attention_gate, loss, qk_norm, relu2
from creditlab.config import CreditConfig, ModelConfig
from creditlab.credit import teacher
from creditlab.ops import qkv_hopper, qkv_rotary, relu2_hopper, relu2_matmul
from creditlab.ops._triton import triton

# One rounding to bf16 (8 significant bits, to nearest) moves a value by at most 2^-8 of itself, so by at most
# 2^-8 of an output's largest value: the unit of the bounds. float32 arithmetic and accumulation (2^-24 an
# operation; sums of at most a few thousand terms, whose rounding errors mostly cancel) stay far below it.
BF16_ROUNDING = 2.0 ** -8
E5M2_ROUNDING = 2.0 ** -3  # e5m2: 3 significant bits
E5M2_SMALLEST = 2.0 ** -16  # its smallest subnormal: a value under half of it is flushed to zero
# The loss kernel's hardware tanh on CUDA (tanh.approx.f32) errs by at most 2^-10.987 (PTX ISA) of |tanh| <= 1
TANH_APPROX = 2.0 ** -10.987
EPS = 1e-6  # the model's RMSNorm epsilon (model.norm_with_scale), which the QK-norm uses too


def bound(roundings: int) -> float:
    """The error bound of an output that goes through `roundings` bf16 roundings (or as large relative errors)
    between the exact inputs and its stored value: one more rounding's worth covers the float32 arithmetic."""
    return (roundings + 1) * BF16_ROUNDING


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64 (a NaN in got gives NaN, which fails every bound)."""
    got = got.double().reshape(want.shape)
    return ((got - want).abs().max() / want.abs().max()).item()


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The model's shapes one comparison needs; `seed()`: the seed model's, at one micro-batch of 2 x 2,048."""
    batch: int
    seq: int
    width: int
    heads: int
    hidden: int
    vocab: int
    padded: int
    gate_dim: int
    code: int  # the learned predictor's code width, 2 credit.rank
    cap: float

    @staticmethod
    def seed(batch: int = 2) -> "Shapes":
        m, c = ModelConfig(), CreditConfig()
        return Shapes(batch, m.seq_len, m.width, m.heads, m.mlp_hidden, m.vocab_size, m.padded_vocab, m.gate_dim,
                      2 * c.rank, m.logit_cap)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


# Small enough for the CPU in a few seconds, every dimension other than the seed's.
SMALL = Shapes(batch=2, seq=48, width=64, heads=2, hidden=96, vocab=301, padded=320, gate_dim=12, code=16, cap=15.0)


@dataclasses.dataclass
class Comparison:
    """One kernel's outputs against float64: each output's error and bound, the same errors against each wrong
    variant of the reference (`controls`: variant -> output -> error, each above the output's bound), and whether
    the package routes these operands to the kernel (`kernel_takes`)."""
    kernel: str
    errors: dict[str, float]
    bounds: dict[str, float]
    controls: dict[str, dict[str, float]]
    kernel_takes: bool

    def failures(self) -> list[str]:
        out = [f"{name}: error {e:.3g} over its bound {self.bounds[name]:.3g}" for name, e in self.errors.items()
               if not e <= self.bounds[name]]
        out += [f"{name} against {variant}: error {e:.3g}, not over its bound {self.bounds[name]:.3g} (the "
                f"comparison cannot tell the wrong variant)" for variant, errors in self.controls.items()
                for name, e in errors.items() if not e > self.bounds[name]]
        uncontrolled = set(self.errors) - {name for errors in self.controls.values() for name in errors}
        out += [f"{name}: no wrong variant shows that its comparison can fail" for name in sorted(uncontrolled)]
        return out

    def record(self, test: str, device: torch.device, shapes: Shapes) -> None:
        folder = os.environ.get("CREDITLAB_GPU_RESULTS")
        if not folder:
            return
        line = {"test": test, "kernel": self.kernel, "device": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device)), "torch": torch.__version__,
                "triton": getattr(triton, "__version__", None), "shapes": dataclasses.asdict(shapes),
                "errors": self.errors, "bounds": self.bounds, "controls": self.controls,
                "kernel_takes": self.kernel_takes, "passed": self.kernel_takes and not self.failures()}
        Path(folder).mkdir(parents=True, exist_ok=True)
        with open(Path(folder) / "gpu_kernels.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _uniform(shape, fan_in: int, g: torch.Generator) -> torch.Tensor:
    """A weight as the model initializes its linear maps: uniform in +-sqrt(3 / fan_in), unit-variance outputs."""
    return (torch.rand(shape, generator=g) * 2 - 1) * math.sqrt(3 / fan_in)


def _rotary_tables(T: int, hd: int, base: float = 10_000.0):
    """cos and sin (T, hd / 2) in float64 of positions 0 .. T - 1, as the model's rotary defines them."""
    freqs = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    return angles.cos(), angles.sin()


def _qk_reference(qkv: torch.Tensor, heads: int, eps: float = EPS):
    """(q, k, v, scales) of qkv (B, T, 3 width) in float64: q and k of each head RMS-normalized and rotated by
    their positions, v as is; scales (B, T, 2, heads) the 1 / rms of q and k."""
    B, T, three_width = qkv.shape
    hd = three_width // 3 // heads
    parts = qkv.view(B, T, 3, heads, hd)
    cos, sin = (t.to(qkv.device)[None, :, None, :] for t in _rotary_tables(T, hd))
    out, scales = [], []
    for part in parts[:, :, 0], parts[:, :, 1]:
        scale = torch.rsqrt(part.square().mean(-1, keepdim=True) + eps)
        x1, x2 = (part * scale).chunk(2, dim=-1)
        out.append(torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1))
        scales.append(scale[..., 0])
    return out[0], out[1], parts[:, :, 2], torch.stack(scales, dim=2)


def _rolled(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """t with its tokens moved by one along `dim`: what a kernel reading a neighbour's row would see."""
    return torch.roll(t, 1, dims=dim)


# The comparisons: each takes the device, the dtype of the step (bf16 on CUDA; float32 for the CPU check) and the
# shapes, and returns a Comparison. On CUDA the package's ops route to the kernels; on the CPU to their torch
# fallbacks. `kernel` names a kernel to call directly where the ops would choose among several by device.


def compare_softcap_ce(device, dtype, shapes: Shapes, fp8: bool = False) -> Comparison:
    """The head loss's per-row loss and logits gradient (kernels/softcap_ce.py) on one micro-batch of logits: the
    plain head's (gradient in the logits' dtype, scaled by 1 / tokens) or with `fp8` the FP8 head's (gradient in
    e5m2, scaled by loss.HEAD_GRAD_SCALE)."""
    n, V, P, cap = shapes.tokens, shapes.vocab, shapes.padded, shapes.cap
    g = _generator(0)
    logits = torch.randn(n, P, generator=g) * 4  # some past the cap's knee: tanh bends them
    logits[:, V:] = 30.0  # the padding columns: a kernel that let them into the softmax would be far off
    logits = logits.to(dtype).to(device)
    targets = torch.randint(0, V, (n,), generator=g)
    targets[0], targets[-1] = 0, V - 1  # the first and the last column of the vocabulary
    targets = targets.to(device)
    scale, grad_dtype = (loss.HEAD_GRAD_SCALE, loss.HEAD_GRAD_FP8) if fp8 else (1.0 / n, None)
    rows_fn = loss._rows_fn(logits)  # what the head loss's chunks call on this device
    rows, grad = rows_fn(logits, targets, V, cap, scale, grad_dtype=grad_dtype)

    def reference(targets):
        live = logits[:, :V].double().requires_grad_(True)
        per_row = F.cross_entropy(cap * torch.tanh(live / cap), targets, reduction="none")
        (scale * per_row.sum()).backward()
        full = torch.zeros(logits.shape, dtype=torch.float64, device=device)
        full[:, :V] = live.grad  # the padding columns' gradient: exactly zero
        return per_row.detach(), full

    want_rows, want_grad = reference(targets)
    wrong_rows, wrong_grad = reference((targets + 1) % V)
    # The hardware tanh's error e moves each z = cap tanh(l / cap) by at most cap e, so each row's loss (log-sum-exp
    # minus the target's z) by at most 2 cap e, each probability p by at most 2 cap e p <= 2 cap e and
    # 1 - tanh^2 by at most 2 e: the gradient, scale (p - onehot)(1 - tanh^2), by at most scale (2 cap + 2) e;
    # then one rounding of the gradient to its dtype (e5m2's, plus the flush of its smallest values, in FP8).
    tanh_grad = scale * (2 * cap + 2) * TANH_APPROX
    grad_rounding = (E5M2_ROUNDING + scale * E5M2_SMALLEST / 2 / want_grad.abs().max().item() if fp8
                     else BF16_ROUNDING)
    bounds = {"loss": bound(0) + 2 * cap * TANH_APPROX / want_rows.abs().max().item(),
              "grad": bound(0) + grad_rounding + tanh_grad / want_grad.abs().max().item()}
    errors = {"loss": error(rows, want_rows), "grad": error(grad, want_grad)}
    controls = {"targets moved one column": {"loss": error(rows, wrong_rows), "grad": error(grad, wrong_grad)}}
    return Comparison("softcap_ce (fp8 gradient)" if fp8 else "softcap_ce", errors, bounds, controls,
                      rows_fn is ops.softcap_ce_rows)


def compare_transpose(device, dtype, shapes: Shapes) -> Comparison:
    """The FP8 head's tiled transpose (kernels/tiled_transpose.py, through ops.transpose) of the three matrices
    it transposes in a step: the chunk's e5m2 logits gradient, and h and W in e4m3. A transpose moves bytes: exact
    (bound 0), each error the share of bytes that differ."""
    g = _generator(1)
    matrices = {"grad_e5m2": ((shapes.tokens, shapes.padded), torch.float8_e5m2),
                "h_e4m3": ((shapes.tokens, shapes.width), torch.float8_e4m3fn),
                "w_e4m3": ((shapes.padded, shapes.width), torch.float8_e4m3fn)}
    errors, untransposed, takes = {}, {}, True
    for name, (shape, fp8) in matrices.items():
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(fp8).to(device)
        takes &= ops.available(x)
        got = ops.transpose(x).view(torch.uint8).cpu().numpy()
        byte_rows = x.view(torch.uint8).cpu().numpy()
        errors[name] = (got != byte_rows.T).mean().item()  # numpy's transpose of the bytes, on the host
        # a copy that did not transpose: the bytes in their own order, read as (cols, rows)
        untransposed[name] = (got != byte_rows.reshape(shape[1], shape[0])).mean().item()
    return Comparison("tiled_transpose", errors, dict.fromkeys(errors, 0.0), {"not transposed": untransposed},
                      takes)


def _mlp_operands(device, dtype, shapes: Shapes):
    """x (tokens, width) as the norm gives it (unit RMS rows), W_fc (hidden, width), W_proj (width, hidden) as
    initialized, and dy (tokens, width), in the step's dtype."""
    g = _generator(2)
    x = torch.randn(shapes.tokens, shapes.width, generator=g)
    w_fc = _uniform((shapes.hidden, shapes.width), shapes.width, g)
    w_proj = _uniform((shapes.width, shapes.hidden), shapes.hidden, g)
    dy = torch.randn(shapes.tokens, shapes.width, generator=g)
    return (t.to(dtype).to(device) for t in (x, w_fc, w_proj, dy))


def compare_relu2_linear(device, dtype, shapes: Shapes) -> Comparison:
    """The MLP's expansion relu(x W_fc^T)^2 (kernels/relu2_matmul.py, through relu2.relu2_linear)."""
    x, w_fc, _, _ = _mlp_operands(device, dtype, shapes)
    post = relu2.relu2_linear(x, w_fc)
    h = x.double() @ w_fc.double().t()
    # float32 products and their square, one rounding of the result
    return Comparison("relu2_matmul.relu2_linear", {"post": error(post, torch.relu(h) ** 2)}, {"post": bound(1)},
                      {"the square left out": {"post": error(post, torch.relu(h))}}, relu2._kernel_takes(x, w_fc))


def compare_relu2_dgrad(device, dtype, shapes: Shapes, kernel: str | None = None) -> Comparison:
    """The MLP's derivative product dL/dh = (dy W_proj) * 2 relu(h), relu(h) = sqrt(post): the kernel `kernel`
    names (triton: kernels/relu2_matmul.py, gluon: kernels/relu2_hopper.py), or what relu2.relu2_dgrad_gluon routes
    to (the op the MLP's backward calls)."""
    x, w_fc, w_proj, dy = _mlp_operands(device, dtype, shapes)
    post = (torch.relu(x.double() @ w_fc.double().t()) ** 2).to(dtype)  # the expansion's output as stored
    op, takes = {None: (relu2.relu2_dgrad_gluon, relu2._kernel_takes(dy, w_proj)),
                 "triton": (relu2_matmul.relu2_dgrad, relu2._kernel_takes(dy, w_proj)),
                 "gluon": (relu2_hopper.relu2_dgrad, relu2._gluon_takes(dy, w_proj))}[kernel]
    dh = op(dy, w_proj, post)
    # autograd of the plain MLP's projection through relu(h)^2, at h = sqrt(post) >= 0
    h = post.double().sqrt().requires_grad_(True)
    F.linear(torch.relu(h) ** 2, w_proj.double()).backward(dy.double())
    want = h.grad
    # float32 products times 2 sqrt(post) in float32, one rounding of the result
    return Comparison(f"relu2_dgrad ({kernel or 'routed'})", {"dh": error(dh, want)}, {"dh": bound(1)},
                      {"the derivative's factor 2 left out": {"dh": error(dh, want / 2)}}, takes)


def _qkv_operands(device, dtype, shapes: Shapes):
    g = _generator(3)
    x = torch.randn(shapes.tokens, shapes.width, generator=g)
    w = _uniform((3 * shapes.width, shapes.width), shapes.width, g)
    cos, sin = (t.float().to(device) for t in _rotary_tables(shapes.seq, shapes.head_dim))  # the model's tables
    return x.to(dtype).to(device), w.to(dtype).to(device), cos, sin


def _product_through_the_op(x, w, cos, sin, heads, T, eps):
    """qk_norm.product_forward_op (the product and the epilogue as the model calls them) in the kernels' layout:
    qkv (3, tokens, width), scales (tokens, 2, heads)."""
    assert eps == qk_norm.EPS
    qkv, scales = qk_norm.product_forward_op(x.view(-1, T, x.shape[1]), w, cos, sin, heads)
    return qkv.reshape(3, x.shape[0], -1), scales.reshape(x.shape[0], 2, heads)


def compare_qkv_rotary(device, dtype, shapes: Shapes, kernel: str | None = None) -> Comparison:
    """The Q/K/V product with QK-norm and rotary in its epilogue: the kernel `kernel` names (triton:
    kernels/qkv_rotary.py, gluon: kernels/qkv_hopper.py), or the model's operator (qk_norm.product_forward_op)."""
    x, w, cos, sin = _qkv_operands(device, dtype, shapes)
    heads, T, M, W = shapes.heads, shapes.seq, shapes.tokens, shapes.width
    op, takes = {None: (_product_through_the_op, ops.available(x) and qkv_rotary.supported(x, w, heads)),
                 "triton": (qkv_rotary.qkv_norm_rotary, qkv_rotary.supported(x, w, heads)),
                 "gluon": (qkv_hopper.qkv_norm_rotary, qkv_hopper.supported(x, w, heads))}[kernel]
    qkv, scales = op(x, w, cos, sin, heads, T, EPS)
    product = (x.double() @ w.double().t()).view(shapes.batch, T, 3 * W)

    def against(*reference):
        q, k, v, s = reference
        return {"q": error(qkv[0], q.reshape(M, W)), "k": error(qkv[1], k.reshape(M, W)),
                "v": error(qkv[2], v.reshape(M, W)), "scales": error(scales, s.reshape(M, 2, heads))}

    # The Triton kernel normalizes and rotates the float32 product: one rounding of q, k, v. The Gluon kernel and
    # the op-by-op path round the product first, as the model does before its norm: the scale then carries one
    # rounding, each normalized value two, and the rotation's sum of a pair of them up to 2 sqrt 2 < 3; with the
    # result's own, four. v and the scales: one.
    rounds_product = kernel != "triton"
    qk_roundings = 4 if rounds_product else 1
    bounds = {"q": bound(qk_roundings), "k": bound(qk_roundings), "v": bound(1),
              "scales": bound(1 if rounds_product else 0)}
    rolled = _rolled(product.view(M, 3 * W)).view(product.shape)
    controls = {"eps 0.1": {key: e for key, e in against(*_qk_reference(product, heads, eps=0.1)).items()
                            if key != "v"},
                "tokens moved by one": against(*_qk_reference(rolled, heads))}
    return Comparison(f"qkv ({kernel or 'routed'})", against(*_qk_reference(product, heads)), bounds, controls,
                      takes)


def compare_qk_norm_rotary(device, dtype, shapes: Shapes) -> Comparison:
    """QK-norm and rotary in one pass each way (kernels/qk_norm_rotary.py, through qk_norm.forward_op and
    backward_op): the backward the Q/K/V product's backward runs, the forward a credit source's product does."""
    g = _generator(4)
    B, T, H, hd = shapes.batch, shapes.seq, shapes.heads, shapes.head_dim
    qkv = torch.randn(B, T, 3 * shapes.width, generator=g).to(dtype).to(device)
    grads = [torch.randn(B, T, H, hd, generator=g).to(dtype).to(device) for _ in range(3)]
    cos, sin = (t.float().to(device) for t in _rotary_tables(T, hd))
    q, k, v, scales = qk_norm.forward_op(qkv, cos, sin, H)
    dqkv = qk_norm.backward_op(*grads, q, k, scales, cos, sin)

    def against(source, eps=EPS):
        x = source.double().requires_grad_(True)
        rq, rk, rv, rs = _qk_reference(x, H, eps=eps)
        dx = torch.autograd.grad((rq, rk, rv), x, [gr.double() for gr in grads])[0]
        return {"q": error(q, rq.detach()), "k": error(k, rk.detach()), "v": error(v, rv.detach()),
                "scales": error(scales, rs.detach()), "dqkv": error(dqkv, dx)}

    # forward: float32 from the bf16 qkv, one rounding (v a copy, the scales float32). backward: n, recovered from
    # the forward's rounded q and k by rotating a pair back (one rounding of the pair's length), enters twice, as
    # n and through mean(dn n): under three, and the result's own.
    bounds = {"q": bound(1), "k": bound(1), "v": bound(0), "scales": bound(0), "dqkv": bound(4)}
    controls = {"eps 0.1": {key: e for key, e in against(qkv, eps=0.1).items() if key != "v"},
                "tokens moved by one": against(_rolled(qkv, 1))}
    return Comparison("qk_norm_rotary", against(qkv), bounds, controls, qk_norm._kernel_takes(qkv))


def compare_thin_linear(device, dtype, shapes: Shapes) -> Comparison:
    """The attention gate's thin product n[..., :gate_dim] W^T and its backward (kernels/thin_linear.py, through
    attention_gate's operators), the input a slice of the branch input's leading channels, read in place."""
    g = _generator(5)
    B, T, K, N = shapes.batch, shapes.seq, shapes.gate_dim, shapes.heads
    n = torch.randn(B, T, shapes.width, generator=g).to(dtype).to(device)
    w = _uniform((N, K), K, g).to(dtype).to(device)
    dy = torch.randn(B, T, N, generator=g).to(dtype).to(device)
    x = n[..., :K]
    y = attention_gate.thin_linear_op(x, w)
    dx, dw = attention_gate.thin_linear_backward_op(dy, x, w)

    def against(x_read, dy_read):
        x64, w64 = x_read.double().requires_grad_(True), w.double().requires_grad_(True)
        y64 = F.linear(x64, w64)
        dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy_read.double())
        return {"y": error(y, y64.detach()), "dx": error(dx, dx64), "dw": error(dw, dw64)}

    # y and dx: float32 sums of a few exact products, one rounding; dw: float32 sums over the tokens, no rounding
    # to bf16
    bounds = {"y": bound(1), "dx": bound(1), "dw": bound(0)}
    controls = {"the next channels read": {k: e for k, e in against(n[..., 1:K + 1], dy).items() if k != "dx"},
                "dy's tokens moved by one": {k: e for k, e in against(x, _rolled(dy, 1)).items() if k != "y"}}
    return Comparison("thin_linear", against(x, dy), bounds, controls,
                      attention_gate._kernel_takes(attention_gate._rows(x), w))


def compare_fit_rows(device, dtype, shapes: Shapes) -> Comparison:
    """The teacher's regression of a branch's prediction D gated onto its true correction c in rank space
    (teacher.rank_space_fit, whose token-wise pass is kernels/fit_rows.py on CUDA), against the same regression
    by float64 autograd with the (tokens, width) prediction formed: the gradients for the code, the gate's
    pre-activation and D, the fit statistics and the least-squares moments."""
    g = _generator(6)
    B, T, d, r2 = shapes.batch, shapes.seq, shapes.width, shapes.code
    gate = torch.sigmoid(torch.randn(B, T, r2, generator=g)).clamp(0.01, 0.99).to(dtype)
    code = torch.randn(B, T, r2, generator=g).to(dtype)
    decoder = torch.randn(d, r2, generator=g) * 0.05  # the float32 parameter
    # c against the prediction (c = noise - pred): the regression's differences then add up rather than cancel,
    # so that the bounds below hold for each output and not only for the sums over tokens
    pred = (gate.double() * code.double()) @ decoder.double().t()
    noise = torch.randn(B, T, d, generator=g, dtype=torch.float64) * pred.square().mean().sqrt()
    c = (noise - pred).to(dtype)
    c, gate, code, decoder = (t.to(device) for t in (c, gate, code, decoder))
    scale = 0.5
    fit = teacher.rank_space_fit(c, gate, code, decoder, scale, torch.float32, dtype)

    def against(gate_twice: bool = False):
        z = torch.logit(gate.double()).requires_grad_(True)
        x, D = code.double().requires_grad_(True), decoder.double().requires_grad_(True)
        c64 = c.double()
        gated = (torch.sigmoid(z) ** (2 if gate_twice else 1)) * x
        pred = gated @ D.t()
        signal = c64.square().sum()
        value = scale * (pred - c64).square().sum() / signal
        d_decoder, d_code, d_gate = torch.autograd.grad(value, (D, x, z))
        flat, c_flat, pred = gated.detach().flatten(0, 1), c64.flatten(0, 1), pred.detach()
        stats = torch.stack([(pred - c64).square().sum() / signal, (pred * c64).sum(), pred.square().sum(), signal])
        return {"code_grad": error(fit.factor * fit.code_grad, d_code),
                "gate_grad": error(fit.factor * fit.gate_grad, d_gate), "d_decoder": error(fit.d_decoder, d_decoder),
                "stats": ((fit.stats.double() - stats).abs() / stats.abs()).max().item(),
                "gram": error(fit.gram, flat.t() @ flat), "cross": error(fit.cross, c_flat.t() @ flat)}

    # The kernel reads D rounded to bf16 for c D, forms gated M with TF32 operands (as large as a rounding), and
    # stores gated in bf16, from which the Gram matrix (two roundings) and c^T gated (one) are formed; the gate's
    # gradient is stored in bf16 too. The statistics (each against its own value): |pred|^2 from the Gram matrix.
    bounds = {"code_grad": bound(2), "gate_grad": bound(3), "d_decoder": bound(2), "stats": bound(2),
              "gram": bound(2), "cross": bound(1)}
    return Comparison("fit_rows", against(), bounds, {"the gate applied twice": against(gate_twice=True)},
                      teacher._fit_kernel_takes(c, code, torch.float32, dtype))


# The GPU tests: the seed shapes, bf16, every kernel the step runs on this device.

def compare_fp8_input_gradient(device, dtype, shapes: Shapes) -> Comparison:
    """The `fp8` source's product dY W (credit/fp8.py: dY in e5m2, W in e4m3, each with its largest magnitude
    scaled to the format's largest value; torch._scaled_mm where the card multiplies FP8) at the Q/K/V product's
    shapes. Its bound is derived here from the formats: each operand entry rounds by at most 2^-3 (e5m2) or 2^-4
    (e4m3) of itself, or half its smallest subnormal times its scale, so output entry c_ij errs by a sum over k of
    terms bounded by b_ijk = E_g |W| + |dY| E_w + E_g E_w. The worst case (the sum of the b_ijk) is too loose to
    tell a product twice too large at these shapes (its error is sqrt(k)-sized, the worst case k-sized), so the
    bound takes the roundings as independent and zero-mean, as they are for operands of random values: then
    Hoeffding's inequality holds each entry's error under sqrt(2 ln(2 N / p) sum_k b_ijk^2) for all N entries
    together but with probability p = 1e-6, plus one bf16 rounding of the output (float32 accumulation's own
    rounding is some 1e-4 of the bound here, left out). The error is the largest |c' - c| over that bound."""
    from creditlab.credit.fp8 import fp8_input_gradient
    from creditlab.ops.fp8 import has_fp8_products

    g = _generator(6)
    m, d = 3 * shapes.width, shapes.width
    dy = torch.randn(shapes.tokens, m, generator=g).to(dtype).to(device)
    w = _uniform((m, d), d, g).to(device)  # a float32 parameter, as the model's
    got = fp8_input_gradient(dy, w).double()
    dy64, w64 = dy.double(), w.double()
    s_g, s_w = dy64.abs().max() / 57344.0, w64.abs().max() / 448.0
    e_g = torch.maximum(E5M2_ROUNDING * dy64.abs(), 0.5 * E5M2_SMALLEST * s_g)
    e_w = torch.maximum(2.0 ** -4 * w64.abs(), 0.5 * 2.0 ** -9 * s_w)
    want = dy64 @ w64
    # sum_k b_ijk^2, expanded: (E_g|W|)^2 + (|dY|E_w)^2 + (E_g E_w)^2 and their cross terms, each a product of
    # two matrices
    sum_b2 = (e_g ** 2 @ w64 ** 2 + dy64 ** 2 @ e_w ** 2 + e_g ** 2 @ e_w ** 2
              + 2 * (e_g * dy64.abs()) @ (w64.abs() * e_w) + 2 * e_g ** 2 @ (w64.abs() * e_w)
              + 2 * (dy64.abs() * e_g) @ e_w ** 2)
    spread = math.sqrt(2 * math.log(2 * want.numel() / 1e-6))
    entry_bound = spread * sum_b2.sqrt() + BF16_ROUNDING * want.abs() + 1e-300

    def against(reference):
        return {"c": ((got - reference).abs() / entry_bound).max().item()}

    controls = {"dy's tokens moved by one": against(_rolled(dy64, 0) @ w64),
                "the gradient's scale doubled": against(2 * want)}
    return Comparison("fp8 input gradient", against(want), {"c": 1.0}, controls, has_fp8_products(dy.device))


SEED = Shapes.seed()


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and relu2_hopper.gluon is not None


# Every kernel the step runs on CUDA, by name: (the comparison at the seed's shapes in bf16, whether it is a Gluon
# kernel, which runs on compute capability 9 alone). The test's id is the name; each appends its line to the record.
GPU_COMPARISONS = {
    "softcap_ce": (lambda: compare_softcap_ce("cuda", torch.bfloat16, SEED), False),
    "softcap_ce_fp8_gradient": (lambda: compare_softcap_ce("cuda", torch.bfloat16, SEED, fp8=True), False),
    "tiled_transpose": (lambda: compare_transpose("cuda", torch.bfloat16, SEED), False),
    "relu2_linear": (lambda: compare_relu2_linear("cuda", torch.bfloat16, SEED), False),
    "relu2_dgrad_triton": (lambda: compare_relu2_dgrad("cuda", torch.bfloat16, SEED, kernel="triton"), False),
    "relu2_dgrad_gluon": (lambda: compare_relu2_dgrad("cuda", torch.bfloat16, SEED, kernel="gluon"), True),
    "qkv_rotary_triton": (lambda: compare_qkv_rotary("cuda", torch.bfloat16, SEED, kernel="triton"), False),
    "qkv_rotary_gluon": (lambda: compare_qkv_rotary("cuda", torch.bfloat16, SEED, kernel="gluon"), True),
    "qk_norm_rotary": (lambda: compare_qk_norm_rotary("cuda", torch.bfloat16, SEED), False),
    "thin_linear": (lambda: compare_thin_linear("cuda", torch.bfloat16, SEED), False),
    "fit_rows": (lambda: compare_fit_rows("cuda", torch.bfloat16, SEED), False),
    "fp8_input_gradient": (lambda: compare_fp8_input_gradient("cuda", torch.bfloat16, SEED), False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(GPU_COMPARISONS))
def test_every_kernel_of_the_step_gives_the_float64_result(request, name):
    """The comparison recorded, then asserted: on the kernel (the package routes these operands to it), within
    its bounds, and over them for every wrong variant."""
    make, gluon = GPU_COMPARISONS[name]
    if gluon and not _hopper():
        pytest.skip("the Gluon kernels run on compute capability 9")
    comparison = make()
    comparison.record(request.node.name, torch.device("cuda"), SEED)
    assert comparison.kernel_takes, f"the package does not route these operands to {comparison.kernel}"
    assert not comparison.failures(), "\n".join(comparison.failures())


def test_the_fp8_comparison_tells_its_wrong_variants_at_the_seed_shapes():
    """The FP8 product's comparison at the GPU test's own shapes and dtype, through the CPU emulation (which gave
    the GPU's errors to the last digit): its bound must be tight enough there to fail a product twice too large.
    A worst-case entrywise bound was not (the scaled product stayed at 0.94 of it on an H100)."""
    comparison = compare_fp8_input_gradient("cpu", torch.bfloat16, SEED)
    assert not comparison.failures(), comparison.failures()
    assert 0.01 < comparison.errors["c"] < 0.5, comparison.errors  # FP8 rounding seen, well inside the bound
    assert min(c["c"] for c in comparison.controls.values()) > 2, comparison.controls


def test_the_comparisons_pass_the_cpu_fallbacks_and_fail_their_wrong_variants():
    """Every comparison above, on the CPU in float32 at small shapes, through the ops' torch fallbacks (no kernel
    takes CPU tensors): the references, the error measures and the wrong variants run, the fallbacks pass within
    the bounds (float32 is far inside bf16's), and every wrong variant fails."""
    comparisons = [compare("cpu", torch.float32, SMALL) for compare in (
        compare_softcap_ce, compare_transpose, compare_relu2_linear, compare_relu2_dgrad, compare_qkv_rotary,
        compare_qk_norm_rotary, compare_thin_linear, compare_fit_rows)]
    comparisons.append(compare_softcap_ce("cpu", torch.float32, SMALL, fp8=True))
    comparisons.append(compare_fp8_input_gradient("cpu", torch.float32, SMALL))
    for comparison in comparisons:
        assert not comparison.kernel_takes, comparison.kernel  # the fallback ran, not a kernel
        assert not comparison.failures(), (comparison.kernel, comparison.failures())
        # float32 through the fallbacks: far inside the bf16 bounds (the FP8 gradient aside, rounded to e5m2)
        if "fp8" not in comparison.kernel:
            assert max(comparison.errors.values()) < 1e-5, (comparison.kernel, comparison.errors)
