"""Config settings that were renamed: the old keyword and the old attribute still work, with a
DeprecationWarning that names the new setting."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

C = TypeVar("C", bound=type)


def renamed(old: str, new: str) -> Callable[[C], C]:
    """Class decorator (over ``@dataclass``): the constructor takes ``old=`` for ``new=``, and
    ``config.<old>`` reads and sets ``config.<new>``, each with a DeprecationWarning."""
    def decorate(cls: C) -> C:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if old in kwargs:
                warnings.warn(f"{cls.__name__}({old}=...) is deprecated: use {new}=...", DeprecationWarning,
                              stacklevel=2)
                value = kwargs.pop(old)
                if new in kwargs and kwargs[new] != value:
                    raise ValueError(f"{cls.__name__}.{old}={value!r} (the deprecated name of {new}) and "
                                     f"{new}={kwargs[new]!r} disagree: give {new} alone")
                kwargs[new] = value
            init(self, *args, **kwargs)

        def say() -> None:
            warnings.warn(f"{cls.__name__}.{old} is deprecated: use {new}", DeprecationWarning, stacklevel=3)

        def get(self: Any) -> Any:
            say()
            return getattr(self, new)

        def set_(self: Any, value: Any) -> None:
            say()
            setattr(self, new, value)

        cls.__init__ = __init__  # type: ignore[misc]
        setattr(cls, old, property(get, set_, doc=f"Deprecated: the old name of ``{new}``."))
        return cls

    return decorate
