"""The commands the documentation gives work as written: every `make TARGET` in a code span or
code block is a Makefile target, and every script it names exists and takes the options it is
given there (its --help lists them)."""

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = {"target", ".venv", "node_modules", ".pytest_cache"}
DOCS = sorted(p for p in ROOT.rglob("*.md") if not SKIP & set(p.relative_to(ROOT).parts))
# A script path as the documents write it, relative to the top of the repository.
SCRIPT = re.compile(r"(?<![\w/.])((?:scripts|envoy|bench|sim)/[\w/-]+\.py)\b")


def code(text):
    """The text of a document's code spans (a span broken over lines joined into one) and fenced
    code blocks (a line ending in a backslash joined to the next), one string each."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    spans = [" ".join(s.split("\n")) for s in re.findall(r"`([^`]+)`", prose)]
    return [b.replace("\\\n", " ") for b in blocks] + spans


def commands():
    """(document, make target or (script, options)) for every command in the documents' code."""
    found = []
    for doc in DOCS:
        for span in code(doc.read_text()):
            for line in span.splitlines():
                line = re.sub(r"(^|\s)#.*", "", line)  # a shell comment
                for target in re.findall(r"(?:^|[\s;&(])make ((?:[a-z][\w-]*\s*)+)", line):
                    found += [(doc, t) for t in target.split() if "=" not in t]
                for m in SCRIPT.finditer(line):
                    rest = re.split(r"[;|&]", line[m.end():])[0]
                    options = re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)
                    found.append((doc, (m.group(1), tuple(options))))
    return found


@cache
def make_targets():
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_.-]+):", text, re.M))


@cache
def script_help(script):
    out = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    return out.returncode, out.stdout + out.stderr


def test_the_documents_give_commands():
    found = commands()
    assert sum(isinstance(c, str) for _, c in found) > 20, found
    assert sum(not isinstance(c, str) for _, c in found) > 20, found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_exists_with_its_options(doc):
    wrong = []
    for d, command in commands():
        if d != doc:
            continue
        if isinstance(command, str):
            if command not in make_targets():
                wrong.append(f"make {command}: no such target")
            continue
        script, options = command
        if not (ROOT / script).is_file():
            wrong.append(f"{script}: no such file")
            continue
        if not options:
            continue
        status, text = script_help(script)
        if status != 0:
            wrong.append(f"{script} --help exits {status}: {text[-300:]}")
            continue
        wrong += [f"{script} {o}: not an option" for o in options if not re.search(rf"{re.escape(o)}(?![\w-])", text)]
    assert not wrong, "\n".join(sorted(set(wrong)))
