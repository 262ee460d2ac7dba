"""Tiny models, tokenizers and datasets generated locally for training tests (no downloads).

- :func:`tiny_llama` / :class:`TokenDataset`: a random ``LlamaForCausalLM`` on integer tokens
  for in-process HF Trainer runs (~0.05 s per step on CPU);
- :func:`write_swift_assets`: a random ``Qwen2ForCausalLM``, a byte-level BPE tokenizer trained
  here and chat jsonl files, for ``swift sft`` offline on CPU (docs/background.md §4);
- :func:`swift_sft_argv` / :func:`offline_env`: the command line and environment that run it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

VOCAB = 128


def tiny_llama(seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


class TokenDataset:
    """``n`` rows of ``length`` random token ids; row ``fail_at`` raises (a bad sample)."""

    def __init__(self, n: int = 64, length: int = 16, seed: int = 0, fail_at: int | None = None):
        rng = random.Random(seed)
        self.rows = [[rng.randrange(VOCAB) for _ in range(length)] for _ in range(n)]
        self.fail_at = fail_at

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        if self.fail_at is not None and i == self.fail_at:
            raise ValueError(f"bad sample {i}")
        ids = torch.tensor(self.rows[i])
        return {"input_ids": ids, "labels": ids.clone()}


def training_args(output_dir: str | Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    values: dict[str, Any] = {
        "output_dir": str(output_dir),
        "max_steps": 6,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "logging_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 3,
        "save_strategy": "steps",
        "save_steps": 3,
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        "save_only_model": False,
        "seed": 0,
    }
    values.update(overrides)
    return TrainingArguments(**values)


# -- swift sft -----------------------------------------------------------------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    "the",
    "a",
    "gpu",
    "trains",
    "fast",
    "slow",
    "model",
    "data",
    "loss",
    "step",
    "memory",
    "leak",
    "checkpoint",
    "epoch",
]


def write_swift_assets(root: Path, rows: int = 48) -> dict[str, Path]:
    """A model dir (random Qwen2 + tokenizer) and train/val jsonl under ``root``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    rng = random.Random(0)
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    sentences = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 9))) for _ in range(rows)
    ]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    chat = [
        f"<|im_start|>user\n{s}<|im_end|>\n<|im_start|>assistant\n{s}<|im_end|>" for s in sentences
    ]
    tok.train_from_iterator(chat + ["system user assistant You are a helpful assistant."], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(model_dir)

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(model_dir)

    def write(path: Path, items: list[str]) -> None:
        with path.open("w") as f:
            for s in items:
                row = {
                    "messages": [
                        {"role": "user", "content": s},
                        {"role": "assistant", "content": s[::-1]},
                    ]
                }
                f.write(json.dumps(row) + "\n")

    train, val = root / "train.jsonl", root / "val.jsonl"
    write(train, sentences)
    write(val, sentences[:8])
    return {"model": model_dir, "train": train, "val": val}


def swift_sft_argv(assets: dict[str, Path], output_dir: Path, **overrides: Any) -> list[str]:
    """``swift sft`` arguments for a short offline CPU run (docs/background.md §4 recipe)."""
    values: dict[str, Any] = {
        "model": assets["model"],
        "model_type": "qwen2",
        "template": "qwen2_5",
        "dataset": assets["train"],
        "val_dataset": assets["val"],
        "tuner_type": "full",
        "torch_dtype": "float32",
        "max_steps": 10,
        "per_device_train_batch_size": 2,
        "logging_steps": 2,
        "eval_steps": 5,
        "save_steps": 5,
        "max_length": 128,
        "dataset_num_proc": 1,
        "dataloader_num_workers": 0,
        "report_to": "none",
        "check_model": "false",
        "add_version": "false",
        "output_dir": output_dir,
    }
    values.update(overrides)
    argv = ["sft"]
    for key, value in values.items():
        argv += [f"--{key}", str(value)]
    return argv


def offline_env(**extra: str) -> dict[str, str]:
    """The environment for offline CPU runs: no hub access, no GPU, no stray OTel settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TRACEPARENT"))}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        MODELSCOPE_OFFLINE="1",
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


# The watched job: a hand-written training loop run under `opentelemetry-instrument` with
# OTEL_METRICS_EXPORTER=prometheus (its own /metrics for training.step / training.phase) and
# its spans over OTLP; an evaluation every 40 steps.
TRAINING_LOOP = """
import time
import otel_gpu

with otel_gpu.phase("train"):
    for n in range(1, 100_000):
        otel_gpu.step(n, loss=1.0 / n)
        time.sleep(0.1)
        if n % 40 == 0:
            with otel_gpu.phase("evaluate"):
                time.sleep(0.5)
"""
