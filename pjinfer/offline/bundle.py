"""The sparse bundle's old home: the bundle is pjinfer.load.bundle now, below the runtime that reads it and the
offline stages that write it. Kept only for runtime/engine.py and cli/common.py, which import it from here until they
are rewritten; nothing else may (tests/test_layering.py)."""
from pjinfer.load.bundle import THRESHOLDS, Bundle  # noqa: F401
