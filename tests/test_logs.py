"""What reaches the user's log: each repeated warning once, and whole lines (no progress-bar redraws)
when stderr is a file."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import src_env


def test_warnings_repeated_every_step_are_shown_once(recwarn):
    import warnings

    from llm_trainer.logs import warnings_once

    shown = []
    original = warnings.showwarning
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
    try:
        with warnings_once():
            for _ in range(5):
                with warnings.catch_warnings():  # what resets Python's own once-per-location memory
                    warnings.simplefilter("ignore", BytesWarning)
                warnings.warn("x is deprecated", FutureWarning, stacklevel=1)
                warnings.warn("y is deprecated", FutureWarning, stacklevel=1)
    finally:
        warnings.showwarning = original
    assert shown == ["x is deprecated", "y is deprecated"]


@pytest.mark.slow  # a child process
def test_eval_lines_are_never_glued_to_a_progress_bar_in_a_file(tmp_path):
    """stderr to a file (not a terminal): no bar redraws, every line whole."""
    script = (
        "import numpy as np\n"
        "from llm_trainer import ModelConfig, Trainer, TrainingConfig, Transformer\n"
        "from llm_trainer.data.batches.loader import BatchLoader, WindowRows\n"
        "t = (np.arange(3000) % 61).astype(np.uint16)\n"
        "train, val = BatchLoader(WindowRows(t, 16), 4, shuffle=True), BatchLoader(WindowRows(t[:300], 16), 4, shuffle=False)\n"
        "model = Transformer(ModelConfig(vocab_size=61, d_model=16, n_heads=2, n_layers=1, max_seq_len=16))\n"
        f"config = TrainingConfig(max_steps=4, eval_steps=2, logging_steps=2, save_steps=0, output_dir={str(tmp_path / 'run')!r}, "
        "device='cpu')\n"
        "Trainer(model, config, train_dataloader=train, val_dataloader=val).train()\n"
    )
    log = tmp_path / "train.log"
    with open(log, "w") as handle:
        subprocess.run(
            [sys.executable, "-c", script],
            stderr=handle,
            stdout=subprocess.DEVNULL,
            check=True,
            env=src_env(),
            timeout=120,
        )
    text = log.read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert sum(line.startswith("eval  step") for line in lines) == 2
    assert sum(line.startswith("train step") for line in lines) == 2  # the bar's place: plain lines


def test_a_line_and_its_newline_go_out_in_one_write_so_threads_never_glue_lines():
    """A background upload's log line and the loop's training line, written from two threads: each line
    reaches the stream in one write, so neither lands between the other's text and its newline (print()
    writes them apart)."""
    import io
    import threading

    from llm_trainer.logs import write_line

    class Recording(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return super().write(text)

    stream = Recording()
    lines = [f"checkpoint: uploaded checkpoint-{i:08d}" for i in range(200)] + [f"train step {i}" for i in range(200)]
    threads = [
        threading.Thread(target=lambda part=part: [write_line(t, stream) for t in part])
        for part in (lines[:200], lines[200:])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(write.endswith("\n") and write.count("\n") == 1 for write in stream.writes)
    assert sorted(stream.getvalue().splitlines()) == sorted(lines)
