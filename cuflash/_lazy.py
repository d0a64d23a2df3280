"""An attribute computed on first use, without a lock (what ``functools.cached_property`` is from Python 3.12)."""
from __future__ import annotations

from typing import Any, Callable, Generic, Optional, TypeVar, overload

T = TypeVar("T")


class lazy_property(Generic[T]):  # noqa: N801 - used as a decorator, as functools.cached_property
    """``functools.cached_property`` without its lock. On Python 3.10 and 3.11 that lock is one per property, shared
    by every instance and held while any instance computes its value: a fork while a worker thread held it left the
    child waiting for ever at its first use (the NumPy backend's tile masks, seen in 11 of 40 forks). Two threads
    computing a value at once compute the same value (these are pure functions of immutable state) and the last
    store wins."""

    def __init__(self, fn: Callable[[Any], T]) -> None:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: Optional[type] = None) -> "lazy_property[T]": ...

    @overload
    def __get__(self, obj: object, owner: Optional[type] = None) -> T: ...

    def __get__(self, obj: Optional[object], owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        value = self.fn(obj)
        obj.__dict__[self.name] = value  # an instance attribute from now on: this descriptor defines no __set__
        return value
