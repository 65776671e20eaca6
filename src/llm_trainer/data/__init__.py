"""The data stage: raw sources in, packed token rows out. One module per job, in pipeline order:

sources     read files, folders, JSONL(.gz/.zst), Parquet, HF datasets into Documents; bad input policy
mixture     weighted, seeded interleaving of several sources
clean       Unicode, control characters, boilerplate lines, whitespace (never code indentation)
filters     quality filters with prose/code presets, each counted
unicode_text  letters (with combining marks) and words (also of scripts without spaces) in any script
dedup       exact (hash) and near (NumPy MinHash + LSH) deduplication across sources
process     the per-batch work that can run in worker processes (clean, filter, keys; tokenize)
shards      shard files with commit records: resumable output, concatenated at the end
report      counters, progress bar, data_report.json, printed summary, padding fractions
prepare     the pipeline that runs all of the above (`prepare_data`) and `PreparedData`
stream      training tokens in object storage read in checksummed chunks (bounded cache, read-ahead, window order)
packing     piece and first-fit-decreasing arithmetic (no torch)
loader      rows (greedy windows, first-fit bins, unpacked; optional document ids) and the batch loader
curriculum  easy rows first, in stages, seeded and seekable
"""
