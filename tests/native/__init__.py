"""Tests of the extension module lowwater._native (a package: the table tests share _tables.py)."""
