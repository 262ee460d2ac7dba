"""Code the tests share, one module per concern.

Test modules import from here, never from each other (tests/test_suite_layout.py
holds that rule)."""
