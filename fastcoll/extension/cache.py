"""The cache of compiled extensions, under ``$FASTCOLL_CACHE_DIR`` (default ``~/.cache/fastcoll``).

Layout, under ``ext/``:

* ``<key>/_C.so`` and ``<key>/build.json``: a published build. The folder
  appears whole, by one rename of a folder built beside it, so a reader never
  sees half a library; ``build.json`` records the key and the library's size,
  which a reader checks before loading (a truncated or foreign file is rebuilt).
* ``<key>.lock``: the build lock (lock.py).
* ``<key>.failed.log``: the output of a failed build. Later imports report it
  rather than compile again; ``python -m fastcoll.extension`` retries.
* ``tmp/``: builds in progress, one folder each; leftovers of killed builds
  older than a day are removed by the next successful build.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Dict, Optional

from . import spec

_STALE_TMP_SECONDS = 24 * 3600


def root() -> str:
    """The cache directory: ``$FASTCOLL_CACHE_DIR``, else ``~/.cache/fastcoll``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("FASTCOLL_CACHE_DIR") or "~/.cache/fastcoll"))


class Entry:
    """The cache entry of one key.

    Args:
        cache_root: The cache directory (:func:`root`).
        key: The build's key (key.py).
    """

    def __init__(self, cache_root: str, key: str):
        self.key = key
        self.ext = os.path.join(cache_root, "ext")
        self.dir = os.path.join(self.ext, key)
        self.lib = os.path.join(self.dir, spec.NAME + ".so")
        self.meta_path = os.path.join(self.dir, "build.json")
        self.lock = os.path.join(self.ext, key + ".lock")
        self.failed_log = os.path.join(self.ext, key + ".failed.log")
        self.tmp = os.path.join(self.ext, "tmp")

    def meta(self) -> Optional[Dict[str, object]]:
        """The published build's record, or None if there is none (or it is unreadable)."""
        try:
            with open(self.meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        return meta if isinstance(meta, dict) else None

    def valid(self) -> bool:
        """Whether a whole build of this key is published (a stat and a small read: no hashing)."""
        meta = self.meta()
        if meta is None or meta.get("key") != self.key:
            return False
        try:
            return os.stat(self.lib).st_size == meta.get("size")
        except OSError:
            return False

    def make_dirs(self) -> None:
        """Create the cache folders.

        Raises:
            OSError: The cache directory is not writable.
        """
        os.makedirs(self.tmp, exist_ok=True)

    def new_build_dir(self) -> str:
        """A fresh folder for one build, under ``tmp/``."""
        return tempfile.mkdtemp(prefix=f"{self.key}-{os.getpid()}-", dir=self.tmp)

    def publish(self, built_lib: str, meta: Dict[str, object]) -> None:
        """Move ``built_lib`` into the cache with its record, replacing an invalid entry.

        Args:
            built_lib: The freshly built library (it is moved, not copied).
            meta: What to record in build.json (the key and the size are added).
        """
        staging = tempfile.mkdtemp(prefix=f"{self.key}-publish-", dir=self.tmp)
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the entry from others sharing the cache
        os.replace(built_lib, os.path.join(staging, os.path.basename(self.lib)))
        record = dict(meta, key=self.key, size=os.stat(os.path.join(staging, os.path.basename(self.lib))).st_size)
        with open(os.path.join(staging, "build.json"), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        self.discard()
        try:
            os.rename(staging, self.dir)
        except OSError:  # another process (an unlocked file system) published this key first
            shutil.rmtree(staging, ignore_errors=True)
            if not self.valid():
                raise
        self.clear_failure()
        self._remove_stale_builds()

    def discard(self) -> None:
        """Remove the published entry, if any (moved aside first: the name is free at once)."""
        if not os.path.lexists(self.dir):
            return
        trash = tempfile.mkdtemp(prefix=f"{self.key}-old-", dir=self.tmp)
        os.rename(self.dir, os.path.join(trash, "entry"))
        shutil.rmtree(trash, ignore_errors=True)

    def record_failure(self, output: str) -> None:
        """Keep a failed build's output; later imports report it instead of compiling again."""
        fd, path = tempfile.mkstemp(prefix=f"{self.key}-failed-", dir=self.tmp)
        with os.fdopen(fd, "w") as f:
            f.write(output)
        os.replace(path, self.failed_log)

    def failed(self) -> bool:
        """Whether the last build of this key failed."""
        return os.path.exists(self.failed_log)

    def clear_failure(self) -> None:
        """Forget a failed build."""
        try:
            os.unlink(self.failed_log)
        except FileNotFoundError:
            pass

    def _remove_stale_builds(self) -> None:
        cutoff = time.time() - _STALE_TMP_SECONDS
        for name in os.listdir(self.tmp):
            path = os.path.join(self.tmp, name)
            try:
                if os.stat(path).st_mtime < cutoff:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass
