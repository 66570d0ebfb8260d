"""clawbridge with capture on (SQLite store in a temporary data directory) on the canned backend."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from canned import CannedBackend
from clawbridge.config import Settings
from clawbridge.server import run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = Settings.load(port=a.port, data_dir=a.data_dir, train=False, model="tiny-random")
    run(settings, backend=CannedBackend(), quiet=True)


if __name__ == "__main__":
    main()
