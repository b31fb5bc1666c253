"""Every backend's constructor refuses a keyword it does not know, at construction.

A backend without pass-through options wraps its ``__init__`` in ``checked_keywords``; one that
passes other keywords on to its client library (``connect_options``, ``client_options``) calls
``refuse_unknown`` with the names that library really accepts, read from its signatures. The
library is imported only when such a keyword is given: constructing a backend with its own
options imports nothing, and never connects. A library that is not installed cannot be asked:
its keywords then pass (but for a near miss of one of the backend's own options), and
``start()`` says how to install it.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Concatenate, ParamSpec, TypeVar

from .._exceptions import ConfigurationError

__all__ = ["checked_keywords", "own_options", "parameter_names", "refuse_unknown"]

P = ParamSpec("P")
S = TypeVar("S")


def parameter_names(*functions: Callable[..., Any]) -> set[str]:
    """The names ``functions`` accept as keywords (``self`` and ``**kwargs`` aside)."""
    names: set[str] = set()
    for function in functions:
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.add(parameter.name)
    names.discard("self")
    return names


def own_options(cls: type) -> list[str]:
    """The keyword-only options of ``cls``'s constructor, in their order."""
    parameters = inspect.signature(cls).parameters.values()
    return [p.name for p in parameters if p.kind is p.KEYWORD_ONLY]


def refuse_unknown(
    backend: str,
    given: Iterable[str],
    *,
    own: Collection[str],
    library: str = "",
    accepted: Callable[[], Collection[str]] | None = None,
    reserved: Mapping[str, str] | None = None,
) -> None:
    """Raise ``ConfigurationError`` for the first of ``given`` that is neither one of ``own``
    nor one of ``accepted()`` (the keywords ``library`` takes; ``None``: it takes none).

    ``reserved``: keywords the library takes but the backend sets itself, each with why.
    """
    unknown = [name for name in given if name not in own]
    reserved = reserved or {}
    for name in unknown:
        if name in reserved:
            raise ConfigurationError(
                f"{backend}: keyword '{name}' cannot be given: {reserved[name]}",
                option=name,
                backend=backend,
            )
    if not unknown:
        return
    theirs: Collection[str] = ()
    if accepted is not None:
        try:
            theirs = set(accepted()) - set(reserved)
        except ImportError:  # not installed: start() says how to install it
            unknown = [name for name in unknown if _closest(name, own)]  # a sure typo
    for name in unknown:
        if name not in theirs:
            raise unknown_keyword(backend, name, own, theirs, library)


def unknown_keyword(
    backend: str, name: str, own: Collection[str], theirs: Collection[str], library: str
) -> ConfigurationError:
    close = _closest(name, [*own, *sorted(theirs)])
    hint = f"; did you mean '{close}'?" if close else ""
    accepted = f"its options: {', '.join(own)}"
    if library:
        accepted += f"; other keywords go to {library} and must be ones it accepts"
    return ConfigurationError(
        f"{backend}: unknown keyword '{name}'{hint} ({accepted})", option=name, backend=backend
    )


def _closest(name: str, names: Collection[str]) -> str | None:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return close[0] if close else None


def checked_keywords(
    init: Callable[Concatenate[S, P], None],
) -> Callable[Concatenate[S, P], None]:
    """Wrap a backend's ``__init__``: an unknown keyword is a ``ConfigurationError`` naming the
    backend, the keyword and the closest option, instead of Python's ``TypeError``."""
    names = parameter_names(init)
    own = [p.name for p in inspect.signature(init).parameters.values() if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(init)
    def checked(self: S, /, *args: P.args, **kwargs: P.kwargs) -> None:
        for name in kwargs:
            if name not in names:
                raise unknown_keyword(type(self).__name__, name, own, (), "")
        init(self, *args, **kwargs)

    return checked
