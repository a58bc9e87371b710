"""The probe's precision session: entered by the probe itself, scoped, re-entrant, shared across threads."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.utils.clip_grad as clip_grad_module
from torch.amp import autocast_mode

from fp16doctor.config import build_config
from fp16doctor.engine.probe import Workbench
from fp16doctor.precision.autocast_policy import _AUTOCAST_CONSTRUCTOR, _INSTALLATION
from fp16doctor.precision.overrides import _CLIP_PATCH, ClipObserver
from fp16doctor.precision.session import PrecisionSession
from fp16doctor.userfile.spec import load_training_file

ORIGINAL_AUTOCAST_INIT = autocast_mode.autocast.__init__
ORIGINAL_CLIP = clip_grad_module.clip_grad_norm_

SOFTMAX_FILE = """
import torch
from torch import nn

SEEN = []

def model():
    return nn.Linear(4, 3)

def train_step(model, batch, optimizer, scaler, autocast):
    x, y = batch
    with autocast():
        logits = model(x)
        probs = torch.softmax(logits, dim=-1)  # CUDA autocast: fp32; native CPU autocast: fp16
        SEEN.append((logits.dtype, probs.dtype))
        loss = nn.functional.nll_loss(torch.log(probs), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss

def data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
"""


def nothing_patched() -> bool:
    return (
        autocast_mode.autocast.__init__ is ORIGINAL_AUTOCAST_INIT
        and not _AUTOCAST_CONSTRUCTOR.active
        and not _INSTALLATION.active
        and torch.nn.utils.clip_grad_norm_ is ORIGINAL_CLIP
        and clip_grad_module.clip_grad_norm_ is ORIGINAL_CLIP
        and _CLIP_PATCH.patched_modules == 0
    )


@pytest.fixture
def bench(training_file):
    spec = load_training_file(training_file(SOFTMAX_FILE))
    return Workbench(spec, build_config(spec.config, {"device": "cpu", "steps": 3}))


def test_a_bare_step_runs_under_cuda_policy_and_nothing_stays_patched(bench):
    probe = bench.probe("amp", instruments=None)
    assert nothing_patched()  # built inside its session, which it left
    record = probe.step()  # no wrapper: the probe enters its session itself
    assert bench.spec.module.SEEN[-1] == (torch.float16, torch.float32)  # softmax in fp32, as on CUDA
    assert record.trace.clip_calls and record.trace.clip_calls[0]["scaled"]  # the clipping observer was on
    assert nothing_patched()
    with torch.autocast("cpu", dtype=torch.float16):  # outside the probe: CPU autocast as PyTorch ships it
        assert torch.softmax(torch.ones(2, 2).half(), dim=-1).dtype == torch.float16
    probe.close()


def test_the_fp32_guards_are_active_only_while_the_probe_builds_or_steps(bench):
    probe = bench.probe("fp32", instruments=None)
    assert torch.ones(2).half().dtype == torch.float16 and nothing_patched()
    probe.step()
    assert bench.spec.module.SEEN[-1] == (torch.float32, torch.float32)  # the user's autocast disabled in the step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")
    probe.run(steps=2)
    assert nothing_patched()
    probe.close()


def test_the_session_is_reentrant_and_restored_when_an_exception_leaves_it():
    session = PrecisionSession.for_mode("amp", "cpu")
    with pytest.raises(ZeroDivisionError):
        with session():
            with session():
                assert session.active and _INSTALLATION.active and _AUTOCAST_CONSTRUCTOR.active
            assert _INSTALLATION.active  # the inner exit left the outer session whole
            raise ZeroDivisionError("a user's error inside the session")
    assert not session.active and nothing_patched()


def test_two_threads_share_the_patches_and_the_last_one_out_restores_them(bench):
    """A leaves while B is still inside: B keeps its patches; a third thread's autocast is never rewritten."""
    probe = bench.probe("amp", instruments=None)
    sessions = {name: PrecisionSession.for_mode(mode, "cpu") for name, mode in (("a", "fp32"), ("b", "amp"))}
    sessions["b"].observe_clipping(ClipObserver(probe.scaler, probe.optimizer, False), bench.spec.module)
    entered, a_left, b_checked = threading.Barrier(3), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def thread_a() -> None:
        with sessions["a"]():
            entered.wait()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                seen["a_autocast"] = torch.is_autocast_enabled("cpu")  # the FP32 guard disables it
        a_left.set()

    def thread_b() -> None:
        with sessions["b"]():
            entered.wait()
            a_left.wait()
            seen["b_kernels"] = _INSTALLATION.active
            seen["b_clip_patched"] = torch.nn.utils.clip_grad_norm_ is not ORIGINAL_CLIP
            with torch.autocast("cuda"):  # rewritten to CPU fp16 autocast in B's session
                seen["b_cuda_block"] = (
                    torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
                )
            b_checked.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    entered.wait()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # this thread holds no session: nothing rewrites it
        seen["main_autocast"] = torch.is_autocast_enabled("cpu")
    for t in threads:
        t.join(timeout=60)
    assert seen == {
        "a_autocast": False,
        "b_kernels": True,
        "b_clip_patched": True,
        "b_cuda_block": True,
        "main_autocast": True,
    }
    assert b_checked.is_set() and nothing_patched()
    probe.close()


class _GramLoss(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ x.T).mean()


def test_loss_in_fp32_leaves_autocast_on_inside_every_submodule_a_step_calls_directly():
    """A GAN's step calls model.generator and model.discriminator, never model(): with only the root hooked the
    override ran the whole step in fp32 (AMP off, not the loss moved), and its 'repair' proved nothing. Inside any
    module the user's code runs under autocast; outside, the loss runs in fp32; a forward that raises leaves no
    module 'entered'."""
    from fp16doctor.precision.overrides import LossInFp32

    gan = torch.nn.Module()
    gan.generator = torch.nn.Linear(4, 4)
    gan.discriminator = torch.nn.Sequential(torch.nn.Linear(4, 1))
    gan.criterion = _GramLoss()  # a loss kept on the model: no parameters, the loss's side
    gan.scripted = torch.jit.script(torch.nn.Linear(4, 4))  # refuses hooks: attaching must not fail on it
    inner: list[torch.dtype] = []
    gan.discriminator[0].register_forward_hook(lambda module, args, out: inner.append(out.dtype))
    mode = LossInFp32("cpu")
    handles = mode.attach(gan)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), mode:
            fake = gan.generator(torch.randn(2, 4))
            loss_product = torch.mm(fake, torch.ones(4, 4))  # outside every module: the loss's arithmetic
            score = gan.discriminator(fake)
            assert mode.depth == 0
            assert gan.criterion(fake).dtype == torch.float32  # its product ran as the loss's: autocast off
            with pytest.raises(RuntimeError):
                gan.generator(torch.randn(2, 3))  # the user's forward raises (a shape mismatch)
        assert inner == [torch.bfloat16]  # inside a module called directly, autocast ran its product low
        assert fake.dtype == score.dtype == torch.float32  # cast up where they leave the model
        assert loss_product.dtype == torch.float32
        assert mode.depth == 0
    finally:
        for handle in handles:
            handle.remove()
