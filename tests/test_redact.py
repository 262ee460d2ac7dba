"""The redaction rules (otel_gpu/core/redact.py): a corpus of command-line shapes, input → output."""

from __future__ import annotations

import random
import string

import pytest

from otel_gpu.core.redact import (
    command_attribute,
    is_secret_name,
    program,
    random_entropy_floor,
    redact_args,
    redact_command,
    redact_text,
    redact_value,
)

pytestmark = pytest.mark.unit

# Realistic-looking fakes (no real credential): each has the length and alphabet of its kind.
HF = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"
GHP = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
GH_FINE = "github_pat_11ABCDEFG0123456789abc_" + "x" * 30 + "Y1z2"
OPENAI = "sk-proj-" + "Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv"
OPENAI_OLD = "sk-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Ji1Hg0Fe"
ANTHROPIC = "sk-ant-api03-" + "Qw3Er4Ty5Ui6Op7As8Df9Gh0Jk1Lz2Xc3Vb4Nm5-_q"
SLACK = "xoxb-123456789012-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx"
AWS_ID = "AKIAIOSFODNN7EXAMPLE"
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
GITLAB = "glpat-" + "Ab3De6Gh9Jk2Mn5Pq8St"
JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpM"
GOOGLE = "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"
RANDOM = "q7Zr2Lx9Kp4Vt8Wm3Ny6Bd1F"  # 24 random base62 characters, no known prefix
SHA = "7ae557604adf67be50417f59c2c2f167def9a775"
WANDB = "5d8a1f0c93b2e7a64f10c8d2b9e3a7f1c6d4e2b0"  # a W&B API key: 40 hex characters
HONEYCOMB = "aF3kq9ZpLm2Xw7RtYb4Ncd"  # a Honeycomb ingest key: 22 characters
BEARER20 = "3f9a0c7e1b5d8f2a6c4e"  # an opaque 20-character token after a bare "Bearer"
PEM_LINES = ("MIIEvQIBADANBgkqhkiG9w0BAQEFAASC", "BKcwggSjAgEAAoIB/AQC7p9+x")
PEM = "-----BEGIN PRIVATE KEY-----\n" + "\n".join(PEM_LINES) + "\n-----END PRIVATE KEY-----"
PEM_SHOWN = "-----BEGIN PRIVATE KEY-----***-----END PRIVATE KEY-----"

P = ["python", "train.py"]  # the program every row starts with (it must survive)

# (argv after the program, expected redacted command after "python train.py ")
CORPUS: list[tuple[list[str], str]] = [
    # flags whose names are secret: --x=v, --x v, -x v
    (["--hf_token", HF], "--hf_token ***"),
    (["--hf-token=" + HF], "--hf-token=***"),
    (["--hub_token", "abc123"], "--hub_token ***"),
    (["--db-pass", "X"], "--db-pass ***"),
    (["--db_password=hunter2"], "--db_password=***"),
    (["-password", "hunter2"], "-password ***"),
    (["--pwd", "s3cr3t"], "--pwd ***"),
    (["--private-key=/tmp/k.pem"], "--private-key=***"),
    (["--api_key", "abc"], "--api_key ***"),
    (["--apiKey", "abc"], "--apiKey ***"),
    (["--client-secret", "abc"], "--client-secret ***"),
    (["--auth", "X"], "--auth ***"),
    (["--credentials", "user:pw"], "--credentials ***"),
    (["--cookie", "sid=abc"], "--cookie ***"),
    (["--session", "abc"], "--session ***"),
    (["--secret_key_b64", "QUJD"], "--secret_key_b64 ***"),
    (["-Dpassword=hunter2"], "-Dpassword=***"),
    # a secret flag followed by another flag (a boolean switch) or a boolean value
    (["--use_auth_token", "--lr", "3e-4"], "--use_auth_token --lr 3e-4"),
    (["--use_auth_token", "True"], "--use_auth_token True"),
    # KEY=VALUE pairs (env, docker -e), including lists of pairs
    (["HF_TOKEN=" + HF], "HF_TOKEN=***"),
    (["-e", "AWS_SECRET_ACCESS_KEY=" + AWS_SECRET], "-e AWS_SECRET_ACCESS_KEY=***"),
    (["WANDB_API_KEY=" + SHA], "WANDB_API_KEY=***"),
    (
        ["OTEL_EXPORTER_OTLP_HEADERS=authorization=Bearer%20abc,x-api-key=k1,tenant=a"],
        "OTEL_EXPORTER_OTLP_HEADERS=authorization=***,x-api-key=***,tenant=a",
    ),
    (["--hub_kwargs", "a=1;token=abc"], "--hub_kwargs a=1;token=***"),
    (["token=abc;private=true"], "token=***"),  # a secret's whole value: it may hold ";"
    # headers: the value hidden, the auth scheme kept
    (["-H", "Authorization: Bearer abc.def"], "-H Authorization: Bearer ***"),
    (["-H", "Proxy-Authorization: Basic dXNlcjpwdw=="], "-H Proxy-Authorization: Basic ***"),
    (["-H", "Cookie: session=abc; theme=dark"], "-H Cookie: ***"),
    (["-H", "X-Api-Key: abc"], "-H X-Api-Key: ***"),
    (["--header=PRIVATE-TOKEN: abc"], "--header=PRIVATE-TOKEN: ***"),
    (["-H", "X-Auth-Token:abc"], "-H X-Auth-Token:***"),
    (["-H", "Authorization:", "Bearer", "abc"], "-H Authorization: Bearer ***"),
    (["-H", "Content-Type: application/json"], "-H Content-Type: application/json"),
    # URLs: user-info and secret query parameters
    (
        ["--push_to", "https://bob:pw123@hub.example.com/x"],
        "--push_to https://***@hub.example.com/x",
    ),
    (["--db=postgres://u:p@db:5432/x"], "--db=postgres://***@db:5432/x"),
    (
        ["https://api.example.com/v1?access_token=abc&page=2"],
        "https://api.example.com/v1?access_token=***&page=2",
    ),
    (
        ["s3://b/k?X-Amz-Credential=AK%2F1&X-Amz-Signature=ff00&x=1"],
        "s3://b/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1",
    ),
    (
        ["https://x.blob.core.windows.net/c?sv=2020&sig=abc"],
        "https://x.blob.core.windows.net/c?sv=2020&sig=***",
    ),
    (["--user", "alice:pw"], "--user alice:***"),
    # known token formats anywhere, the public prefix kept
    ([HF], "hf_***"),
    (["--model_token_is", GHP], "--model_token_is ghp_***"),
    (["--repo", GH_FINE], "--repo github_pat_***"),
    (["--llm", OPENAI], "--llm sk-proj-***"),
    (["--llm", OPENAI_OLD], "--llm sk-***"),
    (["--llm", ANTHROPIC], "--llm sk-ant-***"),
    (["--notify", SLACK], "--notify xoxb-***"),
    (["--aws", AWS_ID], "--aws AKIA***"),
    (["--gitlab", GITLAB], "--gitlab glpat-***"),
    (["--bearer", JWT], "--bearer eyJ***"),
    (["--maps", GOOGLE], "--maps AIza***"),
    (["--opaque", RANDOM], "--opaque ***"),
    (["--cfg=x:" + RANDOM], "--cfg=x:***"),
    (["--q=Bearer%20" + HF], "--q=Bearer%20hf_***"),
    # numbered or versioned flags, a flag written like a header, vendor header names
    (["--api_key2", "numbered-secret"], "--api_key2 ***"),
    (["--hf_token_1", "numbered-secret"], "--hf_token_1 ***"),
    (["--token-v2", "numbered-secret"], "--token-v2 ***"),
    (["--api-key:", "colon-secret"], "--api-key: ***"),
    (["--api-key:colon-secret"], "--api-key:***"),
    (
        ["OTEL_EXPORTER_OTLP_HEADERS=x-honeycomb-team=" + HONEYCOMB],
        "OTEL_EXPORTER_OTLP_HEADERS=x-honeycomb-team=***",
    ),
    (["--sentry_dsn", "dsn-secret"], "--sentry_dsn ***"),
    # a tool's login key, an OAuth fragment, a bare Bearer, a PEM body
    (["wandb", "login", WANDB], "wandb login ***"),
    (
        ["wandb", "login", "--relogin", "--host", "https://w.example.com", WANDB],
        "wandb login --relogin --host https://w.example.com ***",
    ),
    (
        ["https://idp.example.com/cb#access_token=frag-secret&token_type=bearer"],
        "https://idp.example.com/cb#access_token=***&token_type=bearer",
    ),
    (["Bearer", BEARER20], "Bearer ***"),
    (["-c", f"KEY = '{PEM}'"], f"-c KEY = '{PEM_SHOWN}'"),
    # ordinary arguments survive (negative rows)
    (["--lr", "3e-4", "--max_steps", "10"], "--lr 3e-4 --max_steps 10"),
    (["--output_dir", "/tmp/x"], "--output_dir /tmp/x"),
    (["--tokenizer_name", "gpt2", "--max_tokens", "512"], "--tokenizer_name gpt2 --max_tokens 512"),
    (
        ["--max_new_tokens", "128", "--token_file", "/run/t"],
        "--max_new_tokens 128 --token_file /run/t",
    ),
    (["--model", "Qwen/Qwen2.5-0.5B-Instruct"], "--model Qwen/Qwen2.5-0.5B-Instruct"),
    (
        ["--resume", f"/hf/models--Qwen--Qwen2.5-0.5B/snapshots/{SHA}/ckpt"],
        f"--resume /hf/models--Qwen--Qwen2.5-0.5B/snapshots/{SHA}/ckpt",
    ),
    (["--revision", SHA], f"--revision {SHA}"),
    (
        ["--run_id", "550e8400-e29b-41d4-a716-446655440000"],
        "--run_id 550e8400-e29b-41d4-a716-446655440000",
    ),
    (
        ["--model_type", "LlamaForCausalLMWithValueHead2"],
        "--model_type LlamaForCausalLMWithValueHead2",
    ),
    (
        ["--run_name", "sft-Qwen2-0-5B-lr3e-4-bs16-20241201"],
        "--run_name sft-Qwen2-0-5B-lr3e-4-bs16-20241201",
    ),
    (["--num_key_value_heads", "8"], "--num_key_value_heads 8"),
    (["--moe-token-dispatcher-type", "alltoall"], "--moe-token-dispatcher-type alltoall"),
    (
        ["--pad_token", "<|endoftext|>", "--input_key", "prompt"],
        "--pad_token <|endoftext|> --input_key prompt",
    ),
    (["--author", "alice", "--num_passes", "3"], "--author alice --num_passes 3"),
    (["--dataset", "HuggingFaceH4/ultrachat_200k"], "--dataset HuggingFaceH4/ultrachat_200k"),
    (["--task-abcdefghijklmnopqrstuvwxyz"], "--task-abcdefghijklmnopqrstuvwxyz"),
    (
        ["--dataset-v2", "alpaca", "--max_new_tokens_2", "64"],
        "--dataset-v2 alpaca --max_new_tokens_2 64",
    ),
    (["login", WANDB], f"login {WANDB}"),  # hex after no tool that takes its key that way
    (
        ["-u", "1000:1000", "--per_device_train_batch_size", "2"],
        "-u 1000:1000 --per_device_train_batch_size 2",
    ),
]

SECRETS = [
    HF, GHP, GH_FINE, OPENAI, OPENAI_OLD, ANTHROPIC, SLACK, AWS_ID, AWS_SECRET, GITLAB, JWT,
    GOOGLE, RANDOM, "hunter2", "s3cr3t", "pw123", "dXNlcjpwdw==", "abc.def",
    "numbered-secret", "colon-secret", "dsn-secret", "frag-secret", HONEYCOMB, BEARER20,
    *PEM_LINES,
]  # fmt: skip


@pytest.mark.parametrize(("args", "expected"), CORPUS, ids=[str(i) for i in range(len(CORPUS))])
def test_corpus(args: list[str], expected: str) -> None:
    cmd = redact_command([*P, *args])
    assert cmd == "python train.py " + expected
    assert cmd.startswith("python train.py")  # the program stays identifiable
    for secret in SECRETS:
        assert secret not in cmd


def test_corpus_is_large_and_has_negative_rows() -> None:
    assert len(CORPUS) >= 40
    unchanged = [row for row in CORPUS if " ".join(row[0]) == row[1]]
    assert len(unchanged) >= 15


# An argument holding a space is one word only in argv: those rows are not free text.
JOINABLE = [row for row in CORPUS if not any(" " in a for a in row[0])]


@pytest.mark.parametrize(("args", "expected"), JOINABLE)
def test_free_text_is_judged_like_a_command_line(args: list[str], expected: str) -> None:
    """A command line already joined (process.command_line, a log message) gives the same
    result wherever no single argument holds a space."""
    assert redact_text(" ".join([*P, *args])) == "python train.py " + expected


def test_free_text_keeps_its_whitespace_and_masks_split_headers() -> None:
    text = f"retrying\twith  Authorization: Bearer {JWT}\nand token={HF} (cookie: a=1; b=2)"
    assert redact_text(text) == (
        "retrying\twith  Authorization: Bearer ***\nand token=*** (cookie: *** ***"
    )


def test_a_pem_block_in_free_text_is_masked_across_its_lines() -> None:
    text = f"loaded {PEM}\nthen\n-----BEGIN RSA PRIVATE KEY-----\n{PEM_LINES[0]}"  # cut short
    assert redact_text(text) == (f"loaded {PEM_SHOWN}\nthen\n-----BEGIN RSA PRIVATE KEY-----***")


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("hf_token", True), ("HF_TOKEN", True), ("hubToken", True), ("X-Api-Key", True),
        ("AWS_SECRET_ACCESS_KEY", True), ("db-pass", True), ("Authorization", True),
        ("Proxy-Authorization", True), ("Set-Cookie", True), ("sessionToken", True),
        ("oauth", True), ("GOOGLE_APPLICATION_CREDENTIALS", True), ("passphrase", True),
        ("api_key_b64", True), ("api_key2", True), ("hf_token_1", True), ("tokenV2", True),
        ("x-honeycomb-team", True), ("SENTRY_DSN", True), ("dataset_v2", False),
        ("tokenizer_name", False), ("max_tokens", False),
        ("token_file", False), ("secret_name", False), ("num_key_value_heads", False),
        ("pad_token", False), ("eos_token", False), ("input_key", False), ("label_key", False),
        ("author", False), ("bypass", False), ("num_passes", False), ("session_dir", False),
        ("Content-Type", False), ("keys", False),
    ],
)  # fmt: skip
def test_secret_names(name: str, secret: bool) -> None:
    assert is_secret_name(name) is secret


def _random(n: int, rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


def test_random_strings_are_masked_and_identifiers_are_not() -> None:
    rng = random.Random(7)
    missed = [s for n in (20, 24, 32, 48) for s in (_random(n, rng) for _ in range(500))]
    missed = [s for s in missed if redact_text(s) != "***"]
    assert len(missed) <= 0.02 * 2000  # documented: about 99 in 100 are caught
    assert random_entropy_floor(20) == 3.5 and random_entropy_floor(100) == 4.3
    kept = [
        "per_device_train_batch_size", "Qwen2ForSequenceClassification", SHA,
        "0123456789abcdef0123456789ABCDEF", "MyExperimentRunDecember2024",
        "checkpoint-1000_best_model_v2", "train_data_2024_12_01_final", "trainer-7f9c8d6b5-x2k9p",
    ]  # fmt: skip
    assert [redact_text(k) for k in kept] == kept


def test_program_survives_every_mode() -> None:
    argv = ["/usr/bin/python3.11", "-u", "scripts/sft.py", "--hf_token", HF]
    assert command_attribute(argv) == "/usr/bin/python3.11 -u scripts/sft.py --hf_token ***"
    assert command_attribute(argv, "executable") == "/usr/bin/python3.11 scripts/sft.py"
    assert command_attribute(argv, "off") is None
    assert command_attribute([], "redacted") is None
    assert program(["python", "-m", "torch.distributed.run", "--token", "x"]) == (
        "python -m torch.distributed.run"
    )
    assert program(["python", "-c", "print(1)"]) == "python -c"
    assert program(["python3", "-W", "ignore", "-X", "dev", "t.py", "-v"]) == "python3 t.py"
    assert program(["torchrun", "--nproc_per_node", "8", "train.py"]) == "torchrun"
    assert redact_args(["swift", "sft", "--hub_token", "x"]) == [
        "swift",
        "sft",
        "--hub_token",
        "***",
    ]


def test_redact_value_walks_json_like_values() -> None:
    doc = {"text": f"HF_TOKEN={HF}", "n": 3, "args": ["--api_key", "abc"], "t": ("a", HF)}
    assert redact_value(doc) == {
        "text": "HF_TOKEN=***",
        "n": 3,
        "args": ["--api_key", "abc"],  # list items are separate values, judged alone
        "t": ("a", "hf_***"),
    }


@pytest.mark.parametrize("max_len", [1, 20, 33, 34, 35, 60, 1000])
def test_a_cut_command_is_the_prefix_of_the_whole(max_len: int) -> None:
    argv = [*P, "--hf_token", HF, "--lr", "3e-4", "-H", "Authorization: Bearer abc"]
    whole = redact_command(argv)
    assert redact_command(argv, max_len) == whole[:max_len]
    assert command_attribute(argv, "executable", 8) == "python t"
