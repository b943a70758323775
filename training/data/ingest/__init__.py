"""Sources into packed datasets: reading Parquet and CSV, checking and encoding columns, segments,
shards, manifests and the source index."""
