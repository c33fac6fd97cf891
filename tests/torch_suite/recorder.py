"""A unittest result that keeps each test's outcome, error text and duration (for the peer-suite harnesses)."""

from __future__ import annotations

import time
import traceback
import unittest
from typing import Any, Dict


class Recorder(unittest.TextTestResult):
    """A text result that also keeps, per test name, its outcome, error text and duration in :attr:`outcomes`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: Dict[str, Dict[str, Any]] = {}
        self._started: Dict[str, float] = {}

    def _put(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = {
            "outcome": outcome,
            "detail": detail,
            "seconds": round(time.monotonic() - self._started.get(name, time.monotonic()), 1),
        }

    def startTest(self, test: unittest.TestCase) -> None:
        self._started[test.id().rsplit(".", 1)[-1]] = time.monotonic()
        super().startTest(test)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._put(test, "failed", "".join(traceback.format_exception(*err)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._put(test, "failed", "".join(traceback.format_exception(*err)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)
