"""The training process: the Trainer and its state, checkpoints and resume, the child process and its events."""
