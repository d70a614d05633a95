"""Training: the learner, the rollout worker, checkpoints, the local loop and the SFT stage."""
