"""How a person's target text is read (protocol.read_target: the CLI checks with it, the server
resolves by it) and how a process gets its short name (wire.job_name: `flexium ps` NAME)."""

from __future__ import annotations

import pytest

from flexium import protocol, wire


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cuda:1", protocol.TargetText(ordinal=1)),
        (" cuda:0 ", protocol.TargetText(ordinal=0)),
        ("3", protocol.TargetText(index=3)),
        (
            "GPU-5d2c1a3e-0b1f-4c1d-9e8f-0123456789ab",
            protocol.TargetText(uuid="GPU-5d2c1a3e-0b1f-4c1d-9e8f-0123456789ab"),
        ),
        ("MIG-1a2b", protocol.TargetText(uuid="MIG-1a2b")),
    ],
)
def test_the_three_ways_to_name_a_gpu(text: str, expected: protocol.TargetText) -> None:
    assert protocol.read_target(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "cuda1",
            "target 'cuda1' is not a GPU name: use cuda:N (the job's own numbering), N (nvidia-smi's index) "
            "or a GPU UUID (GPU-...); did you mean cuda:1?",
        ),
        ("gpu:2", "did you mean cuda:2?"),
        ("GPU 0", "did you mean cuda:0?"),
        ("device-3", "did you mean cuda:3?"),
        ("cuda:x", "target 'cuda:x' is not cuda:N (N: the job's CUDA ordinal, in digits 0-9)"),
        ("cuda:١", "is not cuda:N"),
        ("²", "is not a GPU name"),
        ("", "the target is empty"),
        ("my-gpu", "is not a GPU name"),
    ],
)
def test_a_mistyped_target_is_refused_with_what_was_meant(text: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        protocol.read_target(text)
    assert message in str(refused.value)
    if "did you mean" not in message:
        assert "did you mean" not in str(refused.value)


@pytest.mark.parametrize(
    "cmdline, name",
    [
        ("/usr/bin/python3 train.py --lr 0.1", "train.py"),
        ("/opt/venv/bin/python -u /home/me/jobs/finetune.py", "finetune.py"),
        ("python -m torch.distributed.run --nproc-per-node 2 train_ddp.py", "train_ddp.py"),
        ("python3 -X dev -m pkg.train --epochs 3", "pkg.train"),
        ("python -c 'import x'", "python"),
        ("/opt/venv/bin/accelerate launch train.py", "train.py"),
        ("python3 'my script.py'", "my script.py"),
        ("python3", "python3"),
        ("", ""),
        ("python3 'unbalanced.py", "unbalanced.py"),
    ],
)
def test_a_process_is_named_by_its_script_or_module(cmdline: str, name: str) -> None:
    assert wire.job_name(cmdline) == name
