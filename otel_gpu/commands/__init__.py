"""``otel-gpu`` subcommands, one module each."""
