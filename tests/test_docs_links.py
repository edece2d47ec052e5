"""README links every docs page, and every relative link in README.md and docs/*.md names a file
that exists and, with a #fragment, a heading of that file (GitHub's anchor rule)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)|<img src=\"([^\"]+)\"")
# Pages README may link before they exist (none now: every page is in the tree).
PENDING: set[str] = set()


def anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [a or b for a, b in LINK.findall(text)]


def test_anchor_rule():
    assert anchor("## Compiled rounds (`rollout.compile`)".lstrip("# ")) == \
        "compiled-rounds-rolloutcompile"
    assert anchor("Schedules over seeds: KD-only (8×8)") == "schedules-over-seeds-kd-only-88"


def test_readme_links_every_docs_page():
    linked = {link.split("#")[0] for link in links(ROOT / "README.md")}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set()
    assert PENDING <= linked


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for link in links(page):
            if re.match(r"[a-z]+:", link):
                continue
            name, _, fragment = link.partition("#")
            target = (page.parent / name).resolve() if name else page
            rel = target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else name
            if not target.exists():
                if rel not in PENDING:
                    broken.append(f"{page.name}: {link}")
            elif fragment and fragment not in anchors(target):
                broken.append(f"{page.name}: {link}")
    assert broken == []
