# A package, so that its conftest.py is imported as ``gpu.conftest`` and never replaces the
# suite's top-level ``conftest`` module that tests/test_*.py import names from.
