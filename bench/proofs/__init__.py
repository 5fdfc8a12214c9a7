"""Proofs that training works, on a tiny model and the real judge: learns (single-turn PPO), speed (PPO on the
judge's timings alone), repair (multi-turn episodes), stages (the paper's four stages chained), and the
learner's dynamics and update size. The entry points (`python -m bench.proofs.NAME`) import only the library
modules: family, speed_family, repair_family, repair_sft and pipeline."""
