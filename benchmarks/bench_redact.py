"""Cost of redacting one 4 KiB command line, beside the rules it replaced.

    python benchmarks/bench_redact.py [--bytes N] [--repeat R]

A process's command is redacted once, when the process is first seen (then cached under its
PID and start time), so this is a per-new-process cost on the sampler thread. The command is
a `swift sft` line of ordinary flags with a few credentials among them, repeated to N bytes.
The baseline, measured in the same run on the same line, is the redaction the agent had
before (a flag-name regex, URL user-info): much narrower, kept here only to compare. Prints
microseconds per command line for both (best of R runs) and ends with one JSON line
{"name", "value", "baseline", "ratio", "unit"}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from otel_gpu.core.redact import redact_command

_OLD_SECRET_KEY = re.compile(
    r"(token|passw(or)?d|secret|api[_-]?key|access[_-]?key|credential)", re.I
)
_OLD_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def old_redact_command(args: list[str]) -> str:
    """The previous ``otel_gpu.sampling.procfs.redact_command``, verbatim."""
    out: list[str] = []
    mask_next = False
    for arg in args:
        if mask_next:
            out.append("***")
            mask_next = False
            continue
        arg = _OLD_URL_CREDENTIALS.sub("***@", arg)
        key, eq, _value = arg.partition("=")
        if _OLD_SECRET_KEY.search(key):
            if eq:
                arg = f"{key}=***"
            elif arg.startswith("-"):
                mask_next = True
        out.append(arg)
    return " ".join(out)


CHUNK = [
    "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--dataset", "/data/train.jsonl",
    "--tuner_type", "lora", "--torch_dtype", "bfloat16", "--max_steps", "1000",
    "--per_device_train_batch_size", "2", "--learning_rate", "3e-4",
    "--output_dir", "/mnt/runs/sft-qwen2-0.5b/7ae557604adf67be50417f59c2c2f167def9a775",
    "--hub_token", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567", "--report_to", "wandb",
    "--push_to", "https://bob:pw123@hub.example.com/x", "HF_ENDPOINT=https://hf-mirror.com",
    "--max_length", "2048", "--tokenizer_name", "gpt2", "--logging_steps", "5",
]  # fmt: skip


CUT = 256  # ProcessTree's command_max_len


def command_line(n_bytes: int) -> list[str]:
    args = ["/usr/bin/python3", "/venv/lib/python3.11/site-packages/swift/cli/sft.py"]
    while len(" ".join(args)) < n_bytes:
        args.extend(CHUNK)
    return args


def best_us(fn: object, args: list[str], repeat: int, loops: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(loops):
            fn(args)  # type: ignore[operator]
        times.append((time.perf_counter() - start) / loops * 1e6)
    return min(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096, help="command line length")
    parser.add_argument("--repeat", type=int, default=7, help="runs; the best one counts")
    args = parser.parse_args(argv)
    line = command_line(args.bytes)
    loops = 50
    # Interleaved so that a busy host slows both alike.
    new, old = [], []
    for _ in range(args.repeat):
        old.append(best_us(old_redact_command, line, 1, loops))
        new.append(best_us(redact_command, line, 1, loops))
    value, baseline = min(new), min(old)
    # What ProcessTree pays per new process: process.command is cut at 256 characters, and
    # the new rules stop reading arguments there (the old ones redacted everything, then cut).
    cut = min(best_us(lambda a: redact_command(a, CUT), line, 1, loops) for _ in range(3))
    print(f"command line: {len(' '.join(line))} bytes, {len(line)} arguments")
    print(f"baseline (previous redact_command): {baseline:.1f} us per command line")
    print(f"otel_gpu.core.redact.redact_command:     {value:.1f} us per command line")
    print(f"  cut at {CUT} characters (ProcessTree): {cut:.1f} us per new process")
    print(
        json.dumps(
            {
                "name": "redact_command_4kib",
                "value": round(value, 1),
                "baseline": round(baseline, 1),
                "ratio": round(value / baseline, 2),
                "unit": "us/command",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
