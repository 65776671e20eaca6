"""`prepare_data`: documents (`data.text`) -> the prepared folder (`data.format`). One module per job:

run          the entry: the folder for a DataConfig found, downloaded (a `cache_dir` URL) or built, one
             prepare per folder at a time (`prepare_data`, `find_prepared`, `fetch_validation`)
build        the build engine: phases, the dedup decision and split, pipelined batches, resumable shards
workers      the per-batch work that can run in worker processes (clean, filter, keys; tokenize)
shards       shard files with commit records: resumable output, concatenated at the end
report       counters, progress bar, data_report.json, printed summary, padding fractions
cluster      the same build as two datatrove stages (per-file parts, one merge): plan, parts, merge
trove_steps  those stages' datatrove pipeline steps (imported only where datatrove is installed)
executors    the driver: the two stages on datatrove's local, Slurm or Ray executor
"""

from .run import fetch_validation, find_prepared, prepare_data

__all__ = ["fetch_validation", "find_prepared", "prepare_data"]
