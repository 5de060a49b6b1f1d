"""What the runner reads from a checkpoint: settings, configuration, weights, memory."""
