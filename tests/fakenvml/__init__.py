"""The fake libnvidia-ml.so.1 (C), its build and its pytest fixtures."""
