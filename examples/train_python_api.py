"""The full pipeline from Python, the three section configs built in code: a small LLaMA-style model with
grouped-query attention and a byte-level BPE tokenizer trained on the Python standard library's sources
(the same steps `llm-trainer train --config FILE` takes; configs/tiny.yaml is a smaller GPT-2 one).

python examples/train_python_api.py
"""

from llm_trainer import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig, train

experiment = ExperimentConfig(
    model=ModelConfig(architecture="llama", d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=128),
    training=TrainingConfig(
        batch_size=8,
        max_steps=100,
        learning_rate=2e-3,
        warmup_steps=10,
        eval_steps=50,
        save_steps=50,
        output_dir="runs/python-api",
        device="cpu",
    ),
    data=DataConfig(dataset_name="python-stdlib", max_documents=100, tokenizer="bpe", tokenizer_vocab_size=1024),
)
summary = train(experiment)
print(f"val_loss {summary['val_loss']:.3f}, perplexity {summary['perplexity']:.1f}")
