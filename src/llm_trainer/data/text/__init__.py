"""Documents as text, before any token: read, mixed, cleaned, filtered, deduplicated. One module per job:

sources       read files, folders, JSONL(.gz/.zst), Parquet, HF datasets into Documents; bad input policy
mixture       weighted, seeded interleaving of several sources
clean         Unicode, control characters, boilerplate lines, whitespace (never code indentation)
filters       quality filters with prose/code presets, each counted
unicode_text  letters (with combining marks) and words (also of scripts without spaces) in any script
dedup         exact (hash) and near (NumPy MinHash + LSH) deduplication across sources
"""
