"""The MkDocs site: `mkdocs build --strict` passes with and without results, and every page
renders in headless Chromium (title, results table, plots that load, mermaid diagrams as SVG,
no request leaving the machine, no JavaScript error).

The build reads a small generated results folder (GPU_DAYS_RESULTS_DIR), never results/.
Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe): standard
library only. Screenshots go to a temporary folder and to build/site-screenshots/.
"""

from __future__ import annotations

import base64
import csv
import functools
import http.server
import json
import os
import re
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmark.store import COLUMNS

for _mod in ("mkdocs", "material", "pymdownx", "matplotlib", "pandas"):
    pytest.importorskip(_mod, reason="the site needs the docs extra: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "build" / "site-screenshots"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
OLD_RUN, NEW_RUN = "20250101T000000Z-aaaaaa", "20250102T000000Z-bbbbbb"


def day_readmes() -> list[Path]:
    return sorted(p for p in (ROOT / "days").glob("day*/README.md") if re.fullmatch(r"day\d+", p.parent.name))


def built_days(site: Path) -> dict[str, str]:
    """Day -> README text, for the day pages in the built `site` (other people may add days meanwhile)."""
    days = [p.parent.name for p in (site / "days").glob("day*/index.html")]
    readmes = {d: ROOT / "days" / d / "README.md" for d in days}
    return {d: readme.read_text() for d, readme in sorted(readmes.items()) if readme.exists()}


# ---------------------------------------------------------------------------- fake results


def write_fake_results(results_dir: Path, days: list[str]) -> None:
    """Two devices (a GPU with GB/s and copy bandwidth, a CPU with ms only), two runs of which
    only the newer one may show, an NA and a wrong row with reasons."""
    gpu = {"device": "NVIDIA Test GPU 80GB", "device_type": "cuda", "driver": "999.99", "cuda": "12.9"}
    cpu = {"device": "CPU Test Processor", "device_type": "cpu", "driver": "-", "cuda": "-"}
    common = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "triton": "3.9.0",
        "max": "26.7.0",
        "mojo": "1.2.0",
        "git_commit": "0123456789ab",
    }
    shapes = ["1024x1024", "4096x4096", "8192x16384"]
    for folder, env in (("nvidia-test-gpu-80gb", gpu), ("cpu", cpu)):
        (results_dir / folder).mkdir(parents=True, exist_ok=True)
        for day in days:
            rows = [
                {
                    "run_id": OLD_RUN,
                    "timestamp": "2025-01-01T00:00:00+00:00",
                    "op": "online_softmax",
                    "impl": "stale_impl",
                    "shape": shapes[0],
                    "dtype": "float32",
                    "status": "ok",
                    "ms_median": 1,
                }
            ]
            for i, shape in enumerate(shapes):
                n = 4**i
                if env["device_type"] == "cuda":
                    rows.append(
                        {
                            "op": "copy_bandwidth",
                            "impl": "torch_copy",
                            "shape": shape,
                            "dtype": "float32",
                            "status": "ok",
                            "ms_median": 0.01 * n,
                            "gbps": 2400 + 300 * i,
                            "pct_copy_bw": 100,
                        }
                    )
                for dtype in ("float32", "bfloat16"):
                    for j, impl in enumerate(("torch", "mojo_online", "triton_online")):
                        ms = 0.02 * n * (1.2 - 0.15 * j) * (0.6 if dtype == "bfloat16" else 1)
                        row = {
                            "op": "online_softmax",
                            "impl": impl,
                            "shape": shape,
                            "dtype": dtype,
                            "status": "ok",
                            "ms_median": ms,
                            "ms_p20": ms * 0.97,
                            "ms_p80": ms * 1.05,
                            "host_us": 8 + j,
                        }
                        if env["device_type"] == "cuda":
                            row |= {
                                "gbps": 1000 * (1 + i) * (1 + 0.2 * j),
                                "pct_copy_bw": 30 * (1 + i) + 5 * j,
                                "speedup_vs_torch": 1.2**j,
                                "peak_extra_mib": 0.0,
                            }
                        rows.append(row)
            rows.append(
                {
                    "op": "online_softmax",
                    "impl": "mojo_online",
                    "shape": "65536x65536",
                    "dtype": "float32",
                    "status": "NA",
                    "reason": "OOM: needs 32 GiB",
                }
            )
            rows.append(
                {
                    "op": "online_softmax",
                    "impl": "triton_online",
                    "shape": "7x3",
                    "dtype": "float64",
                    "status": "wrong",
                    "reason": "max abs err 1e-2 > 1e-6",
                    "note": "float64 path",
                }
            )
            with (results_dir / folder / f"{day}.csv").open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=COLUMNS)
                w.writeheader()
                for r in rows:
                    full = (
                        {k: "" for k in COLUMNS}
                        | env
                        | common
                        | {"run_id": NEW_RUN, "timestamp": "2025-01-02T03:04:05+00:00"}
                    )
                    w.writerow(full | {"day": day} | {k: str(v) for k, v in r.items()})


# ---------------------------------------------------------------------------- build


def build(dest: Path, results_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_DAYS_RESULTS_DIR": str(results_dir), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(dest)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-5000:]}"
    assert not re.search(r"^WARNING", log, re.MULTILINE), f"warnings in the build:\n{log[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("site")
    days = [p.parent.name for p in day_readmes()] or ["day009"]
    write_fake_results(tmp / "results", days)
    build(tmp / "site", tmp / "results")
    return tmp / "site"


def test_build_without_results(tmp_path):
    build(tmp_path / "site", tmp_path / "no-results-here")
    for day, readme in built_days(tmp_path / "site").items():
        text = re.sub(r"<[^>]+>", "", (tmp_path / "site" / "days" / day / "index.html").read_text())
        if f"<!-- results: {day} -->" in readme:
            assert "No results yet" in text and f"nox -s bench -- --day {day}" in text
    assert "No results yet" in (tmp_path / "site" / "families" / "softmax" / "index.html").read_text()
    assert "No results yet" in (tmp_path / "site" / "standings" / "index.html").read_text()


def test_build_with_results(site):
    index = (site / "index.html").read_text()
    for day in built_days(site):
        assert f'href="days/{day}/"' in index
        html = (site / "days" / day / "index.html").read_text()
        assert "<table>" in html and "NVIDIA Test GPU 80GB" in html and "999.99" in html
        assert "stale_impl" not in html, "only the latest run may show"
        assert "OOM: needs 32 GiB" in html and "max abs err" in html
        pngs = re.findall(r'<img[^>]+src="(plots/[^"]+\.png)"', html)
        assert pngs, f"{day}: no plot"
        for src in pngs:
            png = site / "days" / day / src
            assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fam = (site / "families" / "softmax" / "index.html").read_text()
    assert "<table>" in fam and "mojo_online" in fam and "stale_impl" not in fam
    assert re.search(r'<img[^>]+src="plots/family-softmax-nvidia-test-gpu-80gb\.png"', fam)
    assert (site / "assets" / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000
    # where each kernel stands: one line per (op, dtype) at the largest shape, best of ours first
    stand = (site / "standings" / "index.html").read_text()
    assert 'href="standings/"' in index and "<table>" in stand and "stale_impl" not in stand
    assert re.search(r"8192x16384</td>\s*<td><code>triton_online</code>", stand)
    assert "1.33×" in stand  # triton_online vs torch eager there: (1.2) / (1.2 - 2 * 0.15), see the fake rows
    assert re.search(r'<img[^>]+src="plots/standings-nvidia-test-gpu-80gb\.png"', stand)
    # nothing fetched from the network at view time: no Google fonts, no CDN
    for page in site.rglob("*.html"):
        text = page.read_text()
        assert "fonts.googleapis" not in text and "unpkg.com" not in text, page


# ---------------------------------------------------------------------------- browser


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4 of the browser)."""

    def __init__(self, exe: str, profile: Path, log: Path):
        to_r, self._w = os.pipe()
        self._r, from_w = os.pipe()
        args = [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w}', "chromium", *args],
            pass_fds=(to_r, from_w),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=self._log,
        )
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []
        self.session = None

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)
        self._log.close()

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError("no answer from chromium")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise EOFError(f"chromium exited (rc={self.proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, timeout: float = 30, page: bool = False) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if page:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def open_page(self, width: int = 1280, height: int = 1000) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network"):
            self.send(f"{domain}.enable", page=True)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            page=True,
        )

    def goto(self, url: str, timeout: float = 30) -> None:
        self.events.clear()
        self.send("Page.navigate", {"url": url}, page=True)
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read(deadline))

    def eval(self, expr: str):
        res = self.send(
            "Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True}, page=True
        )
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expr}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def wait_for(self, expr: str, timeout: float = 20):
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expr)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.1)

    def shadow_svgs(self) -> int:
        """SVGs inside the (closed) shadow roots of div.mermaid: how Material shows a rendered diagram."""
        root = self.send("DOM.getDocument", {"depth": -1, "pierce": True}, page=True)["root"]
        count = 0

        def has_svg(node) -> bool:
            if node.get("nodeName", "").lower() == "svg":
                return True
            return any(has_svg(c) for c in node.get("children", []) + node.get("shadowRoots", []))

        def walk(node):
            nonlocal count
            attrs = node.get("attributes", [])
            cls = dict(zip(attrs[::2], attrs[1::2], strict=False)).get("class", "")
            if node.get("nodeName") == "DIV" and "mermaid" in cls.split():
                count += any(has_svg(s) for s in node.get("shadowRoots", []))
            for c in node.get("children", []) + node.get("shadowRoots", []):
                walk(c)

        walk(root)
        return count

    def screenshot(self, path: Path, width: int = 1280, height: int = 1000, max_height: int = 5000) -> None:
        """The page from the top, up to `max_height` px: the viewport is grown to the page (capturing
        beyond the viewport instead makes the theme hide its header tabs)."""
        full = int(self.send("Page.getLayoutMetrics", page=True)["cssContentSize"]["height"])
        metrics = {"width": width, "deviceScaleFactor": 1, "mobile": False}
        self.send("Emulation.setDeviceMetricsOverride", metrics | {"height": min(max_height, full)}, page=True)
        time.sleep(0.4)  # relayout, and the header tabs fade in
        data = self.send("Page.captureScreenshot", {"format": "png"}, page=True)["data"]
        self.send("Emulation.setDeviceMetricsOverride", metrics | {"height": height}, page=True)
        path.write_bytes(base64.b64decode(data))


@pytest.fixture(scope="module")
def server(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if exe is None:
        pytest.skip("chromium not installed: apt-get install -y chromium (Debian) to run the site's browser test")
    tmp = tmp_path_factory.mktemp("chromium")
    chrome = Chromium(exe, tmp / "profile", tmp / "chromium.log")
    try:
        chrome.open_page()
    except Exception as e:
        chrome.close()
        raise RuntimeError(f"{exe} did not start: {e}\n{(tmp / 'chromium.log').read_text()[-3000:]}") from e
    yield chrome
    chrome.close()


def test_pages_in_chromium(site, server, browser, tmp_path):
    readmes = built_days(site)
    pages = ["", "standings/", "families/softmax/", "about/"] + [f"days/{d}/" for d in readmes]
    shots = []
    for rel in pages:
        url = server + rel
        html = (site / rel / "index.html").read_text()
        browser.goto(url)
        where = f"page {url}"
        title = browser.eval("document.querySelector('article h1') && document.querySelector('article h1').innerText")
        assert title, f"{where}: no title"
        assert "gpu-days" in browser.eval("document.title"), where

        if rel.startswith("days/"):
            day = rel.split("/")[1]
            assert re.search(rf"0*{int(day[3:])}", title), f"{where}: title {title!r}"
        if rel.startswith(("days/", "families/", "standings/")):
            heads = browser.eval("[...document.querySelectorAll('article table th')].map(t => t.innerText)")
            want = ("best", "% of copy") if rel == "standings/" else ("impl", "GB/s")
            assert want[0] in heads and any(want[1] in h for h in heads), f"{where}: no results table ({heads})"
            imgs = browser.wait_for(
                "(() => { const i = [...document.querySelectorAll('article img.gpu-days-plot')];"
                " return i.length && i.every(x => x.complete) &&"
                " i.map(x => ({src: x.getAttribute('src'), w: x.naturalWidth, h: x.naturalHeight})); })()"
            )
            assert imgs, f"{where}: plot images missing or not loaded"
            for img in imgs:
                assert img["w"] > 100 and img["h"] > 100, f"{where}: {img} did not load"
        if rel == "":
            assert browser.eval("document.querySelectorAll('article table a[href*=\"days/day\"]').length") >= len(
                readmes
            ), f"{where}: days table"

        n_mermaid = html.count('class="mermaid"')
        if rel == "about/" or "```mermaid" in readmes.get(rel[5:-1], ""):
            assert n_mermaid, f"{where}: mermaid block not turned into a diagram container"
        if n_mermaid:
            browser.wait_for(f"document.querySelectorAll('div.mermaid').length >= {n_mermaid}")
            assert browser.shadow_svgs() == n_mermaid, f"{where}: mermaid did not render {n_mermaid} SVG(s)"

        time.sleep(0.2)  # let late requests report
        browser.eval("1")
        urls = [e["params"]["request"]["url"] for e in browser.events if e.get("method") == "Network.requestWillBeSent"]
        external = [u for u in urls if not u.startswith((server, "data:", "blob:", "about:"))]
        assert not external, f"{where}: requests leaving the machine: {external}"
        failed = [
            (e["params"]["response"]["url"], e["params"]["response"]["status"])
            for e in browser.events
            if e.get("method") == "Network.responseReceived" and e["params"]["response"]["status"] >= 400
        ]
        assert not failed, f"{where}: failed requests {failed}"
        errors = [
            e["params"]["exceptionDetails"] for e in browser.events if e.get("method") == "Runtime.exceptionThrown"
        ]
        assert not errors, f"{where}: JavaScript errors {errors}"

        shot = tmp_path / ((rel.strip("/").replace("/", "-") or "index") + ".png")
        browser.screenshot(shot)
        assert shot.stat().st_size > 10_000
        shots.append(shot)

    # the dark palette follows the system preference
    browser.send(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}, page=True
    )
    browser.goto(server + (f"days/{next(iter(readmes))}/" if readmes else "families/softmax/"))
    assert browser.wait_for("document.body.getAttribute('data-md-color-scheme') === 'slate'", timeout=5)
    dark = tmp_path / "dark.png"
    browser.screenshot(dark)
    shots.append(dark)

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for shot in shots:
        shutil.copy(shot, SCREENSHOTS / shot.name)
