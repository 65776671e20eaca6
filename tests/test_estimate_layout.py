"""`estimate` under every parallel degree, against the real split: tensor parallelism's per-rank
parameters measured in two gloo processes, pipeline stages counted by slicing the blocks; and the layout
it advises for a cluster fits by its own estimate."""

import json
import os
import socket

import pytest
import torch

from llm_trainer.cli import main
from llm_trainer.config import ModelConfig, TrainingConfig
from llm_trainer.parallel.mesh import Layout
from llm_trainer.tools.layout_advice import advise_layout
from llm_trainer.train.memory_estimate import GiB, estimate_memory, pipeline_bubble

LLAMA = ModelConfig(architecture="llama", d_model=64, n_heads=4, n_kv_heads=2, n_layers=4, d_ff=96, vocab_size=256)
GPT2 = ModelConfig(architecture="gpt2", d_model=64, n_heads=4, n_layers=4, vocab_size=256, dropout=0.0)
FP32 = TrainingConfig(use_amp=False, batch_size=2)


def _local_parameters(rank: int, world: int, port: int, config: ModelConfig, out) -> None:
    """One rank of a TP=`world` model on CPU: the elements of its parameters' local shards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from llm_trainer.model import Transformer
    from llm_trainer.parallel.tensor_parallel import apply_tensor_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = Transformer(config)
        apply_tensor_parallel(model, init_device_mesh("cpu", (world,)))
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        out.put((rank, local))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")
@pytest.mark.slow  # two processes per model: the full tier only
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_tensor_parallel_parameters_equal_a_real_ranks(config):
    """Two gloo processes split the model by the plan; each rank's parameter bytes are the estimate's
    (GPT-2: row-wise biases whole, the tied head once)."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_local_parameters, args=(r, 2, port, config, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0
    measured = dict(out.get() for _ in procs)
    assert measured[0] == measured[1]
    estimate = estimate_memory(config, FP32, layout=Layout(tp=2), device_type="cpu")
    assert estimate.params_bytes == 4 * measured[0]
    assert estimate.params_bytes < estimate_memory(config, FP32, device_type="cpu").params_bytes


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_pipeline_stages_hold_a_real_splits_parameters(config, schedule):
    """Blocks split by layer, embeddings on the first stage, final norm and head on the last (a tied
    head: its own copy there); a V schedule puts both ends on the first rank. The peak is the largest."""
    from llm_trainer.model import Transformer

    model = Transformer.on_meta(config)
    half = config.n_layers // 2

    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    inputs = [model.tok_emb, *([model.pos_emb] if model.pos_emb is not None else [])]
    first = count(*inputs, *model.blocks[:half])
    last = count(*model.blocks[half:], model.norm, model.lm_head)
    training = TrainingConfig(use_amp=False, batch_size=4, pipeline_parallel_schedule=schedule)
    if schedule == "ZBVZeroBubble":  # 2 ranks x 2 stages: a rank holds a quarter of the blocks, twice
        first = count(*inputs, *model.blocks[:1], *model.blocks[3:], model.norm) + model.lm_head.weight.numel()
        first -= model.lm_head.weight.numel() if model.lm_head.weight is model.tok_emb.weight else 0
        last = count(*model.blocks[1:3])
    estimate = estimate_memory(config, training, layout=Layout(pp=2), device_type="cpu")
    assert estimate.details["stage_parameters"] == [first, last]
    assert estimate.params_bytes == 4 * [first, last][estimate.details["peak_stage"]]
    whole = estimate_memory(config, training, device_type="cpu")
    assert estimate.params_bytes < whole.params_bytes and estimate.peak_bytes < whole.peak_bytes


def test_sequence_and_context_parallelism_split_the_activations():
    """SP splits a block's activations except the projections' gathered inputs; CP splits the sequence;
    the pipeline's first stage holds a micro-batch per stage under 1F1B."""
    base = estimate_memory(LLAMA, FP32, seq_len=64, device_type="cuda")
    tp = estimate_memory(LLAMA, FP32, seq_len=64, device_type="cuda", layout=Layout(tp=2))
    cp = estimate_memory(LLAMA, FP32, seq_len=64, device_type="cuda", layout=Layout(cp=2))
    per_token = base.details["per_token"]
    split = (per_token["per_layer"] + per_token["per_layer_whole"]) / 2
    assert tp.activations_bytes < base.activations_bytes
    layers = LLAMA.n_layers * base.tokens_per_micro_batch
    head_saved = base.activations_bytes - base.tokens_per_micro_batch * (
        LLAMA.n_layers * per_token["per_layer"] + per_token["embedding"]
    )
    assert tp.activations_bytes - head_saved == pytest.approx(
        layers * split + base.tokens_per_micro_batch * (per_token["embedding"] - per_token["final_norm"] / 2)
    )
    assert cp.activations_bytes < 0.6 * base.activations_bytes  # every token's tensors halve
    assert pipeline_bubble(1, 1, "1F1B") == 0
    assert pipeline_bubble(4, 8, "1F1B") == pytest.approx(3 / 11)
    assert pipeline_bubble(4, 8, "Interleaved1F1B") == pytest.approx(3 / 19)


def test_hsdp_shards_within_the_shard_group_only():
    fsdp = estimate_memory(LLAMA, FP32, sharding="fsdp", layout=Layout(dp_shard=4))
    hsdp = estimate_memory(LLAMA, FP32, sharding="fsdp", layout=Layout(dp_replicate=2, dp_shard=2))
    assert hsdp.optimizer_bytes == 2 * fsdp.optimizer_bytes


def test_the_advice_for_7b_on_eight_80gb_gpus_fits_by_the_estimate():
    from llm_trainer.cli import PRESETS
    from llm_trainer.config_loader import load_experiment

    experiment = load_experiment(PRESETS / "llama-7b.yaml")
    advice = advise_layout(experiment.model, experiment.training, world_size=8, device_memory_gb=80, seq_len=4096)
    assert advice is not None and advice.layout.world_size == 8 and advice.peak_gb <= 80
    training = TrainingConfig(**{**experiment.training.to_dict(), **advice.settings()})
    again = estimate_memory(
        experiment.model, training, seq_len=4096, sharding="fsdp", layout=advice.layout, device_type="cuda"
    )
    assert again.peak_bytes / GiB == pytest.approx(advice.peak_gb) and again.fits(80)
    # one device: no layout holds 7B's fp32 weights and AdamW states in 80 GiB
    assert advise_layout(experiment.model, experiment.training, world_size=1, device_memory_gb=80, seq_len=4096) is None


@pytest.mark.parametrize(("preset", "nodes"), [("llama-30b", 1), ("llama-70b", 2)])
def test_the_advice_for_30b_and_70b_is_printed(capsys, preset, nodes):
    assert main(["estimate", "--config", preset, "--gpu-memory", "80", "--nodes", str(nodes)]) == 0
    text = capsys.readouterr().out
    assert f"advised layout for {8 * nodes} devices ({nodes} node(s) x 8), 80 GiB each" in text
    assert f"srun torchrun --nnodes {nodes} --nproc_per_node 8" in text and "training.tensor_parallel_degree=" in text
    assert main(["estimate", "--config", preset, "--gpu-memory", "80", "--nodes", str(nodes), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout_advice"]["peak_gb"] <= 80


def test_seventy_b_on_one_node_is_told_no_layout_fits(capsys):
    assert main(["estimate", "--config", "llama-70b", "--gpu-memory", "80", "--nodes", "1"]) == 0
    assert "no layout of 8 devices fits 80 GiB each" in capsys.readouterr().out


def test_tensor_parallelism_is_advised_only_where_fsdp_alone_does_not_fit():
    """70B on 2 nodes at 4 rows a micro-batch: FSDP over 16 does not fit even with checkpointing, so
    the advice adds the smallest tensor degree that does, within a node."""
    from llm_trainer.cli import PRESETS
    from llm_trainer.config_loader import load_experiment

    e = load_experiment(PRESETS / "llama-70b.yaml")
    advice = advise_layout(e.model, e.training, world_size=16, device_memory_gb=80, seq_len=4096, batch_size=4)
    assert advice.layout == Layout(dp_shard=8, tp=2) and advice.gradient_checkpointing and advice.peak_gb <= 80
    training = TrainingConfig(**{**e.training.to_dict(), "gradient_checkpointing": True})
    fsdp = estimate_memory(e.model, training, seq_len=4096, batch_size=4, sharding="fsdp", layout=Layout(dp_shard=16))
    assert not fsdp.fits(80)
