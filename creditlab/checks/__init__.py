"""Interface checks of the credit path, in float64 on the CPU. Each returns what it measured and a verdict.

* omission: the synthetic backward leaves out exactly the 16 intended input-gradient products (each block's Q/K/V
  projection and MLP expansion), counted by which weights the backward's matrix products read;
* oracle: with the true corrections injected, every trunk parameter's gradient equals native backprop;
* zero: with nothing injected, some gradient differs (so the oracle check can fail);
* mutation: dropping one branch's correction breaks exactly the groups upstream of that branch;
* streaming: the streaming injection of the learned source equals decoding every correction explicitly
  and injecting it (and so does the materialized organization);
* linearity: c(alpha e1 + beta e2) = alpha c(e1) + beta c(e2);
* reverse-causal support: dc_t/de_s is exactly zero for s < t and nonzero somewhere for s >= t;
* fp8: the `fp8` source's corrections within the bound of FP8 rounding of the exact ones, and not equal to them,
  a wrong scale caught (checks/fp8.py);
* dropbp: a dropped branch's parameters get exactly zero gradient, dropping nothing is native, and a pattern gives
  the gradient of the forward whose dropped branch outputs enter as constants (written without the credit hook).

These are interface checks, not learning evidence.
"""

from __future__ import annotations

import contextlib

import copy
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from creditlab.config import CreditConfig, ModelConfig
from creditlab.credit.predictor import LearnedSource, Predictor, StateCredit, TypedSource, decode_all
from creditlab.credit.sources import InjectCredit, OracleSource, RecordCredit, ZeroSource
from creditlab.model import GPT, ExactCredit
from creditlab.checks.fp8 import fp8_check

TOLERANCE = 1e-10


def seed_structure() -> ModelConfig:
    """The seed model's structure at a size the CPU checks in seconds: every parameter kind present."""
    return ModelConfig(layers=8, width=64, heads=4, mlp_hidden=256, seq_len=32, vocab_size=97, value_embeds=3,
                       gate_dim=12)


def randomized_model(cfg: ModelConfig, seed: int) -> GPT:
    """A float64 model with every parameter random: no zero projections, non-trivial scalars and gates."""
    torch.manual_seed(seed)
    return randomize_(GPT(cfg).double())


@torch.no_grad()
def randomize_(model: GPT) -> GPT:
    """Every parameter of `model` random, in place, from torch's generators: embeddings N(0, 1), matrices
    N(0, 1/fan_in), scalars in [0.5, 1.5]."""
    for name, p in model.named_parameters():
        if "embed" in name:
            p.normal_(0.0, 1.0)
        elif p.ndim >= 2:
            p.normal_(0.0, p.shape[-1] ** -0.5)
        else:
            p.uniform_(0.5, 1.5)  # mixes, value lambdas, skip weights: away from 0 and 1
    return model


def _batch(cfg: ModelConfig, seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _trunk_grads(model: GPT, idx, targets, credit) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(idx, targets, credit=credit).backward()
    return {name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for name, p in model.trunk_parameters()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (the difference itself where want is zero)."""
    scale = want.norm().item()
    diff = (got - want).norm().item()
    return diff / scale if scale > 0 else diff


def _rel_errors(got: dict, ref: dict) -> dict[str, float]:
    return {name: relative_error(got[name], r) for name, r in ref.items()}


class _WeightReads(TorchDispatchMode):
    """Records the parameters that matrix products read. In a backward pass a linear map's weight is read only
    by its input-gradient product dY W (its weight gradient dY^T n reads the activations), so the weights read
    are exactly the input-gradient products computed."""

    # relu2_dgrad, relu2_dgrad_gluon: the fused MLP's projection input-gradient product (relu2.py), the Triton and
    # the Gluon operator; thin_linear_backward: the attention gate's input gradient (attention_gate.py)
    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "relu2_dgrad", "relu2_dgrad_gluon",
                "thin_linear_backward")

    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.params, self.read = params, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.PRODUCTS:
            for a in args:
                if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.params:
                    self.read.add(self.params[a.untyped_storage().data_ptr()])
        return func(*args, **(kwargs or {}))


def products_read_in_backward(model: GPT, idx, targets, credit) -> set[str]:
    """The parameters whose input-gradient products the backward under `credit` computes."""
    params = {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets, credit=credit)
    reads = _WeightReads(params)
    with reads:
        loss.backward()
    return reads.read


def intended_omission(model: GPT) -> set[str]:
    """The weights whose input-gradient products the synthetic backward must omit: Q/K/V and MLP expansion."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(lin.weight)] for lin in model.branch_modules()}


def omission_check(cfg: ModelConfig, seed: int, synthetic=None, op_by_op: bool = False) -> dict:
    """Native backprop reads every weight in its backward; the synthetic backward (`zero` unless another context
    factory is given) must read all but the 16 intended ones: no more omitted, no fewer. With `op_by_op`, the
    model's fused modules in their op-by-op forms (GPT.op_by_op)."""
    model = randomized_model(cfg, seed)
    idx, targets = _batch(cfg, seed)
    with model.op_by_op() if op_by_op else contextlib.nullcontext():
        native = products_read_in_backward(model, idx, targets, ExactCredit())
        omitting = products_read_in_backward(model, idx, targets, (synthetic or ZeroSource().step)())
    omitted, expected = native - omitting, intended_omission(model)
    return {"omitted": len(omitted), "expected": len(expected),
            "omitted_but_not_intended": sorted(omitted - expected),
            "intended_but_computed": sorted(expected - omitted),
            "passed": omitted == expected and omitting <= native}


def finite_difference_check(cfg: ModelConfig, seed: int, step: float = 1e-4) -> dict:
    """Native backprop's float64 gradient against the loss itself: for every trunk parameter, the directional
    derivative g . v along a random unit direction v against the central difference (L(p + h v) - L(p - h v)) / 2h
    of the forward pass alone. This reference shares nothing with the backward (no autograd, no custom backward, no
    credit context): a gradient the model stops everywhere alike (a stray detach) passes the oracle's comparisons
    with native, and fails here.

    The tolerance comes from the step: the central difference's error is its truncation, of order h^2, estimated
    from the steps h and h/2 (Richardson: |D(h) - D(h/2)| is 3/4 of D(h)'s), plus the loss's rounding, at most
    about 4 eps |L| / h at the smaller step; a parameter passes where |g . v - D(h/2)| <= 10 x (that estimate +
    the rounding bound) + 1e-12 |g . v|."""
    model = randomized_model(cfg, seed)
    idx, targets = _batch(cfg, seed)
    model.zero_grad(set_to_none=True)
    model(idx, targets).backward()
    g = torch.Generator().manual_seed(seed + 7)
    params = dict(model.trunk_parameters())

    @torch.no_grad()
    def loss_along(p: torch.nn.Parameter, v: torch.Tensor, h: float) -> float:
        p.add_(h * v)
        try:
            return model(idx, targets).item()
        finally:
            p.sub_(h * v)

    eps = torch.finfo(torch.float64).eps
    groups, passed = [], True
    with torch.no_grad():
        base = abs(model(idx, targets).item())
    for name, p in params.items():
        v = torch.randn(p.shape, dtype=p.dtype, generator=g)
        v /= v.norm()
        analytic = float((p.grad * v).sum()) if p.grad is not None else 0.0
        d_h = (loss_along(p, v, step) - loss_along(p, v, -step)) / (2 * step)
        d_half = (loss_along(p, v, step / 2) - loss_along(p, v, -step / 2)) / step
        tolerance = 10 * (abs(d_h - d_half) / 3 + 4 * eps * base / (step / 2)) + 1e-12 * abs(analytic)
        error = abs(analytic - d_half)
        ok = error <= tolerance
        passed &= ok
        groups.append({"name": name, "analytic": analytic, "numeric": d_half, "error": error, "tolerance": tolerance,
                       "passed": ok})
    return {"groups": groups, "passed": passed, "step": step,
            "largest_error_over_tolerance": max(g["error"] / g["tolerance"] for g in groups)}


@dataclass
class CheckResult:
    name: str
    passed: bool
    details: dict = field(default_factory=dict)


def oracle_checks(cfg: ModelConfig, seed: int) -> dict:
    """Oracle equality, zero difference and the mutation check on one randomized model."""
    model = randomized_model(cfg, seed)
    idx, targets = _batch(cfg, seed)
    record = RecordCredit(cfg.branches)
    native = _trunk_grads(model, idx, targets, record)
    oracle = OracleSource()
    oracle.corrections = record.corrections
    injected = _rel_errors(_trunk_grads(model, idx, targets, oracle.step()), native)
    zero = _rel_errors(_trunk_grads(model, idx, targets, ZeroSource().step()), native)

    dropped = cfg.branches // 2 + 1  # a middle MLP branch: attention of its layer and everything below
    mutated = list(record.corrections)
    mutated[dropped] = None
    oracle.corrections = mutated
    mutant = _rel_errors(_trunk_grads(model, idx, targets, oracle.step()), native)
    upstream = upstream_groups(model, idx, dropped)
    broken = {name for name, err in mutant.items() if err > TOLERANCE}
    return {
        "groups": [{"name": n, "rel_err": e} for n, e in injected.items()],
        "max_rel_err": max(injected.values()),
        "zero_max_rel_err": max(zero.values()),
        "mutation": {"dropped_branch": model.branch_names()[dropped], "broken": sorted(broken),
                     "upstream": sorted(upstream),
                     "caught": bool(broken) and broken <= upstream},
    }


def upstream_groups(model: GPT, idx, branch: int) -> set[str]:
    """Trunk parameters the input of `branch` depends on in the forward pass."""
    state = StateCredit()
    out = model.hidden(idx, credit=_KeepGraph(state))
    n = state.branch_inputs[branch]
    probe = torch.randn(n.shape, dtype=n.dtype, generator=torch.Generator().manual_seed(7))
    names = [name for name, _ in model.trunk_parameters()]
    grads = torch.autograd.grad((n * probe).sum(), [p for _, p in model.trunk_parameters()], allow_unused=True)
    del out
    return {name for name, g in zip(names, grads) if g is not None and g.abs().max() > 0}


class _KeepGraph(ExactCredit):
    """Exact, and keeps the branch inputs attached to the graph (to differentiate them)."""

    def __init__(self, state: StateCredit):
        self.state = state

    def branch(self, index, n):
        self.state.branch_inputs.append(n)
        return n


def _learned_setup(cfg: ModelConfig, seed: int, rank: int = 4, source_class=LearnedSource):
    model = randomized_model(cfg, seed)
    source = source_class(cfg, CreditConfig(rank=rank)).double()
    with torch.no_grad():  # non-zero decoders and a non-trivial mean gate, so every path carries signal
        source.predictor.decoders.normal_(0.0, 0.3)
        source.predictor.mean_bias.fill_(0.3)
    return model, source


def streaming_check(cfg: ModelConfig, seed: int, source_class=LearnedSource) -> dict:
    """Streaming adjoint injection == explicit decode + injection == materialized, in float64."""
    model, source = _learned_setup(cfg, seed, source_class=source_class)
    idx, targets = _batch(cfg, seed)
    # The terminal error is a property of the forward pass and the head, the same for every credit path.
    state = StateCredit()
    x_grad = {}

    class Tap(StateCredit):
        def terminal(self, x):
            state.x_terminal = x.detach()
            x.register_hook(lambda g: x_grad.setdefault("e", g.detach()))
            return x

        def branch(self, index, n):
            state.branch_inputs.append(n.detach())
            return n

    _trunk_grads(model, idx, targets, Tap())
    with torch.no_grad():
        explicit = decode_all(source.predictor, x_grad["e"], state.x_terminal, state.branch_inputs)

    def term(b, n):
        return (n * explicit[b]).sum()

    reference = _trunk_grads(model, idx, targets, InjectCredit(term))
    streaming = _rel_errors(_trunk_grads(model, idx, targets, source.step()), reference)
    source.materialized = True
    materialized = _rel_errors(_trunk_grads(model, idx, targets, source.step()), reference)
    zero = _rel_errors(_trunk_grads(model, idx, targets, ZeroSource().step()), reference)
    return {"streaming_max_rel_err": max(streaming.values()),
            "materialized_max_rel_err": max(materialized.values()),
            "zero_max_rel_err": max(zero.values())}


def branch_parameters(model: GPT, branch: int) -> list[str]:
    """The names of the parameters inside branch `branch` (its attention or MLP module)."""
    kind = "attn" if branch % 2 == 0 else "mlp"
    return [name for name, _ in model.named_parameters() if name.startswith(f"blocks.{branch // 2}.{kind}.")]


def _branch_module(model: GPT, branch: int) -> torch.nn.Module:
    block = model.blocks[branch // 2]
    return block.attn if branch % 2 == 0 else block.mlp


def constant_branches_reference(model: GPT, idx, targets, dropped: list[bool]) -> dict[str, torch.Tensor]:
    """Native's trunk gradients of the forward in which each dropped branch's output is a constant: its value from
    a separate forward pass under no_grad, put in place of the branch module's output by a forward hook. No credit
    context takes part (the model runs native), so this route shares nothing with the `output` hook."""
    branches = [b for b, drop in enumerate(dropped) if drop]
    constants = {}
    handles = [_branch_module(model, b).register_forward_hook(
        lambda module, args, y, b=b: constants.__setitem__(b, y.detach().clone())) for b in branches]
    try:
        with torch.no_grad():
            model(idx, targets)
    finally:
        for h in handles:
            h.remove()
    handles = [_branch_module(model, b).register_forward_hook(lambda module, args, y, b=b: constants[b])
               for b in branches]
    try:
        return _trunk_grads(model, idx, targets, ExactCredit())
    finally:
        for h in handles:
            h.remove()


def dropbp_check(cfg: ModelConfig, seed: int, dropped: list[bool] | None = None, context=None) -> dict:
    """The dropbp step (`context(dropped)`, default DropBPSource's) in float64 against three references: (a) every
    parameter of a dropped branch gets exactly zero gradient; (b) with no branch dropped the gradients equal
    native's; (c) with the pattern `dropped` (default: every third branch from the second, both kinds) they equal
    `constant_branches_reference`. The kept branches' gradients are not native's (a dropped branch changes the
    gradient reaching everything below it), which `differs_from_native` (over the parameters outside the dropped
    branches) confirms, so (c) is not (b) again."""
    from creditlab.credit.dropbp import DropBPSource

    if context is None:
        context = DropBPSource(cfg.branches, rate=0.0, seed=seed).dropping
    dropped = [b % 3 == 1 for b in range(cfg.branches)] if dropped is None else list(dropped)
    model = randomized_model(cfg, seed)
    idx, targets = _batch(cfg, seed)
    native = _trunk_grads(model, idx, targets, ExactCredit())
    none_dropped = _rel_errors(_trunk_grads(model, idx, targets, context([False] * cfg.branches)), native)
    model.zero_grad(set_to_none=True)
    model(idx, targets, credit=context(dropped)).backward()
    got = {name: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for name, p in model.trunk_parameters()}
    params = dict(model.named_parameters())
    in_dropped = [name for b, drop in enumerate(dropped) if drop for name in branch_parameters(model, b)]
    nonzero = sorted(name for name in in_dropped if params[name].grad is not None and params[name].grad.any())
    reference = _rel_errors(got, constant_branches_reference(model, idx, targets, dropped))
    result = {"dropped": [name for b, name in enumerate(model.branch_names()) if dropped[b]],
              "dropped_parameters": len(in_dropped), "dropped_with_gradient": nonzero,
              "none_dropped_max_rel_err": max(none_dropped.values()),
              "reference_max_rel_err": max(reference.values()),
              "differs_from_native": max(err for name, err in _rel_errors(got, native).items()
                                         if name not in in_dropped)}
    result["passed"] = bool(in_dropped and not nonzero and result["none_dropped_max_rel_err"] <= TOLERANCE
                            and result["reference_max_rel_err"] <= TOLERANCE and result["differs_from_native"] > 1e-6)
    return result


def _random_states(cfg: ModelConfig, predictor: Predictor, seed: int, batch: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, cfg.width, dtype=torch.float64, generator=g)
    ns = [torch.randn(batch, seq, cfg.width, dtype=torch.float64, generator=g) for _ in range(cfg.branches)]
    return g, x, ns


def linearity_check(predictor: Predictor, cfg: ModelConfig, seed: int) -> dict:
    g, x, ns = _random_states(cfg, predictor, seed)
    e1, e2 = (torch.randn(x.shape, dtype=torch.float64, generator=g) for _ in range(2))
    alpha, beta = (torch.randn((), dtype=torch.float64, generator=g).item() for _ in range(2))
    with torch.no_grad():
        combined = decode_all(predictor, alpha * e1 + beta * e2, x, ns)
        c1, c2 = decode_all(predictor, e1, x, ns), decode_all(predictor, e2, x, ns)
    errs = [((c - (alpha * a + beta * b)).norm() / c.norm().clamp_min(1e-300)).item()
            for c, a, b in zip(combined, c1, c2)]
    return {"max_rel_err": max(errs), "passed": max(errs) <= TOLERANCE}


def reverse_causal_check(predictor: Predictor, cfg: ModelConfig, seed: int) -> dict:
    """Impulses of terminal error at each position s; the correction at t must vanish exactly for t > s."""
    g, x, ns = _random_states(cfg, predictor, seed, batch=1)
    seq = x.shape[1]
    leaks, support = 0, 0
    with torch.no_grad():
        for s in range(seq):
            e = torch.zeros_like(x)
            e[:, s] = torch.randn(cfg.width, dtype=torch.float64, generator=g)
            for c in decode_all(predictor, e, x, ns):
                per_t = c.abs().amax(dim=(0, 2))  # (T,)
                leaks += int((per_t[s + 1:] != 0).sum())  # dc_t/de_s for s < t
                support += int((per_t[: s + 1] != 0).sum())
    return {"nonzero_before": leaks, "nonzero_at_or_after": support, "passed": leaks == 0 and support > 0}


def randomized_predictor(cfg: ModelConfig, seed: int, rank: int = 4, cls=Predictor) -> Predictor:
    torch.manual_seed(seed)
    predictor = cls(cfg, rank).double()
    with torch.no_grad():
        predictor.decoders.normal_(0.0, 0.3)
        predictor.mean_bias.fill_(0.3)
    return predictor


def fp8_band_check(cfg: ModelConfig, seed: int) -> dict:
    """The `fp8` source's corrections within FP8's rounding bound of the exact ones (checks/fp8.py)."""
    model = randomized_model(cfg, seed)
    idx, targets = _batch(cfg, seed)
    return fp8_check(model, idx, targets, _trunk_grads(model, idx, targets, ExactCredit()), cfg.branches)


def run_all(configs: dict[str, ModelConfig], seeds: list[int]) -> dict:
    """Every check on every config and seed; JSON-ready, with an overall verdict."""
    groups, zero_differs, mutation_caught, runs = [], True, True, []
    streaming_ok, linear, causal, omissions, dropbp = True, [], [], [], []
    for label, cfg in configs.items():
        for seed in seeds:
            r = oracle_checks(cfg, seed)
            omissions.append(omission_check(cfg, seed))
            runs.append({"config": label, "seed": seed, "max_rel_err": r["max_rel_err"],
                         "zero_max_rel_err": r["zero_max_rel_err"], "mutation": r["mutation"],
                         "omission": omissions[-1]})
            groups += [{"name": f"{label}/seed{seed}/{gr['name']}", "rel_err": gr["rel_err"]} for gr in r["groups"]]
            zero_differs &= r["zero_max_rel_err"] > 1e-6
            dropbp.append(dropbp_check(cfg, seed))
            runs[-1]["dropbp"] = dropbp[-1]
            mutation_caught &= r["mutation"]["caught"]
            for source_class in (LearnedSource, TypedSource):  # the seed's code layout and the typed one
                s = streaming_check(cfg, seed, source_class)
                runs[-1]["streaming" if source_class is LearnedSource else f"streaming_{source_class.name}"] = s
                streaming_ok &= s["streaming_max_rel_err"] <= TOLERANCE and \
                    s["materialized_max_rel_err"] <= TOLERANCE and s["zero_max_rel_err"] > 1e-6
                predictor = randomized_predictor(cfg, seed, cls=source_class.predictor_class)
                linear.append(linearity_check(predictor, cfg, seed))
                causal.append(reverse_causal_check(predictor, cfg, seed))
    # the reference that shares no code with the backward, on the seed model's structure at the first seed
    label, cfg = next(((label, cfg) for label, cfg in configs.items() if label == "seed-structure"),
                      next(iter(configs.items())))
    finite = finite_difference_check(cfg, seeds[0]) | {"config": label, "seed": seeds[0]}
    fp8 = fp8_band_check(cfg, seeds[0]) | {"config": label, "seed": seeds[0]}
    max_err = max(g["rel_err"] for g in groups)
    result = {
        "oracle": {"groups": groups, "max_rel_err": max_err, "passed": max_err <= TOLERANCE,
                   "groups_per_model": {label: len(list(GPT.trunk_parameters(_meta(cfg)))) for label, cfg in configs.items()}},
        "omission": {"omitted": [o["omitted"] for o in omissions], "expected": [o["expected"] for o in omissions],
                     "passed": all(o["passed"] for o in omissions)},
        "zero_differs": zero_differs,
        "mutation_caught": mutation_caught,
        "streaming": {"passed": streaming_ok},
        "linearity": {"max_rel_err": max(r["max_rel_err"] for r in linear), "passed": all(r["passed"] for r in linear)},
        "reverse_causal": {"nonzero_before": sum(r["nonzero_before"] for r in causal),
                           "passed": all(r["passed"] for r in causal)},
        "finite_differences": finite,
        "fp8": fp8,
        "dropbp": {"reference_max_rel_err": max(d["reference_max_rel_err"] for d in dropbp),
                   "none_dropped_max_rel_err": max(d["none_dropped_max_rel_err"] for d in dropbp),
                   "dropped_with_gradient": sum(len(d["dropped_with_gradient"]) for d in dropbp),
                   "passed": all(d["passed"] for d in dropbp)},
        "runs": runs,
    }
    result["passed"] = bool(result["oracle"]["passed"] and result["omission"]["passed"] and zero_differs and mutation_caught and streaming_ok
                            and result["linearity"]["passed"] and result["reverse_causal"]["passed"]
                            and finite["passed"] and fp8["passed"]
                            and result["dropbp"]["passed"])
    return result


def _meta(cfg: ModelConfig) -> GPT:
    with torch.device("meta"):
        return GPT(copy.deepcopy(cfg))
