"""Generated sections of the docs' pages: a block between two marker lines, rewritten in place."""

from __future__ import annotations

from pathlib import Path


def section(text: str, begin: str, end: str) -> str:
    """The block of ``text`` from ``begin`` to ``end``, markers included."""
    return text[text.index(begin) : text.index(end) + len(end)]


def replace_section(path: Path, begin: str, end: str, block: str) -> bool:
    """Put ``block`` (markers included) in place of ``path``'s section; True when it changed."""
    text = path.read_text()
    new = text.replace(section(text, begin, end), block, 1)
    if new != text:
        path.write_text(new)
        return True
    return False
