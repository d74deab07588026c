"""A four-step run config the CLI tests train."""

TINY = {
    "task": {
        "name": "mqar",
        "vocab_size": 32,
        "train_grid": "16:2",
        "test_grid": "16:2",
        "train_examples": 64,
        "test_examples": 16,
    },
    "model": {"mixer": "gla", "d_model": 16, "n_layers": 1},
    "train": {"max_steps": 4, "batch_size": 8},
    "run": {"log_every": 2, "threads": 1},
}
