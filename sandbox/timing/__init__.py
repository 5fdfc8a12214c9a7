"""Is it fast: `profile` times the candidate against eager and torch.compile and computes the speedups;
`baseline` measures and caches the reference's times; `timing_bound` is the judge's own clock around the
candidate's timed calls; `device_lock` keeps one timing per device; `sealed` authenticates cached data."""
