"""`make run`'s stack (`scripts/stack.py run`: the simulated fleet's demo preset, sidecar-metrics
and Envoy with the filter, in the build GPUROUTE_RUNTIME names): it comes up, and every command it
prints for the user to paste works as printed. Run with `--any-ports`, so that it binds no fixed
port; the printed commands name the ports it took."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def printed_commands(text):
    """The shell commands in the demo's output: lines indented by two spaces that start with
    `curl` or `head`, joined with their `\\` continuation lines."""
    commands, current = [], ""
    for line in text.splitlines():
        if current or re.match(r"  (curl|head) ", line):
            current += line.strip()
            if current.endswith("\\"):
                current = current[:-1]
                continue
            commands.append(current)
            current = ""
    return commands


@pytest.mark.skipif(shutil.which("curl") is None, reason="the printed commands need curl")
def test_every_command_make_run_prints_works_as_printed(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "stack.py"), "run", "--any-ports"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        out = []
        deadline = time.time() + 120
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C stops everything." in line:
                break
            assert time.time() < deadline, "".join(out)[-3000:]
        text = "".join(out)
        assert "gpuroute is up" in text, text[-3000:]
        commands = printed_commands(text)
        curls = [c for c in commands if c.startswith("curl")]
        # Chat, Messages, the models list, the split, the audio upload, the adapter, the stats.
        assert len(curls) == 7 and any("transcriptions" in c for c in curls), commands
        for c in commands:
            run = subprocess.run(["bash", "-c", c], capture_output=True, text=True, timeout=60, cwd=tmp_path)
            assert run.returncode == 0, (c, run.stderr)
            if not c.startswith("curl"):
                continue
            if "/stats/prometheus" in c:
                # The requests above, counted with the pool and the outcome as labels.
                assert re.search(r'(?m)^envoy_gpuroute_pool_requests\{.*gpuroute_pool="llama-8b".*'
                                 r'gpuroute_outcome="picked".*\} [1-9]', run.stdout), (c, run.stdout[:1000])
                continue
            if " -i" not in c:
                assert '"object":"list"' in run.stdout, (c, run.stdout[:300])
                continue
            head = run.stdout.split("\r\n\r\n")[0]
            assert head.startswith("HTTP/1.1 200"), (c, run.stdout[:500])
            served = re.search(r"(?im)^x-served-by: (\S+)", head).group(1)
            pool = "whisper" if "whisper" in c else "(llama|qwen)" if '"assistant"' in c else "llama"
            assert re.match(pool, served), (c, served)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
