"""Downstream evaluation: benchmark scores of our model through lm-evaluation-harness
(`pip install 'llm-trainer[eval]'`), during training (`training.eval_tasks`) and after
(`llm-trainer eval --tasks`).

    tasks.py            which tasks a name or path means (and the tasks shipped in tasks/, read offline)
    task_files.py       what a task YAML the user names may run, read before lm-eval reads it
    adapter.py          our model as an lm-eval model, scoring shared contexts once
    lockstep.py         the model as the adapter calls it when several processes evaluate together
    run.py              one evaluation: lm-eval's results, the scores a run logs, the table
    during_training.py  `training.eval_tasks` inside a run: when, the scores every rank agrees on, best_model
"""

from .run import evaluate_tasks, scores, table, write_results

__all__ = ["evaluate_tasks", "scores", "table", "write_results"]
