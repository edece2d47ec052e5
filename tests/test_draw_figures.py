"""scripts/draw_figures.py, the command README names for its two pictures, runs and writes both
PNGs (docs/images/system.png, docs/images/hbsjd.png) into the folder it is given."""
import subprocess
import sys
from pathlib import Path

import matplotlib.image

ROOT = Path(__file__).resolve().parents[1]


def test_draw_figures_writes_both_pngs(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "draw_figures.py"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["hbsjd.png", "system.png"]
    for name in written:
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, channels = matplotlib.image.imread(path).shape
        assert width > 1200 and height > 600 and channels in (3, 4)
    assert proc.stdout.split() == [str(tmp_path / "system.png"), str(tmp_path / "hbsjd.png")]


def test_readme_names_the_command_and_shows_both_pictures():
    readme = (ROOT / "README.md").read_text()
    assert "python scripts/draw_figures.py" in readme
    for name in ("system.png", "hbsjd.png"):
        assert f"docs/images/{name}" in readme
        assert (ROOT / "docs" / "images" / name).is_file()
