"""A parent of a vLLM server, for the tests that kill it: `eval.serve.Server` on a 16-bit model, then wait.

    python -m tests.integration.vllm_parent MODEL_DIR SERVER_LOG

Prints "child PID" as soon as the server's child process exists (its pid is its process group's id) and "ready"
once the server answers, then serves until it is killed.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from eval.serve import Server


def _report_child(server: Server) -> None:
    while server.proc is None:
        time.sleep(0.02)
    print(f"child {server.proc.pid}", flush=True)


def main(model_dir: str, log: str) -> None:
    server = Server(Path(model_dir), {"served-model-name": "tiny", "dtype": "float16", "max-model-len": 256},
                    log=Path(log), timeout=400)
    threading.Thread(target=_report_child, args=(server,), daemon=True).start()
    with server:
        print("ready", flush=True)
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
