"""Files: the ground floor every other package stands on. Nothing here imports anything of ours but
errors, logs and limits (modules that import nothing of ours but errors), so any module may use it.

    disk          what the OS says once: a full disk, a writable folder, locks that die with their
                  process, the mode new files get, an opener that follows no symlink
    atomic        the one place that renames a file or folder into place: atomic, durable writes of
                  files (and a cache's, without fsync), folders built aside and swapped in, deletes
                  that never leave half a folder under its name
    checksums     chunked, parallel file checksums (integrity, not origin)
    folder_files  the one rule for every file read from a folder we may not have written (a path inside
                  it, a regular file, listed in its meta.json); reads checked once
    safe_pickle   pickles from folders someone else may have made: torch's weights-only unpickler,
                  allow-lists
    buckets       paths that are URLs (s3://, gs://, az://, hf://, ...): the one module that reads and
                  writes a store (bucket), with retries and one-line errors; folders uploaded with a
                  commit record, downloaded checked; the local mirror cache of data files
"""
