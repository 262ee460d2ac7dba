"""The vocabulary the agent, the processor and the trainer's in-process part share.

Nothing here samples, exports or decides: the signal contract (names, units, what feeds the
engine), the settings machinery (declared once, resolved once), errors, units, redaction, the
job's identity, one bounded HTTP server, bounded shutdown and the Prometheus scrape endpoint.
Every other part may import ``core``; ``core`` imports none of them.
"""
