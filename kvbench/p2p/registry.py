"""A name -> class registry filled by the modules of one package, imported on first use.

Transports and patterns both work this way: a backend is one module that decorates its
class with `@register`, so adding one never means editing the harness."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from types import ModuleType
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str, path: Iterable[str], also: str = ""):
        self.kind, self.package, self.path, self.also = kind, package, list(path), also
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, cls: type[T]) -> type[T]:
        self._classes[cls.name] = cls  # type: ignore[attr-defined]
        return cls

    def _load_all(self) -> None:
        """Import every module of the package once (they import heavy packages lazily)."""
        if not self._loaded:
            for mod in pkgutil.iter_modules(self.path):
                if not mod.name.startswith("_") and mod.name != "base":
                    importlib.import_module(f"{self.package}.{mod.name}")
            self._loaded = True

    def available(self) -> dict[str, type[T]]:
        self._load_all()
        return dict(sorted(self._classes.items()))

    def get(self, name: str) -> type[T]:
        self._load_all()
        try:
            return self._classes[name]
        except KeyError:
            choices = ", ".join([self.also] * bool(self.also) + sorted(self._classes))
            raise KeyError(f"unknown {self.kind} {name!r}; choose from {choices}") from None


class LazyModule:
    """A module imported on first attribute access (`torch = LazyModule("torch")`).

    The transport registry imports every transport module to read its declaration (name,
    link kind, descriptor count, record fields), and the fit, the matrix, the plan and the
    report read those declarations on installs without torch or mpi4py (the `p2p` extra):
    a transport module, and the helpers it imports at module level, must therefore import
    neither at module level. Their runtime names such a module through this proxy; tests
    may still replace the module-level name (monkeypatch.setattr(mod, "dist", fake))."""

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str):
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)
