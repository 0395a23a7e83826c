"""flexium.api.device_routing on CPU torch.

CPU torch cannot really run `.cuda()`, so the methods that routing wraps are first replaced by
recorders (installed with monkeypatch, which puts torch's own back afterwards); the recorders
see the device each call would have used.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium.api import device_routing  # noqa: E402

ORIGINAL_TENSOR_CUDA = torch.Tensor.cuda
ORIGINAL_MODULE_CUDA = torch.nn.Module.cuda


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def tensor_cuda(
        self, tensor: Any, device: Any = None, non_blocking: bool = False, memory_format: Any = None
    ) -> Any:
        self.calls.append(("tensor", device, non_blocking, memory_format))
        return tensor

    def module_cuda(self, module: Any, device: Any = None) -> Any:
        self.calls.append(("module", device))
        return module


@pytest.fixture(autouse=True)
def always_uninstalled() -> Iterator[None]:
    device_routing.uninstall()
    yield
    device_routing.uninstall()
    assert torch.Tensor.cuda is ORIGINAL_TENSOR_CUDA
    assert torch.nn.Module.cuda is ORIGINAL_MODULE_CUDA


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()

    def tensor_cuda(self: Any, device: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Any:
        return rec.tensor_cuda(self, device, non_blocking, memory_format)

    def module_cuda(self: Any, device: Any = None) -> Any:
        return rec.module_cuda(self, device)

    monkeypatch.setattr(torch.Tensor, "cuda", tensor_cuda)
    monkeypatch.setattr(torch.nn.Module, "cuda", module_cuda)
    return rec


def test_bare_tensor_cuda_goes_to_managed_device(recorder: Recorder) -> None:
    device_routing.install(lambda: "cuda:1")
    t = torch.zeros(2)
    assert t.cuda() is t
    assert recorder.calls == [("tensor", "cuda:1", False, None)]


def test_explicit_device_is_respected(recorder: Recorder) -> None:
    device_routing.install(lambda: "cuda:1")
    t = torch.zeros(2)
    t.cuda(3)
    t.cuda("cuda:2")
    t.cuda(device=torch.device("cuda", 0))
    assert [c[1] for c in recorder.calls] == [3, "cuda:2", torch.device("cuda", 0)]


def test_other_arguments_pass_through(recorder: Recorder) -> None:
    device_routing.install(lambda: "cuda:1")
    t = torch.zeros(2)
    t.cuda(non_blocking=True, memory_format=torch.contiguous_format)
    t.cuda(None, True)
    t.cuda(2, non_blocking=True)
    assert recorder.calls == [
        ("tensor", "cuda:1", True, torch.contiguous_format),
        ("tensor", "cuda:1", True, None),
        ("tensor", 2, True, None),
    ]


def test_bare_module_cuda_goes_to_managed_device(recorder: Recorder) -> None:
    device_routing.install(lambda: "cuda:1")
    model = torch.nn.Linear(2, 2)
    assert model.cuda() is model
    model.cuda(0)
    assert recorder.calls == [("module", "cuda:1"), ("module", 0)]


def test_managed_device_is_read_at_call_time(recorder: Recorder) -> None:
    current = {"device": "cuda:0"}
    device_routing.install(lambda: current["device"])
    t = torch.zeros(1)
    t.cuda()
    current["device"] = "cuda:3"
    t.cuda()
    assert [c[1] for c in recorder.calls] == ["cuda:0", "cuda:3"]


def test_real_module_cuda_routes_every_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's own Module.cuda calls tensor.cuda(device) for each parameter and buffer: with the
    # module patch it receives the managed device explicitly.
    seen: list[Any] = []

    def tensor_cuda(self: Any, device: Any = None, non_blocking: bool = False, memory_format: Any = None) -> Any:
        seen.append(device)
        return self

    monkeypatch.setattr(torch.Tensor, "cuda", tensor_cuda)
    device_routing.install(lambda: "cuda:1")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    model.cuda()
    assert seen and all(d == "cuda:1" for d in seen)
    assert len(seen) == len(list(model.parameters())) + len(list(model.buffers()))


def test_cpu_managed_device_keeps_tensors_on_cpu() -> None:
    device_routing.install(lambda: "cpu")
    t = torch.ones(2, 3, 4, 5)
    moved = t.cuda(non_blocking=True, memory_format=torch.channels_last)
    assert moved.device.type == "cpu"
    assert moved.is_contiguous(memory_format=torch.channels_last)
    model = torch.nn.Linear(2, 2)
    assert model.cuda() is model
    assert next(model.parameters()).device.type == "cpu"


def test_uninstall_restores_exact_originals() -> None:
    assert "cuda" not in torch.Tensor.__dict__  # inherited from torch._C.TensorBase
    device_routing.install(lambda: "cuda:1")
    assert device_routing.is_installed()
    assert torch.Tensor.cuda is not ORIGINAL_TENSOR_CUDA
    assert torch.nn.Module.cuda is not ORIGINAL_MODULE_CUDA
    device_routing.uninstall()
    assert not device_routing.is_installed()
    assert torch.Tensor.cuda is ORIGINAL_TENSOR_CUDA
    assert torch.nn.Module.cuda is ORIGINAL_MODULE_CUDA
    assert "cuda" not in torch.Tensor.__dict__
    assert device_routing.managed_device() is None


def test_uninstall_restores_an_earlier_patch(recorder: Recorder) -> None:
    earlier_tensor_cuda = torch.Tensor.__dict__["cuda"]
    earlier_module_cuda = torch.nn.Module.__dict__["cuda"]
    device_routing.install(lambda: "cuda:1")
    device_routing.uninstall()
    assert torch.Tensor.__dict__["cuda"] is earlier_tensor_cuda
    assert torch.nn.Module.__dict__["cuda"] is earlier_module_cuda
    torch.zeros(1).cuda()
    assert recorder.calls == [("tensor", None, False, None)]


def test_install_twice_wraps_once_and_uses_latest_provider(recorder: Recorder) -> None:
    device_routing.install(lambda: "cuda:1")
    first = torch.Tensor.__dict__["cuda"]
    device_routing.install(lambda: "cuda:2")
    assert torch.Tensor.__dict__["cuda"] is first
    torch.zeros(1).cuda()
    assert recorder.calls == [("tensor", "cuda:2", False, None)]
    device_routing.uninstall()
    device_routing.uninstall()  # twice is harmless too
    assert not device_routing.is_installed()


def test_wrappers_keep_name_and_docs() -> None:
    device_routing.install(lambda: "cuda:1")
    assert torch.Tensor.cuda.__name__ == "cuda"
    assert torch.Tensor.cuda.__doc__ == ORIGINAL_TENSOR_CUDA.__doc__
    assert torch.nn.Module.cuda.__doc__ == ORIGINAL_MODULE_CUDA.__doc__
    assert torch.nn.Module.cuda.__wrapped__ is ORIGINAL_MODULE_CUDA
    assert inspect.signature(torch.nn.Module.cuda) == inspect.signature(ORIGINAL_MODULE_CUDA)


def test_patch_made_on_top_is_left_in_place_and_ours_goes_inert(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    device_routing.install(lambda: "cuda:1")
    ours = torch.Tensor.__dict__["cuda"]

    def theirs(self: Any, *args: Any, **kwargs: Any) -> Any:
        return ours(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cuda", theirs)
    device_routing.uninstall()
    assert torch.Tensor.__dict__["cuda"] is theirs
    torch.zeros(1).cuda()
    assert recorder.calls == [("tensor", None, False, None)]


def test_install_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="function returning a device string"):
        device_routing.install("cuda:1")  # type: ignore[arg-type]
    assert not device_routing.is_installed()


def test_concurrent_install_uninstall_leaves_torch_intact(recorder: Recorder) -> None:
    before_tensor = torch.Tensor.__dict__["cuda"]
    before_module = torch.nn.Module.__dict__["cuda"]
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(200):
                device_routing.install(lambda: "cuda:1")
                torch.zeros(1).cuda()
                device_routing.uninstall()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert torch.Tensor.__dict__["cuda"] is before_tensor
    assert torch.nn.Module.__dict__["cuda"] is before_module
    # every call went either to the managed device or, between install and uninstall of another
    # thread, through untouched; never anywhere else
    assert {c[1] for c in recorder.calls} <= {"cuda:1", None}


def test_flexium_imports_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import flexium.config, flexium._logging, flexium.api.device_routing, flexium.api.recoverable\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
