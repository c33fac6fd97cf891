"""Why the extension could not be obtained at import (each says the cause and the fix)."""

from __future__ import annotations

from typing import Optional


class ExtensionUnavailable(RuntimeError):
    """The compiled extension cannot be had; fastcoll falls back to its reference ops.

    Args:
        cause: What is missing or went wrong, as one sentence fragment.
        fix: What the user can do about it.
        log: A file holding the full output (the compiler's), if any.
    """

    def __init__(self, cause: str, fix: str, log: Optional[str] = None):
        self.cause, self.fix, self.log = cause, fix, log
        super().__init__(f"{cause}. {fix}" + (f" (full log: {log})" if log else ""))


class BuildFailed(ExtensionUnavailable):
    """The compiler (or the linker, or loading the result) failed."""


class LockTimeout(ExtensionUnavailable):
    """Another live process held the build lock for longer than FASTCOLL_LOCK_TIMEOUT."""
