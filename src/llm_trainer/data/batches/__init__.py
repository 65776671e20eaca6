"""A prepared folder's tokens -> training batches. One module per job:

stream         training tokens in object storage read in checksummed chunks (bounded cache, read-ahead, window order)
packing        piece and first-fit-decreasing arithmetic (no torch)
loader         rows (greedy windows, first-fit bins, unpacked; optional document ids) and the batch loader
ahead          the coming batches read on a worker thread (and copied to the GPU on a side stream) during the step
curriculum     easy rows first, in stages, seeded and seekable
source_labels  per-source validation rows: each source of a mixture beside the mixed one
"""
