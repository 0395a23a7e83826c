"""Whether a pause could checkpoint the job while the copier still copies its memory to the host
(issue 39 item 2: the 64 GiB pause spends 0.6-0.8 s in its checkpoint after a copy step of 7.3 s,
fact `streamed-staging-pace`): can a process that exported its memory, then unmapped and released
its own handle (the fd alone kept), be checkpointed while another process that imported the fd copies
from it; does either slow the other; are the bytes intact; does the GPU come free once both let go;
and can the job, restored, map its memory back from the fd (what a copy that failed half way needs)?

    python bench/probes/copy_during_checkpoint.py [--gb 16] [--job-gb 0.5] [--rounds 2]

The job is a fresh process (ctypes on libcuda, no torch) with --job-gb GiB of its own (what stays in a
fast-paused job's context, outside its pool). Each round it makes --gb GiB with cuMemCreate (POSIX fd
exportable), fills it with a byte of the round, exports the fd and sends it here (SCM_RIGHTS). This
process stands for the copier: a context of its own on the same GPU and --gb GiB of pinned host memory;
it imports and maps the fd, then per round measures:
  copy alone        the copy to the host while the job waits (the pause's copy step, its floor);
  checkpoint alone  the job unmaps and releases its handle, keeps the fd, locks and checkpoints itself,
                    this process holding the import idle; restored and unlocked, the job imports its
                    fd again, maps it at the same address and checks the bytes (a rollback's way back);
  both              the job's release, lock and checkpoint ordered at the same moment the copy starts:
                    each one's seconds, the wall time to the later, the bytes copied checked; then this
                    process lets go of the import and the job, still checkpointed, closes its fd: NVML's
                    memory used on GPU 0 is read before and after, and after this process's context goes
                    (`GPU used` columns: the job's context is checkpointed by then, so only what the fd
                    held and this context should have gone).
The job is restored at the end of each round and checks its own --job-gb GiB. Needs one NVIDIA GPU.
Sizes are GiB (2^30 bytes), bandwidths GB/s (10^9).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import Talking  # noqa: E402
from cuda_driver import CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEMHOSTREGISTER_PORTABLE, Driver  # noqa: E402
from host_cumem_staging import gpu_used_mib  # noqa: E402
from host_staging import GIB, MADV_POPULATE_WRITE, Libc, fmt, gbps, now  # noqa: E402
from tables import print_table  # noqa: E402

COPY_PIECE = 256 << 20
SAMPLES = 64  # bytes checked per copy, spread over the range


class JobMemory:
    """--gb GiB made with cuMemCreate at a reserved address of the job's, mapped for its GPU."""

    def __init__(self, drv: Driver, size: int) -> None:
        self.drv, self.size = drv, size
        self.prop = drv.prop(drv.device)
        granularity = drv.granularity(self.prop)
        self.size = -(-size // granularity) * granularity
        self.va = drv.reserve(self.size)
        self.handle = drv.create(self.size, self.prop)
        drv.map(self.va, self.size, self.handle)
        drv.set_access(self.va, self.size, drv.device)
        self.fd = -1

    def fill(self, byte: int) -> None:
        self.drv.call("cuMemsetD8", self.va, byte, self.size)
        self.drv.call("cuCtxSynchronize")

    def export(self) -> int:
        fd = ctypes.c_int(-1)
        self.drv.call(
            "cuMemExportToShareableHandle", ctypes.byref(fd), self.handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
        )
        self.fd = fd.value
        return self.fd

    def release(self) -> None:
        """The pause's `release`: our mapping and handle go, the address stays reserved, the fd holds it."""
        self.drv.call("cuMemUnmap", self.va, self.size)
        self.drv.call("cuMemRelease", self.handle)
        self.handle = 0

    def map_back(self) -> None:
        handle = ctypes.c_ulonglong()
        self.drv.call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(self.fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        self.handle = handle.value
        self.drv.map(self.va, self.size, self.handle)
        self.drv.set_access(self.va, self.size, self.drv.device)

    def bytes_are(self, byte: int) -> bool:
        return all(b == byte for b in read_samples(self.drv, self.va, self.size))

    def close(self) -> None:
        if self.handle:
            self.drv.call("cuMemUnmap", self.va, self.size)
            self.drv.call("cuMemRelease", self.handle)
            self.handle = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.drv.call("cuMemAddressFree", self.va, self.size)


def read_samples(drv: Driver, va: int, size: int) -> bytes:
    out = ctypes.create_string_buffer(SAMPLES)
    for k in range(SAMPLES):
        offset = (size - 1) * k // (SAMPLES - 1)
        drv.call("cuMemcpyDtoHAsync", ctypes.addressof(out) + k, va + offset, 1, None)
    drv.call("cuCtxSynchronize")
    return out.raw


def job_main(sock_fd: int, gb: float, job_gb: float) -> None:
    """The job: makes, exports, releases, checkpoints and restores its memory as told on stdin."""
    drv = Driver()
    drv.primary_context(0)
    own = ctypes.c_uint64()
    own_size = max(1, int(job_gb * GIB))
    drv.call("cuMemAlloc", ctypes.byref(own), own_size)
    drv.call("cuMemsetD8", own.value, 5, own_size)
    drv.call("cuCtxSynchronize")
    sock = socket.socket(fileno=sock_fd)
    pid = os.getpid()
    memory: JobMemory | None = None

    def checkpoint_steps(names: tuple[str, ...]) -> dict[str, Any]:
        said: dict[str, Any] = {}

        def drive() -> None:  # not on the thread whose CUDA calls the lock waits for
            for name in names:
                started = now()
                code = drv.fns[f"cuCheckpointProcess{name}"](pid, None)
                said[name.lower()] = round(now() - started, 4)
                if code:
                    said["error"] = f"{name} failed: {drv.error_name(code)}"
                    return

        thread = threading.Thread(target=drive, daemon=True)
        thread.start()
        thread.join(120)
        if thread.is_alive():
            said["error"] = "no return in 120 s"
        return said

    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        order, _, arg = line.strip().partition(" ")
        said: dict[str, Any] = {}
        if order == "make":
            memory = JobMemory(drv, int(gb * GIB))
            memory.fill(int(arg))
            socket.send_fds(sock, [json.dumps({"size": memory.size}).encode()], [memory.export()])
        elif order == "release_checkpoint" and memory is not None:
            started = now()
            memory.release()
            said["release"] = round(now() - started, 4)
            said["ordered_at"] = float(arg)
            said.update(checkpoint_steps(("Lock", "Checkpoint")))
            said["done_at"] = now()
        elif order == "close_fd" and memory is not None:
            os.close(memory.fd)
            memory.fd = -1
        elif order == "restore":
            said.update(checkpoint_steps(("Restore", "Unlock")))
            said["own_intact"] = all(b == 5 for b in read_samples(drv, own.value, own_size))
        elif order == "map_back" and memory is not None:
            started = now()
            memory.map_back()
            said["map_back"] = round(now() - started, 4)
            said["intact"] = memory.bytes_are(int(arg))
        elif order == "drop" and memory is not None:
            memory.close()
            memory = None
        else:
            break
        print(json.dumps({"event": order, **said}), flush=True)
    os._exit(0)


class Job(Talking):
    def __init__(self, gb: float, job_gb: float) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [__file__, "--job", str(theirs.fileno()), "--gb", str(gb), "--job-gb", str(job_gb)]
        super().__init__(argv, pass_fds=(theirs.fileno(),))
        theirs.close()
        assert self.read()["event"] == "ready"

    def make(self, byte: int) -> tuple[int, int]:
        """The job's new memory filled with `byte`: (its fd, received here, and its size)."""
        self.order(f"make {byte}")
        message, fds, _flags, _addr = socket.recv_fds(self.sock, 4096, 1)
        self.read()
        return fds[0], int(json.loads(message)["size"])


class Copier:
    """This process: a context on GPU 0, a stream and `size` bytes of pinned host memory."""

    def __init__(self, size: int) -> None:
        self.drv = Driver()
        self.drv.primary_context(0)
        self.stream = self.drv.stream()
        self.libc = Libc()
        self.size = size
        self.host = int(self.libc.lib.mmap(None, size, 0x3, 0x22, -1, 0))  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
        self.libc.lib.madvise(self.host, size, MADV_POPULATE_WRITE)
        self.drv.call("cuMemHostRegister", self.host, size, CU_MEMHOSTREGISTER_PORTABLE)

    def import_fd(self, fd: int, size: int) -> tuple[int, int]:
        handle = ctypes.c_ulonglong()
        self.drv.call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        va = self.drv.reserve(size)
        self.drv.map(va, size, handle.value)
        self.drv.set_access(va, size, self.drv.device)
        return va, handle.value

    def let_go(self, va: int, handle: int, size: int) -> None:
        self.drv.call("cuMemUnmap", va, size)
        self.drv.call("cuMemRelease", handle)
        self.drv.call("cuMemAddressFree", va, size)

    def copy(self, va: int, size: int) -> float:
        started = now()
        for offset in range(0, size, COPY_PIECE):
            n = min(COPY_PIECE, size - offset)
            self.drv.call("cuMemcpyDtoHAsync", self.host + offset, va + offset, n, self.stream)
        self.drv.stream_sync(self.stream)
        return now() - started

    def copied_bytes_are(self, byte: int, size: int) -> bool:
        return all(ctypes.string_at(self.host + (size - 1) * k // (SAMPLES - 1), 1)[0] == byte for k in range(SAMPLES))


def one_round(job: Job, copier: Copier, round_: int) -> dict[str, Any]:
    row: dict[str, Any] = {"round": round_}
    byte = 16 + 3 * round_
    # copy alone
    fd, size = job.make(byte)
    va, handle = copier.import_fd(fd, size)
    os.close(fd)
    row["copy_alone_s"] = copier.copy(va, size)
    row["copy_alone_intact"] = copier.copied_bytes_are(byte, size)
    copier.let_go(va, handle, size)
    job.ask("drop")
    # checkpoint alone, then the way back after a failed copy
    fd, size = job.make(byte + 1)
    va, handle = copier.import_fd(fd, size)
    os.close(fd)
    alone = job.ask(f"release_checkpoint {now()}")
    row["checkpoint_alone_s"] = alone["checkpoint"]
    row["lock_alone_s"] = alone["lock"]
    restored = job.ask("restore")
    back = job.ask(f"map_back {byte + 1}")
    row["map_back_s"], row["map_back_intact"] = back["map_back"], back["intact"]
    row["own_intact_after_alone"] = restored["own_intact"]
    copier.let_go(va, handle, size)
    job.ask("drop")
    # both at once
    fd, size = job.make(byte + 2)
    va, handle = copier.import_fd(fd, size)
    os.close(fd)
    row["gpu_used_before_mib"] = gpu_used_mib()
    ordered = now()
    job.order(f"release_checkpoint {ordered}")
    row["copy_beside_s"] = copier.copy(va, size)
    copied_at = now()
    beside = job.read()
    if "error" in beside:
        raise RuntimeError(f"checkpoint beside the copy: {beside['error']}")
    row["release_beside_s"], row["lock_beside_s"] = beside["release"], beside["lock"]
    row["checkpoint_beside_s"] = beside["checkpoint"]
    row["both_wall_s"] = max(copied_at, float(beside["done_at"])) - ordered
    row["copy_beside_intact"] = copier.copied_bytes_are(byte + 2, size)
    copier.let_go(va, handle, size)
    row["gpu_used_fd_held_mib"] = gpu_used_mib()
    job.ask("close_fd")
    row["gpu_used_fd_closed_mib"] = gpu_used_mib()
    restored = job.ask("restore")
    row["own_intact_after_both"] = restored["own_intact"]
    job.ask("drop")
    row["bytes"] = size
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=16.0, help="GiB of the job's pool the copier copies")
    parser.add_argument("--job-gb", type=float, default=0.5, help="GiB the job's context holds besides")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--job", type=int, help=argparse.SUPPRESS)  # the job's end of the socket
    args = parser.parse_args()
    if args.job is not None:
        job_main(args.job, args.gb, args.job_gb)
        return 0
    copier = Copier(-(-int(args.gb * GIB) // (2 << 20)) * (2 << 20) + (2 << 20))
    job = Job(args.gb, args.job_gb)
    rows = []
    try:
        for round_ in range(1, args.rounds + 1):
            row = one_round(job, copier, round_)
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    finally:
        job.end()
    try:
        copier.drv.call("cuMemHostUnregister", copier.host)
        copier.drv.call("cuDevicePrimaryCtxReset", copier.drv.device)
        after_context: Any = gpu_used_mib()
    except RuntimeError as exc:  # the simulated driver has no reset
        after_context = f"not measured ({exc})"
    print(f"\n{args.gb:g} GiB copied GPU -> host by this process; the job's context holds {args.job_gb:g} GiB")
    print_table(
        (
            "round",
            "copy alone s",
            "checkpoint alone s",
            "copy beside s",
            "checkpoint beside s (lock)",
            "both, wall s",
            "copy GB/s alone / beside",
            "map back s",
            "bytes intact",
            "GPU used MiB: before / fd held / fd closed",
        ),
        [
            (
                str(r["round"]),
                fmt(r["copy_alone_s"]),
                fmt(r["checkpoint_alone_s"]),
                fmt(r["copy_beside_s"]),
                f"{fmt(r['checkpoint_beside_s'])} ({fmt(r['lock_beside_s'])})",
                fmt(r["both_wall_s"]),
                f"{fmt(gbps(r['bytes'], r['copy_alone_s']), 1)} / {fmt(gbps(r['bytes'], r['copy_beside_s']), 1)}",
                fmt(r["map_back_s"]),
                "yes"
                if all(
                    r[k]
                    for k in (
                        "copy_alone_intact",
                        "map_back_intact",
                        "copy_beside_intact",
                        "own_intact_after_alone",
                        "own_intact_after_both",
                    )
                )
                else "NO",
                f"{r['gpu_used_before_mib']} / {r['gpu_used_fd_held_mib']} / {r['gpu_used_fd_closed_mib']}",
            )
            for r in rows
        ],
    )
    print(f"GPU used once this process's context went too: {after_context} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
