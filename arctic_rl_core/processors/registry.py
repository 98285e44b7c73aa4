"""The loss registry: names and aliases to losses, and the guarded import of dotted paths.

``processing["loss_fn"]`` arrives from the network, so resolving it must never
import code the server operator did not allow. Names and aliases resolve
first, without importing anything. A dotted path (``pkg.mod.fn``) is imported
only when it lies under one of the ``allowed_prefixes`` the operator gave at
startup; a request can never widen that list. The imported object must itself
be a registered loss (its module calls :func:`register_loss` on import), so an
allowed prefix still cannot turn an arbitrary function into a loss.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from pydantic import ValidationError

from arctic_rl_core.processors.base import (
    LossConfig,
    LossConfigError,
    LossInputs,
    LossOutput,
    UnknownLossError,
    describe_validation_error,
)

LossFn = Callable[[LossInputs, LossConfig], LossOutput]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function, its config model, and what it reads from the batch."""

    name: str
    fn: LossFn
    config_model: type[LossConfig]
    aliases: tuple[str, ...] = ()

    def parse_config(self, config: Mapping | None) -> LossConfig:
        """Validate ``processing["config"]``; the error names each bad field, its value, and what was expected."""
        if isinstance(config, self.config_model):
            return config
        if config is not None and not isinstance(config, Mapping):
            raise LossConfigError(
                f"config for loss {self.name!r} must be a mapping of field names to values, got {config!r}"
            )
        try:
            return self.config_model.model_validate(dict(config or {}))
        except ValidationError as err:
            raise LossConfigError(f"invalid config for loss {self.name!r}: {describe_validation_error(err)}") from None

    def required_context(self, config: LossConfig) -> frozenset[str]:
        return config.required_context()

    def optional_context(self, config: LossConfig) -> frozenset[str]:
        return config.optional_context()

    def needs_entropy(self, config: LossConfig) -> bool:
        return config.needs_entropy()

    def __call__(self, inputs: LossInputs, config: LossConfig) -> LossOutput:
        return self.fn(inputs, config)


_BY_NAME: dict[str, LossSpec] = {}
_BY_FUNCTION: dict[int, LossSpec] = {}  # id(fn): registered functions stay alive in their spec


def register_loss(
    name: str, *, config_model: type[LossConfig], aliases: Iterable[str] = ()
) -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn(inputs, config) -> LossOutput`` resolvable as ``name`` and each alias."""
    if not (isinstance(config_model, type) and issubclass(config_model, LossConfig)):
        raise TypeError(f"config_model of loss {name!r} must subclass LossConfig, got {config_model!r}")

    def decorator(fn: LossFn) -> LossFn:
        spec = LossSpec(name=name, fn=fn, config_model=config_model, aliases=tuple(aliases))
        keys = (spec.name, *spec.aliases)
        for key in keys:
            if not key or key != key.strip():
                raise ValueError(f"loss name {key!r} must be non-empty and carry no surrounding whitespace")
            if key in _BY_NAME:
                raise ValueError(f"loss name {key!r} is already registered (by loss {_BY_NAME[key].name!r})")
        for key in keys:
            _BY_NAME[key] = spec
        _BY_FUNCTION[id(fn)] = spec
        return fn

    return decorator


def registered_losses() -> list[str]:
    """Names of the registered losses (aliases excluded), sorted."""
    return sorted({spec.name for spec in _BY_NAME.values()})


def _is_dotted_path(path: str, min_parts: int = 2) -> bool:
    parts = path.split(".")
    return len(parts) >= min_parts and all(part.isidentifier() for part in parts)


def _under_prefix(path: str, prefix: str) -> bool:
    # A prefix is a package or module path: "my_pkg" allows "my_pkg.losses.fn" but never "my_pkg_evil.fn".
    prefix = prefix.rstrip(".")
    return path == prefix or path.startswith(prefix + ".")


def resolve_loss(name: str, allowed_prefixes: Iterable[str] = ()) -> LossSpec:
    """The loss that ``processing["loss_fn"]`` names.

    Raises :class:`UnknownLossError` naming the registered losses and the
    allowed prefixes when ``name`` is neither registered nor an importable,
    registered loss under an allowed prefix. Nothing is imported unless the
    path is allowed.
    """
    allowed = tuple(allowed_prefixes)
    for prefix in allowed:
        if not isinstance(prefix, str) or not _is_dotted_path(prefix.rstrip("."), min_parts=1):
            raise ValueError(f"allowed loss prefix {prefix!r} is not a dotted module path such as 'my_pkg.losses'")
    if not isinstance(name, str):
        raise UnknownLossError(f"loss_fn must be a string, got {type(name).__name__}")
    spec = _BY_NAME.get(name)
    if spec is not None:
        return spec

    def unknown(reason: str) -> UnknownLossError:
        prefixes = ", ".join(repr(p) for p in allowed) if allowed else "none (dotted paths are disabled)"
        return UnknownLossError(
            f"unknown loss_fn {name!r}: {reason}. Registered losses: {', '.join(registered_losses())}. "
            f"Dotted paths are imported only under the allowed prefixes: {prefixes}"
        )

    if not _is_dotted_path(name):
        raise unknown("not a registered loss name, and not a dotted path 'package.module.function'")
    if not any(_under_prefix(name, prefix) for prefix in allowed):
        raise unknown("the dotted path is outside the allowed prefixes")

    module_name, _, attribute = name.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise unknown(f"module {module_name!r} cannot be imported ({err})") from None
    target = getattr(module, attribute, None)
    spec = _BY_FUNCTION.get(id(target))
    if spec is None or spec.fn is not target:
        raise unknown(
            f"{attribute!r} in module {module_name!r} is not a loss registered with "
            "arctic_rl_core.processors.register_loss"
        )
    return spec
