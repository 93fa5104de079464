"""Docstrings as the API reference shows them: a griffe extension for mkdocstrings.

The package's docstrings are written for ``help()`` and the source, in reStructuredText habits:
Sphinx roles (``:class:`X```), literal blocks after ``::`` and doctest examples. Markdown would
show those as they are. At render time this extension rewrites each docstring (the source files
stay as they are):

- a Sphinx role becomes a cross-reference, ``[`X`][stream_st.X]``, when its target is an object
  the site renders, else inline code (``~`` keeps only the last name, as in Sphinx);
- a paragraph ending in ``::`` ends in ``:`` and its indented literal block becomes a fenced one;
- a run of doctest lines (``>>>``, ``...`` and the output after them) becomes a ``pycon`` block.

``rewrite_roles`` is also what a one-off conversion of the sources would use.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|exc|data|obj):`(~?)([^`<>]+)`")

Resolver = Callable[[str], "str | None"]
"""A role's target as written (without ``~``) to the identifier of a rendered object, or None."""


def rewrite_roles(text: str, resolve: Resolver) -> str:
    """``text`` with every Sphinx role replaced: a cross-reference where ``resolve`` finds the
    target on the site, else the name as inline code."""

    def one(match: re.Match[str]) -> str:
        short, target = match.group(2) == "~", match.group(3).strip()
        shown = target.lstrip(".").rsplit(".", 1)[-1] if short else target.lstrip(".")
        identifier = resolve(target)
        return f"[`{shown}`][{identifier}]" if identifier else f"`{shown}`"

    return ROLE.sub(one, text)


def fence_blocks(text: str) -> str:
    """Literal blocks after ``::`` and doctest runs as fenced code; fenced code left alone."""
    lines = text.split("\n")
    out: list[str] = []
    i, fenced = 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append(line)
            i += 1
            continue
        if fenced:
            out.append(line)
            i += 1
            continue
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            block_start = i + 1
            while block_start < len(lines) and not lines[block_start].strip():
                block_start += 1
            if block_start < len(lines) and lines[block_start].startswith((" ", "\t")):
                end = block_start
                while end < len(lines) and (
                    not lines[end].strip() or lines[end].startswith((" ", "\t"))
                ):
                    end += 1
                while end > block_start and not lines[end - 1].strip():
                    end -= 1
                stripped = line.rstrip()[:-1]
                out.append(stripped if stripped.strip() else "")
                out.append("")
                out.append("```" + _language(lines[block_start:end]))
                out.extend(textwrap.dedent("\n".join(lines[block_start:end])).split("\n"))
                out.append("```")
                i = end
                continue
        if line.lstrip().startswith(">>>"):
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            if out and out[-1].strip():
                out.append("")
            out.append("```pycon")
            out.extend(textwrap.dedent("\n".join(lines[i:end])).split("\n"))
            out.append("```")
            i = end
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _language(block: Iterable[str]) -> str:
    """``python`` for a block that reads as Python, ``bash`` for a command line, else ``text``."""
    body = textwrap.dedent("\n".join(block)).strip()
    if body.startswith(("pip ", "stream-st ", "python ", "$ ")):
        return "bash"
    python = ("import ", "from ", "async ", "await ", "with ", "def ", "for ", "assert ")
    if any(line.startswith(python) or " = " in line for line in body.split("\n")):
        return "python"
    return "text"


class SiteIndex:
    """Which objects the site renders, and how a role's target maps onto one of them.

    ``modules`` are the modules the API page renders; an object is on the site when it is a
    public member (by ``__all__`` where the module has one) of one of them, or a documented
    public member of such an object."""

    def __init__(self, package: griffe.Module, modules: Iterable[str]) -> None:
        self.package = package
        self.modules = {name: self.module(name) for name in modules}

    def module(self, name: str) -> griffe.Object | griffe.Alias | None:
        """The package's module of that dotted name (``stream_st.kv``), or None."""
        if name == self.package.name:
            return self.package
        prefix = self.package.name + "."
        return _get(self.package, name[len(prefix) :]) if name.startswith(prefix) else None

    def public_path(self, obj: griffe.Object | griffe.Alias) -> str | None:
        """The identifier under which ``obj`` is rendered, or None when it is not."""
        canonical = obj.canonical_path
        for module_name, module in self.modules.items():
            if module is None:
                continue
            if canonical == module.canonical_path:
                return module_name
            for name in _exported(module):
                member = module.members.get(name)
                if member is None:
                    continue
                try:
                    member_path = member.canonical_path
                except griffe.AliasResolutionError:
                    continue
                if canonical == member_path:
                    return f"{module_name}.{name}"
                if canonical.startswith(member_path + ".") and member.is_class:
                    rest = canonical[len(member_path) + 1 :]
                    if _documented_member(member, rest):
                        return f"{module_name}.{name}.{rest}"
        return None

    def resolver(self, scope: griffe.Object | griffe.Alias) -> Resolver:
        """Resolve role targets as Sphinx would from ``scope``: its own members, then its
        enclosing class and module, then the package, then a full dotted path."""

        def resolve(target: str) -> str | None:
            found = self.find(target, scope)
            if found is None:
                return None
            try:
                return self.public_path(found)
            except griffe.AliasResolutionError:
                return None

        return resolve

    def find(
        self, target: str, scope: griffe.Object | griffe.Alias
    ) -> griffe.Object | griffe.Alias | None:
        if target.startswith("."):
            module = scope if scope.is_module else scope.module
            base: griffe.Object | griffe.Alias | None = module.parent or module
            return _get(base, target.lstrip(".")) if base is not None else None
        scopes: list[griffe.Object | griffe.Alias] = []
        current: griffe.Object | griffe.Alias | None = scope
        while current is not None:
            scopes.append(current)
            current = current.parent
        for place in [*scopes, self.package]:
            found = _get(place, target)
            if found is not None:
                return found
        if target.startswith(self.package.name + "."):
            return _get(self.package, target[len(self.package.name) + 1 :])
        return None


def _get(place: griffe.Object | griffe.Alias, dotted: str) -> griffe.Object | griffe.Alias | None:
    current: Any = place
    for part in dotted.split("."):
        try:
            members = current.members
        except griffe.AliasResolutionError:
            return None
        if part not in members:
            return None
        current = members[part]
    return current  # type: ignore[no-any-return]


def _exported(module: griffe.Object | griffe.Alias) -> list[str]:
    names = module.exports
    if names is None:
        return [n for n in module.members if not n.startswith("_")]
    return [n if isinstance(n, str) else n.name for n in names if not str(n).startswith("_")]


def _documented_member(cls: griffe.Object | griffe.Alias, rest: str) -> bool:
    """Whether ``cls.rest`` is rendered: every name public, the member documented, own (not
    inherited, which the reference does not list)."""
    if any(part.startswith("_") for part in rest.split(".")):
        return False
    member = _get(cls, rest)
    if member is None:
        return False
    try:
        return bool(member.docstring) and not member.inherited
    except griffe.AliasResolutionError:
        return False


class SphinxDocstrings(griffe.Extension):
    """Rewrite every docstring of the loaded package as described in this module."""

    def __init__(self, modules: list[str] | None = None) -> None:
        super().__init__()
        self.modules = modules or []

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        index = SiteIndex(pkg, self.modules or [pkg.name])
        for obj in _walk(pkg):
            docstring = obj.docstring
            if docstring is None:
                continue
            docstring.value = fence_blocks(rewrite_roles(docstring.value, index.resolver(obj)))


def _walk(obj: griffe.Object) -> Iterable[griffe.Object]:
    yield obj
    for member in obj.members.values():
        if not member.is_alias and isinstance(member, griffe.Object):
            yield from _walk(member)
