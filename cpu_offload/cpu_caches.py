"""The CPU's cache sizes as Linux reports them (the standard library only): what a measurement must exceed to read
from memory rather than from a cache."""
from __future__ import annotations

import os


def last_level_cache_bytes() -> int | None:
    """The size of the largest CPU cache that cpu0 sees (Linux sysfs; None elsewhere or when unreadable). A VM reports
    the host's cache, which other guests share: what fits in it may, not must, be read from it."""
    sizes = []
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in os.listdir(root):
            if index.startswith("index"):
                with open(f"{root}/{index}/size") as f:
                    text = f.read().strip()
                unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * unit)
    except (OSError, ValueError):
        return None
    return max(sizes) if sizes else None


def beyond_caches(minimum: int) -> int:
    """Bytes a working set must span to be read from memory: `minimum`, or twice the last-level cache where that is
    larger."""
    return max(minimum, 2 * (last_level_cache_bytes() or 0))
