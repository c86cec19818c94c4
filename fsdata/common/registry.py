"""One small registry type: a name -> class table filled by a class decorator, which is the one
list of choices a flag accepts (partitioners, engines; fstrain's pipelines, comm backends and
models). Choices, help and the unknown-name error all come from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fsdata.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes registered by name, in registration order.

    Args:
        kind: what is registered, for the duplicate error (``"engine"``).
        what: how the unknown-name error names the setting (``"--engine"``), or a function
            giving it when the error is raised (default: ``kind``).
    """

    def __init__(self, kind: str, what: str | Callable[[], str] | None = None) -> None:
        self.kind = kind
        self._what = what
        self._classes: dict[str, type[T]] = {}
        self._help: dict[str, str] = {}

    def register(self, name: str, *, help: str | None = None) -> Callable[[type[T]], type[T]]:  # noqa: A002
        """Class decorator: register ``cls`` under ``name`` (sets ``cls.name``).

        Args:
            name: the choice's name (a flag value).
            help: one line for the flag's help (default: the first line of the class docstring).

        Raises:
            ValueError: ``name`` is registered already.
        """

        def deco(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            doc = (cls.__doc__ or "").strip().splitlines()
            self._help[name] = help if help is not None else (doc[0] if doc else "")
            return cls

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a plugin's or a test's class); a name not registered is no error."""
        self._classes.pop(name, None)
        self._help.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._classes)

    def help(self, name: str) -> str:
        """The one-line help of ``name`` ("" when it has none)."""
        return self._help.get(name, "")

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        """The registered names, in registration order: a registry is its flag's choices."""
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as ``name``.

        Raises:
            ConfigError: no class of that name (one line listing the names).
        """
        cls = self._classes.get(name)
        if cls is None:
            what = self._what() if callable(self._what) else (self._what or self.kind)
            raise ConfigError(f"unknown {what} '{name}'; use one of {', '.join(self._classes)}")
        return cls
