"""Online reinforcement learning from rewards (GRPO): reward functions, group advantages."""
