"""The lab checks: tests of the lab scripts in benchmarks/ (`python -m pytest benchmarks/checks`, a part of its own
in .ci/run), kept out of tests/ because nothing the test suite imports lives outside the package. The scripts
import as they do when run (benchmarks/ on the path), and the test suite's fixtures, helpers and hooks
(tests/conftest.py) apply here too: its namespace is this conftest's, so `from conftest import hf_tiny` in a
tests/ helper module finds the same names."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

_spec = importlib.util.spec_from_file_location("tests_conftest", ROOT / "tests" / "conftest.py")
_tests_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests_conftest)
globals().update({k: v for k, v in vars(_tests_conftest).items() if not k.startswith("__")})
