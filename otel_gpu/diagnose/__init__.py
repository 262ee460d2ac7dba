"""Where and why: the logic that names what holds leaked memory, where a hang sits, which rank
never joined (docs/inprocess.md). Pure where it can be, I/O at its edges; imports ``core`` only
(torch lazily). ``tracing/`` (trainer side) and ``agent/`` (watcher side) call it."""
