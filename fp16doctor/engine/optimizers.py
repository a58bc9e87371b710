"""Every optimizer a probe's training steps: the file's own, and those the training creates by itself.

A training file gives its optimizers with ``optimizer(params)`` (one) or ``optimizers(model)`` (a tuple,
list or dict of them, a GAN's generator and discriminator, say). A training may also build one on its
own, inside ``train_step`` on first use or on the model as a Lightning-style ``configure_optimizers()``
does: PyTorch's global optimizer step hook sees it step, and it joins the probe's optimizers (snapshotted,
restored and counted like the others). An optimizer whose parameters are not this probe's model's (one
kept from an earlier probe in a module-level global) would silently train a model that is gone: it is
refused as bad input, never stepped.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import TrainingFileError

FOREIGN_HINT = (
    "Create the optimizer from the model each probe builds: define optimizer(params) or optimizers(model), "
    "or keep an optimizer made inside train_step on the model (`model._opt = ...`), not in a module-level global."
)


def named_optimizers(value: Any, source: str) -> dict[str, torch.optim.Optimizer]:
    """The optimizers in what ``source`` returned (one, or a tuple/list/dict of them), by name.

    Names: ``optimizer`` for a single one, the index for a tuple or list (``optimizers[1]``), the key for a dict.
    """
    if isinstance(value, torch.optim.Optimizer):
        return {"optimizer": value}
    if isinstance(value, Mapping):
        items = [(str(key), item) for key, item in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"optimizers[{index}]", item) for index, item in enumerate(value)]
    else:
        raise TrainingFileError(
            f"{source} returned {type(value).__name__}, not a torch.optim.Optimizer "
            "(nor a tuple, list or dict of them)."
        )
    wrong = [f"{name} ({type(item).__name__})" for name, item in items if not isinstance(item, torch.optim.Optimizer)]
    if not items or wrong:
        raise TrainingFileError(
            f"{source} returned " + (f"non-optimizers: {', '.join(wrong)}." if wrong else "no optimizer."),
            hint="Return torch.optim.Optimizer objects: one, or a tuple, list or dict of them.",
        )
    return dict(items)


def flat_schedulers(value: Any) -> list[Any]:
    """The schedulers in what ``scheduler(optimizer)`` returned: one, or a tuple/list/dict matching the optimizers."""
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [item for item in value.values() if item is not None]
    if isinstance(value, (tuple, list)):
        return [item for item in value if item is not None]
    return [value]


class ProbeOptimizers:
    """The optimizers of one probe, by name; optimizers the training creates itself are found while it steps.

    ``on_found`` is told of each optimizer found (to watch and instrument it like the others); ``user_file``
    is the training file, whose line a refused optimizer's message names.
    """

    def __init__(
        self,
        optimizers: dict[str, torch.optim.Optimizer],
        model: torch.nn.Module,
        on_found: Callable[[str, torch.optim.Optimizer], None] | None = None,
        user_file: Path | None = None,
    ):
        self.by_name = dict(optimizers)
        self.model = model
        self.on_found = on_found
        self.user_file = user_file
        self.initial_states: dict[str, dict[str, Any]] = {}
        """The state of each optimizer found during a step, as it was found (a restore before it existed resets it)."""
        self._hook: Any = None

    @property
    def primary(self) -> torch.optim.Optimizer:
        """The first optimizer: its learning rate is the one a probe record shows."""
        return next(iter(self.by_name.values()))

    def all(self) -> list[torch.optim.Optimizer]:
        return list(self.by_name.values())

    def name_of(self, optimizer: torch.optim.Optimizer) -> str | None:
        return next((name for name, opt in self.by_name.items() if opt is optimizer), None)

    # --- finding the optimizers a training creates itself -------------------------------------------
    def __enter__(self) -> ProbeOptimizers:
        """For one step, see every optimizer step in the process (PyTorch's global step hook): entered only
        around the probe's own step, so other probes' optimizers are never mistaken for this one's."""
        self._hook = register_optimizer_step_pre_hook(self._any_step)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _any_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.name_of(optimizer) is not None:
            return
        ours = {id(p) for p in self.model.parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        foreign = [p for p in params if id(p) not in ours]
        if foreign or not params:
            raise TrainingFileError(
                f"the training steps a {type(optimizer).__name__} whose parameters are not this probe's model's "
                f"({len(foreign)} of its {len(params)} parameter tensors belong to no module of the model() it was "
                "given): an optimizer kept from an earlier call (a module-level global?) would train a model that is "
                "gone, so the doctor refuses to step it.",
                hint=FOREIGN_HINT,
                location=self._user_line(),
            )
        name = f"found: {type(optimizer).__name__}" + (
            f" #{len(self.initial_states) + 1}" if self.initial_states else ""
        )
        self.by_name[name] = optimizer
        self.initial_states[name] = copy.deepcopy(optimizer.state_dict())
        if self.on_found is not None:
            self.on_found(name, optimizer)

    def _user_line(self) -> str | None:
        """``file:line`` of the deepest frame of the training file on the stack (where the optimizer stepped)."""
        if self.user_file is None:
            return None
        target = str(Path(self.user_file).resolve())
        frames = [f for f in traceback.extract_stack() if str(Path(f.filename).resolve()) == target]
        return f"{self.user_file}:{frames[-1].lineno}" if frames else None

    # --- snapshot / restore ---------------------------------------------------------------------
    def state(self, copy_state: bool = True) -> dict[str, dict[str, Any]]:
        """Every optimizer's state dict, by name; ``copy_state=False``: the live tensors, to be saved at once."""
        return {
            name: copy.deepcopy(opt.state_dict()) if copy_state else opt.state_dict()
            for name, opt in self.by_name.items()
        }

    def load(self, states: dict[str, dict[str, Any]], owned: bool = False) -> None:
        """Every optimizer back to ``states``; one found after they were taken goes back to how it was found.
        ``owned``: the states are the caller's to give away (loaded from disk): used as they are, not copied."""
        for name, opt in self.by_name.items():
            state = states.get(name, self.initial_states.get(name))
            if state is not None:
                opt.load_state_dict(state if owned and name in states else copy.deepcopy(state))
