"""The retraining pipeline's library, in floors; each imports only the floors below it:

    tune/      the budgeted search: trials as resumable runs, promoted through the pipeline
    pipeline/  one module per stage (pack, preprocess, train, evaluate, report) and their typed hand-offs
    trainer/   the training process: Trainer, its state, checkpoints, resume, the child process
    model/     networks, objectives, evaluation, the model package, export, batch scoring
    data/      sources, packing into shards, features, the loader
    storage/   the storage root (local or S3), atomic files, leases
    ground     config, errors, metrics, the search space's syntax; cost/, the bill

Nothing here imports Prefect: tasks/ and flows/ wrap it.
"""
