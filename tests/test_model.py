"""The architecture: shapes, presets, initialisation, masking, GQA, RoPE, KV cache, weight tying."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model_config
from llm_trainer.checkpoint.model_folder import load_model_folder, save_model_folder
from llm_trainer.model import KVCache, Transformer, apply_rope, project, rope_tables


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_logits_shape_and_causality(arch):
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(architecture=arch)).eval()
    x = torch.randint(0, 61, (3, 10))
    logits = model(x)
    assert logits.shape == (3, 10, 61)
    # Changing a future token never changes earlier logits.
    y = x.clone()
    y[:, 6] = (y[:, 6] + 1) % 61
    changed = model(y)
    assert torch.equal(logits[:, :6], changed[:, :6])
    assert not torch.allclose(logits[:, 6:], changed[:, 6:])


def test_gpt2_and_llama_modules_match_their_presets():
    gpt2 = Transformer(tiny_model_config(architecture="gpt2"))
    assert isinstance(gpt2.blocks[0].attn_norm, torch.nn.LayerNorm) and gpt2.pos_emb is not None
    assert gpt2.blocks[0].attn.q.bias is not None and gpt2.lm_head.weight is gpt2.tok_emb.weight
    assert isinstance(gpt2.blocks[0].mlp.act, torch.nn.GELU)
    llama = Transformer(tiny_model_config(architecture="llama", n_kv_heads=1))
    assert isinstance(llama.blocks[0].attn_norm, torch.nn.RMSNorm) and llama.pos_emb is None
    assert llama.blocks[0].attn.q.bias is None and llama.lm_head.weight is not llama.tok_emb.weight
    assert llama.blocks[0].mlp.gated and llama.blocks[0].mlp.gate.out_features == llama.config.d_ff
    # GQA: one key/value head -> q (16), k (8), v (8)
    attn = llama.blocks[0].attn
    assert (attn.q.out_features, attn.k.out_features, attn.v.out_features) == (16, 8, 8)


def test_activation_choices_reach_the_mlp():
    """Each activation computes proj(act(fc(x))) with its own function (SwiGLU: proj(silu(gate) * up))."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16)
    functions = {
        "relu": F.relu,
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
        "relu2": lambda h: F.relu(h) ** 2,
    }
    for name, fn in functions.items():
        mlp = Transformer(tiny_model_config(activation=name)).blocks[0].mlp.eval()
        torch.testing.assert_close(mlp(x), mlp.proj(fn(mlp.fc(x))))
    mlp = Transformer(tiny_model_config(architecture="llama")).blocks[0].mlp.eval()
    torch.testing.assert_close(mlp(x), mlp.proj(F.silu(mlp.gate(x)) * mlp.up(x)))


def test_gpt2_initialisation_scales_residual_projections():
    torch.manual_seed(0)
    config = tiny_model_config(d_model=256, n_heads=4, n_layers=8, vocab_size=2000)
    model = Transformer(config)
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.001
    for part in ("q", "k", "v"):
        assert abs(getattr(model.blocks[0].attn, part).weight.std().item() - 0.02) < 0.001
    expected = 0.02 / math.sqrt(2 * 8)
    assert abs(model.blocks[0].attn.proj.weight.std().item() - expected) < 0.0005
    assert abs(model.blocks[3].mlp.proj.weight.std().item() - expected) < 0.0005
    assert torch.all(model.blocks[0].attn.q.bias == 0)


def _rotate_half_reference(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """transformers' LLaMA rotary embedding, written out: x (B, heads, T, D) * cos + rotate_half(x) * sin."""
    T, D = x.shape[-2], x.shape[-1]
    angles = torch.outer(
        torch.arange(T, dtype=torch.float64), 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    )
    angles = torch.cat([angles, angles], dim=-1)
    rotated = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)
    return x * angles.cos().float() + rotated * angles.sin().float()


class _LinearCalls(torch.overrides.TorchFunctionMode):
    """Counts F.linear calls (one per matmul of a projection)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_projections_run_as_one_matmul_that_equals_each_layer_and_yield_to_whatever_took_a_layer_over(arch):
    """Under autocast, q, k, v (and SwiGLU's gate, up) are one matmul over the stacked weights, giving
    each layer's output and each weight's and bias's gradient; in float32, with `fuse=False` (sharded
    weights), with a hook on a layer or a layer replaced by another module (float8's, tensor
    parallelism's), each layer is called itself, so what took it over runs."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(architecture=arch, n_heads=4, n_kv_heads=2))
    attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
    x = torch.randn(2, 5, 16, requires_grad=True)
    for layers in [(attn.q, attn.k, attn.v), *([(mlp.gate, mlp.up)] if mlp.gated else [])]:
        results = []
        for fuse in (True, False):
            with torch.autocast("cpu", dtype=torch.bfloat16), _LinearCalls() as counted:
                outputs = project(x, *layers, fuse=fuse)
            assert counted.calls == (1 if fuse else len(layers))
            weights = [p for layer in layers for p in layer.parameters()]
            loss = sum((o.float() * o.float()).sum() for o in outputs)
            results.append((outputs, torch.autograd.grad(loss, [x, *weights])))
        (fused, fused_grads), (separate, separate_grads) = results
        for a, b in zip(fused, separate):
            torch.testing.assert_close(a, b)  # bf16's tolerance: the same products, summed in bf16 GEMMs
        for a, b in zip(fused_grads, separate_grads):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        with _LinearCalls() as counted:  # float32: autocast's copies to share are absent, so no stacked copy
            project(x, *layers)
        assert counted.calls == len(layers)

    calls = []
    attn.k.register_forward_hook(lambda *_: calls.append("hooked k"))

    class Replaced(torch.nn.Linear):  # as float8's Float8Linear subclasses nn.Linear
        def forward(self, x):
            calls.append("replaced v")
            return super().forward(x)

    replaced = Replaced(16, attn.v.out_features, bias=attn.v.bias is not None)
    replaced.load_state_dict(attn.v.state_dict())
    attn.v = replaced
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [attn.q(x), attn.k(x), attn.v(x)]
        calls.clear()
        outputs = project(x, attn.q, attn.k, attn.v)
    for a, b in zip(outputs, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert calls == ["hooked k", "replaced v"]


def test_parallelize_stacks_the_projections_only_where_every_weight_is_whole():
    """One process (and DDP) may stack the projections' weights; FSDP2 and DeepSpeed gather sharded ones,
    whose stacked copies would outlive the gathered shards, so there each layer runs alone. The memory
    estimate counts the same: one cast of the block input per matmul under autocast."""
    from llm_trainer.config import TrainingConfig
    from llm_trainer.parallel.distributed import DistInfo
    from llm_trainer.parallel.parallelize import parallelize
    from llm_trainer.train.memory_estimate import estimate_memory

    config = tiny_model_config(architecture="llama", n_heads=4, n_kv_heads=2)
    training = TrainingConfig(device="cpu", use_amp=True)
    model = Transformer(config)
    parallelize(
        model,
        config=training,
        dist=DistInfo(),
        device=torch.device("cpu"),
        amp_dtype=torch.bfloat16,
        activation_checkpointing=False,
        build_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    )
    assert all(block.attn.fuse_projections and block.mlp.fuse_projections for block in model.blocks)
    whole = estimate_memory(config, training, device_type="cpu")
    sharded = estimate_memory(config, training, world_size=2, sharding="fsdp", device_type="cpu")
    layers, d, tokens = config.n_layers, config.d_model, training.batch_size * config.max_seq_len
    # unstacked under autocast: q, k, v and gate, up each cast the block input (5 casts, not 2), bf16
    assert sharded.activations_bytes - whole.activations_bytes == layers * 3 * d * 2 * tokens


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_matches_a_hand_written_reference(qk_norm):
    torch.manual_seed(0)
    config = tiny_model_config(architecture="llama", n_heads=4, n_kv_heads=2, qk_norm=qk_norm)
    model = Transformer(config).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, 16)
    q, k, v = attn.q(x), attn.k(x), attn.v(x)
    q, k = q.view(2, 7, 4, 4).transpose(1, 2), k.view(2, 7, 2, 4).transpose(1, 2)
    if qk_norm:  # each head's query and key scaled to unit RMS
        q = q / q.pow(2).mean(-1, keepdim=True).sqrt()
        k = k / k.pow(2).mean(-1, keepdim=True).sqrt()
    q = _rotate_half_reference(q)
    k = _rotate_half_reference(k).repeat_interleave(2, dim=1)
    v = v.view(2, 7, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / 2.0
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    expected = attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 16))
    rope = (model.rope_cos[:7, None], model.rope_sin[:7, None])
    torch.testing.assert_close(attn(x, rope, None, 0), expected, atol=1e-5, rtol=1e-5)


def test_rope_rotates_relative_positions():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i, j):
        return (apply_rope(q, cos[i : i + 1], sin[i : i + 1]) * apply_rope(k, cos[j : j + 1], sin[j : j + 1])).sum()

    torch.testing.assert_close(score(3, 1), score(10, 8))  # depends only on i - j


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_kv_cache_gives_the_same_logits(arch):
    torch.manual_seed(0)
    config = tiny_model_config(architecture=arch, n_kv_heads=1)
    model = Transformer(config).eval()
    x = torch.randint(0, 61, (2, 12))
    full = model(x)
    cache = KVCache.empty(config, 2, config.max_seq_len, "cpu", torch.float32)
    pieces = [model(x[:, :5], cache=cache), model(x[:, 5:6], cache=cache), model(x[:, 6:12], cache=cache)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 12


def test_post_norm_and_untied_head():
    model = Transformer(tiny_model_config(pre_norm=False, tie_embeddings=False))
    assert isinstance(model.norm, torch.nn.Identity)
    assert model.lm_head.weight is not model.tok_emb.weight
    loss = F.cross_entropy(model(torch.randint(0, 61, (2, 8))).flatten(0, 1), torch.randint(0, 61, (16,)))
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_too_long_sequence_is_refused():
    model = Transformer(tiny_model_config())
    with pytest.raises(ValueError, match="longer than max_seq_len"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_save_and_load_pretrained(tmp_path):
    torch.manual_seed(0)
    model = Transformer(tiny_model_config(architecture="llama"))
    save_model_folder(model, tmp_path)
    again = load_model_folder(tmp_path)
    x = torch.randint(0, 61, (1, 9))
    assert torch.equal(model(x), again(x))
    assert again.config == model.config


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_folder_with_fused_projections_loads_with_the_same_logits(tmp_path, arch):
    """Files written when q, k, v (and SwiGLU's gate, up) were one matrix load into the split model."""
    from llm_trainer.checkpoint.model_folder import model_state_dict, save_tensors

    torch.manual_seed(0)
    model = Transformer(tiny_model_config(architecture=arch, n_heads=4, n_kv_heads=2 if arch == "llama" else 4)).eval()
    save_model_folder(model, tmp_path)
    state = model_state_dict(model)
    for i in range(model.config.n_layers):
        for kind in ("weight", "bias") if model.config.bias else ("weight",):
            parts = [state.pop(f"blocks.{i}.attn.{p}.{kind}") for p in ("q", "k", "v")]
            state[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)
            if model.blocks[i].mlp.gated:
                parts = [state.pop(f"blocks.{i}.mlp.{p}.{kind}") for p in ("gate", "up")]
                state[f"blocks.{i}.mlp.fc.{kind}"] = torch.cat(parts)
    save_tensors(state, tmp_path / "model.safetensors")
    x = torch.randint(0, 61, (2, 9))
    assert torch.equal(load_model_folder(tmp_path).eval()(x), model(x))


def test_a_training_checkpoint_with_fused_projections_does_not_resume():
    """Its optimizer state is per fused matrix: refused in one line that names the way on (init_from)."""
    from llm_trainer.checkpoint.fused_projections import refuse_resume
    from llm_trainer.errors import UsageError

    config = tiny_model_config(architecture="llama")
    with pytest.raises(UsageError, match="start a new run from its weights with model.init_from=ckpt$"):
        refuse_resume({"blocks.0.attn.qkv.weight": None}, config, "ckpt")
    refuse_resume({"blocks.0.attn.q.weight": None, "blocks.0.mlp.fc.weight": None}, tiny_model_config(), "ckpt")
