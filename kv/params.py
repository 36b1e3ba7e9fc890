"""Hyper-parameters, declared once beside the policy or prompt compressor that uses them.

A class lists what it uses as `params = (Param(...), ...)`: the name (the CLI flag is --name-with-dashes), the
paper's default, one line of help and a check. A parameter that several classes share (the protection every
policy has, SnapKV's observation window ...) is one Param declared where it first belongs; another class
reuses it, with its own paper's default, as `N_SINKS(4)`. cache.py derives the flags, their help, preset
validation and the unused-flag errors from these declarations, and each instance gets its values as
attributes (self.n_sinks, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from model import KVFastError


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---- checks: (name, value) -> the value, or a one-line KVFastError ---------------------------------------
def number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise KVFastError(f"{flag(name)} must be a number, got {value!r}")
    return value


def count(name: str, value: Any) -> float | int:
    """A positive window/interval: a fraction (< 1) of the capacity or a whole number of tokens."""
    value = number(name, value)
    if value <= 0:
        raise KVFastError(f"{flag(name)} must be > 0, got {value:g}")
    if value >= 1:
        if value != int(value):
            raise KVFastError(f"{flag(name)} of 1 or more is a number of tokens and must be whole, "
                              f"got {value:g}")
        return int(value)
    return float(value)


def whole(minimum: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        value = number(name, value)
        if value != int(value) or value < minimum:
            raise KVFastError(f"{flag(name)} must be a whole number >= {minimum}, got {value:g}")
        return int(value)
    return check


def choice(*options: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in options:
            raise KVFastError(f"{flag(name)} must be one of {', '.join(options)}, got {value!r}")
        return value
    check.options = options  # a string flag
    return check


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise KVFastError(f"{name} must be true or false, got {value!r}")
    return value


def odd(name: str, value: Any) -> int:
    value = whole(1)(name, value)
    if value % 2 == 0:
        raise KVFastError(f"{flag(name)} must be odd (pooling keeps the length), got {value}")
    return value


def fraction(name: str, value: Any) -> float:
    value = number(name, value)
    if not 0 <= value <= 1:
        raise KVFastError(f"{flag(name)} must lie in [0, 1], got {value:g}")
    return float(value)


def nonnegative(name: str, value: Any) -> float:
    value = number(name, value)
    if not 0 <= value < float("inf"):  # NaN fails too
        raise KVFastError(f"{flag(name)} must be a finite number >= 0, got {value:g}")
    return float(value)


# ---- declarations ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One hyper-parameter: name, default (the paper's), help (what it does, no default: the flag's help lists
    each user's), check, and const (the value of the flag given without one; None: a value is required)."""

    name: str
    default: Any
    help: str
    check: Callable[[str, Any], Any] = number
    const: Any = None

    def __call__(self, default: Any) -> Param:
        """The same parameter with another class's default."""
        return replace(self, default=default)

    def validate(self, value: Any) -> Any:
        return self.check(self.name, value)

    def same_as(self, other: Param) -> bool:
        """Declared alike (the default aside): two classes that share a flag must mean the same by it."""
        return replace(self, default=None) == replace(other, default=None)

    def add_flag(self, group: argparse._ActionsContainer, text: str) -> None:
        """--name, default None so that a given flag can be told apart from the class's default."""
        name = flag(self.name)
        if self.check is boolean:
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif hasattr(self.check, "options"):
            group.add_argument(name, default=None, help=text)
        elif self.const is not None:
            group.add_argument(name, type=float, nargs="?", const=self.const, default=None, help=text)
        else:
            group.add_argument(name, type=float, default=None, help=text)


class ParamSet(dict):
    """name -> Param, in declaration order (a later declaration of a name replaces an earlier one)."""

    @classmethod
    def of(cls, declared: tuple[Param, ...] | ParamSet) -> ParamSet:
        return cls((p.name, p) for p in (declared.values() if isinstance(declared, dict) else declared))

    def defaults(self) -> dict[str, Any]:
        return {name: p.default for name, p in self.items()}

    def with_defaults(self, **defaults: Any) -> ParamSet:
        """These parameters, some with other defaults (a subclass's paper)."""
        if set(defaults) - set(self):
            raise TypeError(f"no such parameters {sorted(set(defaults) - set(self))}")
        return ParamSet((name, p(defaults[name]) if name in defaults else p) for name, p in self.items())


class Configurable:
    """A policy or compressor: `name` (its CLI name) and `params`; an instance gets each value as an
    attribute."""

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "cache policy"  # for errors
    params: ClassVar[ParamSet] = ParamSet()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("params")
        if declared is not None and not isinstance(declared, ParamSet):
            cls.params = ParamSet.of(declared)

    def set_params(self, given: dict[str, Any]) -> None:
        """Each parameter as an attribute: the given value, else the default; an undeclared name is an
        error."""
        unknown = set(given) - set(self.params)
        if unknown:
            raise KVFastError(f"{self.kind} {self.name!r} does not use {sorted(unknown)}")
        for key, p in self.params.items():
            setattr(self, key, given.get(key, p.default))


def merge_params(classes: list[type[Configurable]]) -> dict[str, tuple[Param, dict[str, Any]]]:
    """Every parameter of these classes: name -> (its declaration, {class name: default}). Two classes that
    declare one name differently (help, check) are a programming error, caught at import."""
    out: dict[str, tuple[Param, dict[str, Any]]] = {}
    for cls in classes:
        for name, p in cls.params.items():
            first, users = out.setdefault(name, (p, {}))
            if not first.same_as(p):
                raise TypeError(f"{cls.__name__} declares {name!r} unlike another class: declare it once and "
                                "reuse it with its default (PARAM(default))")
            users[cls.name] = p.default
    return out


def shown(value: Any) -> str:
    """A default as the help prints it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def flag_help(p: Param, users: dict[str, Any]) -> str:
    """The flag's help: what it does, then each default with the classes that have it."""
    by_default: dict[str, list[str]] = {}
    for name, default in users.items():
        by_default.setdefault(shown(default), []).append(name)
    defaults = "; ".join(", ".join(names) + f": {value}" for value, names in by_default.items())
    return f"{p.help} ({defaults})"


# ---- the protection every policy shares (kv.slots), and the GQA reduction of the attention policies -------
N_SINKS = Param("n_sinks", 0, "first tokens always kept (attention sinks)", check=whole(0))
RECENT_WINDOW = Param("recent_window", 1, "most recent tokens always kept, the new one included; < 1 = "
                      "fraction of the capacity (window: everything but the sinks)", check=count)
GQA_REDUCE = Param("gqa_reduce", "mean", "reduce the scores of a KV head's query heads: mean or max",
                   check=choice("mean", "max"))
