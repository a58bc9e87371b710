"""The PyTorch messages the rules recognise a fault by, where the exception text is the only signal: each is
raised by the pinned torch as the rule expects, so a torch that rewords one fails here, not in a diagnosis."""

from __future__ import annotations

import pytest
import torch

from fp16doctor.diagnosis.rules import DTYPE_MISMATCH
from fp16doctor.diagnosis.rules.constant_out_of_range import OVERFLOW_MESSAGE
from fp16doctor.diagnosis.rules.half_weights import UNSCALE_REFUSAL
from fp16doctor.diagnosis.rules.loss_in_half import BCE_REFUSAL
from fp16doctor.diagnosis.rules.scaler_misuse import CLIP_RAISES, REFUSALS


def message_of(job) -> str:
    with pytest.raises((RuntimeError, AssertionError, ValueError)) as raised:
        job()
    return str(raised.value)


def one_step(model, scaler, optimizer):
    scaler.scale(model(torch.ones(2, 3, dtype=model.weight.dtype)).sum()).backward()


def scaled_setup(dtype=torch.float32):
    model = torch.nn.Linear(3, 1).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, torch.amp.GradScaler("cpu", init_scale=2.0), optimizer


def test_a_scalar_past_fp16s_range_in_a_fill():
    assert OVERFLOW_MESSAGE in message_of(lambda: torch.zeros(2, dtype=torch.float16).fill_(1e10))


def test_half_gradients_refused_by_unscale():
    model, scaler, optimizer = scaled_setup(torch.float16)
    one_step(model, scaler, optimizer)
    assert UNSCALE_REFUSAL in message_of(lambda: scaler.unscale_(optimizer))


def test_a_clip_that_raises_on_a_nonfinite_norm():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    message = message_of(lambda: torch.nn.utils.clip_grad_norm_([p], 1.0, error_if_nonfinite=True))
    assert CLIP_RAISES in message


def test_the_scalers_refusals():
    model, scaler, optimizer = scaled_setup()
    one_step(model, scaler, optimizer)
    scaler.unscale_(optimizer)
    twice = message_of(lambda: scaler.unscale_(optimizer))
    scaler.step(optimizer)
    after_step = message_of(lambda: scaler.unscale_(optimizer))
    scaler.update()
    no_step = message_of(lambda: scaler.update())
    found = {text for text in REFUSALS if any(text in m for m in (twice, after_step, no_step))}
    assert {
        "has already been called on this optimizer since the last update",
        "is being called after step()",
        "No inf checks were recorded prior to update",
    } <= found


@pytest.mark.parametrize(
    "job",
    [
        lambda: torch.ones(2, 3, dtype=torch.float16) @ torch.ones(3, 2),
        lambda: torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float16)),
    ],
    ids=["matmul", "linear"],
)
def test_an_op_given_two_dtypes(job):
    message = message_of(job)
    assert any(part in message for part in DTYPE_MISMATCH), message


def test_bce_refused_under_cuda_autocast_lists_on_cpu():
    """The doctor's CPU emulation of CUDA autocast raises CUDA's own message for binary_cross_entropy."""
    from fp16doctor.precision.session import PrecisionSession

    session = PrecisionSession.for_mode("amp", "cpu")
    p = torch.full((4,), 0.5, requires_grad=True)
    with session(), torch.autocast("cpu", dtype=torch.float16):
        message = message_of(lambda: torch.nn.functional.binary_cross_entropy(p.sigmoid(), torch.ones(4)))
    assert BCE_REFUSAL in message
