"""What both sides of the training process boundary share, torch-free: the job a child is given,
the events it reports, the results it hands back, and the run folder they both read."""
