"""The live view of a watched job (``otel-gpu run`` / ``watch`` / ``demo``) on stderr."""

from otel_gpu.outputs.view.live import LIVE, OFF, PLAIN, LiveView, choose_mode, make_console

__all__ = ["LIVE", "OFF", "PLAIN", "LiveView", "choose_mode", "make_console"]
