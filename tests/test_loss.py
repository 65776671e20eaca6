"""The chunked head + cross-entropy against F.cross_entropy, the whole-model compile against eager,
and the step's host reads."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from conftest import tiny_model_config
from llm_trainer import loss
from llm_trainer.config import TrainingConfig
from llm_trainer.data.batches.loader import BatchLoader, WindowRows
from llm_trainer.loss import IGNORE_INDEX, chunk_rows, linear_cross_entropy
from llm_trainer.model import Transformer
from llm_trainer.train.evaluate import batch_nll, summed_nll
from llm_trainer.train.trainer import Trainer


def _reference(hidden, weight, targets, softcap, reduction="sum"):
    logits = F.linear(hidden, weight)
    if softcap is not None:
        logits = softcap * torch.tanh(logits.float() / softcap)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction=reduction)


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "small"])
def test_chunked_loss_equals_cross_entropy_in_value_and_gradient(amp, softcap, fused, monkeypatch):
    """Chunks of 8 of 37 positions (the last one short), a fifth of the targets ignored: the summed loss
    and the gradients of hidden states and head weight equal F.cross_entropy over the whole logits (to
    bf16's rounding under bf16 autocast, where both run the head's matmuls in bf16), by the chunked
    gradient and by the plain autograd that logits below `SMALL_LOGITS` take."""
    if fused:
        monkeypatch.setattr(loss, "SMALL_LOGITS", 0)
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    targets[::5] = IGNORE_INDEX
    tol = dict(rtol=0, atol=1e-5) if amp is None else dict(rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
        expected = _reference(hidden, weight, targets, softcap)
        got = linear_cross_entropy(hidden, weight, targets, softcap=softcap, rows=8)
    want = torch.autograd.grad(expected * 0.3, [hidden, weight])
    have = torch.autograd.grad(got * 0.3, [hidden, weight])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5 if amp is None else 1e-3, atol=1e-3)
    for g, w in zip(have, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
        per_token = linear_cross_entropy(hidden, weight, targets, softcap=softcap, reduction="none", rows=8)
        torch.testing.assert_close(
            per_token, _reference(hidden, weight, targets, softcap, reduction="none"), rtol=1e-3, atol=1e-3
        )
    assert (per_token[::5] == 0).all()


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "small"])
def test_a_padded_head_is_multiplied_whole_and_its_padding_columns_leave_the_softmax(amp, softcap, fused, monkeypatch):
    """A head of 64 rows whose first 50 are the vocabulary (`vocab=50`), the padding rows large enough to
    win every softmax were they counted: the loss, per position and summed, and the gradients equal
    those of the 50-row head exactly; the padding rows' gradient is exactly zero."""
    if fused:
        monkeypatch.setattr(loss, "SMALL_LOGITS", 0)
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    real = torch.randn(50, 16)
    padded = torch.cat([real, torch.full((14, 16), 3.0)]).requires_grad_()
    real.requires_grad_()
    targets = torch.randint(0, 50, (37,))
    targets[::5] = IGNORE_INDEX
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
        expected = linear_cross_entropy(hidden, real, targets, softcap=softcap, rows=8)
        got = linear_cross_entropy(hidden, padded, targets, softcap=softcap, rows=8, vocab=50)
    want = torch.autograd.grad(expected * 0.3, [hidden, real])
    have = torch.autograd.grad(got * 0.3, [hidden, padded])
    assert torch.equal(got, expected)
    torch.testing.assert_close(got, _reference(hidden, real, targets, softcap), rtol=1e-3, atol=1e-3)
    assert not have[1][50:].any()  # the padding rows: no gradient at all
    # the real rows' gradient: a matmul of another shape may sum in another order (BLAS blocking, threads)
    torch.testing.assert_close(have[1][:50], want[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(have[0], want[0], rtol=0, atol=1e-6)  # the sum runs over 64 rows, not 50
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
        per_token = linear_cross_entropy(hidden, padded, targets, softcap=softcap, reduction="none", rows=8, vocab=50)
        assert torch.equal(per_token, linear_cross_entropy(hidden, real, targets, softcap=softcap, reduction="none"))
        scored = loss.token_logprobs(hidden, padded, targets.clamp(min=0), softcap=softcap, vocab=50)
        plain = loss.token_logprobs(hidden, real, targets.clamp(min=0), softcap=softcap)
    assert all(torch.equal(a, b) for a, b in zip(scored, plain, strict=True))
    for wrong in (0, 65):
        with pytest.raises(ValueError, match="vocab must be 1 to the head's 64 rows"):
            linear_cross_entropy(hidden, padded, targets, vocab=wrong)


@pytest.mark.slow
@pytest.mark.parametrize("padding", [0, 14], ids=["unpadded", "padded"])
def test_the_chunked_gradient_compiles_into_one_graph_and_keeps_its_values(padding, monkeypatch):
    """Under torch.compile the chunked loss (soft cap, 5 chunks; a head of 50 real rows, padded or not)
    is one graph without breaks, and its value and gradients are F.cross_entropy's over the real rows."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(loss, "SMALL_LOGITS", 0)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.cat([torch.randn(50, 16), torch.full((padding, 16), 3.0)]).requires_grad_()
    targets = torch.randint(0, 50, (37,))
    targets[::4] = IGNORE_INDEX
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, softcap=5.0, rows=8, vocab=50))
    got = compiled(hidden, weight, targets)
    have = torch.autograd.grad(got, [hidden, weight])
    expected = _reference(hidden, weight[:50], targets, 5.0)
    want = torch.autograd.grad(expected, [hidden, weight])
    torch.testing.assert_close(got, expected)
    for g, w in zip(have, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert not have[1][50:].any()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]


def test_chunks_are_even_and_bounded():
    """At GPT-2's vocabulary, 16 x 1024 positions are cut into equal chunks of at most 2**25 logits."""
    rows = chunk_rows(16 * 1024, 50257)
    assert rows * 50257 <= 1 << 25 and (16 * 1024) % rows < rows
    assert chunk_rows(64, 65) == 64  # a character vocabulary: one chunk
    # compiled: 99 chunks of 64 x 1024 become COMPILED_MAX_CHUNKS larger ones, none past its logits' bound
    for positions in (64 * 1024, 1_000_000):
        rows = chunk_rows(positions, 50304, compiled=True)
        assert rows * 50304 <= loss.COMPILED_CHUNK_LOGITS
        assert -(-positions // rows) == max(
            loss.COMPILED_MAX_CHUNKS, -(-positions * 50304 // loss.COMPILED_CHUNK_LOGITS)
        )


def test_a_compiled_loss_traces_a_bounded_number_of_chunks_and_keeps_its_values(monkeypatch):
    """The compiler traces the chunk loop once per chunk, so a compiled loss takes at most
    `COMPILED_MAX_CHUNKS` larger chunks where eager takes many (64 here): the traced graph holds that many
    head matmuls whatever the batch, and the loss and gradients stay F.cross_entropy's."""
    monkeypatch.setattr(loss, "SMALL_LOGITS", 0)
    monkeypatch.setattr(loss, "CHUNK_LOGITS", 1 << 12)  # 4 positions a chunk at a vocabulary of 1024
    torch._dynamo.reset()
    torch.manual_seed(0)
    hidden = torch.randn(256, 32, requires_grad=True)
    weight = torch.randn(1024, 32, requires_grad=True)
    targets = torch.randint(0, 1024, (256,))
    matmuls = []

    def counting(graph_module, example_inputs):  # a backend that counts the traced graph's head matmuls
        graphs = [m for m in graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
        matmuls.append(sum("linear" in str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"))
        return graph_module.forward

    assert 256 // chunk_rows(256, 1024) == 64
    got = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t), backend=counting)(hidden, weight, targets)
    assert matmuls == [loss.COMPILED_MAX_CHUNKS]
    have = torch.autograd.grad(got, [hidden, weight])
    expected = _reference(hidden, weight, targets, None)
    torch.testing.assert_close(got, expected)
    for g, w in zip(have, torch.autograd.grad(expected, [hidden, weight])):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_the_model_computes_the_loss_it_would_give_from_its_logits_with_document_masks(monkeypatch):
    """model(idx, targets=, doc_ids=) is the summed cross-entropy of model(idx, doc_ids=)'s logits, in
    value and in every parameter's gradient (the chunked gradient, which this tiny head would otherwise
    skip), with ignored targets and packed documents; per position with reduction="none"; and
    `batch_nll`, which training and evaluation call, takes that path."""
    monkeypatch.setattr(loss, "SMALL_LOGITS", 0)
    monkeypatch.setattr(loss, "CHUNK_LOGITS", 61 * 10)  # 36 positions in 4 chunks of 9
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(logit_softcap=8.0))
    inputs = torch.randint(0, 61, (3, 12))
    targets = torch.randint(0, 61, (3, 12))
    targets[:, -2:] = IGNORE_INDEX
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 2 + [1] * 4 + [2] * 6])

    expected = summed_nll(model(inputs, doc_ids=doc_ids), targets)
    want = torch.autograd.grad(expected, list(model.parameters()))
    got = model(inputs, doc_ids=doc_ids, targets=targets)
    have = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, expected)
    for g, w in zip(have, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        per_token = model(inputs, doc_ids=doc_ids, targets=targets, reduction="none")
        assert per_token.shape == (3, 12) and (per_token[:, -2:] == 0).all()
        torch.testing.assert_close(per_token.sum(), expected.detach())
        torch.testing.assert_close(batch_nll(model, inputs, targets, doc_ids), expected.detach())


def test_extend_scores_given_tokens_as_the_log_softmax_of_its_logits():
    """extend(..., targets=) gives each selected position's log p(target) and greedy match, as the
    log-softmax of the (N, V) logits it returns without targets (what downstream scoring reads)."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config()).eval()
    ids = torch.randint(0, 61, (2, 6))
    positions = torch.arange(6).expand(2, 6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    select = (torch.tensor([0, 0, 1]), torch.tensor([2, 5, 3]))
    with torch.no_grad():
        logits = model.extend(ids, None, positions, mask, select=select)
        targets = torch.stack([logits[0].argmax(), torch.tensor(7), torch.tensor(9)])
        logprob, greedy = model.extend(ids, None, positions, mask, select=select, targets=targets)
    expected = logits.float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(logprob, expected)
    assert greedy.tolist() == (logits.argmax(-1) == targets).tolist() and bool(greedy[0])


def _training(tmp_path, name, **overrides):
    values = dict(
        batch_size=4,
        max_steps=4,
        learning_rate=1e-2,
        warmup_steps=2,
        eval_steps=2,
        save_steps=0,
        logging_steps=1,
        output_dir=str(tmp_path / name),
        report_to=["jsonl"],
        progress_bar=False,
        device="cpu",
        seed=0,
        use_amp=False,
    )
    values.update(overrides)
    return TrainingConfig(**values)


def _tokens(n=3000, vocab=61):
    rng = np.random.default_rng(0)
    return (np.cumsum(rng.integers(1, 3, size=n)) % vocab).astype(np.uint16)


def _losses(folder) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row and "step" in row and "val_loss" not in row]


@pytest.mark.slow
def test_the_whole_compiled_model_trains_as_eager_and_never_recompiles(tmp_path):
    """training.compile without sharding compiles the whole model with its loss (nothing left eager),
    activation checkpointing inside the graph:
    its losses are the eager run's, and after the first step, nothing compiles again however many steps
    and evaluations follow."""
    from torch._dynamo.utils import counters

    def run(name, compile):
        torch.manual_seed(0)
        model = Transformer(tiny_model_config())
        train = BatchLoader(WindowRows(_tokens(), 16), 4, shuffle=True, seed=0)
        val = BatchLoader(WindowRows(_tokens(400), 16), 4, shuffle=False)
        config = _training(tmp_path, name, compile=compile, gradient_checkpointing=compile)
        trainer = Trainer(model, config, train_dataloader=train, val_dataloader=val)
        assert (model._compiled_call_impl is not None) == compile
        return trainer

    eager = run("eager", False)
    eager.train()
    torch._dynamo.reset()
    counters.clear()
    compiled = run("compiled", True)
    compiled.config.max_steps = 1
    compiled.train()
    compiled.evaluate(full=True)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and not counters["graph_break"]
    compiled.config.max_steps = 4
    compiled.train()
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["recompiles"])
    np.testing.assert_allclose(_losses(tmp_path / "compiled"), _losses(tmp_path / "eager"), rtol=1e-4)


class _HostReads(TorchFunctionMode):
    """Records each read of a tensor's value by the host (what waits for a GPU: `.item()`, `bool()`,
    `float()`, `.tolist()`...) with the training step it happened in."""

    READS = {"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "__format__", "cpu"}

    def __init__(self, trainer=None):
        super().__init__()
        self.trainer, self.seen = trainer, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            self.seen.append((self.trainer.state.step if self.trainer else None, func.__name__))
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_no_value_from_the_device(tmp_path):
    """train_step (the Trainer's and the LR finder's step: forward with the chunked loss, backward, clip,
    the finite-or-skip update) hands back device tensors and reads none of them."""
    from llm_trainer.train.step import train_step

    trainer = Trainer(Transformer(tiny_model_config()), _training(tmp_path, "step", use_amp=True))
    x = torch.randint(0, 61, (4, 16))
    batches = [(x, x.roll(-1, 1)), (x, x.roll(-1, 1))]
    with _HostReads() as reads:
        out = train_step(trainer.parallel, batches, autocast=trainer.autocast, max_grad_norm=1.0)
    assert reads.seen == [] and out.loss.device.type == "cpu"


def test_the_loop_reads_device_values_only_on_logging_steps(tmp_path):
    """With the per-step reads a CPU affords turned off (as on a GPU), 7 steps logged every 3rd read
    values only at steps 3, 6 and the last, 7; evaluation and checkpoints are off."""
    loader = BatchLoader(WindowRows(_tokens(), 16), 4, shuffle=True, seed=0)
    config = _training(tmp_path, "loop", max_steps=7, logging_steps=3, eval_steps=0, use_amp=True)
    trainer = Trainer(Transformer(tiny_model_config()), config, train_dataloader=loader)
    trainer.reads_every_step = False
    with _HostReads(trainer) as reads:
        trainer.train()
    assert {step for step, _ in reads.seen if step is not None and 0 < step < 7} == {3, 6}, reads.seen


DDP_OVER_COMPILE = """
import sys
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

sys.path.insert(0, sys.argv[2])  # the tests folder: conftest's tiny model
from conftest import tiny_model_config
from llm_trainer.model import Transformer
from llm_trainer.parallel.parallelize import apply_compile
from llm_trainer.train.evaluate import batch_nll

dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
torch.manual_seed(0)
eager = Transformer(tiny_model_config())
torch.manual_seed(0)
compiled = Transformer(tiny_model_config())
apply_compile(compiled)
ddp = torch.nn.parallel.DistributedDataParallel(compiled)
x = torch.randint(0, 61, (4, 16))
for _ in range(3):
    want = batch_nll(eager, x, x.roll(-1, 1))
    want.backward()
    got = batch_nll(ddp, x, x.roll(-1, 1))
    got.backward()
    torch.testing.assert_close(got, want)
for p, q in zip(eager.parameters(), compiled.parameters()):
    torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)
assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)
print("ok", flush=True)
"""


@pytest.mark.slow
def test_ddp_over_the_whole_compiled_model_steps_as_eager(tmp_path):
    """DDP wraps the whole compiled model (compile first, in place): the loss and every gradient are the
    eager model's over three steps, from one graph without breaks. In a process of its own: a gloo process
    group torn down inside a pytest worker can hang in its destructor."""
    import subprocess
    import sys

    from conftest import src_env

    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", DDP_OVER_COMPILE, str(tmp_path / "store"), tests],
        env={**src_env(), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
