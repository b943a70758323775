"""The parent side of the training process boundary, torch-free: the job a child is given
(`job`), the events it sends back (`events`) and the result it leaves (`results`), starting and
supervising it (`process`, `child`), and its run folder as the parent reads it (`runs`). The
training loop itself, which imports torch, is `training.trainer`."""
