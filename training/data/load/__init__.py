"""Shards into batches for the training process: the streaming loader, the train split held on
the device, and the local cache of remote shards."""
