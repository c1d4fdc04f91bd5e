"""Checks of the Triton kernels on the CPU, run by tests/test_kernels.py in a process with TRITON_INTERPRET=1
(the interpreter is chosen when a kernel is defined, so it cannot be switched on inside a running test)."""

import json
import sys
from pathlib import Path

import torch

from creditlab import kernels, loss
from creditlab.kernels import relu2_matmul


def reference(logits, targets, vocab, cap, scale):
    """Per-row loss and d(scale * sum)/dlogits by float64 autograd on the true vocabulary."""
    l = logits.double().clone().requires_grad_(True)
    z = cap * torch.tanh(l[:, :vocab] / cap)
    rows = torch.nn.functional.cross_entropy(z, targets, reduction="none")
    (scale * rows.sum()).backward()
    return rows.detach(), l.grad


def kernel_errors(n, vocab, padded, block, spread, dtype, cap=15.0, ref_cap=None, seed=0, poison_padding=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, padded, generator=g) * spread).to(dtype)
    if poison_padding:
        logits[:, vocab::2], logits[:, vocab + 1::2] = float("nan"), float("inf")
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[0], targets[-1] = 0, vocab - 1
    rows, grad = kernels.softcap_ce_rows(logits, targets, vocab, cap, 0.25, block=block)
    ref_rows, ref_grad = reference(logits, targets, vocab, ref_cap or cap, 0.25)
    return {"loss_rel": ((rows.double() - ref_rows).abs() / ref_rows.abs()).max().item(),
            "grad_abs": (grad.double() - ref_grad).abs().max().item() / ref_grad.abs().max().item(),
            "padding_grad_zero": bool((grad[:, vocab:] == 0).all()), "grad_dtype": str(grad.dtype)}


def softcap_variant_errors():
    """The one-pass and two-pass variants of benchmarks/softcap_ce_held.py against float64, on rows whose pieces
    (256 + 64, 1,024 + 64 + 16) and targets (the first and the last column) reach every part of the kernels."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import softcap_ce_held as bench

    out = {}
    for n, vocab, padded in ((4, 300, 320), (3, 1090, 1100)):
        g = torch.Generator().manual_seed(vocab)
        logits = torch.randn(n, padded, generator=g) * 10
        targets = torch.randint(0, vocab, (n,), generator=g)
        targets[0], targets[-1] = 0, vocab - 1
        ref_rows, ref_grad = reference(logits, targets, vocab, 15.0, 0.25)
        for name, kw in bench.VARIANTS:
            if not {"variant", "held", "split"} & set(kw):  # the package's kernel, checked above
                continue
            rows, grad = bench.launcher(kw)(logits, targets, vocab, 15.0, 0.25)
            key = f"{name} ({padded})"
            out[key] = {"loss_rel": ((rows.double() - ref_rows).abs() / ref_rows.abs()).max().item(),
                        "grad_abs": (grad.double() - ref_grad).abs().max().item() / ref_grad.abs().max().item(),
                        "padding_grad_zero": bool((grad[:, vocab:] == 0).all())}
    return out


def head_loss_errors():
    """FusedHeadLoss with its chunks routed through the kernel vs the torch arithmetic, float32."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(50, 16, generator=g)
    w = torch.randn(104, 16, generator=g) * 0.5
    targets = torch.randint(0, 100, (50,), generator=g)
    out = {}
    for use_kernel in (False, True):
        kernels.available = lambda t, use=use_kernel: use
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        value = loss.head_loss(hh, ww, targets, 100, 15.0, 16)
        value.backward()
        out[use_kernel] = (value.detach(), hh.grad, ww.grad)
    return {name: ((a - b).abs().max() / b.abs().max()).item()
            for name, a, b in zip(("loss", "grad_h", "grad_w"), out[True], out[False])}


def opcheck():
    """The fused head-loss operator, with its chunks through the kernel, declares its outputs truthfully."""
    kernels.available = lambda t: True
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(12, 8, generator=g), torch.randn(64, 8, generator=g)
    targets = torch.randint(0, 60, (12,), generator=g)
    result = torch.library.opcheck(loss.fused_head_loss, (h, w, targets, 60, 15.0, 5),
                                   test_utils=("test_schema", "test_faketensor"))
    return {k: v == "SUCCESS" for k, v in result.items()}


@torch.library.custom_op("creditlab_test::softcap_ce_rows", mutates_args=())
def _softcap_ce_rows_op(logits: torch.Tensor, targets: torch.Tensor, vocab: int, cap: float,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _KERNEL_ROWS(logits, targets, vocab, cap, scale)


@_softcap_ce_rows_op.register_fake
def _(logits, targets, vocab, cap, scale):
    return logits.new_empty(logits.shape[0], dtype=torch.float32), torch.empty_like(logits)


_KERNEL_ROWS = kernels.softcap_ce_rows


def logits_shaped_kept_by_compiled_model(products_traced_op_by_op: bool) -> int:
    """How many tensors shaped like a chunk of logits a compiled two-layer model keeps for its backward, with
    the head loss's
    chunks through the kernel. `products_traced_op_by_op` replays the earlier structure, where the compiler
    saw the chunk loop op by op (and kept every chunk's logits gradient for the backward)."""
    from creditlab import config
    from creditlab.model import GPT

    kernels.available = lambda t: True
    real_op = loss.fused_head_loss
    if products_traced_op_by_op:  # the kernel as its own operator, the loop around it traced
        loss.fused_head_loss = real_op._init_fn
        kernels.softcap_ce_rows = _softcap_ce_rows_op
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = config.load("tiny", ["model.layers=2", "model.value_embeds=1"])
        model = GPT(cfg.model)
        idx = torch.randint(0, cfg.model.vocab_size, (2, 32))
        forward = torch.compile(model)
        owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        chunk_of_logits = (32, cfg.model.padded_vocab)
        found = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in owned and tuple(t.shape) == chunk_of_logits:
                found.append(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = forward(idx, idx, loss_chunk=32)
        value.backward()
        return len(set(found))
    finally:
        loss.fused_head_loss = real_op
        kernels.softcap_ce_rows = _KERNEL_ROWS


SMALL_TILES = relu2_matmul.TileConfig(block_m=32, block_n=32, block_k=16, group_m=2, stages=2, warps=4)


def relu2_errors(M, K, N, subtiles, seed=0, reference_derivative=2.0):
    """The three products of the fused-MLP kernel on fresh random float32 inputs, written into NaN-poisoned
    outputs (an element the kernel leaves unwritten stays NaN), against float64; partial tiles in M, N and K.
    `reference_derivative` other than 2 compares the derivative epilogue with a wrong formula."""
    import dataclasses

    cfg = dataclasses.replace(SMALL_TILES, subtiles=subtiles)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    dy, w_kn = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g)
    h = x.double() @ w.double().t()
    poisoned = lambda: torch.full((M, N), float("nan"))  # noqa: E731
    post = relu2_matmul.relu2_linear(x, w, cfg, out=poisoned())
    dh = relu2_matmul.relu2_dgrad(dy, w_kn, post, cfg, out=poisoned())
    plain = relu2_matmul.matmul(x, w, False, cfg, out=poisoned())
    plain_kn = relu2_matmul.matmul(dy, w_kn, True, cfg, out=poisoned())

    def err(got, ref):
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()  # NaN anywhere: NaN, fails a bound

    return {"relu2_linear": err(post, torch.relu(h) ** 2),
            "relu2_dgrad": err(dh, (dy.double() @ w_kn.double()) * reference_derivative * torch.relu(h)),
            "matmul_nk": err(plain, h), "matmul_kn": err(plain_kn, dy.double() @ w_kn.double()),
            "all_written": bool(not post.isnan().any() and not dh.isnan().any())}


def fused_mlp_through_kernel():
    """relu2.expand_relu2 / project_relu2 with the kernel (CPU tensors through the interpreter) against the
    plain float64 MLP: output and every gradient, in float32."""
    from creditlab import relu2

    available, supported, launch = kernels.available, relu2_matmul.supported, relu2_matmul._launch
    launched = []
    kernels.available = lambda t: True
    tiles = relu2_matmul.EXPAND_TILES, relu2_matmul.DGRAD_TILES
    relu2_matmul.EXPAND_TILES = relu2_matmul.DGRAD_TILES = SMALL_TILES
    relu2_matmul.supported = lambda a, b: a.dtype == b.dtype == torch.float32  # the interpreter's dtype
    relu2_matmul._launch = lambda *a, **k: launched.append(a[3]) or launch(*a, **k)
    try:
        g = torch.Generator().manual_seed(3)
        x = torch.randn(2, 20, 24, generator=g, requires_grad=True)
        w1 = torch.randn(40, 24, generator=g, requires_grad=True)
        w2 = torch.randn(24, 40, generator=g, requires_grad=True)
        gy = torch.randn(2, 20, 24, generator=g)
        y = relu2.project_relu2(relu2.expand_relu2(x, w1), w2)
        grads = torch.autograd.grad(y, (x, w1, w2), gy)
        x64, w164, w264 = (t.detach().double().requires_grad_(True) for t in (x, w1, w2))
        y64 = torch.relu(x64 @ w164.t()).square() @ w264.t()
        ref = torch.autograd.grad(y64, (x64, w164, w264), gy.double())
        out = {"y": ((y.double() - y64).abs().max() / y64.abs().max()).item()}
        for name, a, b in zip(("x", "w_fc", "w_proj"), grads, ref):
            out[name] = ((a.double() - b).abs().max() / b.abs().max()).item()
        return {"errors": out, "epilogues_launched": sorted(launched)}
    finally:
        kernels.available, relu2_matmul.supported, relu2_matmul._launch = available, supported, launch
        relu2_matmul.EXPAND_TILES, relu2_matmul.DGRAD_TILES = tiles


def qk_norm_rotary_errors(B, T, heads, hd, seed=0, wrong_eps=False, extra_columns=0):
    """The QK-norm + rotary kernels on fresh random float32 inputs, into NaN-poisoned outputs, against the plain
    float64 model arithmetic (norm, then rotary) and its autograd gradient; T not a multiple of the kernel's rows.
    `wrong_eps` runs the kernel's forward with eps 1e-2 instead of the model's 1e-6. `extra_columns` > 0 hands the
    forward qkv as the leading columns of a wider NaN-padded product (read in place, as with merged gates): a read
    past qkv's own columns would bring NaN into q, k or v."""
    from creditlab import qk_norm
    from creditlab.kernels import qk_norm_rotary as qk_kernels
    from creditlab.model import Rotary, norm

    g = torch.Generator().manual_seed(seed)
    rot = Rotary(hd, T + 3, 10_000.0)
    qkv = torch.randn(B, T, 3 * heads * hd, generator=g) * 3
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    out = (nan(B, T, heads, hd), nan(B, T, heads, hd), nan(B, T, heads, hd), nan(B, T, 2, heads))
    given = qkv
    if extra_columns:
        wide = torch.cat([qkv, nan(B, T, extra_columns)], dim=-1)
        given = wide[..., :qkv.shape[-1]]
        assert not given.is_contiguous()
    q, k, v, scales = qk_kernels.qk_norm_rotary_forward(given, rot.cos, rot.sin, heads, 1e-2 if wrong_eps else 1e-6,
                                                        out=out)
    grads = [torch.randn(B, T, heads, hd, generator=g) for _ in range(3)]
    dqkv = qk_kernels.qk_norm_rotary_backward(*grads, q, k, scales, rot.cos, rot.sin,
                                              out=nan(B, T, 3 * heads * hd))
    x = qkv.double().requires_grad_(True)
    q64, k64, v64 = x.view(B, T, 3, heads, hd).unbind(2)
    rot64 = Rotary(hd, T + 3, 10_000.0).double()
    ref = (rot64(norm(q64)), rot64(norm(k64)), v64)
    ref_dqkv = torch.autograd.grad(ref, x, [gr.double() for gr in grads])[0]

    def err(got, want):
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    return {"q": err(q, ref[0]), "k": err(k, ref[1]), "v": err(v, ref[2]), "dqkv": err(dqkv, ref_dqkv),
            "scales": err(scales, qk_norm.reference_forward(x.detach(), rot64.cos, rot64.sin, heads)[3]),
            "all_written": bool(not any(t.isnan().any() for t in (q, k, v, scales, dqkv)))}


QKV_SMALL_TILES = dict(block_m=16, block_k=16, group_m=2, stages=2, warps=4)


def qkv_rotary_errors(B, T, heads, hd, d, heads_per_tile, seed=0, wrong_eps=False):
    """The Q/K/V product with QK-norm and rotary in its epilogue (kernels/qkv_rotary.py) on fresh random float32
    inputs, into NaN-poisoned outputs, against the float64 product followed by the plain model arithmetic (norm,
    then rotary); B T not a multiple of the tile's rows and d not of its K step, one or two heads a tile.
    `wrong_eps` runs the kernel with eps 1e-2 instead of the model's 1e-6."""
    from creditlab import qk_norm
    from creditlab.kernels import qkv_rotary
    from creditlab.model import Rotary, norm

    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(B * T, d, generator=g), torch.randn(3 * heads * hd, d, generator=g) * 0.5
    rot, rot64 = Rotary(hd, T + 3, 10_000.0), Rotary(hd, T + 3, 10_000.0).double()
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    out = (nan(3, B * T, heads * hd), nan(B * T, 2, heads))
    cfg = qkv_rotary.TileConfig(heads_per_tile=heads_per_tile, **QKV_SMALL_TILES)
    qkv_out, scales = qkv_rotary.qkv_norm_rotary(x, w, rot.cos, rot.sin, heads, T, 1e-2 if wrong_eps else 1e-6,
                                                 cfg, out=out)
    q, k, v = qkv_out.unbind(0)
    qkv = (x.double() @ w.double().t()).view(B, T, 3 * heads * hd)
    q64, k64, v64 = qkv.view(B, T, 3, heads, hd).unbind(2)
    ref = (rot64(norm(q64)), rot64(norm(k64)), v64)

    def err(got, want):
        return ((got.double().view(want.shape) - want).abs().max() / want.abs().max()).item()

    return {"q": err(q, ref[0]), "k": err(k, ref[1]), "v": err(v, ref[2]),
            "scales": err(scales, qk_norm.reference_forward(qkv, rot64.cos, rot64.sin, heads)[3].view(B * T, 2, heads)),
            "all_written": bool(not any(t.isnan().any() for t in (q, k, v, scales)))}


def qkv_product_through_kernel():
    """model.qk=product's Function (qk_norm.product_norm_rotary) with its forward through the kernel (CPU float32,
    the interpreter) against the product and the plain QK-norm and rotary in float64: q, k, v and the gradients
    of n and W, whose backward runs the QK-norm's backward and the product's."""
    from creditlab import qk_norm
    from creditlab.kernels import qkv_rotary
    from creditlab.model import Rotary, norm

    available, supported, launch = kernels.available, qkv_rotary.supported, qkv_rotary.qkv_norm_rotary
    tiles, launched = qkv_rotary.DEFAULT_TILES, []
    kernels.available = lambda t: True
    qkv_rotary.DEFAULT_TILES = qkv_rotary.TileConfig(heads_per_tile=2, **QKV_SMALL_TILES)
    qkv_rotary.supported = lambda x, w, heads: x.dtype == w.dtype == torch.float32  # the interpreter's dtype
    qkv_rotary.qkv_norm_rotary = lambda *a, **k: launched.append(1) or launch(*a, **k)
    try:
        g = torch.Generator().manual_seed(4)
        B, T, heads, hd, d = 2, 21, 2, 16, 24
        rot = Rotary(hd, T, 10_000.0)
        n = torch.randn(B, T, d, generator=g, requires_grad=True)
        w = (torch.randn(3 * heads * hd, d, generator=g) * 0.5).requires_grad_(True)
        grads_out = [torch.randn(B, T, heads, hd, generator=g) for _ in range(3)]
        outs = qk_norm.product_norm_rotary(n, w, rot.cos, rot.sin, heads)
        grads = torch.autograd.grad(outs, (n, w), grads_out)
        n64, w64 = (t.detach().double().requires_grad_(True) for t in (n, w))
        rot64 = Rotary(hd, T, 10_000.0).double()
        q64, k64, v64 = (n64 @ w64.t()).view(B, T, 3, heads, hd).unbind(2)
        ref = (rot64(norm(q64)), rot64(norm(k64)), v64)
        ref_grads = torch.autograd.grad(ref, (n64, w64), [gr.double() for gr in grads_out])
        errors = {}
        for name, a, b in zip(("q", "k", "v", "n", "w"), (*outs, *grads), (*ref, *ref_grads)):
            errors[name] = ((a.double() - b).abs().max() / b.abs().max()).item()
        return {"errors": errors, "launched": len(launched)}
    finally:
        kernels.available, qkv_rotary.supported, qkv_rotary.qkv_norm_rotary = available, supported, launch
        qkv_rotary.DEFAULT_TILES = tiles


def qkv_product_opcheck():
    """The Q/K/V product's operator declares its outputs truthfully, through the kernel and through the torch
    arithmetic."""
    from creditlab import qk_norm
    from creditlab.kernels import qkv_rotary
    from creditlab.model import Rotary

    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(2, 19, 24, generator=g), torch.randn(96, 24, generator=g)
    rot = Rotary(16, 19, 10_000.0)
    out = {}
    available, supported, tiles = kernels.available, qkv_rotary.supported, qkv_rotary.DEFAULT_TILES
    try:
        for through_kernel in (False, True):
            kernels.available = lambda t, use=through_kernel: use
            qkv_rotary.supported = lambda x, w, heads: x.dtype == w.dtype == torch.float32
            qkv_rotary.DEFAULT_TILES = qkv_rotary.TileConfig(heads_per_tile=2, **QKV_SMALL_TILES)
            result = torch.library.opcheck(qk_norm.product_forward_op, (x, w, rot.cos, rot.sin, 2),
                                           test_utils=("test_schema", "test_faketensor"))
            out["kernel" if through_kernel else "torch"] = sorted(set(result.values()))
    finally:
        kernels.available, qkv_rotary.supported, qkv_rotary.DEFAULT_TILES = available, supported, tiles
    return out


def thin_linear_errors(tokens, width, K, N, seed=0, rows=32, drop_partials=False):
    """The attention gate's thin product (kernels/thin_linear.py) on fresh random float32 inputs, x the leading K
    channels of a wider NaN-padded tensor (read in place, as the gate reads the branch input), into NaN-poisoned
    outputs, against float64: y = x w^T, dx = dy w, dw = dy^T x; tokens not a multiple of the block's rows, K and
    N not powers of two. `drop_partials` compares dw against the sum of all partial blocks but the last."""
    from creditlab.kernels import thin_linear

    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, width, generator=g)
    wide[:, K:] = float("nan")
    x, w, dy = wide[:, :K], torch.randn(N, K, generator=g), torch.randn(tokens, N, generator=g)
    y = thin_linear.thin_forward(x, w, rows=rows, out=torch.full((tokens, N), float("nan")))
    dx, dw = thin_linear.thin_backward(dy, x, w, rows=rows, out=torch.full((tokens, K), float("nan")))
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    want_dw = dy64.t() @ x64
    if drop_partials:
        last = (tokens - 1) // rows * rows
        want_dw = dy64[:last].t() @ x64[:last]

    def err(got, want):
        return ((got.double() - want).abs().max() / want.abs().max()).item()

    return {"y": err(y, x64 @ w64.t()), "dx": err(dx, dy64 @ w64), "dw": err(dw, want_dw),
            "all_written": bool(not (y.isnan().any() or dx.isnan().any() or dw.isnan().any()))}


def attention_gate_through_kernel():
    """model.attn_gate=fused's Function (attention_gate.gate_linear) with both passes through the kernels (CPU
    float32, the interpreter) against F.linear in float64, on a slice of the leading channels as the model takes
    it: y and the gradients of the whole input and of W."""
    from creditlab import attention_gate
    from creditlab.kernels import thin_linear

    available, launched = kernels.available, []
    forward, backward = thin_linear.thin_forward, thin_linear.thin_backward
    kernels.available = lambda t: True
    thin_linear.thin_forward = lambda *a, **k: launched.append("forward") or forward(*a, **k)
    thin_linear.thin_backward = lambda *a, **k: launched.append("backward") or backward(*a, **k)
    try:
        g = torch.Generator().manual_seed(7)
        n = torch.randn(2, 37, 24, generator=g, requires_grad=True)
        w = torch.randn(4, 12, generator=g, requires_grad=True)
        gy = torch.randn(2, 37, 4, generator=g)
        y = attention_gate.gate_linear(n[..., :12], w)
        grads = torch.autograd.grad(y, (n, w), gy)
        n64, w64 = (t.detach().double().requires_grad_(True) for t in (n, w))
        y64 = torch.nn.functional.linear(n64[..., :12], w64)
        ref = torch.autograd.grad(y64, (n64, w64), gy.double())
        errors = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
                  for name, a, b in zip(("y", "n", "w"), (y, *grads), (y64, *ref))}
        return {"errors": errors, "launched": launched}
    finally:
        kernels.available, thin_linear.thin_forward, thin_linear.thin_backward = available, forward, backward


def attention_gate_opcheck():
    """The gate's two operators declare their outputs truthfully, through the kernels and the torch arithmetic."""
    from creditlab import attention_gate

    g = torch.Generator().manual_seed(8)
    n, w, dy = torch.randn(2, 19, 24, generator=g), torch.randn(4, 12, generator=g), torch.randn(2, 19, 4, generator=g)
    x = n[..., :12]
    out, available = {}, kernels.available
    try:
        for through_kernel in (False, True):
            kernels.available = lambda t, use=through_kernel: use
            results = [torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
                       for op, args in ((attention_gate.thin_linear_op, (x, w)),
                                        (attention_gate.thin_linear_backward_op, (dy, x, w)))]
            out["kernel" if through_kernel else "torch"] = sorted({v for r in results for v in r.values()})
    finally:
        kernels.available = available
    return out


def norm_decode_errors(tokens, d, r2, with_dn, with_residual=True, seed=0, drop_decode=False, drop_residual=False):
    """The norm backward with the decode inside and the residual gradient added (kernels/norm_decode.py) on fresh
    random float32 inputs, into a NaN-poisoned output, against float64 autograd of model.norm with the correction
    added to dL/dn, plus the residual; tokens not a multiple of the kernel's rows. `drop_decode` compares against a
    reference without the correction, `drop_residual` runs the kernel without the residual the reference adds."""
    from creditlab.kernels import norm_decode
    from creditlab.model import norm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g) * 2
    code, gate = torch.randn(tokens, r2, generator=g), torch.rand(tokens, r2, generator=g)
    decoder = torch.randn(d, r2, generator=g) * 0.1
    dn = torch.randn(tokens, d, generator=g) if with_dn else None
    residual = torch.randn(tokens, d, generator=g) if with_residual else None
    x64 = x.double().requires_grad_(True)
    n64 = norm(x64)
    scale = torch.rsqrt(x.double().square().mean(-1) + 1e-6).float()
    c = (code.double() * gate.double()) @ decoder.double().t()
    upstream = (0 if drop_decode else c) + (dn.double() if with_dn else 0)
    ref = torch.autograd.grad(n64, x64, upstream)[0] + (residual.double() if with_residual else 0)
    got = norm_decode.norm_decode_backward(dn, norm(x), scale, code, gate, decoder, None if drop_residual else residual,
                                           out=torch.full((tokens, d), float("nan")))
    return {"dx": ((got.double() - ref).abs().max() / ref.abs().max()).item(), "all_written": bool(not got.isnan().any())}


def fused_decode_through_kernel():
    """The learned source's fused decode (credit/predictor.py) with its backward through the Triton operator (CPU
    float32, the interpreter) against the same Function in float64 on the torch path: the gradient of the residual
    stream before the branch, with a correction and a residual gradient that both matter."""
    from creditlab.credit import predictor
    from creditlab.kernels import norm_decode

    takes, launched = norm_decode.takes, []
    real = norm_decode._run
    norm_decode._run = lambda *a, **k: launched.append(1) or real(*a, **k)
    try:
        g = torch.Generator().manual_seed(6)
        B, T, d, r2 = 2, 37, 32, 16
        x = torch.randn(B, T, d, generator=g) * 2
        gate_weight, decoder = torch.randn(r2, d, generator=g) * 0.3, torch.randn(d, r2, generator=g) * 0.3
        code, residual = torch.randn(B, T, r2, generator=g), torch.randn(B, T, d, generator=g)
        grads = {}
        for name, dtype, kernel in (("kernel", torch.float32, True), ("torch", torch.float64, False)):
            norm_decode.takes = lambda n, c: kernel
            xi = x.detach().to(dtype).requires_grad_(True)
            passed, n, share = predictor._NormGatedAdjoint.apply(xi, gate_weight.to(dtype), decoder.to(dtype))
            torch.autograd.backward([passed, share], [residual.to(dtype), code.to(dtype)])
            grads[name] = xi.grad
        without_residual = grads["torch"] - residual.double()
        scale = grads["torch"].abs().max()
        return {"dx": ((grads["kernel"].double() - grads["torch"]).abs().max() / scale).item(),
                "residual_share": (without_residual - grads["torch"]).abs().max().item() / scale.item(),
                "correction_share": without_residual.abs().max().item() / scale.item(), "launched": len(launched)}
    finally:
        norm_decode.takes, norm_decode._run = takes, real


def norm_decode_opcheck():
    """The norm_decode operator has a valid schema, with and without its optional inputs."""
    from creditlab.kernels import norm_decode

    g = torch.Generator().manual_seed(7)
    n, residual = torch.randn(40, 32, generator=g), torch.randn(40, 32, generator=g)
    small = torch.randn(40, 16, generator=g)
    results = {}
    for name, dn, res in (("full", residual, residual), ("no_dn", None, residual), ("neither", None, None)):
        args = (dn, res, n, torch.rand(40, generator=g), small, small.sigmoid(), torch.randn(32, 16, generator=g))
        result = torch.library.opcheck(norm_decode.norm_decode_op, args, test_utils=("test_schema",))
        results[name] = all(v == "SUCCESS" for v in result.values())
    return results


def gate_decode_errors(tokens, d, r2, seed=0, strided=False, tiles=True, wrong=None):
    """The predictor's state gate and gated decode (kernels/gate_decode.py) on fresh random float32 inputs, into
    NaN-poisoned outputs, against float64; tokens not a multiple of a program's rows. `tiles`: small tiles, so a
    program walks several K steps and column chunks (else the defaults, one partial program). `strided`: n, code
    and gate as column slices of wider tensors (a typed code's slice). `wrong`: compare the decode against
    code D^T (the gate left out) and the gate against n G^T (the sigmoid left out)."""
    from creditlab.kernels import gate_decode as gd

    g = torch.Generator().manual_seed(seed)
    extra = 8 if strided else 0
    n = (torch.randn(tokens, d + extra, generator=g) * 1.5)[:, extra:]
    code = torch.randn(tokens, r2 + extra, generator=g)[:, :r2]
    gate = torch.rand(tokens, r2 + extra, generator=g)[:, extra:]
    gate_weight, decoder = torch.randn(r2, d, generator=g) * 2 * d ** -0.5, torch.randn(d, r2, generator=g) * 0.3
    gate_tiles, decode_tiles = ((gd.GateTiles(16, 16, 2, 4), gd.DecodeTiles(16, 32, 4)) if tiles
                                else (gd.GATE_TILES, gd.DECODE_TILES))
    got_gate = gd.state_gate(n, gate_weight, gate_tiles, out=torch.full((tokens, r2), float("nan")))
    got_decode = gd.gated_decode(code, gate, decoder, decode_tiles, out=torch.full((tokens, d), float("nan")))
    logits = n.double() @ gate_weight.double().t()
    want_gate = logits if wrong else torch.sigmoid(logits)
    want_decode = (code.double() * (1 if wrong else gate.double())) @ decoder.double().t()
    err = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()  # noqa: E731
    return {"gate": err(got_gate, want_gate), "decode": err(got_decode, want_decode),
            "all_written": bool(not (got_gate.isnan().any() or got_decode.isnan().any())), "strided": strided}


def streaming_products_through_kernels():
    """The learned source's streaming share (credit/predictor.py, _GatedAdjoint) with its gate and its decode
    through the Triton operators (CPU float32, the interpreter) against the same Function in float64 on the torch
    path: the gradient of the branch input, which is the branch's correction."""
    from creditlab.credit import predictor
    from creditlab.kernels import gate_decode as gd

    takes, launched = gd.takes, []
    real = gd._run_gate, gd._run_decode
    gd._run_gate = lambda *a, **k: launched.append("gate") or real[0](*a, **k)
    gd._run_decode = lambda *a, **k: launched.append("decode") or real[1](*a, **k)
    try:
        g = torch.Generator().manual_seed(8)
        B, T, d, r2 = 2, 37, 32, 16
        n = torch.randn(B, T, d, generator=g)
        gate_weight, decoder = torch.randn(r2, d, generator=g) * 0.3, torch.randn(d, r2, generator=g) * 0.3
        code = torch.randn(B, T, r2, generator=g)
        grads = {}
        for name, dtype, kernel in (("kernel", torch.float32, True), ("torch", torch.float64, False)):
            gd.takes = lambda *t, widths=(), k=kernel: k
            ni = n.detach().to(dtype).requires_grad_(True)
            share = predictor._GatedAdjoint.apply(ni, gate_weight.to(dtype), decoder.to(dtype), kernel)
            share.backward(code.to(dtype))
            grads[name] = ni.grad
        ungated = (code.double() @ decoder.double().t())  # the same decode without the gate
        scale = grads["torch"].abs().max()
        return {"dn": ((grads["kernel"].double() - grads["torch"]).abs().max() / scale).item(),
                "gate_matters": ((ungated - grads["torch"]).abs().max() / scale).item(), "launched": launched}
    finally:
        gd.takes, (gd._run_gate, gd._run_decode) = takes, real


def gate_decode_opcheck():
    """The state-gate and gated-decode operators have valid schemas."""
    from creditlab.kernels import gate_decode as gd

    g = torch.Generator().manual_seed(9)
    n, small = torch.randn(2, 20, 32, generator=g), torch.randn(2, 20, 16, generator=g)
    results = {}
    for name, op, args in (("state_gate", gd.state_gate_op, (n, torch.randn(16, 32, generator=g))),
                           ("gated_decode", gd.gated_decode_op, (small, small.sigmoid(), torch.randn(32, 16, generator=g)))):
        result = torch.library.opcheck(op, args, test_utils=("test_schema",))
        results[name] = all(v == "SUCCESS" for v in result.values())
    return results


def fit_rows_errors(tokens, d, r2, seed=0, wrong_gate_derivative=False):
    """The teacher's rank-space kernel (kernels/fit_rows.py) on fresh random float32 inputs, into NaN-poisoned
    outputs, against the same quantities in float64; tokens not a multiple of a program's tokens, several
    programs. `wrong_gate_derivative` compares gate_grad with sigmoid's derivative taken as gate instead of
    gate (1 - gate)."""
    from creditlab.kernels import fit_rows

    tiles = fit_rows.FitTiles(rows=16, block_k=16, tiles=2, warps=4, stages=2)
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(tokens, d, generator=g)
    gate, code = torch.rand(tokens, r2, generator=g), torch.randn(tokens, r2, generator=g)
    decoder = torch.randn(d, r2, generator=g) * 0.3
    m = decoder.double().t() @ decoder.double()
    nan = lambda *shape: torch.full(shape, float("nan"))  # noqa: E731
    rows = fit_rows.programs(tokens, tiles)
    got = fit_rows.fit_rows(c, gate, code, decoder, m.float(), tiles,
                            out=(nan(tokens, r2), nan(tokens, r2), nan(tokens, r2), nan(rows, fit_rows.SUMS + r2 * r2)))
    c64, g64, x64, d64 = c.double(), gate.double(), code.double(), decoder.double()
    gated = g64 * x64
    residual = gated @ m - c64 @ d64
    derivative = g64 if wrong_gate_derivative else g64 * (1 - g64)
    sums = got[3].double().sum(0)
    ref_sums = torch.stack([c64.square().sum(), ((gated @ m) * gated).sum(), ((c64 @ d64) * gated).sum()])

    def err(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    return {"gated": err(got[0], gated), "code_grad": err(got[1], residual * g64),
            "gate_grad": err(got[2], residual * x64 * derivative),
            "sums": err(sums[:fit_rows.SUMS], ref_sums), "gram": err(sums[fit_rows.SUMS:].view(r2, r2), gated.t() @ gated),
            "programs": rows, "all_written": bool(not any(t.isnan().any() for t in got))}


def rank_space_fit_through_kernel():
    """teacher.rank_space_fit with the kernel (CPU float32 through the interpreter) against its op-by-op path in
    float64: every output, on a (B, T, d) correction."""
    from creditlab.credit import teacher
    from creditlab.kernels import fit_rows

    available, tiles = kernels.available, fit_rows.DEFAULT_TILES
    launched = []
    real = fit_rows._run
    fit_rows._run = lambda *a, **k: launched.append(1) or real(*a, **k)
    fit_rows.DEFAULT_TILES = fit_rows.FitTiles(16, 16, 2, 4, 2)  # several programs at these shapes
    try:
        g = torch.Generator().manual_seed(4)
        B, T, d, r2 = 2, 37, 32, 16
        true = torch.randn(B, T, d, generator=g)
        gate, code = torch.rand(B, T, r2, generator=g), torch.randn(B, T, r2, generator=g)
        decoder = torch.randn(d, r2, generator=g) * 0.3
        kernels.available = lambda t: True
        fast = teacher.rank_space_fit(true, gate, code, decoder, 0.5, torch.float32, torch.float32)
        kernels.available = lambda t: False
        ref = teacher.rank_space_fit(*(t.double() for t in (true, gate, code, decoder)), 0.5, torch.float64,
                                     torch.float64)
        errors = {name: ((a.double() - b).abs().max() / b.abs().max()).item()
                  for name, a, b in zip(teacher.RankSpaceFit._fields, fast, ref)}
        return {"errors": errors, "launched": len(launched)}
    finally:
        kernels.available, fit_rows._run, fit_rows.DEFAULT_TILES = available, real, tiles


def fit_rows_opcheck():
    """The teacher's fit_rows operator has a valid schema. (Its fake, which the compiler plans with, is its own
    body with the launch skipped, so its shapes are the real ones by construction; under the interpreter the
    fake check would run the kernel on fake tensors, so it is not run here.)"""
    from creditlab.kernels import fit_rows

    tiles, fit_rows.DEFAULT_TILES = fit_rows.DEFAULT_TILES, fit_rows.FitTiles(16, 16, 2, 4, 2)
    try:
        g = torch.Generator().manual_seed(5)
        c, decoder = torch.randn(40, 32, generator=g), torch.randn(32, 16, generator=g)
        args = (c, torch.rand(40, 16, generator=g), torch.randn(40, 16, generator=g), decoder, decoder.t() @ decoder)
        result = torch.library.opcheck(fit_rows.fit_rows_op, args, test_utils=("test_schema",))
        return {k: v == "SUCCESS" for k, v in result.items()}
    finally:
        fit_rows.DEFAULT_TILES = tiles


def transpose_checks(rows, cols, seed=0):
    """The tiled transpose of a one-byte matrix into a poisoned output: exact, against torch's, and against the
    untransposed matrix read as (cols, rows) (what a kernel that copied without transposing would give)."""
    from creditlab.kernels import tiled_transpose

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 255, (rows, cols), dtype=torch.uint8, generator=g).view(torch.float8_e5m2)
    out = torch.full((cols, rows), 0x7F, dtype=torch.uint8).view(torch.float8_e5m2)  # 0x7F: e5m2 NaN
    got = tiled_transpose.transpose(x, out=out).view(torch.uint8)
    return {"exact": torch.equal(got, x.t().contiguous().view(torch.uint8)),
            "equals_untransposed": torch.equal(got, x.view(torch.uint8).reshape(cols, rows)),
            "dtype": str(out.dtype)}


def embedding_grad_errors(n, vocab, width, ids_kind, seed=0, unsorted_order=False, block_rows=16, block_cols=32):
    """The sorted embedding gradient (kernels/embedding_grad.py) against float64 index_add, on ids drawn as text
    repeats them (zipf), all one token (one run across every block), all distinct, or few tokens; with
    unsorted_order the permutation passed is the identity, a kernel fed the wrong rows (the check must fail)."""
    from creditlab.kernels import embedding_grad

    g = torch.Generator().manual_seed(seed)
    if ids_kind == "zipf":
        ids = torch.multinomial(1.0 / torch.arange(1, vocab + 1, dtype=torch.float64), n, True, generator=g)
    elif ids_kind == "one":
        ids = torch.full((n,), vocab - 1)
    elif ids_kind == "distinct":
        ids = torch.randperm(vocab, generator=g)[:n]
    else:
        ids = torch.randint(0, 3, (n,), generator=g)
    grad = torch.randn(n, width, generator=g).to(torch.bfloat16)
    sorted_ids, order = torch.sort(ids.to(torch.int32))
    if unsorted_order:
        order = torch.arange(n)
    got = embedding_grad.embedding_grad(sorted_ids, order, grad, vocab, block_rows, block_cols)
    want = torch.zeros(vocab, width, dtype=torch.float64).index_add_(0, ids, grad.double())
    return {"abs": (got.double() - want).abs().max().item(), "scale": want.abs().max().item(),
            "dtype": str(got.dtype), "runs": int(torch.unique(ids).numel())}


def embedding_lookups_through_kernel():
    """embedding.lookups' gradients with the kernel (CPU tensors through the interpreter) against the same tables'
    float64 autograd lookups: the token table and two value tables, ids with repeats, outputs cast to bf16."""
    from creditlab import embedding

    g = torch.Generator().manual_seed(4)
    ids = torch.multinomial(1.0 / torch.arange(1, 41, dtype=torch.float64), 2 * 37, True, generator=g).view(2, 37)
    weights = [torch.randn(40, 24, generator=g, requires_grad=True) for _ in range(3)]
    upstream = [torch.randn(2, 37, 24, generator=g).to(torch.bfloat16) for _ in weights]
    available = kernels.available
    kernels.available = lambda t: True  # the interpreter runs the kernel on CPU tensors
    try:
        outs = embedding.lookups(ids, weights, torch.bfloat16)
    finally:
        kernels.available = available
    torch.autograd.backward(outs, upstream)
    errors = {}
    for i, (w, up) in enumerate(zip(weights, upstream)):
        w64 = w.detach().double().requires_grad_()
        torch.nn.functional.embedding(ids, w64).backward(up.double())
        errors[f"table{i}"] = (w.grad.double() - w64.grad).abs().max().item()
    errors["out_dtype_bf16"] = float(all(o.dtype == torch.bfloat16 for o in outs))
    return errors


def embedding_grads_opcheck():
    """torch.library.opcheck of the lookups' backward operator (its fake shapes, schema and autograd wiring)."""
    from creditlab import embedding

    ids = torch.randint(0, 9, (3, 5))
    grads = [torch.randn(3, 5, 4), torch.randn(3, 5, 4)]
    results = torch.library.opcheck(embedding.grads_op, (ids, grads, 9, torch.float32))
    return {k: v == "SUCCESS" for k, v in results.items()}


if __name__ == "__main__":
    report = {
        "embedding_zipf": embedding_grad_errors(300, 50, 72, "zipf"),
        "embedding_one_token": embedding_grad_errors(100, 7, 40, "one", seed=1),
        "embedding_distinct": embedding_grad_errors(45, 64, 32, "distinct", seed=2, block_rows=32, block_cols=64),
        "embedding_few_tokens": embedding_grad_errors(70, 3, 40, "few", seed=3),
        "embedding_unsorted_order": embedding_grad_errors(300, 50, 72, "zipf", unsorted_order=True),
        "embedding_lookups": embedding_lookups_through_kernel(),
        "embedding_opcheck": embedding_grads_opcheck(),
        "transpose_partial": transpose_checks(70, 130),
        "transpose_one_tile": transpose_checks(16, 48, seed=1),
        "fit_rows": fit_rows_errors(70, 64, 16),
        "fit_rows_one_program": fit_rows_errors(20, 32, 32, seed=1),
        "fit_rows_wrong_derivative": fit_rows_errors(70, 64, 16, wrong_gate_derivative=True),
        "rank_space_fit": rank_space_fit_through_kernel(),
        "fit_rows_opcheck": fit_rows_opcheck(),
        "norm_decode_with_dn": norm_decode_errors(70, 64, 16, True),
        "norm_decode_without_dn": norm_decode_errors(33, 32, 32, False, seed=1),
        "norm_decode_without_residual": norm_decode_errors(33, 32, 32, True, with_residual=False, seed=2),
        "norm_decode_dropped": norm_decode_errors(70, 64, 16, True, drop_decode=True),
        "norm_decode_residual_dropped": norm_decode_errors(70, 64, 16, True, seed=3, drop_residual=True),
        "fused_decode": fused_decode_through_kernel(),
        "gate_decode_tiles": gate_decode_errors(70, 64, 16),
        "gate_decode_strided": gate_decode_errors(37, 32, 32, seed=1, strided=True),
        "gate_decode_default_tiles": gate_decode_errors(45, 64, 64, seed=2, tiles=False),
        "gate_decode_wrong": gate_decode_errors(70, 64, 16, wrong=True),
        "streaming_products": streaming_products_through_kernels(),
        "gate_decode_opcheck": gate_decode_opcheck(),
        "norm_decode_opcheck": norm_decode_opcheck(),
        "qk_even": qk_norm_rotary_errors(2, 32, 2, 16),
        "qk_partial_rows": qk_norm_rotary_errors(1, 37, 3, 8, seed=1),
        "qk_wrong_eps": qk_norm_rotary_errors(2, 32, 2, 16, wrong_eps=True),
        "qk_strided_rows": qk_norm_rotary_errors(2, 21, 2, 16, seed=2, extra_columns=12),
        "qkv_two_heads_a_tile": qkv_rotary_errors(2, 21, 4, 16, 40, 2),
        "qkv_one_head_a_tile": qkv_rotary_errors(1, 37, 3, 32, 24, 1, seed=1),
        "qkv_odd_heads": qkv_rotary_errors(2, 19, 3, 16, 24, 2, seed=2),  # two heads a tile asked: one taken
        "qkv_wrong_eps": qkv_rotary_errors(2, 21, 4, 16, 40, 2, wrong_eps=True),
        "qkv_product": qkv_product_through_kernel(),
        "thin_linear_gate": thin_linear_errors(300, 40, 12, 4),
        "thin_linear_odd": thin_linear_errors(45, 20, 7, 3, seed=1, rows=16),
        "thin_linear_one_block": thin_linear_errors(20, 16, 16, 8, seed=2, rows=32),
        "thin_linear_dropped_partial": thin_linear_errors(300, 40, 12, 4, drop_partials=True),
        "attention_gate": attention_gate_through_kernel(),
        "attention_gate_opcheck": attention_gate_opcheck(),
        "qkv_opcheck": qkv_product_opcheck(),
        "relu2_even": relu2_errors(64, 32, 64, 2),
        "relu2_partial": relu2_errors(100, 40, 72, 2, seed=1),
        "relu2_one_subtile": relu2_errors(100, 40, 72, 1, seed=2),
        "relu2_wrong_derivative": relu2_errors(64, 32, 64, 2, reference_derivative=1.0),
        "fused_mlp": fused_mlp_through_kernel(),
        "one_block": kernel_errors(8, 97, 128, None, 20.0, torch.float32),
        "many_blocks": kernel_errors(8, 300, 320, 64, 20.0, torch.float32),
        "saturated": kernel_errors(8, 97, 128, 32, 400.0, torch.float32),
        "near_zero": kernel_errors(8, 97, 128, None, 1e-3, torch.float32),
        "nan_padding": kernel_errors(8, 300, 320, 64, 20.0, torch.float32, poison_padding=True),
        "bf16": kernel_errors(8, 300, 320, 128, 20.0, torch.bfloat16),
        "wrong_cap": kernel_errors(8, 97, 128, None, 20.0, torch.float32, cap=15.0, ref_cap=14.0),
        "softcap_variants": softcap_variant_errors(),
        "head_loss": head_loss_errors(),
        "opcheck": opcheck(),
        "logits_kept_fused": logits_shaped_kept_by_compiled_model(False),
        "logits_kept_op_by_op": logits_shaped_kept_by_compiled_model(True),
    }
    json.dump(report, sys.stdout)
