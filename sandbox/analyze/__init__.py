"""analyze: Nsight Compute's counters of the candidate's kernels, as a roofline and ranked bottleneck sentences.

Kept import-light: sandbox.analyze.target runs in a confined worker and imports this package first.
"""
