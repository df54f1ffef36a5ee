"""Environment variables: every one the library reads is parsed by e3attn._env, and a typo is an error naming it."""
import pathlib
import re
import subprocess
import sys

import pytest

from e3attn._env import env_choice, env_flag

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text, expected", [
    ("1", True), ("true", True), ("YES", True), (" On ", True), ("True\n", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False), (" 0 ", False),
])
def test_flag_spellings(monkeypatch, text, expected):
    monkeypatch.setenv("E3ATTN_TEST_FLAG", text)
    assert env_flag("E3ATTN_TEST_FLAG", not expected) is expected


@pytest.mark.parametrize("default", [True, False])
def test_flag_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("E3ATTN_TEST_FLAG", raising=False)
    assert env_flag("E3ATTN_TEST_FLAG", default) is default
    monkeypatch.setenv("E3ATTN_TEST_FLAG", "  ")
    assert env_flag("E3ATTN_TEST_FLAG", default) is default


@pytest.mark.parametrize("text", ["2", "-1", "enable", "truee", "y", "n", "1.0", "none"])
def test_flag_refuses_anything_else_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv("E3ATTN_TEST_FLAG", text)
    with pytest.raises(ValueError, match=rf"E3ATTN_TEST_FLAG must be 1, true, yes or on \(enabled\), 0, false, no "
                                         rf"or off \(disabled\), in any case, or unset; got '{re.escape(text)}'"):
        env_flag("E3ATTN_TEST_FLAG", True)


def test_choice(monkeypatch):
    choices = ("openmp", "python", "tbb")
    monkeypatch.delenv("E3ATTN_TEST_CHOICE", raising=False)
    assert env_choice("E3ATTN_TEST_CHOICE", choices, "openmp") == "openmp"
    monkeypatch.setenv("E3ATTN_TEST_CHOICE", " Python ")
    assert env_choice("E3ATTN_TEST_CHOICE", choices, "openmp") == "python"
    monkeypatch.setenv("E3ATTN_TEST_CHOICE", "omp")
    with pytest.raises(ValueError, match="E3ATTN_TEST_CHOICE must be 'openmp', 'python' or 'tbb' "
                                         r"\(in any case, or unset\), got 'omp'"):
        env_choice("E3ATTN_TEST_CHOICE", choices, "openmp")


def run_with(variable, value, code):
    """``code`` run in a fresh interpreter (the switches are read at import) with ``variable=value``."""
    env = {"PATH": "/usr/bin:/bin", variable: value}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


FUSED = "import torch, e3attn.kernels as k; print(k.fused_enabled(torch.device('cpu'), torch.float32))"
CUDA = "import e3attn.kernels as k; print(k._CUDA_ENABLED)"


@pytest.mark.parametrize("variable, value, code, printed", [
    ("E3ATTN_FUSED_KERNELS", "false", FUSED, "False"), ("E3ATTN_FUSED_KERNELS", "Off", FUSED, "False"),
    ("E3ATTN_FUSED_KERNELS", "yes", FUSED, "True"), ("E3ATTN_CUDA_KERNELS", "on", CUDA, "True"),
    ("E3ATTN_CUDA_KERNELS", "no", CUDA, "False"), ("E3ATTN_CUDA_KERNELS", " Auto", CUDA, "None"),
    ("E3ATTN_CUDA_KERNELS", "", CUDA, "None"),
])
def test_kernel_switches_read_every_spelling(variable, value, code, printed):
    done = run_with(variable, value, code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == printed


@pytest.mark.parametrize("variable, auto", [("E3ATTN_FUSED_KERNELS", False), ("E3ATTN_CUDA_KERNELS", True)])
def test_kernel_switches_refuse_a_typo_at_import(variable, auto):
    done = run_with(variable, "ture", "import e3attn")
    assert done.returncode != 0
    assert f"ValueError: {variable} must be 1, true, yes or on" in done.stderr and "got 'ture'" in done.stderr
    assert ("off (disabled), auto," in done.stderr) == auto


def test_every_variable_is_read_through_the_one_parser():
    """No module but e3attn/_env.py reads the environment itself (a new variable gets env_flag or env_choice)."""
    readers = re.compile(r"os\.environ|os\.getenv|getenv\(|environ\.get|from os import")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "e3attn").rglob("*.py"))
             if path.name != "_env.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if readers.search(line.split("#")[0])]
    assert not found, f"environment read outside e3attn/_env.py: {found}"
