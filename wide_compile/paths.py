"""Where wide_compile looks for local data: one place, one variable (`WIDE_DATA_DIR`).

The data root holds `wikitext-2/`, `train-text/` and the zero-shot task files. Without the variable it is
`../shared/data` beside the checkout (or `.data` inside it, the layout the GPU-machine scripts carry).
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

DATA_ENV = "WIDE_DATA_DIR"
_DEPRECATED_ENV = "WIDE_DATA"  # the test suite's old name for the same thing
_REPO = Path(__file__).resolve().parents[1]


def _candidates() -> list[Path]:
    return [_REPO.parent / "shared" / "data", _REPO / ".data",
            Path.cwd().parent / "shared" / "data", Path.cwd() / ".data"]


def data_root() -> Path:
    """The data root: $WIDE_DATA_DIR if set (whether or not it exists, so errors name it), else the first
    existing default location, else `../shared/data` beside the checkout (which then does not exist)."""
    env = os.environ.get(DATA_ENV)
    if not env and os.environ.get(_DEPRECATED_ENV):
        env = os.environ[_DEPRECATED_ENV]
        warnings.warn(f"${_DEPRECATED_ENV} is deprecated: set ${DATA_ENV} instead", DeprecationWarning, stacklevel=2)
    if env:
        return Path(env)
    cands = _candidates()
    return next((c for c in cands if c.is_dir()), cands[0])


def data_file(*parts: str) -> Path:
    """A path under the data root, e.g. data_file("wikitext-2", "wiki.test.raw")."""
    return data_root().joinpath(*parts)


def missing_data_hint(path: Path) -> str:
    """What to tell a user whose data file is not at `path`."""
    return f"{path} not found: set {DATA_ENV} to the folder holding wikitext-2/ and train-text/"
