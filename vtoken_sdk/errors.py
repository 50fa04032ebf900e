"""Typed errors of the policy SDK.

Every error a policy author can see names *where* (file:line), *what* (the field or
construct) and *the fix*, in the FlexAttention style: "got X, expected Y, try Z".
"""

from __future__ import annotations

import sys
import traceback
from types import FrameType, TracebackType


class VTokenError(Exception):
    """Base class of all vtoken errors."""


class PolicyDefinitionError(VTokenError):
    """A policy cannot be defined: bad signature, unsupported construct, bad parameters.

    Raised at decoration time (or when a policy file is loaded), never later.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 hint: str | None = None, check: str = "definition") -> None:
        self.message = message
        self.file = file
        self.line = line
        self.hint = hint
        self.check = check
        super().__init__(self.render())

    @property
    def location(self) -> str:
        if self.file is None:
            return "<unknown>"
        return f"{self.file}:{self.line}" if self.line is not None else self.file

    def render(self) -> str:
        text = f"{self.location}: {self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class PolicyRuntimeError(VTokenError):
    """A policy failed while computing a keep mask (its own bug, not the engine's)."""

    def __init__(self, policy: str, message: str, *, file: str | None = None, line: int | None = None) -> None:
        self.policy = policy
        self.file = file
        self.line = line
        loc = f"{file}:{line}: " if file else ""
        super().__init__(f"{loc}policy {policy!r} failed: {message}")


def frame_in_file(filename: str, frame: FrameType | None = None) -> int | None:
    """Line number of the innermost active frame executing ``filename``, if any."""
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename == filename:
            return f.f_lineno
        f = f.f_back
    return None


def traceback_line_in_file(tb: TracebackType | None, filename: str) -> int | None:
    """Line of the innermost traceback entry inside ``filename`` (None when absent)."""
    line = None
    for fs in traceback.extract_tb(tb):
        if fs.filename == filename:
            line = fs.lineno
    return line
