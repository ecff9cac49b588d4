"""A long-running server and the cyclic garbage collector: what start-up made stays out of full collections."""

from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect once, then move every object alive now (the imports - torch, transformers, FastAPI - the engine,
    its models and graphs) into the collector's permanent generation, so that a full collection walks only
    what serving made since. Returns how many objects were frozen.

    On the H200 at 22 req/s, once a run, every instance went ~0.3 s without a call at the same moment: the
    serve process in a full collection. Its imports alone are ~230k tracked objects, 0.11 s a full
    collection on the CI machine; nothing to walk after a freeze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
