"""``otel-gpu report``: a recorded run as one self-contained HTML page with plots."""
