"""The suite's own rules: it never writes to the user's cache, and under CI=true a skip for a missing
real component (g++, nginx, Chromium, ...) fails the run, so a green CI has run the kernel, replica
and browser tests; elsewhere such a skip stays a skip, counted."""

from __future__ import annotations

import os
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
TESTS = """
import pytest

def test_runs():
    assert True

def test_needs_a_compiler():
    pytest.skip("no g++: the kernels cannot be built")

def test_optional():
    pytest.skip("an optional model package is not installed")
"""


def run(pytester, monkeypatch, ci: str):
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(TESTS)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider")


def test_a_missing_component_fails_a_ci_run(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "true")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*skipped: 2 test(s), 1 for a missing component*", "*test_needs_a_compiler*no g++*"])


def test_elsewhere_a_missing_component_is_a_counted_skip(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*skipped: 2 test(s), 1 for a missing component*"])


def test_the_suite_never_touches_the_users_cache():
    from conftest import TEST_CACHE
    from specstream.cache import cache_dir

    assert cache_dir() == TEST_CACHE and os.environ["SPECSTREAM_CACHE_DIR"] == str(TEST_CACHE)
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specstream"
    assert user not in TEST_CACHE.parents and TEST_CACHE != user
