"""Take docs/prefect-ui-run.png: the Prefect UI showing a finished sft run (a docs step, not a test).

    apt-get install -y chromium                    # headless Chromium, once
    .venv/bin/python docs/screenshot.py            # about a minute on 2 CPU cores

Starts a Prefect server with its UI on a free port (own database in a temporary folder), runs the sft flow
on a tiny model against it, opens the run's page in headless Chromium and keeps the PNG small.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "prefect-ui-run.png"
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(api: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"no Prefect server at {api} after {timeout_s} s")


def run_tiny_flow(work: Path, env: dict) -> None:
    from tiny_models import SAMPLE_ROWS, save_tiny_model

    model = save_tiny_model(work / "tiny-llama")
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in SAMPLE_ROWS * 4))
    subprocess.run([sys.executable, "-m", "flows.sft", "--model-id", str(model), "--dataset", str(data),
                    "--eval-dataset", str(data), "--mixed-precision", "no", "--max-steps", "30", "--batch-size", "4",
                    "--lr", "0.02", "--max-length", "96", "--eval-prompts", "1", "--max-new-tokens", "8",
                    "--registered-model-name", "twinkle-tiny-llama", "--output-dir", str(work / "runs")],
                   cwd=work, env=env, check=True)


def latest_flow_run(api: str) -> str:
    request = urllib.request.Request(f"{api}/flow_runs/filter", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"sort": "START_TIME_DESC", "limit": 1}).encode())
    with urllib.request.urlopen(request) as response:
        return json.load(response)[0]["id"]


def screenshot(url: str, target: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("no chromium: apt-get install -y chromium")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1440,1000", "--virtual-time-budget=20000", f"--screenshot={target}", url],
                   check=True, capture_output=True, timeout=120)


def shrink(source: Path, target: Path, max_bytes: int = 300_000) -> None:
    """Quantize to a palette (UI screenshots have few colours) so the PNG stays well under `max_bytes`."""
    from PIL import Image

    image = Image.open(source).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
    image.save(target, optimize=True)
    if target.stat().st_size > max_bytes:
        raise SystemExit(f"{target} is {target.stat().st_size} bytes, more than {max_bytes}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        api = f"http://127.0.0.1:{port}/api"
        env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(work / "prefect"),
               "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{work / 'prefect.db'}",
               "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "TWINKLE_CACHE": str(work / "cache"),
               "PYTHONPATH": str(ROOT)}
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                   "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_healthy(api)
            run_tiny_flow(work, env)
            raw = work / "raw.png"
            screenshot(f"http://127.0.0.1:{port}/runs/flow-run/{latest_flow_run(api)}", raw)
            shrink(raw, OUTPUT)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    print(f"wrote {OUTPUT} ({OUTPUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
