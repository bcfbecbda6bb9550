"""Front doors: @singleton_job, its supervision records, the CLI, the cell magic."""
