"""Is a model's final answer mathematically equal to the reference?

The answer is taken from the last ``\\boxed{...}`` of the completion (else from after the
last "answer is" / "Answer:", else the whole text), then both sides are normalized (``$``,
``\\left``/``\\right``, spacing commands, ``\\text{}``, degrees, percent signs, thousands
separators), turned from LaTeX into sympy syntax (``\\frac``, ``\\dfrac``, ``\\sqrt[n]{}``,
``\\cdot``, ``\\pi``, ``^``) and compared: symbolically (``simplify(a - b) == 0``), then
numerically (relative tolerance), element by element for tuples and lists, on the right-hand
side for ``x = ...``; text that is not mathematics is compared as normalized text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

REL_TOL = 1e-6
MAX_ANSWER_CHARS = 512  # longer "answers" are not parsed by sympy (its parser is recursive)


@dataclass(frozen=True)
class Verdict:
    equal: bool
    extracted: str  # the answer read from the completion
    method: str  # "symbolic", "numeric", "text", or "unparsed"


def extract_answer(completion: str) -> str:
    boxed = _last_braced(completion, ("\\boxed", "\\fbox"))
    if boxed is not None:
        return boxed.strip()
    m = list(re.finditer(r"(?:answer is|answer:)\s*", completion, flags=re.IGNORECASE))
    if m:
        return completion[m[-1].end():].strip().rstrip(".").strip()
    return completion.strip()


def _last_braced(text: str, commands: tuple[str, ...]) -> Optional[str]:
    """The braced argument of the last of ``commands`` in ``text`` (nested braces kept)."""
    start = max(text.rfind(c + "{") for c in commands)
    if start < 0:
        return None
    i = text.index("{", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None  # unbalanced: no answer


def math_equal(completion: str, answer: str) -> Verdict:
    got = extract_answer(completion)
    a, b = _normalize(got), _normalize(answer)
    if a == b:
        return Verdict(True, got, "text")
    left, right = _split_top_level(_strip_lhs(a)), _split_top_level(_strip_lhs(b))
    if len(left) != len(right):
        return Verdict(False, got, "text")
    methods = []
    for x, y in zip(left, right):
        equal, method = _equal_one(x, y)
        if not equal:
            return Verdict(False, got, method)
        methods.append(method)
    return Verdict(True, got, "numeric" if "numeric" in methods else ("symbolic" if "symbolic" in methods else "text"))


_SPACING = re.compile(r"\\[,;:!\s]|\\q?quad|~")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")


def _normalize(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = _SPACING.sub(" ", s)
    s = _TEXT.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)  # degrees
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])", lambda m: m.group(1).replace(",", ""), s)  # 1,000 -> 1000
    s = s.rstrip(".").strip()
    return re.sub(r"\s+", " ", s)


def _strip_lhs(s: str) -> str:
    # "x = 3" answers 3; an equation with anything else on the left stays whole.
    m = re.fullmatch(r"\s*[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(.+)", s)
    return m.group(1) if m else s


def _split_top_level(s: str) -> list[str]:
    """``(1, 2)`` and ``1, 2`` -> ["1", "2"]; commas inside braces or brackets stay."""
    inner = s
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _split_commas(s[1:-1]) != [s[1:-1]]:
        inner = s[1:-1]
    return [p.strip() for p in _split_commas(inner)]


def _split_commas(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def _equal_one(x: str, y: str) -> tuple[bool, str]:
    if x == y:
        return True, "text"
    ex, ey = _to_sympy(x), _to_sympy(y)
    if ex is None or ey is None:
        return _plain(x) == _plain(y), "unparsed"
    import sympy

    try:
        if sympy.simplify(ex - ey) == 0:
            return True, "symbolic"
    except Exception:  # sympy cannot subtract these (e.g. sets): try their values
        pass
    try:
        fx, fy = complex(ex.evalf()), complex(ey.evalf())
    except (TypeError, ValueError, AttributeError, OverflowError):  # free symbols, or no finite value
        return False, "symbolic"
    return abs(fx - fy) <= REL_TOL * max(1.0, abs(fy)), "numeric"


def _plain(s: str) -> str:
    return re.sub(r"[\s{}\\]", "", s).lower()


_COMMANDS = {
    "\\cdot": "*", "\\times": "*", "\\div": "/", "\\pi": "pi", "\\infty": "oo", "\\ln": "log", "\\log": "log",
    "\\sin": "sin", "\\cos": "cos", "\\tan": "tan", "\\exp": "exp", "\\e": "E",
}


# sympy's parse_expr ends in eval(): the text a model wrote must be plain arithmetic before
# it gets there. Allowed: digits, single-letter variables, the names _COMMANDS produce,
# operators and parentheses; a dot only inside a number.
_ARITHMETIC = re.compile(r"[0-9A-Za-z+\-*/^()., ]*")
_NAMES = {"sqrt", "pi", "oo", "log", "sin", "cos", "tan", "exp", "E"}
MAX_DIGITS = 50
MAX_EXPONENT = 1000  # of one power, and of all together: 9^9^9 would take the thread (no timeout stops it) and its memory


def _is_plain_arithmetic(text: str) -> bool:
    if not _ARITHMETIC.fullmatch(text) or re.search(r"(?<![0-9])\.|\.(?![0-9])", text):
        return False
    if any(len(digits) > MAX_DIGITS for digits in re.findall(r"[0-9]+", text)):
        return False
    return all(len(word) == 1 or word in _NAMES for word in re.findall(r"[A-Za-z]+", text))


def _to_sympy(s: str):
    """A sympy expression for ``s``, or None when it is not arithmetic sympy may read."""
    if len(s) > MAX_ANSWER_CHARS:
        return None
    try:
        text = _latex_to_python(s)
    except ValueError:
        return None
    if not _is_plain_arithmetic(text):
        return None
    import sympy
    from sympy.parsing.sympy_parser import convert_xor, implicit_multiplication_application, parse_expr, standard_transformations

    try:
        expr = parse_expr(text, transformations=standard_transformations + (implicit_multiplication_application, convert_xor), evaluate=False)
    except Exception:  # sympy's parser raises many types (SyntaxError, TokenError, TypeError...)
        return None
    # Innermost powers first, so an exponent is only ever evaluated once every power inside
    # it is known to be small; the exponents' product bounds the size of what doit() builds.
    growth = 1.0
    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_number:
            exponent = float(abs(node.exp))
            growth *= max(1.0, exponent)
            if exponent > MAX_EXPONENT or growth > MAX_EXPONENT:
                return None
    try:
        return expr.doit()
    except Exception:
        return None


def _latex_to_python(s: str) -> str:
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _argument(s, i + 5)
            den, i = _argument(s, i)
            out.append(f"(({_latex_to_python(num)})/({_latex_to_python(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            root = None
            if i < len(s) and s[i] == "[":
                close = s.index("]", i)
                root, i = s[i + 1 : close], close + 1
            arg, i = _argument(s, i)
            inner = _latex_to_python(arg)
            out.append(f"(({inner})**(1/({_latex_to_python(root)})))" if root else f"sqrt({inner})")
        elif s[i] == "\\":
            m = re.match(r"\\[A-Za-z]+", s[i:])
            if not m or m.group(0) not in _COMMANDS:
                raise ValueError(f"unknown command {s[i:i + 12]!r}")
            out.append(f" {_COMMANDS[m.group(0)]} ")
            i += len(m.group(0))
        elif s[i] in "{}":
            out.append("(" if s[i] == "{" else ")")
            i += 1
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def _argument(s: str, i: int) -> tuple[str, int]:
    """The argument at ``s[i]``: a braced group or one character (``\\frac12``)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    raise ValueError("unbalanced braces")
