"""The CPU AMP probe follows CUDA's autocast op lists, op by op."""

import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from fp16doctor.precision.autocast_policy import (
    CUDA_FP32,
    CUDA_LOWER,
    CUDA_PROMOTE,
    cuda_policy,
    cuda_policy_on_cpu,
    overridden_ops,
)

LOW = [torch.float16, torch.bfloat16]


def h(*shape):
    return torch.randn(*shape).half()


def f(*shape):
    return torch.randn(*shape)


# (name, callable producing the op's output under autocast, expected dtype: "low" | "fp32")
CASES = [
    ("linear", lambda: F.linear(f(4, 8), f(3, 8), f(3)), "low"),
    ("matmul", lambda: f(4, 8) @ f(8, 2), "low"),
    ("mm", lambda: torch.mm(f(4, 8), f(8, 2)), "low"),
    ("bmm", lambda: torch.bmm(f(2, 4, 8), f(2, 8, 3)), "low"),
    ("baddbmm", lambda: torch.baddbmm(f(2, 4, 3), f(2, 4, 8), f(2, 8, 3)), "low"),
    ("addmm", lambda: torch.addmm(f(4, 2), f(4, 8), f(8, 2)), "low"),
    ("conv1d", lambda: F.conv1d(f(1, 2, 8), f(3, 2, 3)), "low"),
    ("conv2d", lambda: F.conv2d(f(1, 2, 8, 8), f(3, 2, 3, 3)), "low"),
    ("einsum", lambda: torch.einsum("ij,jk->ik", f(3, 4), f(4, 5)), "low"),
    ("sdpa", lambda: F.scaled_dot_product_attention(f(1, 2, 4, 8), f(1, 2, 4, 8), f(1, 2, 4, 8)), "low"),
    ("softmax", lambda: torch.softmax(h(4, 8), -1), "fp32"),
    ("log_softmax", lambda: F.log_softmax(h(4, 8), -1), "fp32"),
    ("layer_norm", lambda: F.layer_norm(h(4, 8), (8,)), "fp32"),
    ("group_norm", lambda: F.group_norm(h(2, 4, 3), 2), "fp32"),
    ("exp", lambda: torch.exp(h(4)), "fp32"),
    ("log", lambda: torch.log(h(4).abs()), "fp32"),
    ("sum", lambda: h(4, 4).sum(), "fp32"),
    ("pow", lambda: h(4).pow(2), "fp32"),
    ("rsqrt", lambda: torch.rsqrt(h(4).abs()), "fp32"),
    ("cumsum", lambda: torch.cumsum(h(4), 0), "fp32"),
    ("norm", lambda: h(4).norm(), "fp32"),
    ("softplus", lambda: F.softplus(h(4)), "fp32"),
    ("mse_loss", lambda: F.mse_loss(h(4), h(4)), "fp32"),
    ("cross_entropy", lambda: F.cross_entropy(h(4, 5), torch.zeros(4, dtype=torch.long)), "fp32"),
    ("bce_with_logits", lambda: F.binary_cross_entropy_with_logits(h(4), torch.rand(4).half()), "fp32"),
    ("cosine_similarity", lambda: F.cosine_similarity(h(2, 4), h(2, 4)), "fp32"),
]


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,fn,expected", CASES, ids=[c[0] for c in CASES])
def test_op_runs_in_the_cuda_policy_dtype(name, fn, expected, dtype):
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=dtype):
        out = fn()
    want = dtype if expected == "low" else torch.float32
    assert out.dtype == want, f"{name}: {out.dtype} under CPU autocast, CUDA gives {want}"


def test_plain_cpu_autocast_differs_which_is_why_the_policy_exists():
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(h(4, 8), -1).dtype == torch.float16  # CPU list: stays fp16
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(h(4, 8), -1).dtype == torch.float32


def test_elementwise_ops_outside_the_lists_keep_their_input_dtype():
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.relu(h(4)).dtype == torch.float16
        assert F.gelu(h(4)).dtype == torch.float16
        assert (h(4) + h(4)).dtype == torch.float16
        assert torch.cat([h(2), f(2)]).dtype == torch.float32  # ordinary type promotion, as on CUDA


def test_promote_ops_take_the_widest_input():
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.addcmul(f(4), h(4), h(4)).dtype == torch.float32
        assert torch.addcmul(h(4), h(4), h(4)).dtype == torch.float16


def test_composite_ops_reach_the_policy_inside():
    """cross_entropy is not on CUDA's list itself; its log_softmax is, and must run in fp32."""
    logits = torch.full((2, 3), 20.0).half()
    logits[:, 0] = -20
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        out = F.cross_entropy(logits, torch.zeros(2, dtype=torch.long))
        mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        x = f(2, 5, 8)
        attn, _ = mha(x, x, x)
    assert torch.isfinite(out) and out.dtype == torch.float32
    assert attn.dtype == torch.float16  # its projections are linear: low precision


def test_binary_cross_entropy_is_banned_as_on_cuda():
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(f(4)), torch.rand(4))


def test_emulated_gemm_matches_native_fp16_within_rounding():
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(256, 32)
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        emulated = a @ b
    exact = a.half().double() @ b.half().double()
    native = (a.half() @ b.half()).double()
    # emulation: fp32 accumulation then one rounding -> within one fp16 rounding of the exact
    # product, plus the fp32 summation error bound (n * 2^-24 * sum |a||b|)
    magnitude = a.half().double().abs() @ b.half().double().abs()
    ulp = torch.finfo(torch.float16).eps * exact.abs() + 256 * 2**-24 * magnitude + 2**-24
    assert ((emulated.double() - exact).abs() <= ulp).all()
    assert ((emulated.double() - native).abs() <= 2 * ulp).all()


def test_emulated_gemm_overflows_like_fp16():
    a = torch.full((2, 256), 16.0)
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        out = a @ a.t()  # 256 * 16 * 16 = 65536 > 65504
    assert torch.isinf(out).all()


def test_backward_sees_low_precision_between_layers():
    seen = []
    lin = torch.nn.Linear(8, 8)
    lin.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].dtype))
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        y = lin(torch.randn(4, 8, requires_grad=True))
    y.float().sum().backward()
    assert seen == [torch.float16]
    assert lin.weight.grad.dtype == torch.float32  # master weights stay fp32


def test_the_policy_is_removed_on_exit():
    with cuda_policy_on_cpu():
        pass
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.softmax(h(4, 8), -1).dtype == torch.float16


def test_every_cuda_autocast_registration_has_a_policy():
    """A new torch version that adds ops to CUDA autocast shows up here instead of silently passing through."""
    cuda = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    unclassified = sorted(name for name in cuda if cuda_policy(name) == "passthrough")
    assert unclassified == []
    assert {"softmax", "layer_norm", "exp", "sum", "pow"} <= CUDA_FP32
    assert {"linear", "matmul", "conv2d"} <= CUDA_LOWER and "addcmul" in CUDA_PROMOTE
    overridden = overridden_ops()
    assert overridden["aten::softmax.int"] == "fp32" and overridden["aten::linear"] == "lower"
    cpu_only = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")) - cuda
    assert any(
        overridden[name] == "passthrough" for name in cpu_only if name in overridden
    )  # CPU-only ops fall through


def test_a_users_cuda_autocast_block_acts_on_cpu_autocast_in_a_probe():
    """GPU code's `autocast("cuda", enabled=False)` keeps its block in fp32 on CPU too; outside the probe's
    context CUDA autocast on a CPU tensor changes nothing (the block would run in fp16)."""
    from fp16doctor.precision.autocast_policy import cuda_autocast_on_cpu

    a, b = torch.randn(4, 4), torch.randn(4, 4)

    def block_dtype() -> torch.dtype:
        with torch.autocast("cpu", dtype=torch.float16):
            with torch.autocast("cuda", enabled=False):
                return (a @ b).dtype

    with cuda_policy_on_cpu(), cuda_autocast_on_cpu():
        assert block_dtype() == torch.float32
        with torch.autocast("cuda"):  # CUDA's default autocast dtype is fp16
            assert (a @ b).dtype == torch.float16
    with cuda_policy_on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": torch disables the CUDA autocast
        assert block_dtype() == torch.float16


def _emulated_step(model, x, outer_hooks=False):
    """Forward under the emulated policy (optionally inside a user's own saved-tensor hooks), backward; the
    gradients."""
    hooks = (
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if outer_hooks else contextlib.nullcontext()
    )
    model.zero_grad(set_to_none=True)
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16), hooks:
        out = model(x)
    out.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _saved_bytes(run):
    from fp16doctor.engine.microbatch import saved_activation_bytes

    return saved_activation_bytes(run, exclude=set())


def test_emulated_products_keep_their_inputs_in_half_precision_for_the_backward():
    """The emulation computes on fp32 copies of the rounded inputs; autograd must not keep those copies (twice
    the activation memory of the GPU training), but the half-precision values, widened again in backward."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(512, 64)

    def forward():
        with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
            return model(x)

    half_inputs = 2 * (512 * 64 + 256 * 64 + 512 * 256 + 256 * 64)  # the products' inputs, in fp16
    assert _saved_bytes(forward) <= half_inputs + 512 * 256 * 2  # + the ReLU's own fp16 output
    out = forward()  # and nothing else holds the fp32 copies while the graph stands
    gc.collect()
    own = {id(x), *(id(p) for p in model.parameters())}
    fp32_alive = [
        o
        for o in gc.get_objects()
        if isinstance(o, torch.Tensor) and id(o) not in own and o.dtype == torch.float32 and o.numel() >= 256 * 64
    ]
    assert out.requires_grad and not fp32_alive


def test_the_backward_on_widened_inputs_is_bit_identical():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16, requires_grad=True)
    packed = _emulated_step(model, x)
    unpacked = _emulated_step(model, x, outer_hooks=True)  # a user's own hooks: the fp32 copies are saved as before
    assert all(torch.equal(a, b) for a, b in zip(packed, unpacked))


def test_an_inplace_change_of_a_kept_half_input_is_refused_as_autograd_would():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with cuda_policy_on_cpu(), torch.autocast("cpu", dtype=torch.float16):
        h = x.half() * 1  # a half activation the product saves as it is
        out = lin(h)
        h.mul_(2)  # changed after the product: its backward would read other values
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()


def test_activation_checkpointing_keeps_its_own_hooks():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    plain = _emulated_step(model, x)
    model.zero_grad(set_to_none=True)
    with cuda_policy_on_cpu():  # held through the backward, as a probe's step holds it: the recompute meets it too
        with torch.autocast("cpu", dtype=torch.float16):
            out = checkpoint(model, x, use_reentrant=False)
        out.float().square().mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
