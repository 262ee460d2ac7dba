"""Kubernetes: which pod and container the watched processes and GPUs belong to."""
