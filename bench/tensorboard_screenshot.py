"""Screenshot TensorBoard's Time Series page, as docs/TRAINING.md shows it.

Needs a TensorBoard serving the runs, Chromium and its driver, and selenium:

    apt install chromium chromium-driver
    python3 -m venv ~/tb && ~/tb/bin/pip install tensorboard selenium
    ~/tb/bin/tensorboard --logdir runs --port 6006 &
    ~/tb/bin/python bench/tensorboard_screenshot.py docs/images/tensorboard.png

The page is loaded in headless Chromium (software WebGL for the charts),
given time to draw every card, the settings pane closed, and saved.
"""

import argparse
import time
import urllib.parse

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

TAGS = "train/loss|val_loss|learning_rate|tokens_per_s|mfu|data_wait"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the PNG to write")
    ap.add_argument("--url", default="http://localhost:6006")
    ap.add_argument("--tags", default=TAGS, help="TensorBoard's tag filter (a regex)")
    ap.add_argument("--size", default="1400,1060", help="the window, WIDTH,HEIGHT")
    ap.add_argument("--driver", default="/usr/bin/chromedriver")
    ap.add_argument("--wait", type=float, default=12.0, help="seconds to let the cards draw")
    args = ap.parse_args()

    options = webdriver.ChromeOptions()
    for flag in ["--headless=new", "--no-sandbox", "--enable-unsafe-swiftshader",
                 "--hide-scrollbars", f"--window-size={args.size}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(args.driver), options=options)
    try:
        query = urllib.parse.urlencode({"tagFilter": args.tags})
        driver.get(f"{args.url}/?{query}#timeseries")
        time.sleep(args.wait)
        # The toolbar's Settings button toggles the pane that opens on wide windows.
        for button in driver.find_elements("xpath", "//button[contains(., 'Settings')]")[:1]:
            button.click()
        time.sleep(2)
        driver.save_screenshot(args.out)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
