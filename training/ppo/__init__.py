"""A small PPO learner for agents (docs/ppo.md): an actor (the causal LM), a critic (a
value model over the same architecture), token-level GAE over whole multi-turn episodes, and the
three stages that use them: single-turn warm-up, critic pretraining and multi-turn agentic PPO."""

from training.ppo.config import PPOConfig

__all__ = ["PPOConfig"]
