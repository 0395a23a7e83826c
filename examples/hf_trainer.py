"""Hugging Face Transformers: `Trainer` on a small randomly initialised BERT-like classifier
and data made here (nothing is downloaded), with `flexium.init()` first.

    python examples/hf_trainer.py [--steps N]

On a machine with several GPUs the Trainer uses them all (DataParallel); flexium then pauses and
moves them together on the driver path. docs/guide/limits.md says how to keep it on one.
"""

import argparse
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import flexium


class RandomSentences(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int = 32, vocab: int = 1000) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)
        self.labels = torch.randint(0, 2, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    flexium.init()
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=16,
            learning_rate=1e-4,
            logging_steps=max(1, args.steps // 10),
            save_strategy="no",
            report_to=[],
            seed=0,
            use_cpu=not flexium.auto.get_device().startswith("cuda"),
        )
        result = Trainer(model=model, args=training, train_dataset=RandomSentences(4096)).train()
    print(f"done: {result.global_step} steps, loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
