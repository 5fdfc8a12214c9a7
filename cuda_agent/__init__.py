"""The `cuda-agent` command line: the top layer, which mounts each layer's commands."""
