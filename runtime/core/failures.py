"""Counters and failure reporting for runtime components that must never raise into
the training (or serving) thread: every failure is counted, the first of each kind is
logged at WARNING, and the latest is kept for ``state()``."""

from __future__ import annotations

import logging
import re
import threading
import time


class Counters:
    def __init__(self, names: tuple, logger: str, label: str, lock=None):
        self.names = names
        self.log = logging.getLogger(logger)
        self.label = label  # "dump", "trace": how log lines name the component
        self.lock = lock if lock is not None else threading.Lock()  # a component's own, to share it
        self.counts: dict = dict.fromkeys(names, 0)
        self.last_error: str | None = None
        self.last_error_time: float | None = None
        self._logged: set = set()

    def add(self, key: str, n=1) -> None:
        with self.lock:
            self.counts[key] += n

    def fail(self, where: str, exc: BaseException, lost: int = 0) -> None:
        """Count a failure (``lost`` records with it, where the component counts them)."""
        try:
            message = f"{where}: {type(exc).__name__}: {exc}"
            kind = (re.sub(r"'[^']*'|\d+", "", where), type(exc).__name__, getattr(exc, "errno", None))
            with self.lock:
                self.counts["errors"] += 1
                if lost:
                    self.counts["lost"] += lost
                self.last_error, self.last_error_time = message, time.time()
                first = kind not in self._logged and len(self._logged) < 64
                self._logged.add(kind)
            if first:
                self.log.warning("source-patch %s: %s (training continues; later failures of this kind "
                                 "are only counted: see state())", self.label, message)
        except Exception:  # noqa: BLE001 - reporting a failure must not fail
            pass

    def snapshot(self) -> dict:
        with self.lock:
            return dict(self.counts)

    def reset(self) -> None:
        with self.lock:
            for key in self.names:
                self.counts[key] = 0
            self.last_error = self.last_error_time = None
            self._logged.clear()
