"""Data: Parquet sources packed into verified shards, fitted features, the streaming loader."""
