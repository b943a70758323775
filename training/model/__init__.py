"""Models: networks and encoders, task objectives, evaluation, the model package, export, batch scoring."""
