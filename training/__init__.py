"""Training: models and tokenizers, training records, rejection fine-tuning, and the rollout engine.

The top layer: imports the harness and below, never the other way. Heavy libraries (torch,
transformers, trl, peft) are imported inside functions, so `cuda-agent --help` stays fast.
"""
