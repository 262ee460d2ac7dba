"""What a person sees locally: the live view, the end-of-run summary, the recording and the
HTML report, all fed by the agent's sweeps (:mod:`otel_gpu.outputs.sweeps`)."""
