"""Real text the project measures on: the calibration files shipped in the exllamav2 wheel."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pjinfer.config import ConfigError

CALIBRATION_FILES = ("wiki", "c4", "tiny", "technical", "code", "multilingual")
WIKI_EVAL_CHARS = 20_000   # the perplexity protocol (docs/architecture.md)


def calibration_dir() -> Path:
    spec = importlib.util.find_spec("exllamav2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("calibration text not installed: run `make setup` (pip install --no-deps exllamav2==0.3.2)")
    return Path(spec.submodule_search_locations[0]) / "conversion" / "standard_cal_data"


def calibration_file(name: str) -> Path:
    if name not in CALIBRATION_FILES:
        raise ConfigError(f"unknown calibration text {name!r} (known: {', '.join(CALIBRATION_FILES)})")
    return calibration_dir() / f"{name}.utf8"


def strip_tags(text: str) -> str:
    """Remove markup such as the <doc id=...> lines that wrap each wiki article."""
    return re.sub(r"<[^>]*>", "", text)


def wiki_eval_text() -> str:
    """The first 20,000 characters of wiki.utf8, <...> tags removed, stripped of surrounding white space.

    The strip matters: it drops the newline left by the first <doc> tag, which shifts every window by a
    token. With it, llama.cpp scores 17.188; without it, 16.80.
    """
    return strip_tags(read_text(calibration_file("wiki"))[:WIKI_EVAL_CHARS]).strip()


def read_text(path) -> str:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"text file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text.strip():
        raise ConfigError(f"{path} is empty")
    return text
