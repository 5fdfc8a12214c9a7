"""Static checks, before any candidate code runs: the scan of `model_new.py`'s source and the scan of the
built extension's dynamic symbols. Both run in the judge's own process and only read files."""
