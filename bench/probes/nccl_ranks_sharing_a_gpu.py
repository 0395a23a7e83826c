"""Two NCCL ranks on one GPU, NCCL suspended around a driver checkpoint and restore of one rank or
both, without flexium's engine: fact `nccl-ranks-sharing-gpu-fail` (a rank the driver restored there fails its
next collective). Why is not known; run it again on a new driver or NCCL: while it fails, flexium
refuses to move NCCL ranks that share a GPU.

    python bench/probes/nccl_ranks_sharing_a_gpu.py --nccl /path/libnccl.so.2 [--cases sockets:none,...]
        [--no-controls]

Each case is a 2-rank torchrun job (DDP, both ranks on cuda:0) that trains 20 steps, suspends its
communicator (ncclCommSuspend, NCCL_SUSPEND_MEM), checkpoints and restores the ranks the case
names (none, pause0, pause1, both) by the driver's calls from a thread of their own, resumes NCCL
(ncclCommResume) and checks it with a one-element all-reduce. NCCL refuses two ranks of one host
on one GPU unless told: "sockets", each rank names a host of its own (NCCL_HOSTID) and NCCL
connects them by its socket transport; "ipc", NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30+). A case
may set NCCL's settings in its ranks: "sockets+NCCL_CUMEM_HOST_ENABLE=0:both" (NCCL then makes
its host memory by cudaHostAlloc, not as cuMem allocations on the host).

Then controls without NCCL (--no-controls skips them), each a process restored (or not) by the
driver: two 2-second kernels while another process keeps the GPU busy (or not). One table row per
case, each also printed as a JSON line as it is measured. Needs a GPU and an NCCL with
ncclCommSuspend (2.29.7+), which the job loads by LD_PRELOAD (ci/build-nccl.sh builds one).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import run_child  # noqa: E402
from cuda_driver import checkpoint_and_restore_self  # noqa: E402
from tables import print_table  # noqa: E402

CASES = (
    "sockets:none",
    "sockets:pause0",
    "sockets:pause1",
    "sockets:both",
    "ipc:both",
    "sockets+NCCL_CUMEM_HOST_ENABLE=0:both",
    "ipc+NCCL_CUMEM_HOST_ENABLE=0:both",
)
CONTROLS = ("plain:shared", "restored:alone", "restored:shared")
SUSPEND_AT_STEP = 20
NCCL_SUSPEND_MEM = 0x01
LONG_KERNEL_CYCLES = 4_000_000_000  # about 2 s on an H200


def rank_main(case: str) -> None:
    """In each rank (under torchrun): prints one JSON line with what its check all-reduce did."""
    spec, who = case.rsplit(":", 1)
    transport, *settings = spec.split("+")
    os.environ.update(dict(setting.split("=", 1) for setting in settings))  # NCCL reads them at its init
    rank = int(os.environ["RANK"])
    if transport == "sockets":
        os.environ.update(NCCL_HOSTID=f"probe-rank-{rank}", NCCL_SOCKET_IFNAME="lo")
    else:
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    optimizer = torch.optim.AdamW(ddp.parameters())
    data = torch.Generator(device="cuda").manual_seed(10 + rank)
    for _ in range(SUSPEND_AT_STEP):
        loss = ddp(torch.randn(256, 2048, device="cuda", generator=data)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()
    seen: dict[str, Any] = {"rank": rank}
    if who != "none":
        nccl = ctypes.CDLL("libnccl.so.2")
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
        comm = ctypes.c_void_p(backend._comm_ptr())  # type: ignore[attr-defined]  # NCCL backend only
        seen["suspend"] = int(nccl.ncclCommSuspend(comm, NCCL_SUSPEND_MEM))
        if who in ("both", f"pause{rank}"):
            seen["driver"] = checkpoint_and_restore_self()
        store = dist.distributed_c10d._get_default_store()
        store.set(f"restored/{rank}", "1")
        store.wait([f"restored/{r}" for r in range(dist.get_world_size())])
        seen["resume"] = int(nccl.ncclCommResume(comm))
    probe = torch.ones(1, device="cuda")
    began = time.perf_counter()
    try:
        dist.all_reduce(probe)
        seen["check"] = f"{probe.item():g} in {time.perf_counter() - began:.2f} s"
    except Exception as exc:  # the watchdog usually aborts the process first
        seen["check"] = f"{exc}".splitlines()[0]
    print(json.dumps(seen), flush=True)
    dist.destroy_process_group()


def run_case(case: str, nccl: str, timeout: float) -> dict[str, Any]:
    env = {
        **os.environ,
        "LD_PRELOAD": nccl,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "NCCL_DEBUG": "WARN",
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += [__file__, "--rank-case", case]
    child = run_child(argv, env, timeout)  # past the timeout torchrun and both ranks are killed
    out, err, code = child.stdout, child.stderr, None if child.timed_out else child.returncode
    ranks = {int(s["rank"]): s for s in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    failure = next((line.strip() for line in err.splitlines() if "CUDA error" in line), None)
    row: dict[str, Any] = {"case": case, "exit": "timeout" if code is None else code}
    warning = next((line.strip() for line in err.splitlines() if "NCCL WARN" in line), None)
    if warning:
        row["first NCCL warning"] = warning  # in the row's JSON line, not the table
    for rank in (0, 1):
        seen = ranks.get(rank)
        row[f"rank {rank}"] = seen["check"] if seen else f"died: {failure or 'see its stderr'}"
    return row


def control_main(mode: str, company: str) -> None:
    """In a child: optionally restored by the driver, two long kernels beside a busy process or
    alone; prints one JSON line."""
    import torch

    torch.ones(1, device="cuda").sum().item()
    seen: dict[str, Any] = {}
    if mode == "restored":
        seen["driver"] = checkpoint_and_restore_self()
    busy = None
    if company == "shared":
        busy = subprocess.Popen([sys.executable, __file__, "--busy", "12"], stdout=subprocess.PIPE, text=True)
        time.sleep(3)  # its CUDA context is up and it is launching
    kernels = []
    for _ in range(2):
        began = time.perf_counter()
        try:
            torch.cuda._sleep(LONG_KERNEL_CYCLES)
            torch.cuda.synchronize()
            kernels.append(f"{time.perf_counter() - began:.2f} s")
        except Exception as exc:
            kernels.append(f"{exc}".splitlines()[0])
            break
    seen["kernels"] = kernels
    if busy is not None:
        seen["busy"] = busy.communicate()[0].strip()
    print(json.dumps(seen), flush=True)


def busy_main(seconds: float) -> None:
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    until, launches = time.time() + seconds, 0
    while time.time() < until:
        a = (a @ a).tanh()
        launches += 1
        if launches % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(f"{launches} matmuls", flush=True)


def _child(argv: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """A control's child run: the JSON line it printed last, or None and how it ended (its last
    line on stderr says how far it came)."""
    child = run_child(argv, dict(os.environ), timeout)
    if child.timed_out:
        said = child.stderr.strip().splitlines()
        return None, f"timeout, {said[-1] if said else 'nothing said'}"
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1]), ""
    return None, f"died: {child.stderr.strip()[-200:]}"


def run_control(control: str, timeout: float) -> dict[str, Any]:
    mode, company = control.split(":")
    seen, failure = _child([sys.executable, __file__, "--control", control], timeout)
    seen = seen or {"kernels": [failure]}
    return {
        "case": f"no NCCL, {mode}, {'beside a busy process' if company == 'shared' else 'alone'}",
        "exit": "",
        "rank 0": ", ".join(seen["kernels"]),
        "rank 1": seen.get("busy", ""),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nccl", help="a libnccl.so.2 with ncclCommSuspend, LD_PRELOADed into the ranks")
    parser.add_argument("--cases", default=",".join(CASES), help="TRANSPORT:WHO, comma-separated")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds each case may take")
    parser.add_argument("--no-controls", action="store_true", help="skip the controls without NCCL")
    parser.add_argument("--rank-case", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    parser.add_argument("--busy", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_case:
        rank_main(args.rank_case)
        return 0
    if args.control:
        control_main(*args.control.split(":"))
        return 0
    if args.busy is not None:
        busy_main(args.busy)
        return 0
    if not args.nccl:
        parser.error("--nccl names the libnccl.so.2 to preload (ci/build-nccl.sh builds one)")
    rows: list[dict[str, Any]] = []

    def measured(row: dict[str, Any]) -> None:
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # each row as it comes: a run cut short keeps them

    for case in (c.strip() for c in args.cases.split(",") if c.strip()):
        print(f"-- {case}", file=sys.stderr, flush=True)
        measured(run_case(case, os.path.realpath(args.nccl), args.timeout))
    for control in () if args.no_controls else CONTROLS:
        print(f"-- control {control}", file=sys.stderr, flush=True)
        measured(run_control(control, args.timeout))
    columns = ("case", "exit", "rank 0: check all-reduce (control: kernels)", "rank 1 (control: the busy one)")
    print_table(columns, [[str(row[key]) for key in ("case", "exit", "rank 0", "rank 1")] for row in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
