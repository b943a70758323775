"""What a run costs: prices, the bill and its counterfactuals, where the time went. Imports nothing above the ground floor."""
