"""Which GPU a process trains on, decided once by flexium.init().

The setting decides (init's ``device=``, ``GPU_DEVICE``, .flexiumrc, else ``cuda:LOCAL_RANK``
under torchrun, else ``cuda:0``) unless the script already chose: a script that called
``torch.cuda.set_device`` (or used CUDA) before ``flexium.init()`` has its tensors on that GPU,
and moving the rest of the job elsewhere would split it. A device choice never ends a job: a
setting that cannot be followed (a GPU this process does not see, a choice the script overrode)
is a warning, and the job trains on a GPU it sees.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "cuda:N" or "cpu"
    warning: str | None = None  # why the setting was not followed, for the job's log


def choose_device(
    *, setting: str, where: str, visible: int, script_device: int | None, local_rank: int | None = None
) -> DeviceChoice:
    """``setting``: the configured device, "cuda:N" or "cpu"; ``where``: where it came from, as
    messages name it ("GPU_DEVICE", "the default"); ``visible``: the GPUs this process sees;
    ``script_device``: the GPU the script chose before init, None when it chose none;
    ``local_rank``: torchrun's LOCAL_RANK, when the default came from it."""
    if setting == "cpu":
        return DeviceChoice("cpu")
    ordinal = int(setting.split(":", 1)[1])
    if script_device is not None:
        chosen = f"cuda:{script_device}"
        if script_device == ordinal:
            return DeviceChoice(chosen)
        if local_rank is not None:
            return DeviceChoice(
                chosen,
                f"training on {chosen}, the GPU the script chose before flexium.init() (torch.cuda.set_device), "
                f"not cuda:{local_rank} of its LOCAL_RANK: ranks that share a GPU cannot be moved as a whole when "
                "they use NCCL; give each rank its own GPU (torch.cuda.set_device(LOCAL_RANK)) to move the job",
            )
        return DeviceChoice(
            chosen,
            f"training on {chosen}, the GPU the script chose before flexium.init() (torch.cuda.set_device); "
            f"device {setting} ({where}) is not used",
        )
    if visible <= 0:  # the start-up line says why there is no GPU
        return DeviceChoice("cpu")
    if ordinal < visible:
        return DeviceChoice(setting)
    warning = f"device {setting} ({where}) does not exist: this process sees {_gpus(visible)}; training on cuda:0"
    if local_rank is not None:
        warning += "; a rank that sees only its own GPU (CUDA_VISIBLE_DEVICES per rank) can be paused but not moved"
    return DeviceChoice("cuda:0", warning)


def _gpus(count: int) -> str:
    return "1 GPU (cuda:0)" if count == 1 else f"{count} GPUs (cuda:0..cuda:{count - 1})"
