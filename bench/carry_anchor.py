"""Copy the by-hand anchor (``shared/anchors/hf_llama_loop.py``) into the ignored
``.device-carry/anchors/``, which a device call carries (``shared/`` itself does not travel).

    python3 bench/carry_anchor.py [--from PATH]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".device-carry" / "anchors" / "hf_llama_loop.py"
# the shared folder sits beside the main checkout; a worktree may be one level deeper
CANDIDATES = [ROOT.parent / "shared", ROOT.parent.parent / "shared", Path("/work/shared")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--from", dest="src", default=None, help="the anchor script (default: found)")
    args = ap.parse_args()
    found = [Path(args.src)] if args.src else [c / "anchors" / "hf_llama_loop.py" for c in CANDIDATES]
    src = next((p for p in found if p.is_file()), None)
    if src is None:
        print(f"no anchor script at {', '.join(map(str, found))}: pass --from PATH", file=sys.stderr)
        return 1
    DEST.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, DEST)
    print(f"{src} -> {DEST.relative_to(ROOT)} ({DEST.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
