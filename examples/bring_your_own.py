"""Bring your own pieces: any nn.Module that returns logits, any iterable of batches.

Batches may be (inputs, targets) pairs already aligned, dicts with `input_ids` (and `labels`, Hugging
Face style, shifted inside), or tensors of token rows (shifted inside).

    python examples/bring_your_own.py
"""

import torch
import torch.nn as nn

from llm_trainer import Callback, Trainer, TrainingConfig


class Bigram(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, input_ids):  # (B, T) -> (B, T, V)
        return self.table(input_ids)


class PrintEvals(Callback):
    def on_evaluate(self, trainer, metrics):
        print(f"step {trainer.state.step}: perplexity {metrics['perplexity']:.2f}")


text = open(__file__).read()
vocab = sorted(set(text))
ids = torch.tensor([vocab.index(c) for c in text])
rows = ids[: len(ids) // 33 * 33].view(-1, 33)  # rows of 33 tokens: 32 inputs, 32 targets
loader = torch.utils.data.DataLoader(rows, batch_size=16, shuffle=True)

trainer = Trainer(
    Bigram(len(vocab)),
    TrainingConfig(
        max_steps=200,
        learning_rate=0.05,
        eval_steps=100,
        output_dir="runs/bring-your-own",
        device="cpu",
        report_to=["jsonl"],
        progress_bar=False,
    ),
    train_dataloader=loader,
    val_dataloader=loader,
    callbacks=[PrintEvals()],
)
print(trainer.train())
