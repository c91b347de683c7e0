"""Griffe extension: let docstring lists follow their heading line, as they do in the sources.

recurrax's docstrings write a bold heading and its list on consecutive lines:

    **Arguments:**
    - `query`: ...

Python-Markdown (which mkdocs uses) starts a list only after a blank line, so without this
the list would render as one run-on paragraph. This inserts that blank line when the API
reference is built (nothing in the sources changes). Fenced and indented code is left alone.
"""

from __future__ import annotations

import re

import griffe

LIST_ITEM = re.compile(r"^ {0,3}(?:[-*+]|\d+[.)]) ")
FENCE = re.compile(r"^\s*(```|~~~)")


def separate_lists(text: str) -> str:
    """Insert a blank line before every list that directly follows a non-blank, non-list line."""
    lines, in_list, in_fence = [], False, False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        is_item = not in_fence and bool(LIST_ITEM.match(line))
        if is_item and not in_list and lines and lines[-1].strip():
            lines.append("")
        if not line.strip():
            in_list = False
        elif is_item:
            in_list = True
        lines.append(line)
    return "\n".join(lines)


class MarkdownLists(griffe.Extension):
    """Applies `separate_lists` to every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        self._visit(pkg, set())

    def _visit(self, obj: griffe.Object, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.docstring is not None:
            obj.docstring.value = separate_lists(obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._visit(member, seen)
