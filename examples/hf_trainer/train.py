"""A tiny HF Trainer run (random Llama, integer tokens, CPU, no downloads) to see the spans.

    opentelemetry-instrument python examples/hf_trainer/train.py /tmp/hf-out

No code here mentions OpenTelemetry: the ``otel_gpu`` distro attaches the Trainer callback.
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int = 32, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main(output_dir: str) -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=20,
        per_device_train_batch_size=8,
        logging_steps=5,
        eval_strategy="steps",
        eval_steps=10,
        save_steps=10,
        report_to=[],
        use_cpu=True,
    )
    trainer = Trainer(
        model=LlamaForCausalLM(config),
        args=args,
        train_dataset=Tokens(256),
        eval_dataset=Tokens(32),
    )
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/otel-gpu-hf-example")
