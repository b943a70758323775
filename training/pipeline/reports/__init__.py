"""A run's report: `report.json` as one typed model, and the human page beside it."""
