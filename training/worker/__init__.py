"""The processes the launcher starts: the training worker, the zygote that forks it, the stage
child (evaluation, promotion, calibration) and a multi-node job's node. Each has a `main`."""
