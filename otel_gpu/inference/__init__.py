"""Inference servers beside the sidecar: their metrics, what they say about the GPUs, readiness."""
