"""The ground floor of compute: the types every room uses (a request's `Sequence`, the
scheduled step and its results, the model's `ForwardBatch`). They import nothing from the
rooms above them (scheduling, kv, length, model, the runner): every arrow points down here."""
