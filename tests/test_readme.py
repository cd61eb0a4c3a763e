"""Every code block of the README runs as written and prints something."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# Blocks run from a scratch directory (some write relative paths) against this checkout, with this
# interpreter first on PATH.
ENV = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def blocks(lang):
    text = open(README).read()
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)]


def _id(block):
    return block.strip().splitlines()[0][:60]


# The set-up commands install packages: the environment running these tests is already set up.
# ```shell blocks are long local runs (a 10,000-case fuzz, a sanitizer build in a second tree): runnable
# as written, not run here.
SHELL = [b for b in blocks("bash") if "pip install" not in b]


def test_readme_has_the_blocks_we_check():
    assert len(blocks("python")) >= 3
    assert len(blocks("bash")) == len(SHELL) + 2


@pytest.mark.parametrize("code", blocks("python"), ids=_id)
def test_python_block_runs(code, tmp_path):
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip(), "the block printed nothing"


@pytest.mark.parametrize("script", SHELL, ids=_id)
def test_shell_block_runs(script, tmp_path):
    r = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()
    assert "Traceback" not in r.stderr
