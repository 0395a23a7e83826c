"""Step time of a training job with flexium's memory pool against flexium disabled.

    python bench/step_overhead.py [--models cnn,transformer] [--procs 2] [--json results.json]

Each measurement is a fresh process on cuda:0: "pool" calls flexium.init() in local mode
(FLEXIUM_SERVER unset: memory pool, engine and its optimizer hook on), "disabled" calls
flexium.init(disabled=True). Modes alternate pool, disabled, pool, disabled (--procs of each).
Every process runs --warmup steps, then times --steps steps one by one (torch.cuda.synchronize
before and after each). Per model and mode: the median of all timed steps of its processes;
the ratio pool / disabled is shown beside the goal (<= 1.01), not asserted.

Models (synthetic data, bf16 autocast unless --no-amp):
  cnn          a ResNet-18 (written here), batch 128 of 3x224x224, SGD with momentum
  transformer  nn.TransformerEncoder, d_model 1024, 16 heads, 8 layers, seq 1024, batch 16, AdamW
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tables import print_table

MODELS = ("cnn", "transformer")
MODES = ("pool", "disabled")
GOAL = 1.01


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the worker (one fresh process per measurement) ------------------------------------------


def build_cnn(torch: Any, device: str, amp: bool) -> Callable[[], None]:
    nn = torch.nn

    def conv_bn(cin: int, cout: int, k: int, stride: int) -> list[Any]:
        return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]

    class Basic(nn.Module):  # type: ignore[name-defined]
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, cout, 3, stride), nn.ReLU(inplace=True), *conv_bn(cout, cout, 3, 1))
            self.skip = nn.Sequential(*conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else nn.Identity()

        def forward(self, x: Any) -> Any:
            return torch.relu(self.body(x) + self.skip(x))

    layers: list[Any] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Basic(cin, cout, stride), Basic(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000)]
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(128, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (128,), device=device)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def build_transformer(torch: Any, device: str, amp: bool) -> Callable[[], None]:
    nn = torch.nn
    layer = nn.TransformerEncoderLayer(
        d_model=1024, nhead=16, dim_feedforward=4096, dropout=0.1, batch_first=True, norm_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=8, enable_nested_tensor=False).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = torch.randn(16, 1024, 1024, device=device)
    target = torch.randn(16, 1024, 1024, device=device)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            out = model(inputs)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def worker(args: argparse.Namespace) -> int:
    import flexium

    if args.mode == "pool":
        os.environ.pop("FLEXIUM_SERVER", None)
        flexium.init()
    else:
        flexium.init(disabled=True)
    import torch

    from flexium.api import runtime

    current = runtime.current()
    pool = current.memory_pool if current is not None else None
    pool_active = bool(pool is not None and pool.active)
    reason_off = None if pool_active or pool is None else pool.reason_off
    engine = current.engine if current is not None else None
    torch.manual_seed(0)
    device = "cuda:0"
    step = (build_cnn if args.model == "cnn" else build_transformer)(torch, device, args.amp)
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    print(
        json.dumps(
            {
                "event": "result",
                "model": args.model,
                "mode": args.mode,
                "pool_active": pool_active,
                "pool_reason_off": reason_off,
                "engine": engine is not None,
                "amp": args.amp,
                "step_seconds": times,
                "median_ms": statistics.median(times) * 1e3,
                "reserved_bytes": int(torch.cuda.memory_reserved(device)),
            }
        ),
        flush=True,
    )
    flexium.shutdown()
    return 0


# ---- the driver -------------------------------------------------------------------------------


def run_worker(model: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--model",
        model,
        "--mode",
        mode,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    if not args.amp:
        argv.append("--no-amp")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FLEXIUM_SERVER", None)
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {
            "model": model,
            "mode": mode,
            "ok": False,
            "error": f"timed out after {args.timeout:g} s",
            "stderr_tail": tail[-3000:],
        }
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"event": "result"')]
    if proc.returncode != 0 or not results:
        return {
            "model": model,
            "mode": mode,
            "ok": False,
            "error": f"exit status {proc.returncode}, no result",
            "stderr_tail": proc.stderr[-3000:],
        }
    result = results[0]
    result.update(ok=True, wall_seconds=time.perf_counter() - started)
    if mode == "pool" and not result["pool_active"]:
        result.update(ok=False, error=f"the memory pool was off: {result.get('pool_reason_off')}")
    return result


def summarise(model: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {"model": model}
    for mode in MODES:
        steps = [s for r in runs if r["mode"] == mode and r.get("step_seconds") for s in r["step_seconds"]]
        summary[mode] = {
            "median_ms": statistics.median(steps) * 1e3 if steps else None,
            "process_medians_ms": [r["median_ms"] for r in runs if r["mode"] == mode and r.get("ok")],
            "processes": sum(1 for r in runs if r["mode"] == mode and r.get("ok")),
        }
    pool, disabled = summary["pool"]["median_ms"], summary["disabled"]["median_ms"]
    summary["ratio"] = pool / disabled if pool and disabled else None
    summary["goal"] = GOAL
    summary["met"] = None if summary["ratio"] is None else summary["ratio"] <= GOAL
    return summary


def print_report(summaries: list[dict[str, Any]]) -> None:
    columns = (
        "model",
        "pool ms",
        "disabled ms",
        "pool/disabled",
        "goal",
        "",
        "pool per process",
        "disabled per process",
    )
    rows = []
    for s in summaries:
        ratio = s["ratio"]
        mark = {True: "[x]", False: "[ ]", None: "[?]"}[s["met"]]

        def ms(value: Any) -> str:
            return "-" if value is None else f"{value:.2f}"

        rows.append(
            (
                s["model"],
                ms(s["pool"]["median_ms"]),
                ms(s["disabled"]["median_ms"]),
                "-" if ratio is None else f"{ratio:.4f}",
                f"<= {GOAL}",
                mark,
                " ".join(f"{v:.2f}" for v in s["pool"]["process_medians_ms"]) or "-",
                " ".join(f"{v:.2f}" for v in s["disabled"]["process_medians_ms"]) or "-",
            )
        )
    print_table(columns, rows)
    print("median step time over every timed step of the mode's processes; [x] goal met, [ ] missed (not asserted)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: cnn, transformer")
    parser.add_argument("--procs", type=int, default=2, help="processes per mode and model (alternating)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--no-amp", dest="amp", action="store_false", help="fp32 instead of bf16 autocast")
    parser.add_argument("--timeout", type=float, default=150, help="seconds per process before it is killed")
    parser.add_argument("--json", type=Path, help="write every raw result here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(MODELS)}")

    started = time.perf_counter()
    failures = []
    runs: list[dict[str, Any]] = []
    summaries = []
    for model in models:
        model_runs = []
        for index in range(args.procs):
            for mode in MODES:  # pool, disabled, pool, disabled, ...
                log(f"-- {model}: {mode} ({index + 1}/{args.procs}) ...")
                result = run_worker(model, mode, args)
                model_runs.append(result)
                if result["ok"]:
                    log(f"   median step {result['median_ms']:.2f} ms ({result['wall_seconds']:.0f} s)")
                else:
                    failures.append(f"{model} {mode}: {result['error']}")
                    log(f"!! {model} {mode} failed: {result['error']}\n{result.get('stderr_tail', '')}")
        runs += model_runs
        summaries.append(summarise(model, [r for r in model_runs if r.get("ok")]))
    print_report(summaries)
    elapsed = time.perf_counter() - started
    print(f"{len(runs)} processes in {elapsed:.0f} s" + (f"; FAILED: {'; '.join(failures)}" if failures else ""))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"summaries": summaries, "runs": runs, "failures": failures, "seconds": elapsed, "amp": args.amp},
                indent=1,
            )
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
