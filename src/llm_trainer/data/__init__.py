"""The data stage: raw sources in, packed token rows out. Three packages and the format between them:

text/       documents: sources, mixing, cleaning, quality filters, Unicode, deduplication (no tokens)
prepare/    `prepare_data`: documents -> the prepared folder (the build, its workers, shards, report,
            the datatrove stages and their driver)
format      the prepared folder's files: `PreparedData`, the manifest and its check, FORMAT_VERSION
batches/    a prepared folder's tokens -> training batches (streaming, packing, rows, loader, curriculum)

Imports run down: prepare/ uses text/, format and batches/ (its streamed tokens); batches/ uses format
only; text/ none of them.
"""
