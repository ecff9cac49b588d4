"""Test-wide settings: one thread per process on the 2-core machines, Ray without auth tokens, an empty trace cache."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the user's own fetched traces (~/.cache/modelpool/traces) must not change what a test reads
if "MODELPOOL_TRACES_CACHE" not in os.environ:
    _traces_cache = tempfile.mkdtemp(prefix="modelpool-test-traces-")
    os.environ["MODELPOOL_TRACES_CACHE"] = _traces_cache
    atexit.register(shutil.rmtree, _traces_cache, ignore_errors=True)  # one per session, not left in /tmp
