"""flexium run's command line: its amounts of memory, the GPU it names as the job will see it, and
the host it runs on."""

from __future__ import annotations

import pytest

from flexium import units, wire
from flexium.cli import run as run_cli
from flexium.cli.exit_status import UsageError
from flexium.cli.main import build_parser
from flexium.cli.run import HostGpus
from flexium.client import Unreachable


def test_memory_reads_as_people_write_it() -> None:
    assert units.read_size("40GiB") == units.read_size("40g") == 40 << 30
    assert units.read_size("512MiB") == 512 << 20 and units.read_size("1.5GB") == 1_500_000_000
    assert units.read_size("1000") == 1000
    with pytest.raises(ValueError, match="not an amount of memory"):
        units.read_size("forty gigs")


def test_memory_without_its_unit_is_refused_naming_the_units() -> None:
    """--memory 40 meant 40 GiB to its user and 40 bytes to read_size: the job would start on a full GPU."""
    for text in ("40", "1.5"):
        with pytest.raises(UsageError, match=rf"--memory {text}: give its unit, e\.g\. {text}GiB or {text}MiB"):
            run_cli._memory(text)
    assert run_cli._memory("40GiB") == 40 << 30


def test_the_gpu_it_names_is_one_the_job_sees() -> None:
    gpus = HostGpus(
        ordinals={"GPU-b": 0, "GPU-a": 1},
        indexes={0: "GPU-a", 1: "GPU-b"},
        reports=[wire.GpuReport(uuid="GPU-a", index=0), wire.GpuReport(uuid="GPU-b", index=1)],
    )
    assert gpus.uuid_of("auto") is None
    assert gpus.uuid_of("cuda:0") == "GPU-b"  # the job's CUDA numbering
    assert gpus.uuid_of("0") == "GPU-a"  # nvidia-smi's index
    assert gpus.uuid_of("GPU-b") == "GPU-b"
    for wrong in ("cuda:2", "7", "GPU-c", "gpu0"):
        with pytest.raises(UsageError):
            gpus.uuid_of(wrong)
    with pytest.raises(UsageError, match=r"'cuda1'.*; did you mean cuda:1\?; or auto"):
        gpus.uuid_of("cuda1")
    # a number the job cannot see is not suggested: the range it sees is
    with pytest.raises(UsageError, match=r"'cuda5'.*; the job sees cuda:0 to cuda:1; or auto") as refused:
        gpus.uuid_of("cuda5")
    assert "did you mean" not in str(refused.value)


def test_the_command_follows_its_options() -> None:
    args = build_parser().parse_args(["run", "--memory", "40GiB", "--priority", "high", "--", "python", "-u", "t.py"])
    assert args.command == ["--", "python", "-u", "t.py"] and args.memory == "40GiB" and args.priority == "high"


def test_it_asks_again_while_the_server_cannot_be_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted server: the placement is a row, so flexium run waits on, saying so once."""
    placement = wire.PlacementInfo(
        id=7, host="node1", state="waiting", gpu_uuid=None, need_bytes=0, priority=50, position=1, placed_uuid=None,
        placed_index=None, process_id=None, created_at=0.0, placed_at=None, finished_at=None, requested_by="alice",
        command="python t.py", note="waits for a GPU", reservation=None,
    )  # fmt: skip
    down = Unreachable("cannot reach the flexium server at http://s: refused", code="unreachable")
    answers: list[wire.PlacementInfo | Exception] = [down, down, placement.model_copy(update={"state": "placed"})]

    class Api:
        def report_placement(self, placement_id: int, body: wire.PlacementReport) -> wire.PlacementInfo:
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    said: list[str] = []
    monkeypatch.setattr(run_cli, "ASK_EVERY_S", 0.0)
    monkeypatch.setattr(run_cli, "read_reports", list)
    monkeypatch.setattr(run_cli, "_say", said.append)
    assert run_cli._wait_until_placed(Api(), placement).state == "placed"  # type: ignore[arg-type]
    assert said == [
        "placement 7 waits (number 1 to start on node1): waits for a GPU",
        f"placement 7: {down.message}; asking again",
    ]


def test_a_host_without_a_gpu_says_how_to_try_it_on_the_demos_simulated_host(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_driver() -> HostGpus:
        raise RuntimeError("no NVIDIA driver: could not load libcuda.so.1")

    monkeypatch.setattr(HostGpus, "read", staticmethod(no_driver))
    args = build_parser().parse_args(["run", "--memory", "4GiB", "--", "python", "t.py"])
    assert run_cli._run(None, args) == 1  # type: ignore[arg-type]  # refused before any request
    err = capsys.readouterr().err
    assert "nothing to place the job on: no NVIDIA driver: could not load libcuda.so.1" in err
    assert "the variables of the simulated host that `flexium demo` prints before flexium run" in err
