"""Checks that every relative link and image in README.md and docs/*.md resolves to a file, and an anchor to a
heading. Run: python docs/check_links.py [REPO_ROOT] (default: the repository this file is in)."""

import re
import sys
from pathlib import Path

root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def anchors(md: Path) -> set[str]:
    out = set()
    for line in md.read_text().splitlines():
        if line.startswith("#"):
            t = line.lstrip("#").strip().lower()
            t = re.sub(r"[^\w\- ]", "", t).replace(" ", "-")
            out.add(t)
    return out


bad = 0
for f in files:
    text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
    for m in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = m.group(1)
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (f.parent / path) if path else f
        if not dest.exists():
            print(f"{f.relative_to(root)}: missing {target}")
            bad += 1
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            print(f"{f.relative_to(root)}: no anchor {target}")
            bad += 1
print(f"{bad} broken of the links in {len(files)} files")
sys.exit(1 if bad else 0)
