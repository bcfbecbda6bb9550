"""The PostgreSQL engine: one database, many machines."""
