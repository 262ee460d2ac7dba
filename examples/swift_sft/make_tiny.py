"""Write a tiny random Qwen2 model, a locally trained tokenizer and chat data for ``swift sft``.

    python examples/swift_sft/make_tiny.py /tmp/tiny-sft

Everything is generated here (no downloads); the same generator feeds the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from support.tiny_training import write_swift_assets  # noqa: E402

if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-sft")
    paths = write_swift_assets(root)
    print("\n".join(f"{name}: {path}" for name, path in paths.items()))
