"""Baby GPT on Tiny Shakespeare with a bare PyTorch loop: the framework-overhead floor.

Per step: set lr, sample a batch, forward, cross-entropy, backward, clip, AdamW step. Nothing else
(no logging, no eval, no checkpoint) until training ends; then one validation pass with the shared
definition (bench/shakespeare.py) and one JSON line on stdout.

    python bench/bare_loop.py [--steps 2000] [--compile]
"""

import time

_T0 = time.perf_counter()  # process wall is measured from here (script import)

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shakespeare as sh  # noqa: E402

# ----------------------------------------------------------------------------------------------
# A minimal GPT-2: LayerNorm, exact GELU, learned positions, biases, tied embeddings, fused qkv.


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, d: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(block_size, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for name, p in self.named_parameters():  # GPT-2 init; residual projections scaled by depth
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif "ln" in name:
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        self.register_buffer("pos", torch.arange(block_size), persistent=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(self.pos[: idx.size(1)])
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def param_groups(self, weight_decay: float):
        """Decay only the 2-D matmul weights; no decay on biases, norms or (tied) embeddings."""
        embeddings = {id(self.wte.weight), id(self.wpe.weight)}
        decay = [p for p in self.parameters() if p.dim() >= 2 and id(p) not in embeddings]
        other = [p for p in self.parameters() if p.dim() < 2 or id(p) in embeddings]
        return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=sh.MAX_STEPS)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args(argv)

    torch.manual_seed(sh.SEED)
    data = sh.load_data()
    model = GPT(data.vocab_size, sh.BLOCK_SIZE, sh.N_LAYER, sh.N_HEAD, sh.D_MODEL)
    train_model = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.param_groups(sh.WEIGHT_DECAY), lr=sh.LEARNING_RATE, betas=sh.BETAS, eps=1e-8)
    gen = sh.make_generator(sh.SEED)
    train_ids, vocab, steps = data.train_ids, data.vocab_size, args.steps
    params = list(model.parameters())

    model.train()
    t_train = time.perf_counter()
    for step in range(steps):
        lr = sh.lr_at(step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sh.get_batch(train_ids, gen)
        logits = train_model(x)
        loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, sh.GRAD_CLIP)
        optimizer.step()
    train_wall = time.perf_counter() - t_train
    final_train_loss = loss.item() if steps else float("nan")

    t_eval = time.perf_counter()
    model.eval()  # the uncompiled module: same weights, no recompile for the short last window
    val = sh.evaluate_val_loss(model, data.val_ids)
    eval_s = time.perf_counter() - t_eval

    result = {
        "name": "bare_loop",
        "steps": steps,
        "tokens_per_s": steps * sh.tokens_per_step() / train_wall if train_wall > 0 else None,
        "train_wall_s": train_wall,
        "process_wall_s": time.perf_counter() - _T0,
        "val_loss": val["val_loss"],
        "compile": bool(args.compile),
        "final_train_loss": final_train_loss,
        "setup_s": t_train - _T0,
        "eval_s": eval_s,
        "val_tokens": val["val_tokens"],
        "n_params": sum(p.numel() for p in params),
        "torch_num_threads": torch.get_num_threads(),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
