"""The reports as a person sees them: rendered by headless Chromium, every plot region of the
screenshot must hold drawn data (coloured pixels), and the plots of an empty fleet must hold none,
so the check itself can fail. Skips only where no Chromium binary exists (.ci/run installs
Debian's `chromium`); tests/test_report.py is the twin that always runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fakes.fleet import BURNIN, NOW, fleet_store
from screener.output.report import burnin_html, fleet_data, fleet_html, load_burnin_report
from screener.stores.local import LocalStore

CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no Chromium binary (apt-get install chromium)")
WIDTH = 1000
HEIGHT = 4000  # taller than any page here: the whole page in one screenshot

# Appended to a copy of the page (the report itself has no script): records where each plot is,
# as attributes of <body>, which change no layout, so the screenshot of the same copy matches.
PROBE = """<script>
const r = [...document.querySelectorAll('figure.plot svg')].map(s => {
  const b = s.getBoundingClientRect();
  return {id: s.parentElement.dataset.plot, x: b.left + scrollX, y: b.top + scrollY,
          w: b.width, h: b.height};
});
document.body.setAttribute('data-rects', JSON.stringify(r));
document.body.setAttribute('data-height', String(document.documentElement.scrollHeight));
</script>"""


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--force-device-scale-factor=1", "--mute-audio",
                           "--no-first-run", "--disable-extensions", *args],
                          capture_output=True, text=True, timeout=90)


def render(page: str, path: Path) -> tuple[list[dict], "Image.Image"]:
    """The plot rectangles (CSS px) and the screenshot of `page`, from one Chromium run."""
    from PIL import Image

    path.write_text(page.replace("</body>", PROBE + "</body>"))
    png = path.with_suffix(".png")
    run = _chromium(f"--window-size={WIDTH},{HEIGHT}", "--dump-dom", f"--screenshot={png}",
                    path.as_uri())
    assert run.returncode == 0 and png.exists(), run.stderr[-2000:]
    rects = json.loads(re.search(r"data-rects=\"([^\"]*)\"", run.stdout).group(1)
                       .replace("&quot;", '"'))
    return rects, Image.open(png).convert("RGB")


def coloured_pixels(img, r: dict) -> int:
    """Pixels in the plot's box whose colour is saturated: the data marks. Text, axes and grid
    lines are grey and the background white, so an empty plot counts nothing."""
    box = (int(r["x"]), int(r["y"]), int(r["x"] + r["w"]), int(r["y"] + r["h"]))
    assert box[2] <= img.width and box[3] <= img.height, (r, img.size)
    saturation = img.crop(box).convert("HSV").getchannel("S")
    return sum(saturation.point(lambda v: 255 if v > 80 else 0).histogram()[255:])


@pytest.mark.slow
def test_burnin_and_fleet_reports_show_their_plots(tmp_path):
    burnin = burnin_html(load_burnin_report(BURNIN))
    store = fleet_store(tmp_path / "f.db")
    fleet = fleet_html(fleet_data(store, now=NOW, burnin_reports=[load_burnin_report(BURNIN)]))
    empty = fleet_html(fleet_data(LocalStore(tmp_path / "e.db"), now=NOW))
    seen = {}
    for name, page, want in (("burnin", burnin, {"stages", "job-seconds", "hbm-bandwidth"}),
                             ("fleet", fleet, {"states", "timeline", "job-seconds",
                                               "hbm-bandwidth"})):
        rects, img = render(page, tmp_path / f"{name}.html")
        assert {r["id"] for r in rects} == want
        for r in rects:
            n = coloured_pixels(img, r)
            seen[f"{name}/{r['id']}"] = n
            # A bar of 1 px or a single dot is a few dozen pixels; every plot here draws several.
            assert n >= 150, f"{name} plot {r['id']} looks empty in the screenshot ({n} px)"
    rects, img = render(empty, tmp_path / "empty.html")
    assert len(rects) == 4
    for r in rects:
        assert coloured_pixels(img, r) == 0, f"empty fleet plot {r['id']} shows something"
