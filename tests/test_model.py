"""The GPT: causality, precision, the 16 branches, value-embedding routing, trunk/head split, loss at init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from creditlab import config
from creditlab.flops import flop_budget
from creditlab.model import GPT, ExactCredit, norm, relu_squared
from dispatched import DispatchedOps

SMALL = ["model.vocab_size=97", "model.width=32", "model.heads=2", "model.mlp_hidden=64", "model.seq_len=16",
         "model.gate_dim=8", "model.layers=4", "model.value_embeds=2"]


def small_cfg(*extra: str):
    return config.load("tiny", SMALL + list(extra)).model


@torch.no_grad()
def randomize(model: GPT, seed: int = 0) -> GPT:
    """Random values for every parameter: the default zero-initialized projections and head would hide paths."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if p.ndim == 2:
            r = r * p.shape[1] ** -0.5
        else:
            r = 0.5 + 0.5 * r  # scalars: around 0.5, not the trivial 1/0 defaults
        p.copy_(r.to(p.dtype))
    return model


def tokens(cfg, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and targets of one batch, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)


def logits64(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """Soft-capped logits kept in the model's dtype (model.logits returns float32)."""
    cap = model.cfg.logit_cap
    z = model.head(norm(model.hidden(idx)))[..., :model.cfg.vocab_size]
    return cap * torch.tanh(z / cap)


def test_causal_changing_a_later_token_never_moves_earlier_logits():
    cfg = small_cfg()
    torch.manual_seed(0)
    model = randomize(GPT(cfg).double())
    T = cfg.seq_len
    idx = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = logits64(model, idx)
        assert base.dtype == torch.float64 and base.shape == (2, T, cfg.vocab_size)
        for t in range(T - 1):
            changed = idx.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1 + t) % cfg.vocab_size
            out = logits64(model, changed)
            # Positions <= t see only tokens <= t: identical to float64 rounding.
            assert (out[:, :t + 1] - base[:, :t + 1]).abs().max().item() <= 1e-12, t
            # The change itself must reach the positions that may see it (the check can fail).
            assert (out[:, t + 1:] - base[:, t + 1:]).abs().max().item() > 1e-4, t


def test_causality_check_detects_a_leak(monkeypatch):
    """The same comparison on a non-causal variant of attention does flag earlier positions."""
    cfg = small_cfg()
    model = randomize(GPT(cfg).double())
    idx = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, 5] = (changed[:, 5] + 1) % cfg.vocab_size
    real_sdpa = F.scaled_dot_product_attention

    def leaky(q, k, v, is_causal=False, scale=None, **kw):
        return real_sdpa(q, k, v, is_causal=False, scale=scale, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", leaky)
    with torch.no_grad():
        diff = (logits64(model, changed) - logits64(model, idx))[:, :5].abs().max().item()
    assert diff > 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_runs_in_float32_and_float64(dtype):
    cfg = small_cfg()
    model = randomize(GPT(cfg)).to(dtype)
    idx, tgt = tokens(cfg, batch=2, seed=3)
    loss = model(idx, tgt, loss_chunk=7)
    assert loss.dtype == dtype and loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert torch.isfinite(p.grad).all(), name
    assert model.hidden(idx).dtype == dtype


def test_float32_and_float64_agree():
    cfg = small_cfg()
    m64 = randomize(GPT(cfg)).double()
    m32 = GPT(cfg)
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    idx, tgt = tokens(cfg, batch=2, seed=4)
    l64, l32 = m64(idx, tgt).item(), m32(idx, tgt).item()
    assert l32 == pytest.approx(l64, rel=1e-5)


def test_forward_loss_is_cross_entropy_of_the_logits_for_any_chunk():
    cfg = small_cfg()
    model = randomize(GPT(cfg).double())
    idx, tgt = tokens(cfg, batch=3, seed=5)
    with torch.no_grad():
        ref = F.cross_entropy(logits64(model, idx).flatten(0, 1), tgt.flatten()).item()
        for chunk in (1, 5, 16, 48, 1000):
            assert model(idx, tgt, loss_chunk=chunk).item() == pytest.approx(ref, rel=1e-12)
        # model.logits (the evaluation path) agrees to float32 precision.
        ev = model.logits(idx)
        assert ev.shape == (3, cfg.seq_len, cfg.vocab_size)
        torch.testing.assert_close(ev.double(), logits64(model, idx), rtol=1e-5, atol=1e-5)
        assert ev.abs().max().item() <= cfg.logit_cap


def test_seed_config_exposes_16_branches_without_allocating():
    mcfg = config.load("seed").model
    with torch.device("meta"):
        model = GPT(mcfg)
    assert all(p.is_meta for p in model.parameters())
    names = model.branch_names()
    assert len(names) == 16 == mcfg.branches
    assert names == [f"layer{i}.{k}" for i in range(8) for k in ("attn", "mlp")]
    mods = model.branch_modules()
    assert len(mods) == 16
    for b, lin in enumerate(mods):
        blk = model.blocks[b // 2]
        assert lin is (blk.attn.qkv if b % 2 == 0 else blk.mlp.fc)
        assert tuple(lin.weight.shape) == ((3 * 512, 512) if b % 2 == 0 else (2048, 512))
    # The hidden matrices are exactly the N_trunk of the FLOP accounting; the head is padded, FLOPs count V.
    hidden = sum(blk.attn.qkv.weight.numel() + blk.attn.proj.weight.numel() + blk.mlp.fc.weight.numel()
                 + blk.mlp.proj.weight.numel() for blk in model.blocks)
    assert hidden == flop_budget(mcfg).n_trunk == 25_165_824
    assert tuple(model.head.weight.shape) == (12_352, 512)
    assert flop_budget(mcfg).n_head == 512 * 12_289


def test_branch_names_at_small_width_with_eight_layers():
    model = GPT(small_cfg("model.layers=8", "model.value_embeds=3"))
    assert len(model.branch_names()) == 16 and len(model.branch_modules()) == 16
    assert len(set(map(id, model.branch_modules()))) == 16


def test_value_embedding_tables_map_to_first_and_last_layers():
    model = GPT(small_cfg("model.layers=8", "model.value_embeds=3"))
    assert len(model.value_embeds) == 3
    assert model.value_embed_of_layer == [0, 1, 2, None, None, 0, 1, 2]
    assert [blk.attn.value_mix is not None for blk in model.blocks] == [True] * 3 + [False] * 2 + [True] * 3
    none = GPT(small_cfg("model.value_embeds=0"))
    assert len(none.value_embeds) == 0 and all(blk.attn.value_mix is None for blk in none.blocks)


def test_value_embeddings_feed_exactly_the_mapped_layers():
    """Functional routing: with every layer's mix weight for its table at zero but one, only that table learns."""
    cfg = small_cfg("model.layers=8", "model.value_embeds=3")
    model = randomize(GPT(cfg).double())
    idx, tgt = tokens(cfg, batch=2, seed=6)

    def table_grads(open_layer):
        with torch.no_grad():
            for i, blk in enumerate(model.blocks):
                if blk.attn.value_mix is not None:
                    blk.attn.value_mix[1] = 0.7 if i == open_layer else 0.0
        model.zero_grad(set_to_none=True)
        model(idx, tgt).backward()
        return [t.weight.grad.abs().sum().item() for t in model.value_embeds]

    assert table_grads(None) == [0.0, 0.0, 0.0]
    expected = {0: 0, 1: 1, 2: 2, 5: 0, 6: 1, 7: 2}
    for layer, table in expected.items():
        grads = table_grads(layer)
        assert grads[table] > 0, (layer, grads)
        assert all(v == 0.0 for j, v in enumerate(grads) if j != table), (layer, grads)


def test_trunk_parameters_exclude_only_the_head():
    model = GPT(small_cfg())
    all_names = {n for n, _ in model.named_parameters()}
    trunk = model.trunk_parameters()
    trunk_names = [n for n, _ in trunk]
    assert len(trunk_names) == len(set(trunk_names))
    assert set(trunk_names) == all_names - {"head.weight"}
    assert "head.weight" in all_names
    params = dict(model.named_parameters())
    assert all(p is params[n] for n, p in trunk)


def test_every_parameter_gets_gradient_with_random_weights():
    cfg = small_cfg()
    model = randomize(GPT(cfg).double())
    idx, tgt = tokens(cfg, batch=2, seed=7)
    model(idx, tgt).backward()
    for name, p in model.named_parameters():
        assert p.grad.abs().sum().item() > 0, name


def test_default_init_zeroes_head_and_output_projections():
    model = GPT(small_cfg())
    assert not model.head.weight.any()
    for blk in model.blocks:
        assert not blk.attn.proj.weight.any() and not blk.mlp.proj.weight.any()
        assert blk.attn.qkv.weight.abs().sum() > 0 and blk.mlp.fc.weight.abs().sum() > 0
    assert model.head.weight.shape[0] == 128  # V = 97 padded to a multiple of 64


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-15), (torch.float32, 1e-6)])
def test_zero_head_gives_loss_ln_vocab_at_init(dtype, rel):
    cfg = small_cfg()  # V = 97, head padded to 128: the padding must take no probability
    torch.manual_seed(8)
    model = GPT(cfg).to(dtype)
    idx, tgt = tokens(cfg, batch=2, seed=9)
    loss = model(idx, tgt, loss_chunk=5).item()
    assert loss == pytest.approx(math.log(97), rel=rel)
    assert abs(loss - math.log(128)) > 0.2


# Matrix products and attention: CUDA autocast runs these in bf16, as intended.
_LOW_PRECISION_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}


def _upcast_by_cuda_autocast(fn, *args) -> list[str]:
    """The ops of fn that CUDA autocast would run in float32 although they receive bf16 tensors (read from the
    dispatcher's AutocastCUDA registrations, so it needs no GPU): each one silently doubles what it writes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    found = []
    for node in make_fx(fn)(*args).graph.nodes:
        name = getattr(node.target, "name", lambda: "")()
        if not name or name in _LOW_PRECISION_OPS:
            continue
        if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA"):
            continue
        dtypes = [a.meta["val"].dtype for a in node.args
                  if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        if torch.bfloat16 in dtypes:
            found.append(name)
    return found


@pytest.mark.parametrize("source", ["exact", "learned"])
def test_no_forward_op_is_upcast_by_cuda_autocast(source):
    from creditlab.credit import make_source

    cfg = config.load("tiny", [f"credit.source={source}", "credit.schedule=never"])
    model = GPT(cfg.model).to(torch.bfloat16)
    credit_source = make_source(cfg).to(torch.bfloat16)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16))
    assert _upcast_by_cuda_autocast(lambda i: model.hidden(i, credit=credit_source.step()), idx) == []


def test_the_fused_modules_give_their_op_by_op_forms_gradients_in_float64():
    # the norms keeping their output, QK-norm and rotary in the Q/K/V product's epilogue, the attention gate's thin
    # product and ReLU^2 inside the MLP's products (through the Triton and Gluon operators' CPU paths) compute the
    # functions their op-by-op forms compute: every parameter's float64 gradient equal; and the comparison can fail
    cfg = small_cfg()
    idx, tgt = tokens(cfg, batch=2, seed=4)
    fused = _float64_grads(cfg, idx, tgt)
    plain = _float64_grads(cfg, idx, tgt, op_by_op=True)
    assert fused.keys() == plain.keys()
    for name in plain:
        assert plain[name].abs().max() > 0, name  # every parameter's path is live
        assert torch.allclose(fused[name], plain[name], rtol=1e-12, atol=1e-14), name
    other = _float64_grads(cfg, idx.roll(1, dims=1), tgt, op_by_op=True)
    assert not torch.allclose(other["blocks.0.mlp.fc.weight"], plain["blocks.0.mlp.fc.weight"], rtol=1e-6)


def test_the_model_routes_the_mlps_derivative_product_through_the_gluon_operator():
    # the Gluon operator runs the Hopper kernel where it takes the operands and the Triton operator elsewhere: the
    # model must call it (not the Triton operator directly), or Hopper never runs its kernel
    cfg = small_cfg()
    model = randomize(GPT(cfg))
    idx, tgt = tokens(cfg, batch=2, seed=4)
    with DispatchedOps() as ops:
        model(idx, tgt).backward()
    assert "creditlab.relu2_dgrad_gluon.default" in ops.seen and "creditlab.relu2_linear.default" in ops.seen


def test_the_upcast_scan_flags_square():
    h = torch.randn(4, 8, dtype=torch.bfloat16)
    assert _upcast_by_cuda_autocast(lambda t: torch.relu(t).square(), h) == ["aten::pow.Tensor_Scalar"]
    assert _upcast_by_cuda_autocast(relu_squared, h) == []


@pytest.mark.parametrize("op_by_op", [False, True])
def test_the_model_compiles_to_one_graph(op_by_op):
    # A graph break splits the compiled step and stops fusion across it (a custom `jvp` on the fused MLP's
    # Functions once broke the graph at every MLP: 3,772 kernels per seed update instead of about 3,200).
    import contextlib

    from creditlab.credit.sources import OmitCredit

    cfg = config.load("tiny", ["model.vocab_size=97"])
    model = GPT(cfg.model)
    idx = torch.randint(0, 97, (2, 16))
    with model.op_by_op() if op_by_op else contextlib.nullcontext():
        for credit in (ExactCredit(), OmitCredit()):
            torch._dynamo.reset()
            explained = torch._dynamo.explain(model)(idx, idx, credit=credit)
            assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("op_by_op", [False, True])
def test_the_compiled_model_gives_the_eager_gradients(op_by_op):
    """Every parameter's gradient through the compiler (aot_eager: no C++ toolchain needed) equals the eager
    engine's, in float32, with every weight random: zero-initialized projections give every branch's input a
    zero gradient, which hides a wrong branch backward (torch 2.11 compiled the keep_output norm's backward to
    zeros while its output was a same-dtype .to(); the first two updates of a fresh model trained identically)."""
    import contextlib

    cfg = small_cfg()
    model = randomize(GPT(cfg))
    idx, tgt = tokens(cfg, batch=2, seed=3)
    grads = {}
    with model.op_by_op() if op_by_op else contextlib.nullcontext():
        for compiled in (False, True):
            torch._dynamo.reset()
            forward = torch.compile(model, backend="aot_eager") if compiled else model
            model.zero_grad(set_to_none=True)
            forward(idx, tgt).backward()
            grads[compiled] = {name: p.grad.clone() for name, p in model.named_parameters()}
    for name, eager in grads[False].items():
        assert eager.abs().max() > 0, name  # every parameter's path is live
        torch.testing.assert_close(grads[True][name], eager, rtol=1e-5, atol=1e-6 * eager.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_fused_modules_operators_declare_their_outputs_truthfully():
    # what the compiler is told of each operator (its fake implementation) is what the operator returns
    from creditlab.ops import qk_norm, relu2

    g = torch.Generator().manual_seed(0)
    x, w, w_kn = torch.randn(6, 8, generator=g), torch.randn(10, 8, generator=g), torch.randn(8, 10, generator=g)
    qkv, cos, sin = torch.randn(2, 3, 24, generator=g), torch.randn(5, 2, generator=g), torch.randn(5, 2, generator=g)
    q, k, v, scales = qk_norm.forward_op(qkv, cos, sin, 2)
    post = relu2.relu2_linear(x, w_kn.t())
    cases = [(relu2.relu2_linear, (x, w)), (relu2.relu2_dgrad, (x, w_kn, post)),
             (relu2.relu2_dgrad_gluon, (x, w_kn, post)),
             (qk_norm.forward_op, (qkv, cos, sin, 2)), (qk_norm.backward_op, (q, k, v, q, k, scales, cos, sin))]
    for op, args in cases:
        result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert all(v == "SUCCESS" for v in result.values()), (op, result)


def test_the_fp8_head_trains_the_same_model_through_quantized_products():
    """model.head=fp8 changes only the head's products: the loss to FP8 precision, every parameter's gradient
    near the plain head's and not equal to it; evaluation (loss_sum) is the plain head's."""
    plain_cfg, fp8_cfg = small_cfg(), small_cfg("model.head=fp8")
    plain, fp8 = randomize(GPT(plain_cfg)), randomize(GPT(fp8_cfg))
    idx, tgt = tokens(plain_cfg, batch=2, seed=6)
    losses, grads = [], []
    for model in (plain, fp8):
        loss = model(idx, tgt, loss_chunk=16)
        losses.append(loss.item())
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(model.parameters()))]))
    assert losses[1] == pytest.approx(losses[0], rel=2e-2) and losses[1] != losses[0]
    relative = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
    assert 1e-4 < relative < 0.1, relative
    with torch.no_grad():
        assert fp8.loss_sum(idx, tgt).item() == plain.loss_sum(idx, tgt).item()


def _float64_grads(cfg, idx, tgt, op_by_op: bool = False):
    import contextlib

    model = randomize(GPT(cfg).double())
    with model.op_by_op() if op_by_op else contextlib.nullcontext():
        model(idx, tgt).backward()
    return {name: p.grad for name, p in model.named_parameters()}
