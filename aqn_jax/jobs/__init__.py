"""One module per job; each defines `run(config, workdir)`. Selected by `config.job`."""
