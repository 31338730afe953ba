"""Data-parallel tests on 8 fake CPU devices (run in a subprocess; see conftest.py)."""
