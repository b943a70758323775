"""What a storage root keeps from run to run: the champion and the gate a challenger passes,
MLflow's tracking and model registry, and the step times runs measured for the next plan."""
