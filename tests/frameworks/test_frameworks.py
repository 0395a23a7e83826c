"""flexium supports the training frameworks (README.md, "Frameworks"). Here PyTorch Lightning's Trainer,
Hugging Face's Trainer (over Accelerate) and fastai's Learner (with fastai's own optimizer, not a
torch.optim one) each train after a bare `flexium.init()`, while a
control thread migrates the job 0 -> 1 -> 0 and pauses and resumes it: every operation runs at
the framework's own optimizer step on its training thread, no step runs while paused, and the
losses are bit-identical to an undisturbed run of the same script.

Each runs in a fresh interpreter on the fake NVIDIA driver (tests/support/fake_driver.py) with CPU torch:
the frameworks' real training loops, flexium's real engine, only libcuda replaced. CI installs the
frameworks (ci/test.sh); a run without them fails and says what to install."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from support import fake_driver

FRAMEWORKS = {
    "lightning": "lightning==2.6.6",
    "transformers": "transformers==5.24.0",
    "accelerate": "accelerate==1.15.0",
    "fastai": "fastai==2.8.12",
}

# Runs the operations of PLAN from a control thread as the training loop passes their steps.
CONTROL = """
import json, threading, time
import torch
import flexium
from flexium.api import runtime

# The two runs must be able to agree bit for bit without flexium: one intra-op thread (a CI run
# saw them differ by 1e-7 at step 1, before any operation) and MKL's reproducible mode (its env).
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

flexium.init()
engine = runtime.current().engine
losses, ops, on_thread = [], [], []
engine.add_state_listener(lambda state: on_thread.append((state.value, threading.current_thread().name)))
PLAN = [(6, "migrate", 1), (14, "pause", None), (22, "migrate", 0)]  # targets: GPUs as seen at init
STEPS = 40  # the last operation's safe point comes well before the end

def wait_for_step(n):
    while len(losses) < n:
        time.sleep(0.002)

def control():
    for step, op, target in PLAN:
        wait_for_step(step)
        if op == "migrate":
            result = engine.migrate(engine.gpus[target])
            ops.append(dict(op=op, ok=result.ok, path=result.path, physical=flexium.auto.get_physical_device()))
        else:
            result = engine.pause()
            held_at = len(losses)
            time.sleep(0.5)
            steps_while_paused = len(losses) - held_at
            resumed = engine.resume()
            ops.append(dict(op=op, ok=result.ok and resumed.ok, path=result.path,
                            steps_while_paused=steps_while_paused))

# fit(record) undisturbed, then again while control() runs; prints both runs' losses.
def run_both(fit):
    undisturbed = []
    fit(undisturbed)
    controller = threading.Thread(target=control, name="control")
    controller.start()
    fit(losses)
    controller.join()
    print("RESULT " + json.dumps(dict(undisturbed=undisturbed, disturbed=losses, ops=ops, on_thread=on_thread,
                                      training_thread=threading.current_thread().name,
                                      device=flexium.auto.get_device())))
    flexium.shutdown()
"""

LIGHTNING = """
import time, torch, lightning as L

class Net(L.LightningModule):
    def __init__(self, record):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.record = record

    def training_step(self, batch, index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.record.append(loss.item())
        time.sleep(0.01)                      # a step long enough for the control thread to act
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

def fit(record):
    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, num_workers=2,
                                         generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(record), loader)

run_both(fit)
"""

HF_TRAINER = """
import tempfile, time, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging
hf_logging.set_verbosity_error()

class Recording(Trainer):
    record = None

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        self.record.append((out[0] if return_outputs else out).item())
        time.sleep(0.01)
        return out

def fit(record):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 97, (256, 16), generator=g)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=8,
                             max_steps=STEPS, learning_rate=1e-3, seed=0, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = Recording(model=model, args=args, train_dataset=data)
    trainer.record = record
    trainer.train()

run_both(fit)
"""


FASTAI = """
import time, torch
from fastai.callback.core import Callback
from fastai.callback.schedule import fit_one_cycle  # adds Learner.fit_one_cycle
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.torch_core import set_seed
from torch.utils.data import TensorDataset

class Record(Callback):
    def __init__(self, record):
        self.record = record

    def after_batch(self):
        if self.training:
            self.record.append(self.learn.loss.item())
            time.sleep(0.01)

def fit(record):
    set_seed(0, reproducible=True)
    g = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(STEPS * 16, 8, generator=g), torch.randn(STEPS * 16, 1, generator=g))
    valid = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    dls = DataLoaders.from_dsets(train, valid, bs=16, device=torch.device("cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    learn = Learner(dls, model, loss_func=torch.nn.functional.mse_loss, cbs=[Record(record)])  # fastai's Adam
    with learn.no_logging(), learn.no_bar():
        learn.fit_one_cycle(1, lr_max=1e-2)

run_both(fit)
"""


def _require_frameworks() -> None:
    missing = [spec for module, spec in FRAMEWORKS.items() if importlib.util.find_spec(module) is None]
    if missing:
        pytest.fail(
            f"the framework tests need {', '.join(missing)}: pip install {' '.join(missing)} "
            "(ci/test.sh installs them)",
            pytrace=False,
        )


def _run(script: str) -> dict[str, Any]:
    _require_frameworks()
    env = fake_driver.subprocess_env()
    env["MKL_CBWR"] = "COMPATIBLE"  # MKL's results otherwise may depend on the buffers' alignment
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CONTROL) + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def _check(out: dict[str, Any]) -> None:
    assert len(out["undisturbed"]) == 40
    assert out["disturbed"] == out["undisturbed"]  # bit-identical losses
    assert [(o["op"], o["ok"]) for o in out["ops"]] == [("migrate", True), ("pause", True), ("migrate", True)]
    assert [o.get("physical") for o in out["ops"]] == ["cuda:1", None, "cuda:0"]
    assert out["ops"][1]["steps_while_paused"] == 0
    assert out["device"] == "cuda:0"  # what the training code sees never changes
    # Every operation ran on the framework's training thread: migrate and pause at its optimizer
    # step, the resume handed to the training thread parked there while paused.
    thread = out["training_thread"]
    started = [(state, by) for state, by in out["on_thread"] if state in ("MIGRATING", "PAUSING", "RESUMING")]
    assert started == [("MIGRATING", thread), ("PAUSING", thread), ("RESUMING", thread), ("MIGRATING", thread)]


def test_pytorch_lightning_trainer() -> None:
    _check(_run(LIGHTNING))


def test_hugging_face_trainer() -> None:
    _check(_run(HF_TRAINER))


def test_fastai_learner_with_its_own_optimizer() -> None:
    _check(_run(FASTAI))
