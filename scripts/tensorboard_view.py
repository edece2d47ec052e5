"""TensorBoard's own page for a run directory, served on 127.0.0.1 and read in headless Chromium
(Debian's chromium and chromium-driver, driven by Selenium): what a user sees after
`tensorboard --logdir runs/`.  tests/launch/test_tensorboard_browser.py asserts what the page
lists; this command takes README's screenshot of it:

    python scripts/tensorboard_view.py --logdir runs/digits --out docs/images/tensorboard.png
"""
import argparse
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# Without the background-networking flags Chromium keeps dialling Google's hosts, which this
# kind of machine refuses (FACTS.md §5); as root it needs --no-sandbox.
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")
COUNT = re.compile(r"Tags matching filter\s+(\d+) cards?")


def missing() -> str | None:
    """Why the browser cannot run here (one line with the fix), or None."""
    absent = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if absent:
        return (f"{' and '.join(absent)} not found: install Debian's browser with "
                f"`apt-get install chromium chromium-driver` (.ci/run does)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e \".[test]\""
    return None


def serve(logdir: Path) -> str:
    """Start TensorBoard on 127.0.0.1 (a free port) in this process; return its URL.  The
    server's threads end with the process."""
    from tensorboard import program
    board = program.TensorBoard()
    board.configure(argv=[None, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0",
                          "--reload_interval", "0"])
    return board.launch()


@contextmanager
def browser():
    """A headless Chromium with its own empty profile, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    profile = tempfile.mkdtemp(prefix="opd-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for(probe, timeout: float = 60.0, every: float = 0.25):
    """probe()'s first truthy value, polled until `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"the TensorBoard page did not show it within {timeout:.0f} s")
        time.sleep(every)


def open_time_series(driver, url: str) -> None:
    """Load the Time Series dashboard (TensorBoard's default page) and wait for its groups."""
    driver.get(url + "#timeseries")
    wait_for(lambda: groups(driver))


def groups(driver) -> list[str]:
    """The tag groups the page lists, in its order (one per tag prefix: loss, rollout, ...)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.card-group .group-title')]"
        ".map(e => e.textContent.trim())")


def matching(driver, regex: str) -> int:
    """Type `regex` into the page's tag filter; return how many cards the page says match.
    Read once the page shows this filter's result (no match, or cards whose tags all match
    it), never after a fixed wait: the page recounts as the text arrives."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    box = driver.find_element(By.CSS_SELECTOR, "metrics-tag-filter input")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.BACKSPACE)
    box.send_keys(regex)
    pattern = re.compile(regex)

    def result():       # (count,) where the page agrees with itself on `regex`'s result
        text = driver.find_element(By.TAG_NAME, "metrics-main-view").text
        titles = card_titles(driver, "metrics-filtered-view")   # the cards drawn so far
        none = f"No matches for tag filter /{regex}/" in text
        found = COUNT.search(text)                # no count is written for a single card
        if box.get_attribute("value") != regex or not all(pattern.search(t) for t in titles):
            return None
        if none:
            return None if titles or found else (0,)
        if found:
            return (int(found.group(1)),) if titles else None
        return (1,) if len(titles) == 1 else None

    def twice():        # the same answer on two reads: the page has stopped recounting
        first = wait_for(result)
        return first if result() == first else None

    return wait_for(twice)[0]


def card_titles(driver, within: str = "metrics-main-view") -> list[str]:
    """The full tag of every card rendered now in the page's element `within`."""
    return driver.execute_script(
        "return [...document.querySelectorAll(arguments[0] + ' card-view tb-truncated-path')]"
        ".map(e => e.getAttribute('title') || e.textContent.replace(/\\s+/g, ''))", within)


def screenshot(logdir: Path, out: Path) -> Path:
    with browser() as driver:
        open_time_series(driver, serve(logdir))
        time.sleep(3)                                   # the first group's charts draw
        driver.save_screenshot(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", type=Path, required=True, help="a run directory, or runs/")
    parser.add_argument("--out", type=Path, default=Path("docs/images/tensorboard.png"))
    args = parser.parse_args()
    why = missing()
    if why:
        raise SystemExit(f"tensorboard_view: {why}")
    print(screenshot(args.logdir, args.out))


if __name__ == "__main__":
    main()
