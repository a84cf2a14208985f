"""A loaded checkpoint checked, entry by entry, against the state of the run that would continue it, before any
of it is used.

`ffkv.models.safe_load.load_checkpoint` makes a checkpoint safe to open (nothing of it runs); this makes what
it holds safe to use. A crafted or damaged checkpoint can hold an optimizer moment of another shape (a fused
optimizer kernel then writes out of bounds), NaN weights (every step then trains on them), a tensor whose
strides view one element as many, or a count that is a string. `mismatch(saved, expected)` compares the loaded
payload with a template built from the fresh state of the resuming run:

- a tensor: a dense, contiguous tensor of the template's shape, dtype and device that asks for no gradient,
  finite where it is floating point;
- a dict: the same keys (an `Omittable` entry may be absent), each entry compared; a list or tuple: the same
  length, each item compared;
- a `Rule`: a value the rule accepts (`count`, `number`, `text`, `rows`, `either`, `tensor`);
- any other value: one of the same type, equal to it.

The answer is the first difference, worded for a message (``optimizers[3].state[2].exp_avg has shape (3,),
not (256, 256)``), or None; `check` refuses a checkpoint with it in one line. `adam_state` is the template of
an Adam optimizer's state.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ffkv.errors import FfkvError


@dataclass(frozen=True)
class Rule:
    """A template entry for a value that is not fixed: `check(value, where)` says what is wrong with one, naming
    the entry `where` (None: nothing)."""

    check: Callable[[Any, str], str | None]


@dataclass(frozen=True)
class Omittable:
    """A dict entry of the template that may be absent (one that older checkpoints lack); present, it is compared."""

    template: Any


def mismatch(saved: Any, expected: Any, where: str = "") -> str | None:
    """The first way `saved` differs from the template `expected` (module docstring), in words that name the
    entry (`where` and the keys below it), or None when it matches."""
    if isinstance(expected, Rule):
        return expected.check(saved, where)
    if isinstance(expected, torch.Tensor):
        return _tensor_mismatch(saved, expected, where)
    if isinstance(expected, dict):
        if not isinstance(saved, dict):
            return f"{_name(where)} is {_shown(saved)}, not a dict"
        missing = [key for key, value in expected.items() if key not in saved and not isinstance(value, Omittable)]
        if missing:
            return f"{_name(where)} lacks {', '.join(map(repr, missing[:5]))}"
        extra = [key for key in saved if key not in expected]
        if extra:
            return f"{_name(where)} holds unexpected {', '.join(repr(key)[:40] for key in extra[:5])}"
        for key, template in expected.items():
            if key in saved:
                inner = template.template if isinstance(template, Omittable) else template
                problem = mismatch(saved[key], inner, _join(where, key))
                if problem is not None:
                    return problem
        return None
    if isinstance(expected, (list, tuple)):
        if type(saved) is not type(expected) or len(saved) != len(expected):
            return f"{_name(where)} is {_shown(saved)}, not a {type(expected).__name__} of {len(expected)}"
        for i, (item, template) in enumerate(zip(saved, expected)):
            problem = mismatch(item, template, f"{where}[{i}]")
            if problem is not None:
                return problem
        return None
    if type(saved) is not type(expected) or saved != expected:
        return f"{_name(where)} is {_shown(saved)}, not {_shown(expected)}"
    return None


def _tensor_mismatch(saved: Any, expected: torch.Tensor, where: str, finite: bool = True,
                     device: torch.device | str | None = None) -> str | None:
    name = _name(where)
    if not isinstance(saved, torch.Tensor):
        return f"{name} is {_shown(saved)}, not a tensor"
    if saved.layout != torch.strided or saved.is_quantized or saved.is_nested:
        return f"{name} is a {saved.layout} tensor, not a dense one"
    if tuple(saved.shape) != tuple(expected.shape):
        return f"{name} has shape {tuple(saved.shape)}, not {tuple(expected.shape)}"
    if saved.dtype != expected.dtype:
        return f"{name} is {saved.dtype}, not {expected.dtype}"
    on = expected.device if device is None else torch.device(device)
    if saved.device.type != on.type or (None not in (saved.device.index, on.index) and saved.device != on):
        return f"{name} is on {saved.device}, not {on}"  # ("cuda" is the current GPU, whichever its number)
    if not saved.is_contiguous():  # strides that may view fewer elements than the shape holds
        return f"{name} has strides {saved.stride()}, not those of a contiguous tensor"
    if saved.requires_grad:
        return f"{name} asks for a gradient"
    if saved.is_floating_point() and finite and not bool(torch.isfinite(saved).all()):
        return f"{name} holds {int((~torch.isfinite(saved)).sum())} NaN or infinite value(s)"
    return None


def count(maximum: int = sys.maxsize) -> Rule:
    """A whole number from 0 to `maximum` (at most 2⁶³ − 1, what Python's slices and torch's integers take), as
    Python's int: not a bool, a float or a string."""
    def check(v: Any, where: str) -> str | None:
        if type(v) is not int or v < 0:
            return f"{_name(where)} is {_shown(v)}, not a count (a whole number of 0 or more)"
        if v > maximum:
            return f"{_name(where)} is {v}, more than {maximum}"
        return None
    return Rule(check)


def text() -> Rule:
    """A str of at most 200 characters."""
    return Rule(lambda v, where: None if type(v) is str and len(v) <= 200 else f"{_name(where)} is {_shown(v)}, "
                "not a short text")


def number(minimum: float | None = None, finite: bool = True) -> Rule:
    """An int or a float (not a bool), finite unless `finite` is False, and at least `minimum` when it is set."""
    def check(v: Any, where: str) -> str | None:
        if type(v) not in (int, float):
            return f"{_name(where)} is {_shown(v)}, not a number"
        if finite and not math.isfinite(v):
            return f"{_name(where)} is {v}, not a finite number"
        if minimum is not None and v < minimum:
            return f"{_name(where)} is {v}, below {minimum}"
        return None
    return Rule(check)


def rows(width: int, item: Any, first: Any = None) -> Rule:
    """A list of lists of `width` items each, every item matching the template `item` (the first of each row
    `first`, when it is given)."""
    def check(v: Any, where: str) -> str | None:
        if type(v) is not list:
            return f"{_name(where)} is {_shown(v)}, not a list of rows"
        for i, row in enumerate(v):
            if type(row) is not list or len(row) != width:
                return f"{where}[{i}] is {_shown(row)}, not a list of {width}"
            for j, x in enumerate(row):
                problem = mismatch(x, first if j == 0 and first is not None else item, f"{where}[{i}][{j}]")
                if problem is not None:
                    return problem
        return None
    return Rule(check)


def either(*templates: Any) -> Rule:
    """A value that matches one of the templates (told otherwise by its difference from the last)."""
    def check(v: Any, where: str) -> str | None:
        problems = [mismatch(v, template, where) for template in templates]
        return None if any(problem is None for problem in problems) else problems[-1]
    return Rule(check)


def tensor(like: torch.Tensor, minimum: float | None = None, whole: bool = False, finite: bool = True,
           device: torch.device | str | None = None) -> Rule:
    """A tensor as the template `like` is checked (module docstring), but for NaN and infinities where `finite`
    is False (an index's scores, -inf in its empty slots), and on `device` when it is given (`like` may then be
    on the meta device, a shape and a dtype without memory); its values also at least `minimum` when it is set,
    and whole numbers when `whole` (an optimizer's step count)."""
    def check(v: Any, where: str) -> str | None:
        problem = _tensor_mismatch(v, like, where, finite, device)
        if problem is not None or v.numel() == 0 or v.dtype == torch.bool:
            return problem
        if minimum is not None and bool((v < minimum).any()):
            return f"{_name(where)} holds {int((v < minimum).sum())} value(s) below {minimum}"
        if whole and v.is_floating_point() and not bool((v == v.round()).all()):
            return f"{_name(where)} holds value(s) that are not whole numbers"
        return None
    return Rule(check)


def adam_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The template of an Adam or AdamW optimizer's state_dict (without amsgrad) after any number of steps: its
    groups as the optimizer's but for the step size (any number of 0 or more); and no moments (before the first
    step) or, for every parameter, a whole float32 step count of 0 or more (on the parameter's device where the
    fused or capturable kernel keeps it, else on the CPU), the first moment and the second (0 or more), each of
    the parameter's shape, dtype and device."""
    moments: dict[int, Any] = {}
    for group in optimizer.param_groups:
        kept_on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = torch.zeros((), dtype=torch.float32, device=p.device if kept_on_device else "cpu")
            moments[len(moments)] = {"step": tensor(step, minimum=0, whole=True), "exp_avg": p.detach(),
                                     "exp_avg_sq": tensor(p.detach(), minimum=0)}
    groups = [{**group, "lr": number(minimum=0)} for group in optimizer.state_dict()["param_groups"]]
    return {"state": either({}, moments), "param_groups": groups}


def check(saved: Any, template: Any, path: str | Path, advice: str) -> None:
    """Refuse the checkpoint `saved`, read from `path`, unless it matches `template`: one line (`FfkvError`)
    naming the file and the first entry that differs, then `advice` (what to do instead)."""
    problem = mismatch(saved, template)
    if problem is not None:
        raise FfkvError(f"the checkpoint {path} cannot be resumed: {problem}; it is damaged or was not written by "
                        f"this run: {advice}")


def _join(where: str, key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f"{where}.{key}" if where else key
    return f"{where}[{key!r}]"


def _name(where: str) -> str:
    return where or "the top level"


def _shown(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    if isinstance(v, (list, tuple, dict)):
        return f"a {type(v).__name__} of {len(v)}"
    text = repr(v)
    return f"{text[:40]}... ({type(v).__name__})" if len(text) > 40 else f"{text} ({type(v).__name__})"


__all__ = ["Omittable", "Rule", "adam_state", "check", "count", "either", "mismatch", "number", "rows", "tensor",
           "text"]
